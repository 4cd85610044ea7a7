"""`weightpull bench registry`: lease acquire/release round trips against a served registry.

Each client has its own `ZmqRegistry` (its own sockets) and loops acquire+release on the
newest READY version for the measured time. Against `--registry ADDRESS` the bench only
leases what is there (it never publishes into a live job); without one it starts its own
server process on loopback (`--insecure-dev`: no keys, every client an admin) and
publishes a one-byte version into it.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import anyio
import attrs

from weightpull.drivers.zmq_registry.client import ZmqRegistry
from weightpull.drivers.zmq_registry.keys import KEY_ENV, SERVER_KEY_ENV
from weightpull.drivers.zmq_registry.wire import SECRET_ENV
from weightpull.errors import NoReadyVersionError, RegistryError
from weightpull.integrations.processes import Children
from weightpull.layout import TensorSpec, plan_layout
from weightpull.manifest import Manifest


@attrs.frozen
class BenchResult:
    address: str
    clients: int
    seconds: float
    round_trips: int
    p50_ms: float
    p99_ms: float
    max_ms: float

    @property
    def per_second(self) -> float:
        return self.round_trips / self.seconds

    def to_dict(self) -> dict[str, float | int | str]:
        return {**attrs.asdict(self), "round_trips_per_s": round(self.per_second, 1)}

    def lines(self) -> list[str]:
        return [
            f"registry bench: {self.clients} clients for {self.seconds:.1f} s against {self.address}",
            f"  lease acquire+release round trips: {self.round_trips} = {self.per_second:,.0f}/s "
            f"({2 * self.per_second:,.0f} requests/s)",
            f"  latency per round trip: p50 {self.p50_ms:.2f} ms, p99 {self.p99_ms:.2f} ms, max {self.max_ms:.2f} ms",
        ]


def _quantile(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


async def run_bench(
    address: str, *, clients: int = 8, seconds: float = 3.0, secret: bytes | None = None
) -> BenchResult:
    regs = [ZmqRegistry(address, secret=secret) for _ in range(clients)]
    if await regs[0].newest() is None:
        raise NoReadyVersionError(
            f"the bench leases the newest READY version; the registry at {address} has none: "
            "publish one first, or leave out --registry and the bench serves its own"
        )
    latencies: list[float] = []
    warm, go = [0], anyio.Event()
    window = [0.0, 0.0]

    async def client(i: int) -> None:
        reg, holder = regs[i], f"bench-{i}"
        await reg.release(await reg.acquire(ttl=30.0, holder=holder))  # connect, learn the run
        warm[0] += 1
        if warm[0] == clients:
            window[:] = [time.perf_counter(), time.perf_counter() + seconds]
            go.set()
        await go.wait()
        while (t0 := time.perf_counter()) < window[1]:
            await reg.release(await reg.acquire(ttl=30.0, holder=holder))
            latencies.append(time.perf_counter() - t0)

    try:
        async with anyio.create_task_group() as tg:
            for i in range(clients):
                tg.start_soon(client, i)
    finally:
        for reg in regs:
            await reg.aclose()
    elapsed = time.perf_counter() - window[0]
    latencies.sort()
    ms = [x * 1e3 for x in latencies] or [0.0]
    return BenchResult(address, clients, elapsed, len(latencies), _quantile(ms, 0.5), _quantile(ms, 0.99), ms[-1])


# The bench's own server: its publisher publishes once and is heard from no more, so a
# liveness TTL (10 s by default) would withdraw the version mid-bench; a week outlasts any.
OWN_LIVENESS_TTL = 7 * 24 * 3600.0
# What the bench's own server and its clients must not take from this environment: they
# speak plainly (the server takes no key and no secret).
NOT_FOR_OWN_SERVER = (SECRET_ENV, KEY_ENV, SERVER_KEY_ENV)


@contextlib.contextmanager
def own_server() -> Iterator[tuple[str, bytes]]:
    """A `weightpull registry serve --insecure-dev` process on a free loopback port:
    (address, b""). The empty secret says "none" explicitly, so the bench's clients speak
    plainly, as this server does, instead of taking $WEIGHTPULL_KEY or $WEIGHTPULL_SECRET
    from the environment."""
    env = {k: v for k, v in os.environ.items() if k not in NOT_FOR_OWN_SERVER}
    cmd = [
        *(sys.executable, "-m", "weightpull", "registry", "serve", "--bind", "tcp://127.0.0.1:0", "--insecure-dev"),
        *("--liveness-ttl", str(OWN_LIVENESS_TTL), "--json"),
    ]
    # Its log (the --insecure-dev warning, each refusal) goes to a file, shown if it fails to
    # start: a pipe nobody reads could fill and stall it.
    with tempfile.TemporaryFile("w+") as log, Children() as children:  # it ends with the bench, even a killed one
        proc = children.popen(cmd, env=env, stdout=subprocess.PIPE, stderr=log, text=True)
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline()  # its ready line, or its error, as JSON
            try:
                address = json.loads(line)["listening"]
            except (ValueError, KeyError, TypeError):
                proc.wait(10)
                log.seek(0)
                raise RegistryError(
                    f"the bench's registry server did not start (exit {proc.poll()}): {line!r} {log.read().strip()}"
                ) from None
            yield address, b""
        finally:
            proc.terminate()
            proc.wait(10)
            if proc.stdout is not None:
                proc.stdout.close()


async def publish_one(address: str, secret: bytes | None = None) -> None:
    """A one-byte version for the bench to lease. Its client sends no heartbeat and
    closes at once: the version stays READY for the server's --liveness-ttl (the bench's
    own server: a week), or as long as another client publishes as `bench`."""
    reg = ZmqRegistry(address, secret=secret, heartbeat=None)
    layout = plan_layout([TensorSpec("bench", "uint8", (1,))])
    await reg.begin(1, publisher="bench", slot=0)
    await reg.commit(Manifest(1, layout, "fake", b"{}", 0, "bench"))
    await reg.aclose()
