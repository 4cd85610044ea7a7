"""Host memory per node of a tensor-parallel vLLM replica, by how its workers hold versions.

    python -m weightpull.integrations.bench.vllm_memory [--tp 2] [--layers 8] [--hidden 1024] [--json]

One run, three replicas of the same Qwen3-shaped model (random bf16 weights: ~0.33 GB at
the defaults), one after another, each a tensor-parallel `AsyncLLM` with weightpull's
worker extension on the CPU:

- **before**: every worker pulls the whole version into two mirrors (`sharded=False`),
- **sliced, spare off**: each worker its slice into one mirror (`spare_mirror=False`),
- **sliced, spare on**: each worker its slice into two mirrors (the default at TP > 1).

For each: the trainer (this process, over nixl, the registry served over ZeroMQ) reserves
its slots, then publishes two versions, which the replica pulls and applies in turn (the
update agent's steps, driven here one by one). Measured per worker (`VllmEngine.memory`,
each worker's freed heap given back first, so that the resident set counts live memory):
its resident set with the engine alone (before `start`), once its slice is recorded
(`start`), once its mirrors are registered and the first version pulled (no apply yet),
and after both updates (also untrimmed: what the allocator kept); and its mirrors' bytes.
Printed side by side: sums over the workers (a node's), and against the model's bytes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio

SETUPS = (  # name, PullSpec fields
    ("before: whole, two mirrors", {"sharded": False, "spare_mirror": True}),
    ("sliced, spare mirror off", {"spare_mirror": False}),
    ("sliced, spare mirror on", {"spare_mirror": True}),
)


def write_model(path: Path, dims: dict[str, int]) -> list[tuple[str, tuple[int, ...]]]:
    """A Qwen3 checkpoint of `dims` with version 0's bytes (`vllm_engine.version_weights`),
    and its tensors' shapes. A real checkpoint, not vLLM's dummy weights: a sliced worker
    reloads its checkpoint after recording its slice."""
    from safetensors.torch import save_file
    from transformers import AutoConfig

    from .presets import qwen3_shaped
    from .vllm_engine import version_weights

    model = qwen3_shaped(**dims)
    shapes = [(name, tuple(p.shape)) for name, p in model.named_parameters()]
    AutoConfig.for_model(
        "qwen3",
        hidden_size=dims["hidden"],
        intermediate_size=dims["inter"],
        num_hidden_layers=dims["layers"],
        num_attention_heads=dims["heads"],
        num_key_value_heads=dims["kv_heads"],
        head_dim=dims["head_dim"],
        vocab_size=dims["vocab"],
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        architectures=["Qwen3ForCausalLM"],
        dtype="bfloat16",
    ).save_pretrained(path)
    save_file(version_weights(shapes, 0, "cpu"), str(path / "model.safetensors"))
    return shapes


async def measure(
    path: Path, shapes: list[tuple[str, tuple[int, ...]]], tp: int, say: Any
) -> tuple[int, list[dict[str, Any]]]:
    """The model's bytes, and per setup the workers' memory at each stage."""
    from weightpull import InProcessRegistry, Publisher, create_transport
    from weightpull.drivers.zmq_registry.server import RegistryServer
    from weightpull.integrations.vllm import PullSpec, VllmEngine, engine_args, shutdown, start_engine
    from weightpull.layout import TensorSpec
    from weightpull.rl.agent import PauseMode

    from .vllm_engine import version_weights

    nbytes = sum(2 * math.prod(s) for _, s in shapes)
    registry = InProcessRegistry()
    transport = create_transport("nixl")
    publisher = Publisher(registry, transport, rollout_dtype=None, num_slots=2, when_full="wait", name="trainer")
    rows = []
    engine = {"dtype": "bfloat16", "max_model_len": 512, "max_num_seqs": 4, "tensor_parallel_size": tp}
    async with anyio.create_task_group() as tg:
        address = await tg.start(RegistryServer("tcp://127.0.0.1:0", insecure_dev=True, registry=registry).serve)
        tg.start_soon(transport.serve)  # the workers' reads need the trainer's progress
        await publisher.reserve([TensorSpec(name, "bfloat16", shape) for name, shape in shapes])
        version = 0
        for name, fields in SETUPS:
            started = time.perf_counter()
            llm = await start_engine(engine_args(str(path), **engine))
            try:
                control = VllmEngine(llm, apply_timeout=600)
                stages = {"engine": await control.memory(trim=True)}
                spec = PullSpec(address, f"replica-{version}", ttl=60.0, **fields)
                await control.start(spec)
                stages["started"] = await control.memory(trim=True)
                say(f"{name}: engine up and started in {time.perf_counter() - started:.0f} s")
                await control.prepare()  # registers every mirror, in the background
                for update in range(2):
                    version += 1
                    await publisher.publish(version, version_weights(shapes, version, "cpu"))
                    await control.prefetch(version)
                    if update == 0:
                        stages["pulled"] = await _settled(control)
                    await control.pause(PauseMode.ABORT)
                    await control.apply(version)
                    await control.label(version)
                    await control.resume()
                stages["updated, untrimmed"] = await control.memory()
                stages["updated"] = await control.memory(trim=True)
            finally:
                await shutdown(llm, control)
            rows.append(_row(name, spec.sliced(tp), stages, nbytes))
            say(_line(rows[-1]))
        await publisher.aclose()
        tg.cancel_scope.cancel()
    await transport.aclose()
    return nbytes, rows


async def _settled(control: Any) -> list[dict[str, Any]]:
    """The workers' memory once their mirrors are all registered (`prepare` runs in the
    background): the mirrors' bytes the same twice, a second apart."""
    last = await control.memory(trim=True)
    while True:
        await anyio.sleep(1.0)
        now = await control.memory(trim=True)
        if [m["mirror_bytes"] for m in now] == [m["mirror_bytes"] for m in last]:
            return now
        last = now


def _row(name: str, sliced: bool, stages: dict[str, list[dict[str, Any]]], nbytes: int) -> dict[str, Any]:
    rss = {stage: sum(m["rss_bytes"] for m in memory) for stage, memory in stages.items()}
    mirrors = sum(m["mirror_bytes"] for m in stages["updated"])
    return {
        "setup": name,
        "sliced": sliced,
        "mirrors_per_worker": stages["updated"][0]["mirrors"],
        "mirror_bytes": mirrors,
        "mirrors_of_model": round(mirrors / nbytes, 3),
        "rss": rss,
        "pulled_added_of_model": round((rss["pulled"] - rss["started"]) / nbytes, 3),
        "updated_added_of_model": round((rss["updated"] - rss["engine"]) / nbytes, 3),
        "workers": {stage: [m["rss_bytes"] for m in memory] for stage, memory in stages.items()},
    }


def _gb(n: int) -> str:
    return f"{n / 1e9:.3f}"


def _line(row: dict[str, Any]) -> str:
    rss = "; ".join(f"{stage} {_gb(n)}" for stage, n in row["rss"].items())
    return f"{row['setup']}: mirrors {_gb(row['mirror_bytes'])} GB ({row['mirrors_of_model']}x); workers' RSS GB: {rss}"


def table(result: dict[str, Any]) -> list[str]:
    """The setups side by side: sums over the node's workers (GB), and ratios to the model's bytes."""
    lines = [
        f"host memory per node: TP={result['tp']} on {result['machine']}, a {_gb(result['nbytes'])} GB model "
        f"(bf16, {result['tensors']} tensors); sums over the workers, GB, freed heap trimmed",
        f"{'':27} {'mirrors':>7} {'x model':>7} | {'RSS: engine':>11} {'started':>8} {'pulled':>7} "
        f"{'x model':>7} {'updated':>8} {'x model':>7} {'untrimmed':>9}",
    ]
    for r in result["rows"]:
        rss = r["rss"]
        lines.append(
            f"{r['setup']:27} {_gb(r['mirror_bytes']):>7} {r['mirrors_of_model']:>7} | {_gb(rss['engine']):>11} "
            f"{_gb(rss['started']):>8} {_gb(rss['pulled']):>7} {r['pulled_added_of_model']:>7} "
            f"{_gb(rss['updated']):>8} {r['updated_added_of_model']:>7} {_gb(rss['updated, untrimmed']):>9}"
        )
    lines.append(
        "x model: pulled - started (the mirrors, resident), updated - engine (all weightpull adds, and the applies')"
    )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m weightpull.integrations.bench.vllm_memory", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--tp", type=int, default=2, help="the replica's tensor-parallel size (default: 2)")
    parser.add_argument("--layers", type=int, default=8, help="decoder layers (default: 8)")
    parser.add_argument("--hidden", type=int, default=1024, help="hidden size (default: 1024)")
    parser.add_argument("--inter", type=int, default=3072, help="MLP size (default: 3072)")
    parser.add_argument("--vocab", type=int, default=32000, help="vocabulary (default: 32000)")
    parser.add_argument("--json", action="store_true", help="print the results as one JSON line last")
    args = parser.parse_args(argv)
    if args.tp < 1 or min(args.layers, args.hidden, args.inter, args.vocab) < 1:
        parser.error("--tp, --layers, --hidden, --inter and --vocab must be at least 1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # before vLLM is imported, here and in its processes
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # TP workers on a machine of one NUMA node
    import platform

    from weightpull.integrations.processes import Children

    from .util import say_to_stderr

    dims = {"layers": args.layers, "hidden": args.hidden, "inter": args.inter, "vocab": args.vocab}
    dims |= {"heads": args.hidden // 64, "kv_heads": max(args.tp, args.hidden // 128), "head_dim": 64}
    say = say_to_stderr("vllm-memory")
    with tempfile.TemporaryDirectory(prefix="weightpull-vllm-memory-") as tmp, Children():
        shapes = write_model(Path(tmp), dims)
        nbytes, rows = anyio.run(measure, Path(tmp), shapes, args.tp, say)
    result = {"tp": args.tp, "machine": platform.node(), "nbytes": nbytes, "tensors": len(shapes), "dims": dims}
    result["rows"] = rows
    print("\n".join(table(result)), file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
