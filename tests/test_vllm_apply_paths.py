"""The apply's paths on a real vLLM engine: layers loaded straight into the tensors the
kernels use, and through vLLM's layerwise reload, side by side.

One CPU engine (a tiny Qwen3, bf16; tests/gpu/test_vllm_apply_paths_gpu.py runs the same
process on a GPU) whose unquantized linear layers keep their weights as on a GPU (vLLM's own `_cpu_skip_gemm_dispatch` branch: plain `F.linear`, no oneDNN repack),
so that the probe finds them, and the norms, loaded straight; the embedding and the head
still repack (the CPU backend derives a oneDNN handle from them), so they take the
layerwise reload and the check's processed copy: both branches in one engine. The engine
runs in a process of its own (`python -m tests.test_vllm_apply_paths`: its core in that
process, so the checks call `apply.load` on the worker directly) and reports as JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def report() -> dict:
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_LOGGING_LEVEL": "ERROR"}
    done = subprocess.run(
        [sys.executable, "-m", "tests.test_vllm_apply_paths"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=Path(__file__).parent.parent,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_probe_finds_what_a_first_load_leaves_alone(report):
    straight = set(report["identity"])
    assert {"model.layers.0.self_attn.qkv_proj", "model.layers.1.mlp.down_proj", "model.norm"} <= straight
    assert "model.layers.0.self_attn.q_norm" in straight
    assert not straight & {"model.embed_tokens", "lm_head", "model.layers.0.self_attn.attn"}


def test_every_path_leaves_the_same_bytes_and_the_same_outputs(report):
    paths = report["paths"]
    assert set(paths) == {"direct", "layerwise", "reference"}
    assert len({json.dumps(p["state"], sort_keys=True) for p in paths.values()}) == 1
    assert len({json.dumps(p["tokens"]) for p in paths.values()}) == 1
    assert report["v1_tokens"] != paths["direct"]["tokens"]  # the versions differ in output
    direct, layerwise, ref = paths["direct"]["report"], paths["layerwise"]["report"], paths["reference"]["report"]
    layers = len(report["identity"])
    assert direct["direct"] == layers and direct["layers"] == 2  # the embedding and the head
    assert direct["checked"] == layers + 2 and direct["scratch"] == 2
    assert layerwise["direct"] == 0 and layerwise["scratch"] == 2  # identity layers: no copy
    assert ref["scratch"] == ref["checked"] == ref["layers"]  # every layer against a processed copy
    assert direct["fingerprint_by"] == "torch"  # a CPU engine


def test_what_the_direct_path_refuses(report):
    errors = report["errors"]
    # A layer loaded straight that got only some of its weights (v_proj not published).
    assert (
        errors["partial"].startswith("IncompleteApplyError")
        and "model.layers.1.self_attn.qkv_proj" in errors["partial"]
    )
    # A layer loaded straight, overwritten after it was whole: the check names it.
    assert (
        errors["clobbered"].startswith("ApplyCheckError")
        and "model.layers.0.input_layernorm.weight" in errors["clobbered"]
    )
    assert errors["path"].startswith("InvalidArgumentError") and "direct, layerwise, reference" in errors["path"]
    assert report["restored_tokens"] == report["paths"]["direct"]["tokens"]  # a whole load after them


# -- the engine's process ---------------------------------------------------------------------


def _main() -> None:
    import tempfile

    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    from weightpull.integrations.bench import vllm_engine

    first_load = UnquantizedLinearMethod.process_weights_after_loading

    def as_on_a_gpu(self, layer):  # vLLM's own branch for layers it does not repack
        layer._cpu_skip_gemm_dispatch = True
        first_load(self, layer)

    UnquantizedLinearMethod.process_weights_after_loading = as_on_a_gpu
    shapes = vllm_engine.model_shapes("tiny")
    path = tempfile.mkdtemp(prefix="weightpull-apply-paths-")
    vllm_engine.write_model(path, "tiny")
    on_gpu = {"gpu_memory_utilization": 0.1} if torch.cuda.is_available() else {}  # tests/gpu runs it too
    llm = LLM(
        model=path,
        skip_tokenizer_init=True,
        load_format="dummy",
        dtype="bfloat16",
        enforce_eager=True,
        kv_cache_memory_bytes=32 << 20,
        max_model_len=256,
        **on_gpu,
    )

    def tokens() -> list[int]:
        params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        [out] = llm.generate([TokensPrompt(prompt_token_ids=vllm_engine.PROMPTS[1])], params, use_tqdm=False)
        return list(out.outputs[0].token_ids)

    def on_worker(fn):
        [result] = llm.collective_rpc(fn)
        return result

    def load(weights, path="direct"):
        def run(worker):
            from weightpull.integrations.vllm import apply

            runner = worker.model_runner
            ties = apply.tied_parameters(runner.get_model())
            try:
                return apply.load(runner, iter(weights.items()), ties=ties, check=True, path=path).as_dict()
            except Exception as exc:
                return f"{type(exc).__name__}: {exc}"

        return on_worker(run)

    def state(worker):
        from weightpull.integrations.torch_tensors import fingerprints

        model = worker.model_runner.get_model()
        tensors = {f"p:{n}": p for n, p in model.named_parameters()} | {f"b:{n}": b for n, b in model.named_buffers()}
        return fingerprints({k: t for k, t in tensors.items() if t.numel()})

    def identity(worker):
        from weightpull.integrations.vllm import apply

        model = worker.model_runner.get_model()
        layers = apply.identity_layers(model)
        return [n for n, m in model.named_modules() if m in layers]

    v1, v2 = (vllm_engine.version_weights(shapes, v, "cpu") for v in (1, 2))
    out: dict = {"identity": on_worker(identity), "paths": {}, "errors": {}}
    load(v1)
    out["v1_tokens"] = tokens()
    for name in ("reference", "layerwise", "direct"):
        load(v1)  # from another version each time: every byte rewritten
        report = load(v2, name)
        out["paths"][name] = {"report": report, "state": on_worker(state), "tokens": tokens()}
    out["errors"]["partial"] = load({k: t for k, t in v1.items() if "layers.1.self_attn.v_proj" not in k})

    def run_clobbering(worker):  # v2, with a write into a layer loaded straight once it was whole
        from weightpull.integrations.vllm import apply

        model = worker.model_runner.get_model()

        def weights():
            for name, t in v2.items():
                yield name, t
                if name == "model.layers.1.input_layernorm.weight":
                    with torch.no_grad():
                        model.model.layers[0].input_layernorm.weight.add_(1)

        try:
            apply.load(worker.model_runner, weights(), ties={}, check=True)
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        return "loaded"

    out["errors"]["clobbered"] = on_worker(run_clobbering)
    out["errors"]["path"] = load(v2, "bogus")
    load(v2)
    out["restored_tokens"] = tokens()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    _main()
