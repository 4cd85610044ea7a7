"""The processes tests/test_vllm_backend*.py drive the `weightpull` backend of vLLM's
weight-transfer API with, each in a process of its own (test code).

- `python -m tests.vllm_backend_roles trainer OUT ...`, one per rank with torchrun's
  environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT): an FSDP2 trainer of the tiny
  Llama that knows weightpull only by the backend's init info. Every rank makes the
  trainer engine through vLLM's factory with vLLM's `ModuleSource` and HTTP client, and
  sends each version asked for (`--weights`: the tiny model's version whose weights it
  holds, one per step), pausing the server around it as any framework on vLLM's API
  does (the pause clears the prefix cache). After each send rank 0 writes
  OUT/sent-N.json, and every rank waits for OUT/go-N before the next step; then each
  waits, its slots still served, until killed or OUT/exit appears.
- `python -m tests.vllm_backend_roles offline OUT ...`: the reference results on each
  checkpoint (`references`), written to OUT/references.json at once; then an
  offline `vllm.LLM` made with the backend, updated through the trainer engine over
  `OfflineClient` (one trainer rank, whole versions), its results and the errors it
  gave (a bad init, an unknown version, a version it cannot load, a lapsed publisher)
  in OUT/offline.json.
- `python -m tests.vllm_backend_roles reload OUT --checkpoints PATH...`: the same
  reference results at tensor parallel `--tp`, in OUT/reload.json.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

FAMILY = "llama"  # untied, no biases: a plain model, the backend is what is under test


def _wait_for(path: Path, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout} s")
        time.sleep(0.05)


def _write(path: Path, data: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    tmp.rename(path)  # whole or not at all, for the test that polls for it


def set_version_sharded(model: Any, base: dict, version: int, rank: int, ranks: int) -> None:
    """`tiny.set_version` on an FSDP2 model: each rank writes its rows of the same values."""
    import torch

    from weightpull.sharding import chunk_rows

    g = torch.Generator().manual_seed(version)
    with torch.no_grad():
        for name, p in model.named_parameters():
            full = base[name] + 0.05 * torch.randn(p.shape, generator=g)  # drawn in set_version's order
            a, b = chunk_rows(p.shape[0], rank, ranks)
            p.to_local().copy_(full[a:b])


def trainer(args: argparse.Namespace) -> None:
    import requests
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient, ModuleSource, WeightTransferTrainerFactory

    from weightpull.integrations.vllm.tiny import base_weights, make_model
    from weightpull.integrations.vllm.trainer import WeightpullTrainerInitInfo

    out = Path(args.out)
    rank, ranks = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=ranks)
    model = make_model(FAMILY, 0)
    base = base_weights(model)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    info = WeightpullTrainerInitInfo(
        registry=args.registry,
        rank=rank,
        name=args.name,
        first_version=args.first_version,
        rollout_dtype="bfloat16",
        replica={"publisher": args.name, "ttl": 5.0},
    )
    client = HTTPVLLMWeightSyncClient(args.url)
    engine = WeightTransferTrainerFactory.trainer_init(info, client=client, source=ModuleSource(model))
    for weights in args.weights:
        set_version_sharded(model, base, weights, rank, ranks)
        if rank == 0:  # what a framework does around a sync on vLLM's API, whatever the backend
            requests.post(f"{args.url}/pause", params={"mode": "abort"}, timeout=60).raise_for_status()
        started = time.perf_counter()
        version = engine.send_weights()
        seconds = time.perf_counter() - started
        if rank == 0:
            requests.post(f"{args.url}/resume", timeout=60).raise_for_status()
            assert engine.publisher is not None
            _write(
                out / f"sent-{version}.json",
                {"version": version, "seconds": seconds, "slot_bytes": engine.publisher.staging.layout.total_bytes},
            )
        _wait_for(out / f"go-{version}")
    _wait_for(out / "exit", timeout=3600)
    engine.shutdown()
    dist.destroy_process_group()


def _addresses(worker: Any) -> dict[str, int]:
    """Where each of the model's tensors lies (what a CUDA graph captured at start-up
    replays on), read in the worker."""
    model = worker.model_runner.get_model()
    return {name: t.data_ptr() for name, t in [*model.named_parameters(), *model.named_buffers()] if t.numel()}


def offline(args: argparse.Namespace) -> None:
    from vllm import LLM
    from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory

    from tests.vllm_families import ENGINE, serve
    from weightpull.integrations.vllm.tiny import base_weights, make_model, set_version
    from weightpull.integrations.vllm.trainer import OfflineClient, WeightpullTrainerInitInfo

    out = Path(args.out)
    _write(out / "references.json", references(args.checkpoints))

    started = time.perf_counter()
    llm = LLM(model=args.model, **ENGINE, weight_transfer_config={"backend": "weightpull"})
    report: dict[str, Any] = {"start_s": time.perf_counter() - started, "versions": {}, "errors": {}}
    model = make_model(FAMILY, 0)
    base = base_weights(model)
    info = WeightpullTrainerInitInfo(
        registry=args.registry, rank=0, name="offline", first_version=1, replica={"publisher": "offline"}
    )
    trainer = WeightTransferTrainerFactory.trainer_init(info, client=OfflineClient(llm), source=ModuleSource(model))
    client = trainer.client
    before = llm.collective_rpc(_addresses)[0]
    for weights in args.weights:
        set_version(model, base, weights)
        version = trainer.send_weights()
        llm.reset_prefix_cache()  # what pausing would do: no block cached under the old weights is reused
        report["versions"][str(version)] = {
            "weights": weights,
            "weight_version": llm.get_weight_version(),
            "results": serve(llm),
        }
    after = llm.collective_rpc(_addresses)[0]
    report["addresses"] = {"tensors": len(before), "moved": sorted(n for n in before if after.get(n) != before[n])}

    def error(name: str, call: Any, *call_args: Any) -> None:
        try:
            call(*call_args)
        except Exception as exc:  # what the trainer's side sees: the type and the words
            report["errors"][name] = {"type": type(exc).__name__, "message": str(exc)}
        report["errors"].setdefault(name, None)
        report["errors"][name + "/after"] = {"weight_version": llm.get_weight_version(), "results": serve(llm)}

    error("bad_init", client.init_weight_transfer_engine, {"registry": args.registry, "transport": "nixel"})

    def unknown() -> None:
        client.start_weight_update()
        client.update_weights({"version": 99, "timeout": 1.0})

    error("unknown_version", unknown)

    class WithoutNorm(ModuleSource):  # a version the model cannot take whole
        def metadata(self) -> list:
            return [m for m in super().metadata() if m.name != "model.norm.weight"]

        def __iter__(self) -> Any:
            return ((n, t) for n, t in super().__iter__() if n != "model.norm.weight")

    # Another publisher of the same principal (its line), the replica's init unchanged: kept.
    odd_info = WeightpullTrainerInitInfo(
        registry=args.registry, rank=0, name="offline/odd", first_version=4, replica={"publisher": "offline"}
    )
    odd = WeightTransferTrainerFactory.trainer_init(odd_info, client=client, source=WithoutNorm(model))
    error("bad_version", odd.send_weights)
    for sender in (trainer, odd):
        sender.shutdown()  # the slots deregistered, the heartbeats stopped: the registry will take it for lapsed
    time.sleep(args.lapse)

    def lapsed() -> None:
        client.start_weight_update()
        began = time.perf_counter()
        try:
            client.update_weights({"version": odd.version + 1, "timeout": 60.0})
        finally:
            report["lapse_s"] = time.perf_counter() - began

    error("lapsed", lapsed)
    _write(out / "offline.json", report)
    llm.llm_engine.engine_core.shutdown()


def references(checkpoints: list[str], tp: int = 1) -> dict[str, Any]:
    """A fresh engine's results on the first checkpoint, then, reloaded by vLLM's own
    loader from each next one (one engine start, not one per checkpoint), on each."""
    from tests.vllm_families import engine, serve

    llm = engine(checkpoints[0], tensor_parallel_size=tp)
    results = {checkpoints[0]: serve(llm)}
    for path in checkpoints[1:]:
        llm.collective_rpc("reload_weights", kwargs={"weights_path": path})
        llm.reset_prefix_cache()
        results[path] = serve(llm)
    llm.llm_engine.engine_core.shutdown()
    return results


def reload(args: argparse.Namespace) -> None:
    _write(Path(args.out) / "reload.json", references(args.checkpoints, args.tp))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    roles = parser.add_subparsers(dest="role", required=True)
    t = roles.add_parser("trainer")
    t.add_argument("out")
    t.add_argument("--registry", required=True)
    t.add_argument("--url", required=True)
    t.add_argument("--name", required=True)
    t.add_argument("--first-version", type=int, default=None)
    t.add_argument("--weights", type=int, nargs="+", required=True)
    o = roles.add_parser("offline")
    o.add_argument("out")
    o.add_argument("--registry", required=True)
    o.add_argument("--model", required=True)
    o.add_argument("--weights", type=int, nargs="+", required=True)
    o.add_argument("--lapse", type=float, required=True, help="seconds to wait for the trainer's lapse")
    o.add_argument("--checkpoints", nargs="+", required=True, help="a fresh engine's results on each, first")
    r = roles.add_parser("reload")
    r.add_argument("out")
    r.add_argument("--tp", type=int, default=1)
    r.add_argument("--checkpoints", nargs="+", required=True)
    args = parser.parse_args()
    {"trainer": trainer, "offline": offline, "reload": reload}[args.role](args)


if __name__ == "__main__":
    main()
