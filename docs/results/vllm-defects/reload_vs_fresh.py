"""Does a vLLM engine serve exactly the new weights after a layerwise `reload_weights`?

Self-contained (vLLM, transformers, torch, safetensors; no downloads): a tiny random
model of one family is made with transformers, and versions 1 and 2 of its weights are
saved in bf16. An engine started on v1 reloads v2 through the worker's
`reload_weights(weights_iterator=..., is_checkpoint_format=True)`; its greedy tokens and
first-token logprobs must equal those of a fresh engine started on v2. Prints SAME or
DIFFERS last.

    python reload_vs_fresh.py llama [--tie] [--names checkpoint|state_dict]
    python reload_vs_fresh.py qwen2 | qwen3 | qwen3_moe [--repack-moe]

--names checkpoint: v2 as `save_pretrained` wrote it (tied models: no `lm_head.weight`;
MoE: per-expert `experts.N.gate_proj.weight`). --names state_dict: `model.state_dict()`
(tied models: with `lm_head.weight`; MoE: transformers 5's fused 3-D `experts.gate_up_proj`).
"""

from __future__ import annotations

import argparse
import os
import tempfile

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the worker in this process

import torch  # noqa: E402

COMMON = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=64,
    vocab_size=1024,
    max_position_embeddings=512,
    initializer_range=0.2,
)
EXTRA = {"qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True)}
# block_size 32: the CPU default (128) would leave a 100-token prompt out of the prefix cache
ENGINE = dict(
    dtype="bfloat16",
    enforce_eager=True,
    skip_tokenizer_init=True,
    kv_cache_memory_bytes=32 << 20,
    max_model_len=256,
    block_size=32,
)
PROMPTS = {"short": [1, 5, 9, 22, 100, 7], "long": [(7 * i + 3) % 1000 + 1 for i in range(100)]}
PROMPTS["long-again"] = PROMPTS["long"]  # a prefix-cache hit


def make_model(model_type: str, tie: bool):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, **COMMON, **EXTRA.get(model_type, {}), tie_word_embeddings=tie)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def set_version(model, base: dict, version: int) -> None:
    g = torch.Generator().manual_seed(version)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(base[name] + 0.05 * torch.randn(p.shape, generator=g))


def greedy(llm) -> list[tuple[list[int], float]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=1)
    results = []
    for prompt in PROMPTS.values():  # one at a time, so the last one hits the prefix cache
        out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)[0].outputs[0]
        results.append((list(out.token_ids), out.logprobs[0][out.token_ids[0]].logprob))
    return results


def repack_moe(worker) -> int:
    """The workaround for the MoE defect: run the experts' own post-load step (on CPU,
    the prepack) that vLLM skips on a weight update. Returns how many layers it ran on."""
    n = 0
    for layer in worker.model_runner.get_model().modules():
        kernel = getattr(getattr(layer, "quant_method", None), "moe_kernel", None)
        if kernel is not None:
            kernel.fused_experts.process_weights_after_loading(layer)
            n += 1
    return n


def main(model_type: str, tie: bool, names: str, repack: bool = False) -> bool:
    """True if the reloaded engine serves what a fresh one does."""
    from safetensors.torch import load_file
    from vllm import LLM

    model = make_model(model_type, tie)
    base = {k: v.clone() for k, v in model.state_dict().items()}
    root = tempfile.mkdtemp()
    for v in (1, 2):
        set_version(model, base, v)
        model.to(torch.bfloat16).save_pretrained(f"{root}/v{v}")
        model.to(torch.float32)
    if names == "checkpoint":
        weights = load_file(f"{root}/v2/model.safetensors")
    else:  # v2 is still loaded; the bf16 round trip above is exact
        weights = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
    print(
        f"v2 as {names} names: {len(weights)} tensors, lm_head.weight {'in' if 'lm_head.weight' in weights else 'NOT in'} them; "
        f"e.g. {[k for k in weights if 'layers.0.mlp' in k][:3]}"
    )

    llm = LLM(model=f"{root}/v1", **ENGINE)
    greedy(llm)  # serve v1 first, as a replica does: fills the prefix cache
    llm.collective_rpc("reload_weights", kwargs=dict(weights_iterator=iter(weights.items()), is_checkpoint_format=True))
    if repack:
        print("repacked MoE layers:", llm.collective_rpc(repack_moe))
    llm.reset_prefix_cache()
    reloaded = greedy(llm)
    llm.llm_engine.engine_core.shutdown()
    del llm

    fresh = LLM(model=f"{root}/v2", **ENGINE)
    expected = greedy(fresh)
    fresh.llm_engine.engine_core.shutdown()

    same = True
    for name, (tokens, logprob), (want, want_logprob) in zip(PROMPTS, reloaded, expected, strict=True):
        ok = tokens == want and logprob == want_logprob
        same &= ok
        print(
            f"{name:10s} {'same' if ok else 'DIFFERS'}: reloaded {tokens} {logprob:.6f} | fresh v2 {want} {want_logprob:.6f}"
        )
    tag = f"{model_type}{' tied' if tie else ''} ({names} names{', experts repacked' if repack else ''})"
    print(f"{'SAME' if same else 'DIFFERS'}: {tag}, reloaded v2 vs fresh v2")
    return same


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model_type", help="a transformers model_type: llama, qwen2, qwen3, qwen3_moe")
    parser.add_argument("--tie", action="store_true", help="tie_word_embeddings=True")
    parser.add_argument("--names", choices=["checkpoint", "state_dict"], default="checkpoint")
    parser.add_argument("--repack-moe", action="store_true", help="after the reload, run the workaround (repack_moe)")
    args = parser.parse_args()
    main(args.model_type, args.tie, args.names, args.repack_moe)
