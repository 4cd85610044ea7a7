"""FSDP2 trainers publishing through weightpull: two gloo ranks in their own processes
train a small model, publishing at start and after every step, through the served
registry and NIXL; this process pulls as a replica and checks the weights bit for bit."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("zmq")

from weightpull import Puller, VersionState  # noqa: E402
from weightpull.drivers.zmq_registry.client import ZmqRegistry  # noqa: E402
from weightpull.integrations.fsdp import hf_name  # noqa: E402
from weightpull.integrations.torch_tensors import as_tensors  # noqa: E402

from .fsdp_rank import TinyLM  # noqa: E402
from .served import SECRET, ServedRegistry, env  # noqa: E402

pytestmark = [pytest.mark.anyio, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def nixl():
    from weightpull.drivers.nixl import NixlTransport

    reason = NixlTransport.unavailable_reason()
    if reason:  # CI installs it ([all]): failing says so, where a skip would hide it
        pytest.fail(f"the nixl driver is needed here: {reason}")
    return NixlTransport


@pytest.fixture
def registry(tmp_path):
    served = ServedRegistry(tmp_path)
    served.start()
    yield served
    if served.alive():
        served.stop()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Job:
    """Two trainer ranks, launched as torchrun would: `python -m MODULE *ARGS OUT`."""

    def __init__(self, module: str, args: list[str], address: str, out: Path, secret: bytes | None = SECRET) -> None:
        self.out = out
        port = str(free_port())
        self.procs = []
        for rank in range(2):
            extra = {
                "RANK": str(rank),
                "WORLD_SIZE": "2",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": port,
                "WEIGHTPULL_REGISTRY": address,
                "OMP_NUM_THREADS": "1",
            }
            log = open(out / f"rank{rank}.log", "w")
            self.procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", module, *args, str(out)],
                    cwd=ROOT,
                    env=env(secret, **extra),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )

    def report(self, rank: int, timeout: float = 90.0) -> dict:
        path = self.out / f"rank{rank}.json"
        deadline = time.monotonic() + timeout
        while not path.exists():
            if self.procs[rank].poll() is not None or time.monotonic() > deadline:
                raise AssertionError(
                    f"rank {rank} ended ({self.procs[rank].returncode}) without a report:\n"
                    + (self.out / f"rank{rank}.log").read_text()
                )
            time.sleep(0.05)
        return json.loads(path.read_text())

    def finish(self) -> list[int]:
        (self.out / "done").touch()
        return [p.wait(30) for p in self.procs]

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()


async def pull_and_check(registry: ServedRegistry, nixl, out: Path, version: int):
    client = ZmqRegistry(registry.address, secret=SECRET)
    puller = Puller(client, nixl(), holder="replica")
    try:
        pulled = await puller.pull()
        assert pulled.version == version
        expected = torch.load(out / "expected.pt")
        names = [hf_name(n) for n in TinyLM().state_dict()]
        assert list(expected) == names  # the checkpoint's names, wrappers and all left out
        got = as_tensors(pulled.layout, pulled.region)
        assert list(got) == names
        for name in names:
            assert got[name].dtype == torch.bfloat16
            assert torch.equal(got[name].view(torch.int16), expected[name].view(torch.int16)), name
        status = await client.status()
        return pulled.manifest, {v.version: v for v in status.versions}
    finally:
        await puller.aclose()
        await client.aclose()


@pytest.mark.parametrize("mode", ["sharded", "gathered"])
async def test_fsdp_ranks_publish_every_step_and_a_broken_publish_keeps_the_last_version(
    mode, registry, nixl, tmp_path
):
    job = Job("tests.fsdp_rank", [mode], registry.address, tmp_path)
    try:
        reports = [job.report(0), job.report(1) if mode == "sharded" else None]
        manifest, versions = await pull_and_check(registry, nixl, tmp_path, version=3)
        assert all(s <= 1.0 for s in reports[0]["blocking_s"])  # the metric is there, and small
        if mode == "sharded":  # each rank's own rows, read straight into place; v4 died with rank 1's copy
            assert "failed" not in reports[0] and "failed" not in reports[1]  # nor did any publish gather
            assert [(s.index, s.publisher) for s in manifest.shards] == [(0, "trainer/rank0"), (1, "trainer/rank1")]
            sinks = manifest.layout.specs.index(next(s for s in manifest.layout.specs if s.name.endswith("sinks")))
            assert manifest.shards[1].rows[sinks] == (1, 1)  # an empty shard
            assert versions[4].state is VersionState.ABORTED and "lost its device" in versions[4].reason
            assert job.finish() == [0, 0]
        else:  # rank 1 died in the gather of v4: rank 0 copied nothing, recorded why, and still serves v3
            assert not manifest.shards and manifest.publisher == "trainer/rank0"
            assert "PublishError" in reports[0]["failed"]
            assert versions[4].state is VersionState.ABORTED and "gathering" in versions[4].reason
            assert job.finish() == [0, -9]
        assert versions[3].state is VersionState.READY
    finally:
        job.kill()


def test_checkpoint_names_leave_wrappers_out():
    assert (
        hf_name("model.layers.0._checkpoint_wrapped_module.mlp.up_proj.weight") == "model.layers.0.mlp.up_proj.weight"
    )
    assert hf_name("_orig_mod.model._fsdp_wrapped_module.embed_tokens.weight") == "model.embed_tokens.weight"
    assert hf_name("lm_head.weight") == "lm_head.weight"


SMALL = [
    "--layers",
    "2",
    "--hidden",
    "64",
    "--inter",
    "96",
    "--vocab",
    "301",
    "--heads",
    "4",
    "--kv-heads",
    "2",
    "--head-dim",
    "16",
    "--device",
    "cpu",
]


def test_the_blocking_time_bench_runs_small_on_cpu():
    """The H200 figure of docs/guides/fsdp.md comes from this bench at Qwen3-8B's shapes."""
    run = subprocess.run(
        [sys.executable, "-m", "weightpull", "bench", "fsdp", *SMALL, "--publishes", "2"],
        cwd=ROOT,
        env=env(MASTER_PORT=str(free_port())),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    lines = [json.loads(line) for line in run.stdout.splitlines()]
    assert [r["mode"] for r in lines] == ["sharded", "gathered"]
    assert all(r["bit_exact"] and r["tensors"] == 2 * 11 + 3 and len(r["blocking_ms"]) == 2 for r in lines)


def test_the_blocking_time_bench_old_module_path_still_runs_and_warns():
    run = subprocess.run(
        [sys.executable, "-m", "weightpull.integrations.fsdp_bench", *SMALL, "--publishes", "1", "--mode", "sharded"],
        cwd=ROOT,
        env=env(MASTER_PORT=str(free_port())),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert "`python -m weightpull.integrations.fsdp_bench` is deprecated" in run.stderr
    (line,) = [json.loads(line) for line in run.stdout.splitlines()]
    assert line["mode"] == "sharded" and line["bit_exact"] is True
