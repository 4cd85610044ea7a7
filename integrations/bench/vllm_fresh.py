"""`weightpull bench vllm`'s reference: fresh vLLM engines, each started on one version's bytes.

Run by the bench as `python -m weightpull.integrations.bench.vllm_fresh`, a job as JSON on
stdin: the model's folder, the preset, the versions, the engine's arguments. For each
version in turn it starts an `LLM` (its engine core in this process:
VLLM_ENABLE_V1_MULTIPROCESSING=0) whose model loader, registered here, feeds the model the
version's tensors (`vllm_engine.iter_weights`) through the model's own `load_weights`: the
first load, post-processing and all, that an update must match. It prints one JSON line:
per version, the greedy outputs of each prompt alone and the engine's start seconds.
"""

from __future__ import annotations

import gc
import json
import sys
import time
from typing import Any

from vllm.model_executor.model_loader import register_model_loader
from vllm.model_executor.model_loader.base_loader import BaseModelLoader

from .vllm_engine import PROMPTS, iter_weights, model_shapes, output_of, sampling

LOAD_FORMAT = "weightpull-bench-version"
# What `weightpull.integrations.vllm.engine_args` gives the replica unless told otherwise.
FRESH_DEFAULTS = {"kv_cache_memory_bytes": 32 << 20, "enforce_eager": True, "disable_log_stats": True}


@register_model_loader(LOAD_FORMAT)
class VersionLoader(BaseModelLoader):
    """Loads `model_loader_extra_config`'s version of its preset, built on the model's device."""

    def download_model(self, model_config: Any) -> None:
        pass  # nothing to download: the bytes are made

    def load_weights(self, model: Any, model_config: Any) -> None:
        extra = self.load_config.model_loader_extra_config
        device = next(model.parameters()).device
        loaded = model.load_weights(iter_weights(model_shapes(extra["preset"]), int(extra["version"]), device))
        missing = {n for n, _ in model.named_parameters()} - set(loaded or ())
        if loaded is not None and missing:
            raise RuntimeError(f"the fresh engine's load left {sorted(missing)[:5]} unloaded")


def main() -> None:
    from vllm import LLM
    from vllm.distributed import cleanup_dist_env_and_memory
    from vllm.inputs import TokensPrompt

    job = json.load(sys.stdin)
    out: dict[int, Any] = {}
    for version in job["versions"]:
        start = time.perf_counter()
        llm = LLM(
            model=job["model"],
            skip_tokenizer_init=True,
            load_format=LOAD_FORMAT,
            model_loader_extra_config={"preset": job["preset"], "version": version},
            **{**FRESH_DEFAULTS, **job["engine"]},
        )
        started = time.perf_counter() - start
        outputs = []
        for prompt in PROMPTS:  # each alone, as the bench's replica runs them
            [final] = llm.generate([TokensPrompt(prompt_token_ids=prompt)], sampling(job["max_tokens"]), use_tqdm=False)
            outputs.append(output_of(final.outputs[0]))
        out[version] = {"outputs": outputs, "start_s": round(started, 2)}
        print(f"[vllm-fresh] v{version}: started in {started:.1f} s", file=sys.stderr, flush=True)
        del llm
        gc.collect()
        cleanup_dist_env_and_memory()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
