"""Fan-out across emulated hosts: the time until N replicas serve one version.

The trainer (a streaming `Publisher` over NIXL) runs in host 0's namespace; each replica
(a `Puller`) in a host of its own; every data link is shaped (`hosts.Hosts`), and NIXL
runs over TCP (`UCX_TLS=tcp`), so every byte a replica reads crosses its source's link and
its own. They all speak to one registry, the real server (`weightpull registry serve`,
keyed: each process its own principal), in the switch's namespace on the hosts' unshaped
control network: its few small messages (leases, offers, marks) do not queue behind the
shaped bulk bytes, as a cluster's front-end network carries them beside its data fabric.

Before each step the trainer publishes a version of its own (its relays' offers of the
one before go with it); the replicas start, make their NIXL agents, map the trainer's
reserved slots and their mirrors (`Puller.prepare`), then are told to go at once; the
time until N serve is from that moment until the last one's pull ended (leasing, every
bucket, the lease check and the digest check). Each copy is then checked byte for byte,
once every replica ended (a check while others still read would take their CPU). Each
process also says its CPU seconds (user and system, every thread) from going until the
last replica ended, the bench reads the registry's from /proc, and the machine's busy CPU
seconds (/proc/stat) over the same time: on a machine of few cores they contend.

Directly, each replica is a plain `Puller` reading the trainer's slot. With relays, each
is a `Puller(host=, stream=True, relay=True, relay_cap=cap)`: the registry places its
lease at the source `choose_source` picks (the slot, or a replica that offered what it
holds), it offers its own mirror once its first bucket landed and marks each bucket as it
lands, and a reader of a relay reads each bucket once the relay marked it, then checks
the publisher's digests. The registry lets `cap` readers at once read the trainer's slot
(`registry serve --origin-cap`), as each relay does; a replica it finds no source for
(every one full) asks again every `ASK_AGAIN_S`. A relaying puller reads its buckets one
at a time, in order, so that each lands, and is offered, as early as it can (asked at
once, over NIXL's tcp, they would all land together at the end).

Each process is this module run with `python -m` inside its namespace, spoken to by JSON
lines on its stdin and stdout.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import anyio
import attrs

from weightpull.digests import KINDS
from weightpull.errors import InvalidArgumentError
from weightpull.integrations.processes import Children

from .hosts import ENV, Hosts

MiB = 1 << 20
DEFAULT_SIZE = 256 * MiB
DEFAULT_BUCKET = 16 * MiB
_START_TIMEOUT_S = 120.0
MAX_REPLICAS = 16  # hosts.MAX_HOSTS less the trainer's
# How often the trainer and each relay poll NIXL for their readers (UCX's tcp emulation
# needs the owner's progress): every 5 ms, not the driver's 1 ms, spent 6% less CPU in a
# relayed run of 8 on 2 cores (7.57 against 8.05 core-seconds); 20 ms slowed one copy.
DEFAULT_PROGRESS_S = 0.005
# What the publisher records and readers check: replicas of one job, so the cheap
# checksum (a 256 MiB copy checked in 0.02 core-s against BLAKE2b's 0.29).
DEFAULT_DIGEST = "wsum64"
# How soon a replica asks the registry again when every source is full (a chain's next
# link offers once its first bucket landed, ~0.15 s after it was placed).
ASK_AGAIN_S = 0.005
_LEASE_TTL_S = 60.0  # every reader shares one link: a pull of 8 direct takes ~18 s


# -- the processes -------------------------------------------------------------------------------


def _say(**message: Any) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


async def _line() -> dict[str, Any]:
    """The next JSON line on stdin; {} once it closed."""
    line = await anyio.to_thread.run_sync(sys.stdin.readline)
    return json.loads(line) if line.strip() else {}


def _connect(cfg: dict[str, Any]) -> Any:
    from weightpull.registry import connect_registry

    return connect_registry(cfg["registry"], key=cfg["key"], server_key=cfg["server_key"])


async def _trainer(cfg: dict[str, Any]) -> None:
    from weightpull.publisher import Publisher
    from weightpull.transports import create_transport

    from .pull import BenchConfig, _tensors, content, digest

    data = content(cfg["size"])
    tensors = _tensors(BenchConfig(transport="nixl", size=cfg["size"], bucket_bytes=cfg["bucket"]), data)
    async with _connect(cfg) as registry:
        publisher = Publisher(
            registry,
            create_transport("nixl", progress_interval=cfg["progress_s"]),
            rollout_dtype=None,
            bucket_bytes=cfg["bucket"],
            name="trainer",
            stream=True,
            digests=cfg["digest"],  # what readers from relays check (and every puller, as it does)
        )
        await publisher.reserve(cfg["size"])  # slots made ahead: replicas map them (Puller.prepare)
        _say(ready=True, digest=digest(data))
        async with anyio.create_task_group() as tg:
            tg.start_soon(publisher.serve)  # over TCP every read needs the owner's progress
            while message := await _line():  # until told to stop (or stdin closes)
                if "publish" in message:
                    result = await publisher.publish(message["publish"], tensors)
                    assert result.manifest is not None
                    _say(published=result.manifest.version)
                elif message.get("cpu"):
                    _say(cpu=time.process_time())  # the bench takes the difference around each run
                else:
                    break
            tg.cancel_scope.cancel()
        await publisher.aclose()
        await publisher.transport.aclose()


def verify_cpu(mirror: Any, manifest: Any) -> float:
    """CPU seconds to check every bucket of `mirror` against the publisher's digests, as a
    reader does (measured off the clock, to calibrate the model); 0 without."""
    from weightpull.digests import matches

    if manifest.digests is None:
        return 0.0
    view = mirror.host_view()
    start = time.process_time()
    for b, want in zip(manifest.layout.buckets, manifest.digests, strict=True):
        if not matches(view[b.offset : b.offset + b.nbytes], want):
            raise RuntimeError(f"bucket {b.index} does not match its digest")
    return time.process_time() - start


def busy_cpu_s() -> tuple[float, float]:
    """The machine's busy and all CPU-seconds since boot, from /proc/stat (every core):
    busy is all but idle and iowait."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    hz = os.sysconf("SC_CLK_TCK")
    total = sum(ticks[:8])  # user nice system idle iowait irq softirq steal (guest is in user)
    idle = ticks[3] + ticks[4]
    return (total - idle) / hz, total / hz


def process_cpu_s(pid: int) -> float:
    """A process's CPU seconds (user and system, every thread), read from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


async def _replica(cfg: dict[str, Any]) -> None:
    from weightpull.errors import NoSourceError
    from weightpull.puller import Puller
    from weightpull.transports import create_transport

    from .pull import digest

    # Every reader shares one link here: a read outlasting the driver's 10 s warning is expected.
    logging.getLogger("weightpull.drivers.nixl").setLevel(logging.ERROR)
    relay = bool(cfg["relays"])
    transport = create_transport("nixl", progress_interval=cfg["progress_s"])
    transport.agent  # noqa: B018  (made now, ~0.4 s, not on the clock)
    async with _connect(cfg) as registry:
        if relay:
            puller = Puller(
                registry,
                transport,
                holder=cfg["name"],
                ttl=_LEASE_TTL_S,
                host=cfg["host"],
                stream=True,
                relay=True,
                relay_cap=cfg["cap"],
            )
        else:
            puller = Puller(registry, transport, holder=cfg["name"], ttl=_LEASE_TTL_S)
        await puller.prepare()  # its mirror made and touched, the trainer's slots mapped: not on the clock
        placed: list[tuple[float, str]] = []  # when each lease was granted, and at which source
        acquire = registry.acquire

        async def placing(*args: Any, **kwargs: Any) -> Any:
            lease = await acquire(*args, **kwargs)
            placed.append((time.time(), lease.source))
            return lease

        setattr(registry, "acquire", placing)  # noqa: B010  (observed only)
        offered: list[float] = []  # when a relay offered its mirror: its first bucket had landed
        offer = registry.offer

        async def offering(*args: Any, **kwargs: Any) -> Any:
            offered.append(time.time())
            return await offer(*args, **kwargs)

        setattr(registry, "offer", offering)  # noqa: B010  (observed only)
        _say(ready=True)
        await _line()  # go
        cpu0 = time.process_time()  # every thread of this process, user and system
        pulled: Any = None

        async def pull() -> None:
            nonlocal pulled
            start, refused = time.time(), 0
            while pulled is None:
                try:
                    pulled = await puller.pull()
                except NoSourceError:  # every source is full: ask again soon
                    refused += 1
                    await anyio.sleep(ASK_AGAIN_S)
            end = time.time()
            handed, source = placed[-1]
            first = offered[0] if offered else None  # a relay's: its first offer
            _say(
                end=end,
                start=start,
                cpu_s=time.process_time() - cpu0,
                source=source,
                handed=handed,
                first=first,
                refused=refused,
            )  # the copy is checked once all ended

        async def listen() -> None:
            while message := await _line():
                if message.get("cpu"):  # the run is over: this process's CPU since go, then the checks
                    said: dict[str, Any] = {"cpu": time.process_time() - cpu0}
                    if message.get("verify"):
                        said["verify_cpu_s"] = verify_cpu(pulled.region, pulled.manifest)
                    said["digest"] = digest(pulled.region.host_view()[: pulled.nbytes])
                    _say(**said)
                if message.get("stop"):
                    break
            tg.cancel_scope.cancel()

        async with anyio.create_task_group() as tg:
            if relay:  # its readers' reads need this process's progress (a direct reader has none)
                tg.start_soon(transport.serve)
            tg.start_soon(pull)
            tg.start_soon(listen)  # serves until told to stop, its own pull long done
        await puller.aclose()
    await transport.aclose()


def main(argv: Sequence[str]) -> None:
    role, cfg = argv[0], json.loads(argv[1])
    anyio.run({"trainer": _trainer, "replica": _replica}[role], cfg)


# -- the run -------------------------------------------------------------------------------------


class _Proc:
    """One process inside a host, spoken to by JSON lines (read from its raw pipe, so that
    a selector sees every line)."""

    def __init__(self, children: Children, hosts: Hosts, host: int, role: str, cfg: dict[str, Any]) -> None:
        import subprocess

        argv = [sys.executable, "-m", __name__, role, json.dumps(cfg)]
        env = {**os.environ, **ENV, "PYTHONUNBUFFERED": "1"}
        self.what = f"the {role} on host {host}"
        self.proc = children.popen(hosts.command(host, argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        assert self.proc.stdout is not None
        self.fd = self.proc.stdout.fileno()
        self.buffer = b""
        self.lines: list[dict[str, Any]] = []

    def send(self, **message: Any) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write((json.dumps(message) + "\n").encode())
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise RuntimeError(f"{self.what} exited (code {self.proc.wait()})") from None

    def take(self) -> None:
        """Read what the process wrote (the pipe is readable)."""
        chunk = os.read(self.fd, 1 << 16)
        if not chunk:
            raise RuntimeError(f"{self.what} exited (code {self.proc.wait()})")
        self.buffer += chunk
        *whole, self.buffer = self.buffer.split(b"\n")
        self.lines += [json.loads(line) for line in whole if line.strip()]

    def expect(self, key: str, timeout: float = _START_TIMEOUT_S) -> dict[str, Any]:
        import selectors

        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as sel:
            sel.register(self.fd, selectors.EVENT_READ)
            while not self.lines:
                if not sel.select(max(0.0, deadline - time.monotonic())):
                    raise RuntimeError(f"{self.what} said nothing for {timeout:.0f} s (waiting for {key!r})")
                self.take()
        message = self.lines.pop(0)
        if key not in message:
            raise RuntimeError(f"{self.what} said {message!r}, not {key!r}")
        return message

    def stop(self) -> None:
        try:
            if self.proc.stdin:
                self.proc.stdin.close()
            self.proc.wait(15)
        except Exception:
            self.proc.kill()
            self.proc.wait(5)


class _Registry:
    """The registry server (`weightpull registry serve`, keyed) in the switch's namespace,
    on the control network; each process gets a key of its own (`client(name)`).
    `origin_cap`: the most readers of the trainer's slot at once (`--origin-cap`)."""

    def __init__(
        self, children: Children, hosts: Hosts, workdir: Path, names: Sequence[str], origin_cap: int | None = None
    ) -> None:
        import select
        import subprocess

        from weightpull.drivers.zmq_registry import keys

        self.keys = workdir / "keys"
        keys.new(self.keys, "server", "registry")
        keys.new(self.keys, "publisher", "trainer")
        for name in names:
            keys.new(self.keys, "reader", name)
        argv = [sys.executable, "-m", "weightpull", "registry", "serve", "--json"]
        argv += ["--bind", f"tcp://{hosts.hub_address}:0", "--keys", str(self.keys)]
        argv += ["--server-key", str(self.keys / "registry.key_secret")]
        if origin_cap is not None:
            argv += ["--origin-cap", str(origin_cap)]
        self.log_path = workdir / "registry.log"
        with open(self.log_path, "w") as log:
            self.proc = children.popen(hosts.hub_command(argv), stdout=subprocess.PIPE, stderr=log, text=True)
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], _START_TIMEOUT_S)
        line = self.proc.stdout.readline() if ready else ""
        try:
            self.address = json.loads(line)["listening"]
        except (ValueError, KeyError):
            self.stop()
            raise RuntimeError(f"the registry did not start: {line!r} {self.log_path.read_text()[-2000:]}") from None

    def client(self, name: str) -> dict[str, str]:
        """What a process named `name` connects with (`_connect`)."""
        return {
            "registry": self.address,
            "key": str(self.keys / f"{name}.key_secret"),
            "server_key": str(self.keys / "registry.key"),
        }

    def cpu_s(self) -> float:
        return process_cpu_s(self.proc.pid)  # `ip netns exec` execs the server: the same pid

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            self.proc.wait(15)
        except Exception:
            self.proc.kill()
            self.proc.wait(5)
        if self.proc.stdout:
            self.proc.stdout.close()


@attrs.frozen
class _Ran:
    ends: list[dict[str, Any]]  # each replica's "end": its pull's start, end, CPU and source
    digests: list[str]  # each replica's copy, taken once all ended
    go: float
    hops: list[int]  # each replica's: 1 for the trainer's slot, one more than its relay's
    trainer_cpu_s: float  # from go until the last replica's end
    replica_cpu_s: list[float]  # each, from its go until the last end
    registry_cpu_s: float  # the registry server's, over the same time
    verify_cpu_s: float | None  # the first replica's check of its copy, off the clock
    busy_cpu_s: float  # the machine's (every process's, not only the bench's)
    wall_s: float


def _hops(sources: dict[int, str], names: list[str]) -> list[int]:
    """Each replica's hops from the trainer's slot, from the source each read ("": the slot)."""
    index = {name: i for i, name in enumerate(names)}
    hops: dict[int, int] = {}

    def of(i: int, seen: int = 0) -> int:
        if i not in hops:
            if seen > len(names):
                raise RuntimeError(f"the replicas' sources make a cycle: {sources}")
            source = sources[i]
            hops[i] = 1 if not source else 1 + of(index[source], seen + 1)
        return hops[i]

    return [of(i) for i in range(len(names))]


def _one_run(
    procs: list[_Proc], names: list[str], trainer: _Proc, registry: _Registry, timeout: float, *, verify: bool = False
) -> _Ran:
    """Tell every replica to go, and wait until each pulled the version; around it, the
    CPU seconds each process, the registry and the machine spent. `verify`: the first
    replica also measures its digest check."""
    import selectors

    for p in procs:
        p.expect("ready")
    trainer.send(cpu=True)
    trainer_cpu = trainer.expect("cpu")["cpu"]
    registry_cpu = registry.cpu_s()
    busy, _ = busy_cpu_s()
    go = time.time()
    for p in procs:
        p.send(go=True)
    ends: dict[int, dict[str, Any]] = {}
    deadline = time.monotonic() + timeout
    with selectors.DefaultSelector() as sel:
        for i, p in enumerate(procs):
            sel.register(p.fd, selectors.EVENT_READ, i)
        while len(ends) < len(procs):
            events = sel.select(max(0.0, deadline - time.monotonic()))
            if not events:
                raise RuntimeError(f"{len(procs) - len(ends)} replicas did not finish in {timeout:.0f} s")
            for key, _ in events:
                i = key.data
                procs[i].take()
                while procs[i].lines:
                    message = procs[i].lines.pop(0)
                    if "end" not in message:
                        raise RuntimeError(f"{procs[i].what} said {message!r}, not 'end'")
                    ends[i] = message
    busy_end, _ = busy_cpu_s()
    registry_cpu = registry.cpu_s() - registry_cpu
    wall = time.time() - go
    trainer.send(cpu=True)
    trainer_cpu = trainer.expect("cpu")["cpu"] - trainer_cpu
    for i, p in enumerate(procs):
        p.send(cpu=True, verify=verify and i == 0)
    cpus = [p.expect("cpu") for p in procs]
    for p in procs:
        p.send(stop=True)
    return _Ran(
        ends=[ends[i] for i in range(len(procs))],
        digests=[c["digest"] for c in cpus],
        go=go,
        hops=_hops({i: e["source"] for i, e in ends.items()}, names),
        trainer_cpu_s=trainer_cpu,
        replica_cpu_s=[c["cpu"] for c in cpus],
        registry_cpu_s=registry_cpu,
        verify_cpu_s=cpus[0].get("verify_cpu_s"),
        busy_cpu_s=busy_end - busy,
        wall_s=wall,
    )


def run_fanout(
    replicas: Sequence[int] = (1, 2, 4, 8),
    *,
    size: int = DEFAULT_SIZE,
    bucket: int = DEFAULT_BUCKET,
    rate: str | None = "1gbit",
    relays: bool = False,
    cap: int | None = None,
    progress_s: float = DEFAULT_PROGRESS_S,
    digest: str = DEFAULT_DIGEST,
    say: Callable[[str], None] = lambda line: None,
) -> dict[str, Any]:
    """For each N in `replicas`: the time until N replicas, told to go at once, all hold a
    version the trainer published: every one a plain `Puller` reading the trainer's slot,
    or with `relays`, each a `Puller(host=, stream=True, relay=True, relay_cap=cap)` whose
    lease the registry places at a source by its policy (`weightpull.sources`), relays
    among them forwarding buckets as they land and their readers checking the publisher's
    digests. `cap`: live readers per source (None: no cap). `progress_s`: how often the
    trainer and each relay poll NIXL for their readers' progress. `digest`: the kind the
    publisher records (`weightpull.digests`), in both modes: every puller checks it."""
    if not replicas or any(not isinstance(n, int) or n < 1 for n in replicas):
        raise InvalidArgumentError(f"replicas must be positive ints, got {list(replicas)!r}")
    if size <= 0 or bucket <= 0:
        raise InvalidArgumentError("size and bucket must be positive")
    if digest not in KINDS:
        raise InvalidArgumentError(f"digest must be one of {', '.join(KINDS)}, got {digest!r}")
    most = max(replicas)
    names = [f"replica{i + 1}" for i in range(most)]
    rows = []
    # Left in this order: every process in the hosts stopped (also on SIGINT or SIGTERM),
    # then the hosts deleted.
    with (
        Hosts(most + 1, rate=rate, control=True) as hosts,
        tempfile.TemporaryDirectory(prefix="wpfan-") as work,
        Children() as children,
    ):
        say(
            f"{most + 1} emulated hosts, links shaped to {rate or 'no limit'}; the trainer on host 0, "
            "the registry on the control network"
        )
        # with relays the trainer's slot takes `cap` readers at once, as every relay does
        registry = _Registry(children, hosts, Path(work), names, origin_cap=cap if relays else None)
        procs: list[_Proc] = []
        trainer: _Proc | None = None
        try:
            config = {"size": size, "bucket": bucket, "digest": digest, "progress_s": progress_s}
            trainer = _Proc(children, hosts, 0, "trainer", {**config, **registry.client("trainer")})
            want = trainer.expect("ready")["digest"]
            for step, n in enumerate(replicas, 1):
                trainer.send(publish=step)  # a version per step: the last step's relays offer theirs
                trainer.expect("published")
                procs = [
                    _Proc(
                        children,
                        hosts,
                        1 + i,
                        "replica",
                        {
                            "relays": relays,
                            "cap": cap,
                            "progress_s": progress_s,
                            "name": names[i],
                            "host": f"host-{1 + i}",
                            **registry.client(names[i]),
                        },
                    )
                    for i in range(n)
                ]
                load = loadavg()
                ran = _one_run(procs, names[:n], trainer, registry, timeout=600, verify=n == 1)
                for p in procs:
                    p.stop()
                procs = []
                ends = [d["end"] - ran.go for d in ran.ends]
                procs_cpu = ran.trainer_cpu_s + sum(ran.replica_cpu_s) + ran.registry_cpu_s
                row = {
                    "replicas": n,
                    "all_serve_s": round(max(ends), 3),
                    "first_s": round(min(ends), 3),
                    "hops": max(ran.hops),
                    "byte_exact": all(d == want for d in ran.digests),
                    # CPU seconds from go until the last replica's end: each process's own
                    # (user+sys, every thread), the registry's, and the machine's busy time
                    # over all its cores
                    "trainer_cpu_s": round(ran.trainer_cpu_s, 3),
                    "replica_cpu_s": [round(c, 3) for c in ran.replica_cpu_s],
                    "registry_cpu_s": round(ran.registry_cpu_s, 3),
                    "pull_cpu_s": [round(d["cpu_s"], 3) for d in ran.ends],
                    "procs_cpu_s": round(procs_cpu, 3),
                    "busy_cpu_s": round(ran.busy_cpu_s, 3),
                    "wall_s": round(ran.wall_s, 3),
                    # since go: when each replica's lease was granted (placed at a source),
                    # and (relays) when its first bucket landed; each one's hops and source
                    "handed_s": [round(d["handed"] - ran.go, 3) for d in ran.ends],
                    "first_bucket_s": [None if d["first"] is None else round(d["first"] - ran.go, 3) for d in ran.ends],
                    "replica_hops": ran.hops,
                    "sources": [d["source"] or "trainer" for d in ran.ends],
                    "refused": [d["refused"] for d in ran.ends],  # acquires refused (every source full)
                    "cpus": os.cpu_count(),
                    "loadavg": load,  # before the run: the machine is shared
                }
                if ran.verify_cpu_s is not None:
                    row["verify_cpu_s"] = round(ran.verify_cpu_s, 3)
                rows.append(row)
                say(
                    f"{n} replicas{' with relays' if relays else ''}: all serve after {row['all_serve_s']:.2f} s "
                    f"(first {row['first_s']:.2f} s, {row['hops']} hops); CPU: the bench's processes "
                    f"{procs_cpu:.2f} s (the registry {ran.registry_cpu_s:.2f}), the machine "
                    f"{ran.busy_cpu_s:.2f} s of {os.cpu_count()} cores x {ran.wall_s:.2f} s (load before: {load})"
                )
        finally:
            for p in procs:
                p.stop()
            if trainer is not None:
                trainer.stop()
            registry.stop()
    one = rows[0]["all_serve_s"] / rows[0]["replicas"]  # per replica, from the first N
    for row in rows:
        row["vs_one"] = round(row["all_serve_s"] / one, 2)
    return {
        "size_bytes": size,
        "bucket_bytes": bucket,
        "rate": rate,
        "relays": relays,
        "cap": cap,
        "progress_s": progress_s,
        "digest": digest,
        "ask_again_s": ASK_AGAIN_S if relays else None,
        "cpus": os.cpu_count(),
        "rows": rows,
    }


# -- the command ---------------------------------------------------------------------------------


def counts(most: int) -> list[int]:
    """1, 2, 4, ... up to `most` (and `most` itself)."""
    out = [1]
    while out[-1] * 2 <= most:
        out.append(out[-1] * 2)
    return out if out[-1] == most else [*out, most]


def add_parser(figures: Any) -> None:
    p = figures.add_parser(
        "fanout",
        help="the time until 1, 2, 4 ... N replicas serve one version, across emulated hosts (root, nixl)",
        description="The trainer and each replica in a network namespace of its own, every host's link "
        "shaped with tc to RATE, NIXL over TCP between them; the time until 1, 2, 4 ... N replicas, told "
        "to go at once, all serve a version of SIZE bytes, through a served registry on an unshaped control "
        "network: first every one a plain Puller reading the trainer's slot, then each a relaying Puller "
        "(host=, stream=True, relay=True) whose lease the registry places at a source by its policy, relays "
        "forwarding buckets as they land; beside what `weightpull simulate` predicts from each run's "
        "one-replica row (its link and CPU per byte, all hosts sharing this machine's cores). Needs root (ip "
        "netns), the nixl and service extras; it deletes every namespace it made (docs/guides/fanout.md). Also spelled "
        "`weightpull bench --replicas N --hosts emulated`.",
    )
    p.add_argument("--replicas", type=int, default=8, help=f"the most replicas, 1 to {MAX_REPLICAS} (default: 8)")
    p.add_argument("--hosts", choices=("emulated",), default="emulated", help="where the hosts are (default: emulated)")
    p.add_argument("--size", default="256M", help="bytes per version (default: 256M)")
    p.add_argument("--bucket-size", default="16M", help="bytes per bucket (default: 16M)")
    p.add_argument("--rate", default="1gbit", help="each host's link, as tc writes it (default: 1gbit)")
    p.add_argument(
        "--cap",
        type=int,
        default=1,
        help="with relays, live readers per source, the trainer's slot (the registry's --origin-cap) and each "
        "relay's (relay_cap) (default: 1, a chain)",
    )
    p.add_argument("--no-relays", action="store_true", help="measure only the direct reads from the trainer")
    p.add_argument(
        "--digest",
        choices=KINDS,
        default=DEFAULT_DIGEST,
        help="the digests the publisher records, which every reader checks (a reader from a relay bucket by "
        "bucket): "
        "wsum64 (default) is a checksum, cheap (numpy, ~0.02 core-s per 256 MiB), catching corrupt, swapped "
        "or stale buckets but not bytes a hostile relay made to match, for replicas of one job; blake2b128 "
        "is cryptographic, catching those too, at ~1 GB/s a core (docs/guides/fanout.md)",
    )
    p.add_argument(
        "--progress-ms",
        type=float,
        default=DEFAULT_PROGRESS_S * 1e3,
        help=f"how often the trainer and each relay poll NIXL for their readers' progress, ms "
        f"(default: {DEFAULT_PROGRESS_S * 1e3:g})",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line of stdout")
    p.set_defaults(func=run_command)


def run_command(args: Any) -> int:
    from weightpull.integrations.simulate import validate
    from weightpull.transports import transport_class

    from .util import parse_size, say_to_stderr

    if not 1 <= args.replicas <= MAX_REPLICAS:
        raise InvalidArgumentError(f"--replicas must be in [1, {MAX_REPLICAS}], got {args.replicas}")
    if args.cap is not None and args.cap < 1:
        raise InvalidArgumentError(f"--cap must be a positive int, got {args.cap}")
    if not 0 < args.progress_ms <= 1000:
        raise InvalidArgumentError(f"--progress-ms must be in (0, 1000], got {args.progress_ms}")
    transport_class("nixl")  # fails early, naming the missing extra
    size, bucket = parse_size(args.size), parse_size(args.bucket_size)
    say = say_to_stderr("fanout")
    common = dict(
        size=size, bucket=bucket, rate=args.rate, progress_s=args.progress_ms / 1e3, digest=args.digest, say=say
    )
    runs = {"direct": run_fanout(counts(args.replicas), **common)}
    if not args.no_relays:
        runs["relays"] = run_fanout(counts(args.replicas), relays=True, cap=args.cap, **common)
    for result in runs.values():
        simulated = {r["replicas"]: r for r in validate(result)}
        for row in result["rows"]:
            model = simulated[row["replicas"]]
            row["simulated_s"], row["simulated_error"] = model["simulated_s"], model["error"]
            row["enough_cpus_s"] = model.get("enough_cpus_s")  # the model with a core for every demand
    exact = all(r["byte_exact"] for result in runs.values() for r in result["rows"])
    if args.json:
        print(json.dumps(runs))
        return 0 if exact else 1
    direct = runs["direct"]
    print(
        f"{size / MiB:.0f} MiB in {bucket / MiB:.0f} MiB buckets, every link {args.rate}, every reader checking "
        f"the publisher's {args.digest} digests; direct: every replica reads the trainer's slot; relays: the "
        f"registry places each at a source by its policy (cap {args.cap}), relays forward buckets as they "
        "land; simulated: the model "
        f"calibrated on the one-replica row, hosts sharing {os.cpu_count()} cores; cpu s: the bench's processes "
        "/ the machine's busy CPU-seconds over the run"
    )
    print(
        "replicas  direct s  x one  simulated  error  cpu s        relays s  x one  simulated  error  cpu s        "
        "hops  byte-exact"
    )
    relayed = {r["replicas"]: r for r in runs.get("relays", {"rows": []})["rows"]}

    def cols(r: dict[str, Any]) -> str:
        cpu = f"{r['procs_cpu_s']:.1f}/{r['busy_cpu_s']:.1f}"
        return f"{r['all_serve_s']:8.2f}  {r['vs_one']:5.2f}  {r['simulated_s']:9.2f}  {r['simulated_error']:+5.0%}  {cpu:11}"

    for d in direct["rows"]:
        r = relayed.get(d["replicas"])
        tail = f"{cols(r)}  {r['hops']:4d}" if r else f"{'-':>8}  {'-':>5}  {'-':>9}  {'-':>5}  {'-':11}  {'-':>4}"
        ok = d["byte_exact"] and (r is None or r["byte_exact"])
        print(f"{d['replicas']:8d}  {cols(d)}  {tail}  {'yes' if ok else 'NO'}")
    return 0 if exact else 1


if __name__ == "__main__":
    main(sys.argv[1:])
