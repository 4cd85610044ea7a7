"""A tiny random Llama, made locally, for the vLLM demo and tests: no downloads.

The "trainer" is Hugging Face transformers' own model; each version's weights are the
base weights plus noise seeded by the version, so anyone can rebuild any version.
`hf_greedy` is the reference a replica's greedy output must equal.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

CONFIG = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=1024,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)


def make_tiny_llama(path: str | Path, seed: int = 0) -> Any:
    """Save a random float32 Llama (hidden 128, 2 layers, vocab 1024) to `path`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG)).to(torch.float32).eval()
    model.save_pretrained(path)
    return model


def set_version(
    model: Any, base: dict[str, torch.Tensor], version: int, scale: float = 0.05
) -> dict[str, torch.Tensor]:
    """Load version `version` into `model` (the trainer's step) and return its state dict,
    named as the checkpoint names them."""
    g = torch.Generator().manual_seed(version)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(base[name] + scale * torch.randn(p.shape, generator=g))
    return dict(model.state_dict())


def hf_greedy(model: Any, prompt: list[int], max_tokens: int) -> list[int]:
    """transformers' greedy continuation of `prompt` (never stopping early)."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


# -- tiny models of several families, for checking what a replica serves after an update --

_COMMON = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=64,  # vLLM's CPU attention accepts 64 and 128
    vocab_size=1024,
    max_position_embeddings=512,
    initializer_range=0.2,  # large: versions differ in output
    tie_word_embeddings=False,
)
# family -> (transformers model_type, its settings beyond _COMMON). One feature each:
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "qwen2": ("qwen2", {}),  # q/k/v biases; untied, as Qwen2-7B (the tie is llama-tied's case)
    "qwen3": ("qwen3", {}),  # q/k norms
    "qwen3-moe": (
        "qwen3_moe",
        {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 64,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "norm_topk_prob": True,
        },
    ),
}
NAMES = ("checkpoint", "state_dict")


def make_model(family: str, seed: int = 0, **overrides: Any) -> Any:
    """A random float32 model of `family` (see FAMILIES), seeded; `overrides` go to its config."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, extra = FAMILIES[family]
    config = AutoConfig.for_model(model_type, **{**_COMMON, **extra, **overrides})
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def base_weights(model: Any) -> dict[str, torch.Tensor]:
    """The weights versions are made from (a copy: versions overwrite the model's own)."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def checkpoint_names(model: Any, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` (named as `model.state_dict()`) named as `save_pretrained` writes it: tied
    copies dropped, and transformers 5's fused layouts reverted (MoE experts per expert)."""
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    return revert_weight_conversion(model, remove_tied_weights_from_state_dict(dict(state), model))


def version_weights(
    model: Any, base: dict[str, torch.Tensor], version: int, names: str = "checkpoint", scale: float = 0.05
) -> dict[str, torch.Tensor]:
    """Load `version` into `model` (as `set_version`) and return its weights, named as
    "state_dict" (`model.state_dict()`: tied models include `lm_head.weight`, MoE experts
    fused 3-D) or "checkpoint" (what `save_pretrained` writes, which vLLM loads)."""
    if names not in NAMES:
        raise ValueError(f"names must be one of {NAMES}, not {names!r}")
    state = set_version(model, base, version, scale)
    return state if names == "state_dict" else checkpoint_names(model, state)


def save(model: Any, path: str | Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write the model's current weights, cast to `dtype`, as a checkpoint vLLM loads."""
    import copy

    copy.deepcopy(model).to(dtype).save_pretrained(path)
    return Path(path)


def save_tiny_tokenizer(path: str | Path) -> None:
    """Save a word-level tokenizer of the tiny model's vocabulary ("t0" ... "t1023") beside
    it, for servers that need one (`vllm serve`'s completions route): made here, no downloads."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(CONFIG["vocab_size"])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="t0", pad_token="t0").save_pretrained(path)
