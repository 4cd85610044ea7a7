"""Sliced relays in real processes over NIXL on the CPU: the registry served over ZeroMQ
with keys, a trainer publishing into nixl-registered slots, a relay process whose rank 0
of TP=2 pulls its slice from the trainer and offers it (`SlicePuller(relay=True)`), and
this process's rank 0 of another replica, placed at that relay, reading the slice
byte for byte; its rank 1 (another layout) reads the trainer. Then the relay SIGKILLed
mid-serve, after its reader's first bucket landed: the reader drops that copy and
finishes bit-exact from the trainer."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from weightpull import create_transport, list_transports
from weightpull.slice_puller import SlicePuller
from weightpull.transport import WrappedTransport

pytest.importorskip("zmq")
if not any(d.name == "nixl" and d.available for d in list_transports()):
    pytest.skip("the nixl driver is not available here", allow_module_level=True)

from weightpull.registry import connect_registry  # noqa: E402

from .served import ServedRegistry, env, make_keys  # noqa: E402
from .test_slice_puller import _check  # noqa: E402
from .test_slices import _model, _slice  # noqa: E402

pytestmark = pytest.mark.anyio
ROOT = Path(__file__).parent.parent
SHAPE = {"vocab_size": 30, "hidden": 64, "heads": 4, "kv": 2, "inter": 128, "experts": 2}  # 0.3 MB
MODEL = ", ".join(f"{k}={v}" for k, v in SHAPE.items())  # the same model, as the processes make it
SPECS = _model(**SHAPE)
BUCKET = 16 << 10  # each rank's mirror, in buckets: the relay's is read a bucket at a time

TRAINER = textwrap.dedent(f"""
    import sys, anyio, numpy as np
    from weightpull import HostTensor, Publisher, create_transport
    from weightpull.registry import connect_registry
    from tests.test_slices import _model

    async def main():
        address, key, server_key = sys.argv[1:4]
        specs = _model({MODEL})
        rng = np.random.default_rng(1)
        tensors = {{s.name: HostTensor("int32", s.shape, rng.integers(-2**31, 2**31 - 1, size=s.shape,
                    dtype=np.int32).tobytes()) for s in specs}}
        async with connect_registry(address, key=key, server_key=server_key) as registry:
            publisher = Publisher(registry, create_transport("nixl"), rollout_dtype=None, bucket_bytes={BUCKET},
                                  name="trainer")
            async with anyio.create_task_group() as tg:
                tg.start_soon(publisher.transport.serve)  # replicas' reads need our agent's progress
                await publisher.publish(1, tensors)
                print("published", flush=True)
                await anyio.to_thread.run_sync(sys.stdin.readline)
                tg.cancel_scope.cancel()
            await publisher.aclose()
            await publisher.transport.aclose()

    anyio.run(main)
""")

RELAY = textwrap.dedent(f"""
    import sys, anyio
    from weightpull import create_transport
    from weightpull.registry import connect_registry
    from weightpull.slice_puller import SlicePuller
    from tests.test_slices import _model, _slice

    async def main():
        address, key, server_key = sys.argv[1:4]
        async with connect_registry(address, key=key, server_key=server_key) as registry:
            transport = create_transport("nixl")
            rank = SlicePuller(registry, transport, _slice(_model({MODEL}), 0, 2, 2), holder="relay", host="h1",
                               relay=True, bucket_bytes={BUCKET}, ttl=10)
            async with anyio.create_task_group() as tg:
                tg.start_soon(transport.serve)  # its readers' reads need our agent's progress
                pulled = await rank.pull(1)
                print("offered", pulled.version, rank.offered, pulled.source or "trainer", flush=True)
                await anyio.to_thread.run_sync(sys.stdin.readline)  # serve its mirror until told
                tg.cancel_scope.cancel()
            await rank.aclose()
            await transport.aclose()

    anyio.run(main)
""")


def _full() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    return {s.name: rng.integers(-(2**31), 2**31 - 1, size=s.shape, dtype=np.int32) for s in SPECS}


class KillAfterFirst(WrappedTransport):
    """Reads one at a time; once the first read of the first batch landed (rank 0's, from
    the relay it was placed at), SIGKILL `victim`, the relay's process."""

    def __init__(self, inner, victim: subprocess.Popen | None) -> None:
        super().__init__(inner)
        self.victim, self.landed_before_kill = victim, 0

    async def read_many(self, reads) -> None:
        for read in reads:
            await self.inner.read(*read)
            if self.victim is not None:
                self.landed_before_kill = 1
                self.victim.send_signal(signal.SIGKILL)
                self.victim.wait(10)
                self.victim = None


def spawn(code: str, served: ServedRegistry, name: str) -> subprocess.Popen:
    key = served.key(name)
    return subprocess.Popen(
        [sys.executable, "-c", code, served.address, key["key"], key["server_key"]],
        env=env(None),
        text=True,
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )


async def replicas(tmp_path: Path, *, kill: bool) -> dict:
    keys = make_keys(tmp_path / "keys", ("publisher", "trainer"), ("reader", "relay"), ("reader", "reader"))
    served = ServedRegistry(tmp_path, keys=keys, args=("--liveness-ttl", "2"))
    served.start()
    trainer = relay = None
    out: dict = {}
    try:
        trainer = spawn(TRAINER, served, "trainer")
        assert trainer.stdout is not None and trainer.stdout.readline().split() == ["published"]
        relay = spawn(RELAY, served, "relay")
        assert relay.stdout is not None
        out["relay"] = relay.stdout.readline().split()
        async with connect_registry(served.address, **served.key("reader")) as registry:
            inner = create_transport("nixl")
            transport = KillAfterFirst(inner, relay if kill else None)
            ranks = [
                SlicePuller(
                    registry,
                    transport,
                    _slice(SPECS, r, 2, 2),
                    holder=f"reader/{r}",
                    host="h1",
                    bucket_bytes=BUCKET,
                    ttl=10,
                    stall_timeout=5,
                )
                for r in (0, 1)
            ]
            out["pulled"] = [await rank.pull() for rank in ranks]
            out["relayed"] = transport.landed_before_kill
            for rank in ranks:
                await rank.aclose()
            await inner.aclose()
    finally:
        for proc in (trainer, relay):
            if proc is not None and proc.poll() is None:
                assert proc.stdin is not None
                proc.stdin.close()
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
        served.stop()
    return out


async def test_a_rank_reads_its_slice_from_the_same_rank_of_a_relay_process(tmp_path):
    out = await replicas(tmp_path, kill=False)
    assert out["relay"] == ["offered", "1", "1", "trainer"]
    zero, one = out["pulled"]
    assert zero.source == "relay" and one.source == ""  # rank 1's layout: no relay holds it
    full = _full()
    _check(zero, full, 0, 2)
    _check(one, full, 1, 2)


async def test_a_relay_killed_mid_serve_leaves_its_reader_a_bit_exact_slice_from_the_trainer(tmp_path, caplog):
    out = await replicas(tmp_path, kill=True)
    assert out["relay"] == ["offered", "1", "1", "trainer"]
    zero, one = out["pulled"]
    assert out["relayed"] >= 1  # a bucket of the relay's mirror landed before it died
    assert zero.source == "" and "relay 'relay' failed v1's slice" in caplog.text
    full = _full()
    _check(zero, full, 0, 2)
    _check(one, full, 1, 2)
