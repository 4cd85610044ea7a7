"""The parts of the vLLM apply that need no engine: which published tensors a load read,
tied parameters, the scratch copy the first-load reference processes, the reads tracker."""

from __future__ import annotations

import torch

from weightpull.integrations.vllm.apply import _Published, _Reads, _scratch, tied_parameters
from weightpull.integrations.vllm.tiny import make_model


def _mirror() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Three tensors laid out in one region, as a mirror's zero-copy views are."""
    region = torch.arange(64, dtype=torch.float32)
    return region, {"a": region[0:16].view(4, 4), "b": region[16:48].view(8, 4), "c": region[48:64]}


def test_a_published_tensor_counts_as_loaded_once_any_operation_reads_any_part_of_it():
    _, views = _mirror()
    published = _Published(views.items())
    assert [name for name, _ in published] == ["a", "b", "c"]
    assert published.unread() == ["a", "b", "c"]
    b = views["b"]
    published.mark_read(b[2:3].data_ptr(), b[2:3].data_ptr() + 16)  # one row of b, as a TP shard is read
    assert published.unread() == ["a", "c"]
    a, c = views["a"], views["c"]
    published.mark_read(a.data_ptr() + 60, c.data_ptr() + 4)  # the last word of a to the first of c
    assert published.unread() == []


def test_reads_are_seen_through_tensor_operations_while_loading():
    _, views = _mirror()
    published = _Published(views.items())
    dst = torch.empty(8, 4, device="meta")
    with _Reads(published):
        for name, tensor in published:
            if name == "b":
                dst.copy_(tensor)  # a loader under vLLM's copy counting: into a meta tensor
            if name == "c":
                tensor.narrow(0, 4, 4).sum()
    assert published.unread() == ["a"]


def test_an_empty_tensor_needs_no_reading_and_tied_conflicts_are_named():
    same = torch.ones(3, 2)
    published = _Published([("empty", torch.empty(0)), ("x", same), ("y", same.clone()), ("z", torch.zeros(3, 2))])
    list(published)
    assert published.unread() == ["x", "y", "z"]
    assert published.tie_conflicts({"x": ["y"], "y": ["x"]}) == []
    assert published.tie_conflicts({"x": ["z"], "z": ["x"]}) == ["x != z"]


def test_tied_parameters_name_the_head_and_the_embedding_both_ways():
    assert tied_parameters(make_model("llama-tied")) == {
        "model.embed_tokens.weight": ["lm_head.weight"],
        "lm_head.weight": ["model.embed_tokens.weight"],
    }
    assert tied_parameters(make_model("llama")) == {}


def test_processing_a_scratch_copy_leaves_the_layer_alone():
    layer = torch.nn.Linear(4, 3)
    layer.weight.weight_loader = "kept"  # vLLM's attributes on a parameter travel with it
    before = layer.weight.detach().clone()
    scratch = _scratch(layer)
    scratch.weight.data.mul_(2)
    scratch.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)  # as CPU processing does
    scratch.cpu_linear = object()
    assert torch.equal(layer.weight, before) and layer.weight.shape == (3, 4)
    assert not hasattr(layer, "cpu_linear") and _scratch(layer).weight.weight_loader == "kept"


def test_quantized_fused_moe_with_post_load_processing_is_refused_at_start_up():
    from types import SimpleNamespace

    import pytest
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    from weightpull.errors import UnsupportedModelError
    from weightpull.integrations.vllm.apply import refuse_unsupported

    class Repacking:  # experts whose post-load processing does something (vLLM skips it on updates)
        def process_weights_after_loading(self, layer):
            pass

    def model(method):
        moe = torch.nn.Module()
        moe.quant_method = method
        method.moe_kernel = SimpleNamespace(fused_experts=Repacking())
        root = torch.nn.Module()
        root.experts = moe
        return root

    unquantized = UnquantizedFusedMoEMethod.__new__(UnquantizedFusedMoEMethod)
    torch.nn.Module.__init__(unquantized)  # a CustomOp (a module): only what the check reads
    refuse_unsupported(model(unquantized))  # its experts' processing is run again by weightpull
    with pytest.raises(UnsupportedModelError, match="experts"):
        refuse_unsupported(model(SimpleNamespace()))  # a quantized method: refused
