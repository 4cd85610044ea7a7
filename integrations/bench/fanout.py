"""Fan-out across emulated hosts: the time until N replicas serve one version.

The trainer (a `Publisher` over NIXL) runs in host 0's namespace; each replica (a
`Puller`) in a host of its own; every link is shaped (`hosts.Hosts`), and NIXL runs over
TCP (`UCX_TLS=tcp`), so every byte a replica reads crosses the trainer's link and its own.
The replicas start, make their NIXL agents, then are told to go at once; the time until
N serve is from that moment until the last one's pull ended (the pull alone: leasing,
every bucket, the lease check). Each copy is then checked byte for byte, once every
replica ended (a check while others still read would take their CPU). Each process also
says its CPU seconds (user and system, every thread) from going until the last replica
ended, and the bench reads the machine's busy CPU seconds (/proc/stat) over the same
time: on a machine of few cores the processes contend for them.

Each process is this module run with `python -m` inside its namespace, spoken to by JSON
lines on its stdin and stdout. A replica hands its manifest to a registry of its own in
its process (as `bench pull` does): the data path, not the registry's round trips, is
what is measured across the links.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import anyio
import attrs

from weightpull.digests import KINDS
from weightpull.errors import InvalidArgumentError
from weightpull.transport import WrappedTransport

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
# What readers of a relayed run check: replicas of one job, so the cheap checksum (a
# 256 MiB copy checked in 0.02 core-s against BLAKE2b's 0.29).
DEFAULT_DIGEST = "wsum64"


# -- the processes -------------------------------------------------------------------------------


def _say(**message: Any) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


async def _trainer(cfg: dict[str, Any]) -> None:
    from weightpull.publisher import Publisher
    from weightpull.registry import InProcessRegistry
    from weightpull.transports import create_transport

    from .pull import BenchConfig, _tensors, content, digest

    data = content(cfg["size"])
    bench = BenchConfig(transport="nixl", size=cfg["size"], bucket_bytes=cfg["bucket"])
    publisher = Publisher(
        InProcessRegistry(),
        create_transport("nixl", progress_interval=cfg["progress_s"]),
        rollout_dtype=None,
        bucket_bytes=cfg["bucket"],
        name=f"trainer-{os.getpid()}",
        digests=cfg["digests"] or False,  # a kind: what readers from relays check
    )
    result = await publisher.publish(1, _tensors(bench, data))
    assert result.manifest is not None
    _say(ready=result.manifest.to_dict(), digest=digest(data))
    async with anyio.create_task_group() as tg:
        tg.start_soon(publisher.serve)  # over TCP every read needs the owner's progress
        while line := await anyio.to_thread.run_sync(sys.stdin.readline):  # until told to stop (or stdin closes)
            if not json.loads(line).get("cpu"):
                break
            _say(cpu=time.process_time())  # the bench takes the difference around each run
        tg.cancel_scope.cancel()
    await publisher.aclose()
    await publisher.transport.aclose()


def verify_cpu(mirror: Any, manifest: Any) -> float:
    """CPU seconds to check every bucket of `mirror` against the publisher's digests, as a
    reader from a relay does (measured off the clock, to calibrate the model); 0 without."""
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


def loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


class _Landing(WrappedTransport):
    """A relay's transport: says on stdout, as its reads land, how many of the version's
    first buckets its mirror holds whole, so that its own readers may read them."""

    def __init__(self, inner: Any, layout: Any) -> None:
        super().__init__(inner)
        self.starts = {b.offset: b.index for b in layout.buckets}
        self.whole: set[int] = set()
        self.prefix = 0
        self.lock: anyio.Lock | None = None

    async def read(self, remote: Any, remote_offset: int, local: Any, local_offset: int, nbytes: int) -> None:
        # One read at a time, in the order asked (the lock is FIFO): buckets then land in
        # order, each as soon as it can, so readers of this relay get the first ones early.
        # (A puller reads all buckets at once: they would land together, at the end.)
        if self.lock is None:
            self.lock = anyio.Lock()
        async with self.lock:
            await self.inner.read(remote, remote_offset, local, local_offset, nbytes)
        if local_offset in self.starts:
            self.whole.add(self.starts[local_offset])
        before = self.prefix
        while self.prefix in self.whole:
            self.prefix += 1
        if self.prefix > before:
            _say(landed=self.prefix)


async def _replica(cfg: dict[str, Any]) -> None:
    import base64

    import attrs

    from weightpull.manifest import Manifest
    from weightpull.puller import Puller
    from weightpull.registry import InProcessRegistry
    from weightpull.transports import create_transport

    from .pull import digest

    # Every reader shares one link here: a read outlasting the driver's 10 s warning is expected.
    logging.getLogger("weightpull.drivers.nixl").setLevel(logging.ERROR)
    manifest = Manifest.from_dict(json.loads(sys.stdin.readline())["manifest"])
    nixl = create_transport("nixl", progress_interval=cfg["progress_s"])
    nixl.agent  # noqa: B018  (made now, ~0.4 s, not on the clock)
    relay = bool(cfg.get("relays"))
    transport = _Landing(nixl, manifest.layout) if relay else nixl
    registry = InProcessRegistry()  # the reader's view of the version: its source's progress
    puller = Puller(registry, transport, ttl=60.0, stream=True, verify_digests=relay)
    mirror = puller.mirror = transport.allocate(manifest.layout.total_bytes)  # made ahead: relays export it
    _say(ready=True, descriptor=base64.b64encode(transport.export(mirror)).decode())
    go = json.loads(await anyio.to_thread.run_sync(sys.stdin.readline))
    cpu0 = time.process_time()  # every thread of this process, user and system
    await registry.begin(manifest.version, publisher=manifest.publisher, slot=manifest.slot)
    if go.get("source") is None:  # the trainer's slot, whole
        await registry.commit(manifest)
        source = manifest
    else:  # a relay's mirror, readable as far as the relay says
        source = attrs.evolve(manifest, source=base64.b64decode(go["source"]), digests=None)
        await registry.stream(source)
    buckets = len(manifest.layout.buckets)

    async def pull() -> None:
        start = time.time()
        await puller.pull()
        end = time.time()
        _say(start=start, end=end, cpu_s=time.process_time() - cpu0)  # the copy is checked once all ended

    async def listen() -> None:
        while line := await anyio.to_thread.run_sync(sys.stdin.readline):
            message = json.loads(line)
            if "mark" in message and source is not manifest:
                await registry.mark(manifest.version, message["mark"])
                if message["mark"] == buckets:  # whole: READY, with the publisher's digests to check
                    await registry.commit(attrs.evolve(source, digests=manifest.digests))
            if message.get("cpu"):  # the run is over: this process's CPU since go, then the checks
                said: dict[str, Any] = {"cpu": time.process_time() - cpu0}
                if message.get("verify"):
                    said["verify_cpu_s"] = verify_cpu(mirror, manifest)
                said["digest"] = digest(mirror.host_view()[: manifest.nbytes])
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

    def __init__(self, hosts: Hosts, host: int, role: str, cfg: dict[str, Any]) -> None:
        import subprocess

        argv = [sys.executable, "-m", __name__, role, json.dumps(cfg)]
        env = {**os.environ, **ENV, "PYTHONUNBUFFERED": "1"}
        self.what = f"the {role} on host {host}"
        self.proc = subprocess.Popen(hosts.command(host, argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
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


@attrs.frozen
class _Ran:
    ends: list[dict[str, Any]]  # each replica's "end": its pull's start, end and CPU
    digests: list[str]  # each replica's copy, taken once all ended
    go: float
    hops: int
    trainer_cpu_s: float  # from go until the last replica's end
    replica_cpu_s: list[float]  # each, from its go until the last end
    verify_cpu_s: float | None  # the first replica's check of its copy, off the clock
    busy_cpu_s: float  # the machine's (every process's, not only the bench's)
    wall_s: float
    handed_s: list[float]
    first_bucket_s: list[float | None]


def _one_run(
    procs: list[_Proc], trainer: _Proc, relays: bool, cap: int | None, timeout: float, *, verify: bool = False
) -> _Ran:
    """Tell every replica to go, handing each a source by the registry's policy as sources
    offer themselves (a relay once it holds its first bucket), and pass each relay's
    progress on to its readers. Around it, the CPU seconds each process and the machine
    spent. `verify`: the first replica also measures its digest check."""
    import selectors
    from collections import deque

    from weightpull.errors import NoSourceError
    from weightpull.sources import Reader, Source, choose_source

    ready = [p.expect("ready") for p in procs]
    names = [f"replica{i + 1}" for i in range(len(procs))]
    offered = {"trainer": Source("trainer", "host-0", cap=cap)}
    index = {name: i for i, name in enumerate(names)}
    parent: dict[int, str] = {}
    hops: dict[int, int] = {}
    readers: dict[int, list[int]] = {i: [] for i in range(len(procs))}
    asking = deque(range(len(procs)))

    def hand_out() -> None:
        while asking:
            i = asking[0]
            try:
                chosen = choose_source(offered.values(), Reader(names[i], f"host-{i + 1}"))
            except NoSourceError:
                return
            asking.popleft()
            offered[chosen.name] = attrs.evolve(chosen, leases=chosen.leases + 1)
            parent[i], hops[i] = chosen.name, chosen.hops + 1
            handed[i] = time.time() - go
            if chosen.name == "trainer":
                procs[i].send(source=None)
            else:
                relay = index[chosen.name]
                readers[relay].append(i)
                procs[i].send(source=ready[relay]["descriptor"])
                # what the relay holds already: its next landing may be a bucket's time away
                procs[i].send(mark=held[relay])

    trainer.send(cpu=True)
    trainer_cpu = trainer.expect("cpu")["cpu"]
    busy, total = busy_cpu_s()
    handed: dict[int, float] = {}  # when each was handed its source, since go
    first: dict[int, float] = {}  # when each said its first bucket landed (relays only)
    held = [0] * len(procs)  # the whole buckets each holds, as it last said
    go = time.time()
    hand_out()
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
                    if "landed" in message:
                        first.setdefault(i, time.time() - go)
                        held[i] = message["landed"]
                        for r in readers[i]:
                            procs[r].send(mark=message["landed"])
                        if relays and names[i] not in offered:  # it holds a bucket: it may serve
                            offered[names[i]] = Source(names[i], f"host-{i + 1}", cap=cap, hops=hops[i])
                            hand_out()
                    if "end" in message:
                        ends[i] = message
                        was = offered[parent[i]]  # its lease ends: its source has room again
                        offered[parent[i]] = attrs.evolve(was, leases=was.leases - 1)
                        hand_out()
    busy_end, total_end = busy_cpu_s()
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
        hops=max(hops.values()),
        trainer_cpu_s=trainer_cpu,
        replica_cpu_s=[c["cpu"] for c in cpus],
        verify_cpu_s=cpus[0].get("verify_cpu_s"),
        busy_cpu_s=busy_end - busy,
        wall_s=wall,
        handed_s=[handed[i] for i in range(len(procs))],
        first_bucket_s=[first.get(i) for i in range(len(procs))],
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
    """For each N in `replicas`: the time until N replicas, told to go at once, all hold the
    trainer's version: every one reading the trainer's slot, or with `relays`, each from
    the source the registry's policy hands it (`weightpull.sources`), relays among them,
    each relay forwarding buckets as they land and every reader checking the publisher's
    digests. `cap`: live readers per source (None: no cap). `progress_s`: how often the
    trainer and each relay poll NIXL for their readers' progress. `digest`: the kind the
    publisher records for relayed runs (`weightpull.digests`)."""
    if not replicas or any(not isinstance(n, int) or n < 1 for n in replicas):
        raise InvalidArgumentError(f"replicas must be positive ints, got {list(replicas)!r}")
    if size <= 0 or bucket <= 0:
        raise InvalidArgumentError("size and bucket must be positive")
    most = max(replicas)
    rows = []
    with Hosts(most + 1, rate=rate) as hosts:
        say(f"{most + 1} emulated hosts, links shaped to {rate or 'no limit'}; the trainer on host 0")
        trainer = _Proc(
            hosts,
            0,
            "trainer",
            {"size": size, "bucket": bucket, "digests": relays and digest, "progress_s": progress_s},
        )
        procs: list[_Proc] = []
        try:
            ready = trainer.expect("ready")
            for n in replicas:
                procs = [_Proc(hosts, 1 + i, "replica", {"relays": relays, "progress_s": progress_s}) for i in range(n)]
                for p in procs:
                    p.send(manifest=ready["ready"])
                load = loadavg()
                ran = _one_run(procs, trainer, relays, cap, timeout=600, verify=n == 1)
                for p in procs:
                    p.stop()
                procs = []
                ends = [d["end"] - ran.go for d in ran.ends]
                procs_cpu = ran.trainer_cpu_s + sum(ran.replica_cpu_s)
                row = {
                    "replicas": n,
                    "all_serve_s": round(max(ends), 3),
                    "first_s": round(min(ends), 3),
                    "hops": ran.hops,
                    "byte_exact": all(d == ready["digest"] for d in ran.digests),
                    # CPU seconds from go until the last replica's end: each process's own
                    # (user+sys, every thread) and the machine's busy time over all its cores
                    "trainer_cpu_s": round(ran.trainer_cpu_s, 3),
                    "replica_cpu_s": [round(c, 3) for c in ran.replica_cpu_s],
                    "pull_cpu_s": [round(d["cpu_s"], 3) for d in ran.ends],
                    "procs_cpu_s": round(procs_cpu, 3),
                    "busy_cpu_s": round(ran.busy_cpu_s, 3),
                    "wall_s": round(ran.wall_s, 3),
                    # since go: when each replica was handed its source, and (a relay) held its first bucket
                    "handed_s": [round(t, 3) for t in ran.handed_s],
                    "first_bucket_s": [None if t is None else round(t, 3) for t in ran.first_bucket_s],
                    "cpus": os.cpu_count(),
                    "loadavg": load,  # before the run: the machine is shared
                }
                if ran.verify_cpu_s is not None:
                    row["verify_cpu_s"] = round(ran.verify_cpu_s, 3)
                rows.append(row)
                say(
                    f"{n} replicas{' with relays' if relays else ''}: all serve after {row['all_serve_s']:.2f} s "
                    f"(first {row['first_s']:.2f} s, {ran.hops} hops); CPU: the bench's processes "
                    f"{procs_cpu:.2f} s, the machine {ran.busy_cpu_s:.2f} s of {os.cpu_count()} cores x "
                    f"{ran.wall_s:.2f} s (load before: {load})"
                )
        finally:
            for p in procs:
                p.stop()
            trainer.stop()
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
        "digest": digest if relays else None,
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
        "to go at once, all serve a version of SIZE bytes: first every one reading the trainer's slot, then "
        "each reading the source the registry's policy hands it, relays forwarding buckets as they land; "
        "beside what `weightpull simulate` predicts from each run's one-replica row (its link and CPU per byte, all hosts sharing this machine's cores). Needs root (ip netns) and the nixl "
        "extra; it deletes every namespace it made (docs/fanout.md). Also spelled "
        "`weightpull bench --replicas N --hosts emulated`.",
    )
    p.add_argument("--replicas", type=int, default=8, help=f"the most replicas, 1 to {MAX_REPLICAS} (default: 8)")
    p.add_argument("--hosts", choices=("emulated",), default="emulated", help="where the hosts are (default: emulated)")
    p.add_argument("--size", default="256M", help="bytes per version (default: 256M)")
    p.add_argument("--bucket-size", default="16M", help="bytes per bucket (default: 16M)")
    p.add_argument("--rate", default="1gbit", help="each host's link, as tc writes it (default: 1gbit)")
    p.add_argument("--cap", type=int, default=1, help="with relays, live readers per source (default: 1, a chain)")
    p.add_argument("--no-relays", action="store_true", help="measure only the direct reads from the trainer")
    p.add_argument(
        "--digest",
        choices=KINDS,
        default=DEFAULT_DIGEST,
        help="what the readers of the relayed run check each bucket against (the publisher's digests): "
        "wsum64 (default) is a checksum, cheap (numpy, ~0.02 core-s per 256 MiB), catching corrupt, swapped "
        "or stale buckets but not bytes a hostile relay made to match, for replicas of one job; blake2b128 "
        "is cryptographic, catching those too, at ~1 GB/s a core (docs/fanout.md)",
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
    common = dict(size=size, bucket=bucket, rate=args.rate, progress_s=args.progress_ms / 1e3, say=say)
    runs = {"direct": run_fanout(counts(args.replicas), **common)}
    if not args.no_relays:
        runs["relays"] = run_fanout(counts(args.replicas), relays=True, cap=args.cap, digest=args.digest, **common)
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
        f"{size / MiB:.0f} MiB in {bucket / MiB:.0f} MiB buckets, every link {args.rate}; direct: every replica "
        f"reads the trainer's slot; relays: each reads the source the policy hands it (cap {args.cap}), "
        f"relays forward buckets as they land, readers check the publisher's {args.digest} digests; simulated: the model "
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
