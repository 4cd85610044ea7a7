"""Fan-out across emulated hosts: the time until N replicas serve one version.

The trainer (a `Publisher` over NIXL) runs in host 0's namespace; each replica (a
`Puller`) in a host of its own; every link is shaped (`hosts.Hosts`), and NIXL runs over
TCP (`UCX_TLS=tcp`), so every byte a replica reads crosses the trainer's link and its own.
The replicas start, make their NIXL agents, then are told to go at once; the time until
N serve is from that moment until the last one's pull ended (the pull alone: leasing,
every bucket, the lease check). Each copy is then checked byte for byte, off the clock.

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

from weightpull.errors import InvalidArgumentError

from .hosts import ENV, Hosts

MiB = 1 << 20
DEFAULT_SIZE = 256 * MiB
DEFAULT_BUCKET = 16 * MiB
_START_TIMEOUT_S = 120.0
MAX_REPLICAS = 16  # hosts.MAX_HOSTS less the trainer's


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
        create_transport("nixl"),
        rollout_dtype=None,
        bucket_bytes=cfg["bucket"],
        name=f"trainer-{os.getpid()}",
    )
    result = await publisher.publish(1, _tensors(bench, data))
    assert result.manifest is not None
    _say(ready=result.manifest.to_dict(), digest=digest(data))
    async with anyio.create_task_group() as tg:
        tg.start_soon(publisher.serve)  # over TCP every read needs the owner's progress
        await anyio.to_thread.run_sync(sys.stdin.readline)  # until told to stop (or stdin closes)
        tg.cancel_scope.cancel()
    await publisher.aclose()
    await publisher.transport.aclose()


async def _replica(cfg: dict[str, Any]) -> None:
    from weightpull.manifest import Manifest
    from weightpull.puller import Puller
    from weightpull.registry import InProcessRegistry
    from weightpull.transports import create_transport

    from .pull import digest

    # Every reader shares one link here: a read outlasting the driver's 10 s warning is expected.
    logging.getLogger("weightpull.drivers.nixl").setLevel(logging.ERROR)
    manifest = Manifest.from_dict(json.loads(sys.stdin.readline())["manifest"])
    registry = InProcessRegistry()
    await registry.begin(manifest.version, publisher=manifest.publisher, slot=manifest.slot)
    await registry.commit(manifest)
    transport = create_transport("nixl")
    transport.agent  # noqa: B018  (made now, ~0.4 s, not on the clock)
    puller = Puller(registry, transport, ttl=60.0, verify_digests=False)
    _say(ready=True)
    await anyio.to_thread.run_sync(sys.stdin.readline)  # go
    start = time.time()
    pulled = await puller.pull()
    end = time.time()
    exact = digest(pulled.region.host_view()[: manifest.nbytes])
    _say(start=start, end=end, digest=exact)
    await puller.aclose()
    await transport.aclose()


def main(argv: Sequence[str]) -> None:
    role, cfg = argv[0], json.loads(argv[1])
    anyio.run({"trainer": _trainer, "replica": _replica}[role], cfg)


# -- the run -------------------------------------------------------------------------------------


class _Proc:
    """One process inside a host, spoken to by JSON lines."""

    def __init__(self, hosts: Hosts, host: int, role: str, cfg: dict[str, Any]) -> None:
        import subprocess

        argv = [sys.executable, "-m", __name__, role, json.dumps(cfg)]
        env = {**os.environ, **ENV, "PYTHONUNBUFFERED": "1"}
        self.what = f"the {role} on host {host}"
        self.proc = subprocess.Popen(
            hosts.command(host, argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
        )

    def send(self, **message: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(message) + "\n")
        self.proc.stdin.flush()

    def expect(self, key: str, timeout: float = _START_TIMEOUT_S) -> dict[str, Any]:
        import selectors

        assert self.proc.stdout is not None
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            raise RuntimeError(f"{self.what} said nothing for {timeout:.0f} s (waiting for {key!r})")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.what} exited (code {self.proc.wait()}) before {key!r}")
        message: dict[str, Any] = json.loads(line)
        if key not in message:
            raise RuntimeError(f"{self.what} said {line.strip()!r}, not {key!r}")
        return message

    def stop(self) -> None:
        try:
            if self.proc.stdin:
                self.proc.stdin.close()
            self.proc.wait(15)
        except Exception:
            self.proc.kill()
            self.proc.wait(5)


def run_fanout(
    replicas: Sequence[int] = (1, 2, 4, 8),
    *,
    size: int = DEFAULT_SIZE,
    bucket: int = DEFAULT_BUCKET,
    rate: str | None = "1gbit",
    say: Callable[[str], None] = lambda line: None,
) -> dict[str, Any]:
    """For each N in `replicas`: the time until N replicas, told to go at once, all hold the
    trainer's version, every one reading from the trainer's slot (no relays)."""
    if not replicas or any(not isinstance(n, int) or n < 1 for n in replicas):
        raise InvalidArgumentError(f"replicas must be positive ints, got {list(replicas)!r}")
    if size <= 0 or bucket <= 0:
        raise InvalidArgumentError("size and bucket must be positive")
    most = max(replicas)
    rows = []
    with Hosts(most + 1, rate=rate) as hosts:
        say(f"{most + 1} emulated hosts, links shaped to {rate or 'no limit'}; the trainer on host 0")
        trainer = _Proc(hosts, 0, "trainer", {"size": size, "bucket": bucket})
        procs: list[_Proc] = []
        try:
            ready = trainer.expect("ready")
            for n in replicas:
                procs = [_Proc(hosts, 1 + i, "replica", {}) for i in range(n)]
                for p in procs:
                    p.send(manifest=ready["ready"])
                for p in procs:
                    p.expect("ready")
                go = time.time()
                for p in procs:
                    p.send(go=True)
                done = [p.expect("end", timeout=600) for p in procs]
                for p in procs:
                    p.stop()
                procs = []
                ends = [d["end"] - go for d in done]
                row = {
                    "replicas": n,
                    "all_serve_s": round(max(ends), 3),
                    "first_s": round(min(ends), 3),
                    "byte_exact": all(d["digest"] == ready["digest"] for d in done),
                }
                rows.append(row)
                say(f"{n} replicas: all serve after {row['all_serve_s']:.2f} s (first {row['first_s']:.2f} s)")
        finally:
            for p in procs:
                p.stop()
            trainer.stop()
    one = rows[0]["all_serve_s"] / rows[0]["replicas"]  # per replica, from the first N
    for row in rows:
        row["vs_one"] = round(row["all_serve_s"] / one, 2)
    return {"size_bytes": size, "bucket_bytes": bucket, "rate": rate, "relays": False, "rows": rows}


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
        "to go at once, all serve a version of SIZE bytes read from the trainer's slot, beside what "
        "`weightpull simulate` predicts from the one-replica time. Needs root (ip netns) and the nixl "
        "extra; it deletes every namespace it made (docs/fanout.md). Also spelled "
        "`weightpull bench --replicas N --hosts emulated`.",
    )
    p.add_argument("--replicas", type=int, default=8, help=f"the most replicas, 1 to {MAX_REPLICAS} (default: 8)")
    p.add_argument("--hosts", choices=("emulated",), default="emulated", help="where the hosts are (default: emulated)")
    p.add_argument("--size", default="256M", help="bytes per version (default: 256M)")
    p.add_argument("--bucket-size", default="16M", help="bytes per bucket (default: 16M)")
    p.add_argument("--rate", default="1gbit", help="each host's link, as tc writes it (default: 1gbit)")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line of stdout")
    p.set_defaults(func=run_command)


def run_command(args: Any) -> int:
    from weightpull.integrations.simulate import validate

    from .util import parse_size, say_to_stderr

    if not 1 <= args.replicas <= MAX_REPLICAS:
        raise InvalidArgumentError(f"--replicas must be in [1, {MAX_REPLICAS}], got {args.replicas}")
    from weightpull.transports import transport_class

    transport_class("nixl")  # fails early, naming the missing extra
    result = run_fanout(
        counts(args.replicas),
        size=parse_size(args.size),
        bucket=parse_size(args.bucket_size),
        rate=args.rate,
        say=say_to_stderr("fanout"),
    )
    simulated = {r["replicas"]: r for r in validate(result)}
    for row in result["rows"]:
        row["simulated_s"] = simulated[row["replicas"]]["simulated_s"]
    exact = all(r["byte_exact"] for r in result["rows"])
    if args.json:
        print(json.dumps({"direct": result}))
    else:
        print(
            f"{result['size_bytes'] / MiB:.0f} MiB in {result['bucket_bytes'] / MiB:.0f} MiB buckets, links "
            f"{result['rate']}; every replica reads the trainer's slot (no relays)"
        )
        print("replicas  all serve s  x one  simulated s  byte-exact")
        for r in result["rows"]:
            print(
                f"{r['replicas']:8d}  {r['all_serve_s']:11.2f}  {r['vs_one']:5.2f}  {r['simulated_s']:11.2f}  "
                f"{'yes' if r['byte_exact'] else 'NO'}"
            )
    return 0 if exact else 1


if __name__ == "__main__":
    main(sys.argv[1:])
