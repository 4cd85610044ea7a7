"""A sharded FSDP2 trainer SIGKILLed mid-publish and restarted before, at and after its
liveness TTL takes up its slots and goes on (issue 29, item 3).

Two gloo ranks publish sharded over NIXL to a served, keyed registry; each run is killed
while its next version is WRITING (rank 1's copy stalled). Its successor, started ahead
and silent until told, speaks to the registry 0.1, 1 and 2 TTLs after the kill: it must
adopt its slots (the dead run's READY version still holds one; its WRITING one, whose
memory died with it, is aborted), publish the next version, and a reader (one puller
throughout, as a replica outlives a trainer's restarts) must pull it bit-exact.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import anyio
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("zmq")

from weightpull import Puller, VersionState  # noqa: E402
from weightpull.drivers.zmq_registry.client import ZmqRegistry  # noqa: E402
from weightpull.integrations.torch_tensors import as_tensors  # noqa: E402

from .fsdp_resume_rank import weights  # noqa: E402
from .served import ServedRegistry, env, make_keys  # noqa: E402
from .test_fsdp import free_port  # noqa: E402

pytestmark = [pytest.mark.anyio, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[1]
TTL = 3.0  # the registry's liveness TTL (the client's heartbeat beats each second)
DELAYS = (0.1 * TTL, TTL, 2 * TTL)  # from a kill to the next run's first word: before, at, after the TTL


@pytest.fixture
def nixl():
    from weightpull.drivers.nixl import NixlTransport

    reason = NixlTransport.unavailable_reason()
    if reason:  # CI installs it ([all]): failing says so, where a skip would hide it
        pytest.fail(f"the nixl driver is needed here: {reason}")
    return NixlTransport


class Trainer:
    """Both ranks' processes, each forking one process per run (tests/fsdp_resume_rank.py)."""

    def __init__(self, out: Path, registry: ServedRegistry, runs: int) -> None:
        self.out = out
        keys = registry.key("trainer")
        ports = [str(free_port()) for _ in range(runs)]
        self.procs = []
        for rank in range(2):
            extra = {
                "RANK": str(rank),
                "WORLD_SIZE": "2",
                "MASTER_ADDR": "127.0.0.1",
                "WEIGHTPULL_REGISTRY": registry.address,
                "WEIGHTPULL_KEY": keys["key"],
                "WEIGHTPULL_SERVER_KEY": keys["server_key"],
                "OMP_NUM_THREADS": "1",
            }
            log = open(out / f"rank{rank}.log", "w")
            self.procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "tests.fsdp_resume_rank", str(out), *ports],
                    cwd=ROOT,
                    env=env(None, **extra),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )

    def logs(self) -> str:
        return "\n".join((self.out / f"rank{r}.log").read_text()[-3000:] for r in range(2))

    def _wait(self, path: Path, what: str, timeout: float = 60.0) -> str:
        deadline = time.monotonic() + timeout
        while not path.exists() or not path.read_text():
            if any(p.poll() is not None for p in self.procs) or time.monotonic() > deadline:
                raise AssertionError(f"{what}:\n{self.logs()}")
            time.sleep(0.05)
        return path.read_text()

    def ready(self, run: int) -> list[int]:
        """The pids of run `run`'s two processes, once both wait to be told to go."""
        return [int(self._wait(self.out / f"ready-{run}-{r}", f"run {run} rank {r} did not start")) for r in range(2)]

    def go(self, run: int) -> None:
        (self.out / f"go-{run}").touch()

    def published(self, run: int) -> int:
        """The version both ranks of `run` published (the registry's number: the one asked)."""
        got = set()
        for rank in range(2):
            report = json.loads(self._wait(self.out / f"run{run}-rank{rank}.json", f"run {run} rank {rank} hung"))
            assert report["version"] == report["asked"], f"run {run}: {report}\n{self.logs()}"
            got.add(report["version"])
        (version,) = got
        return version

    def kill(self, run: int) -> None:
        for pid in self.ready(run):
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except ChildProcessError:  # not ours: its rank's process reaps it
                pass
        for pid in self.ready(run):  # gone, not a zombie of the rank's process
            while os.path.exists(f"/proc/{pid}") and "Z" not in _state(pid):
                time.sleep(0.01)

    def close(self) -> None:
        for p in self.procs:
            p.kill()
            p.wait()


def _state(pid: int) -> str:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


async def pull_and_check(puller: Puller, client: ZmqRegistry, version: int) -> None:
    await client.wait_for_version(version, timeout=60)
    pulled = await puller.pull(version)
    assert pulled.version == version and len(pulled.manifest.shards) == 2
    got = as_tensors(pulled.layout, pulled.region)
    for name, full in weights(version).items():
        assert torch.equal(got[name].view(torch.int16), full.to(torch.bfloat16).view(torch.int16)), name


async def writing(client: ZmqRegistry, version: int, timeout: float = 30.0) -> None:
    """Until `version` is WRITING with both shards begun (rank 1's copy stalled)."""
    deadline = time.monotonic() + timeout
    while True:
        info = {v.version: v for v in (await client.status()).versions}.get(version)
        if info is not None and info.state is VersionState.WRITING and len(info.slots) == 2:
            return
        assert time.monotonic() < deadline, f"v{version} never was WRITING with two shards: {info}"
        await anyio.sleep(0.05)


async def test_a_sharded_trainer_killed_mid_publish_resumes_before_at_and_after_its_liveness_ttl(tmp_path, nixl):
    keys = make_keys(tmp_path / "keys", ("publisher", "trainer"), ("reader", "replica"))
    registry = ServedRegistry(tmp_path, keys=keys, args=("--liveness-ttl", str(TTL)))
    registry.start()
    client = ZmqRegistry(registry.address, **registry.key("replica"))
    puller = Puller(client, nixl(), holder="replica")
    trainer = Trainer(tmp_path, registry, 1 + len(DELAYS))
    try:
        trainer.ready(1)
        trainer.go(1)
        await pull_and_check(puller, client, trainer.published(1))
        for run, delay in enumerate(DELAYS, start=2):
            dead = trainer.published(run - 1)
            await writing(client, dead + 1)  # the next run asks past it, as the loop's trainer does
            trainer.ready(run)  # started long before: the delay is the restart's alone
            trainer.kill(run - 1)
            await anyio.sleep(delay)
            trainer.go(run)
            version = trainer.published(run)
            await pull_and_check(puller, client, version)
            left = {v.version: v for v in (await client.status()).versions}.get(dead + 1)
            assert left is None or left.state is VersionState.ABORTED, (delay, left)  # never READY, nor WRITING
    finally:
        trainer.close()
        await puller.aclose()
        await client.aclose()
        registry.stop()
