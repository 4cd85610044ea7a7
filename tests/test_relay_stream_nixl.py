"""A chain of relays in real processes: the registry served over ZeroMQ with keys, a
trainer streaming a version slowly into nixl-registered slots, relay1 pulling it while it
forwards what landed (`Puller(relay=True)`), and relay2 (this process) handed relay1 by
the registry while relay1 is still receiving; byte for byte. Then the same with relay1
killed mid-stream: relay2 drops its copy and completes from the trainer."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import anyio
import pytest

from weightpull import Puller, create_transport, list_transports

pytest.importorskip("zmq")
if not any(d.name == "nixl" and d.available for d in list_transports()):
    pytest.skip("the nixl driver is not available here", allow_module_level=True)

from weightpull.registry import connect_registry  # noqa: E402

from .conftest import host_tensors  # noqa: E402
from .served import ServedRegistry, env, make_keys  # noqa: E402

pytestmark = pytest.mark.anyio
SIZES = (40_000,) * 8  # eight buckets of 64 KiB
PER_BUCKET = 0.4  # seconds the trainer's copy takes per bucket: a 3.2 s stream
ROOT = Path(__file__).parent.parent
KILL_AFTER = 3 * PER_BUCKET / 2  # seconds after relay2 is placed at relay1 that relay1 is killed

TRAINER = textwrap.dedent(f"""
    import sys, anyio
    from weightpull import Publisher, create_transport
    from weightpull.registry import connect_registry
    from tests.conftest import SlowCopy, host_tensors

    async def main():
        address, key, server_key = sys.argv[1:4]
        async with connect_registry(address, key=key, server_key=server_key) as registry:
            publisher = Publisher(registry, create_transport("nixl"), rollout_dtype=None, bucket_bytes=64 << 10,
                                  name="trainer", stream=True, digests=True,
                                  adapter=SlowCopy({SIZES[0] / PER_BUCKET!r}))
            async with anyio.create_task_group() as tg:
                tg.start_soon(publisher.transport.serve)  # replicas' reads need our agent's progress
                print("ready", flush=True)
                while line := await anyio.to_thread.run_sync(sys.stdin.readline):
                    await publisher.publish(int(line), host_tensors(int(line), sizes={SIZES!r}))
                    print("published", int(line), flush=True)
                tg.cancel_scope.cancel()
            await publisher.aclose()
            await publisher.transport.aclose()

    anyio.run(main)
""")

RELAY = textwrap.dedent(f"""
    import sys, anyio
    from weightpull import Puller, create_transport
    from weightpull.errors import NoReadyVersionError
    from weightpull.registry import connect_registry
    from tests.conftest import host_tensors

    async def main():
        address, key, server_key = sys.argv[1:4]
        async with connect_registry(address, key=key, server_key=server_key) as registry:
            transport = create_transport("nixl")
            puller = Puller(registry, transport, holder="relay1", host="h1", stream=True, relay=True, ttl=10)
            async with anyio.create_task_group() as tg:
                tg.start_soon(transport.serve)  # its readers' reads need our agent's progress
                print("ready", flush=True)
                while True:
                    try:
                        pulled = await puller.pull()
                        break
                    except NoReadyVersionError:  # nothing streams yet
                        await anyio.sleep(0.02)
                want = host_tensors(pulled.version, sizes={SIZES!r})
                exact = all(bytes(pulled.view(n)) == t.data for n, t in want.items())
                print("pulled", pulled.version, "exact" if exact else "MIXED", flush=True)
                await registry.report_serving("relay1", pulled.version)
                await anyio.to_thread.run_sync(sys.stdin.readline)  # serve its mirror until told
                tg.cancel_scope.cancel()
            await puller.aclose()
            await transport.aclose()

    anyio.run(main)
""")


def spawn(code: str, served: ServedRegistry, name: str) -> subprocess.Popen:
    key = served.key(name)
    proc = subprocess.Popen(
        [sys.executable, "-c", code, served.address, key["key"], key["server_key"]],
        env=env(None),
        text=True,
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().split() == ["ready"], f"{name} did not start"
    return proc


async def chain(tmp_path: Path, *, kill_relay1: bool) -> dict:
    keys = make_keys(tmp_path / "keys", ("publisher", "trainer"), ("reader", "relay1"), ("reader", "relay2"))
    served = ServedRegistry(tmp_path, keys=keys, args=("--liveness-ttl", "2"))
    served.start()
    trainer = relay1 = None
    out: dict = {"placed": []}
    try:
        trainer = spawn(TRAINER, served, "trainer")
        relay1 = spawn(RELAY, served, "relay1")
        async with connect_registry(served.address, **served.key("relay2")) as registry:
            transport = create_transport("nixl")
            relay2 = Puller(registry, transport, holder="relay2", host="h1", stream=True, ttl=10, stall_timeout=10)
            real_acquire = registry.acquire

            async def acquire(*args, **kw):
                lease = await real_acquire(*args, **kw)
                offers = {o.holder: o for o in (await registry.status()).offers}
                held = offers.get("relay1")
                out["placed"].append((lease.source, None if held is None else (held.landed, held.buckets)))
                if kill_relay1 and lease.source == "relay1":  # mid-stream, once relay2 read from it a while
                    threading.Timer(KILL_AFTER, relay1.send_signal, (signal.SIGKILL,)).start()
                return lease

            registry.acquire = acquire
            trainer.stdin.write("1\n")
            trainer.stdin.flush()
            started = time.monotonic()
            while not any(o.holder == "relay1" for o in (await registry.status()).offers):
                assert time.monotonic() - started < 20, "relay1 never offered what it receives"
                await anyio.sleep(0.02)
            pulled = await relay2.pull()
            out["relay2_seconds"] = time.monotonic() - started
            out["exact"] = all(bytes(pulled.view(n)) == t.data for n, t in host_tensors(1, sizes=SIZES).items()) and (
                pulled.version == 1
            )
            out["failed"] = relay2.metrics()["pull/failed"]
            status = await registry.status()
            out["offers"] = {o.holder: (o.landed, o.buckets) for o in status.offers}
            await relay2.aclose()
            await transport.aclose()
        assert (await anyio.to_thread.run_sync(trainer.stdout.readline)).split() == ["published", "1"]
        if not kill_relay1:
            out["relay1"] = (await anyio.to_thread.run_sync(relay1.stdout.readline)).split()
    finally:
        for proc in (trainer, relay1):
            if proc is not None and proc.poll() is None:
                proc.stdin.close()
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
        served.stop()
    print(f"chain (kill relay1: {kill_relay1}): {out}")  # the figures, with -s
    return out


async def test_relay2_streams_from_relay1_while_relay1_still_receives(tmp_path):
    out = await chain(tmp_path, kill_relay1=False)
    source, held = out["placed"][0]
    assert source == "relay1" and held[0] < held[1]  # placed at relay1 while it held part of v1
    assert out["exact"] and out["failed"] == 0 and len(out["placed"]) == 1
    assert out["relay1"] == ["pulled", "1", "exact"]
    assert out["offers"]["relay1"] == (8, 8)


async def test_relay1_killed_mid_stream_and_relay2_completes_from_the_trainer(tmp_path):
    out = await chain(tmp_path, kill_relay1=True)
    sources = [source for source, _ in out["placed"]]
    assert sources == ["relay1", ""]  # dropped relay1's copy, then the trainer's slot
    assert out["exact"] and out["failed"] == 0
    assert "relay1" not in out["offers"]  # its offer lapsed with it
