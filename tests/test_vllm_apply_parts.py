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


# -- which layers load straight: what the backend's first-load processing does ---------------


def _layer(process=None, buffer: bool = False) -> torch.nn.Module:
    """A linear layer as vLLM makes one: its tensors recorded as created, and a quant
    method whose first-load processing is `process` (None: no quant method at all)."""
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
    from vllm.model_executor.model_loader.reload import record_metadata_for_reloading

    class Method(QuantizeMethodBase):
        def create_weights(self, layer, *args, **kwargs):
            pass

        def apply(self, layer, *args, **kwargs):
            pass

        def process_weights_after_loading(self, layer):
            if process is not None:
                process(self, layer)

    layer = torch.nn.Linear(8, 4, bias=False)
    layer.weight.requires_grad_(False)
    layer.weight.weight_loader = "kept"
    if buffer:
        layer.register_buffer("cache", torch.zeros(3))
    if process is not None:
        layer.quant_method = Method()
    record_metadata_for_reloading(layer)
    return layer


def _repack(method, layer):  # as the CPU backend does: the weight goes, a packed copy comes
    layer.packed = layer.weight.detach().t().contiguous()
    layer.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)


def test_a_layer_loads_straight_only_if_its_first_load_processing_touches_nothing():
    from weightpull.integrations.vllm.apply import _leaves_alone

    def nothing(method, layer):
        pass

    def handle(method, layer):  # a derived handle (the CPU backend's oneDNN one)
        layer.cpu_linear = object()

    def scaled(method, layer):  # the same tensor, other bytes
        layer.weight.data.mul_(2)

    def kernel(method, layer):  # the method keeps state made from the weights
        method.kernel = object()

    def fails(method, layer):  # on random values: what it would do is unknown
        raise ValueError("scales out of range")

    assert _leaves_alone(_layer(nothing))  # unquantized linear on a GPU
    assert _leaves_alone(_layer(None))  # a norm: vLLM processes nothing without a quant method
    for process in (handle, scaled, kernel, fails, _repack):
        assert not _leaves_alone(_layer(process)), process.__name__
    assert not _leaves_alone(_layer(nothing, buffer=True))
    created_other = _layer(nothing)
    created_other.weight = torch.nn.Parameter(torch.zeros(4, 8).t(), requires_grad=False)  # another layout
    assert not _leaves_alone(created_other)


def test_the_probe_runs_on_a_copy_and_leaves_the_layer_alone():
    from weightpull.integrations.vllm.apply import _leaves_alone

    layer = _layer(_repack)
    before = layer.weight.detach().clone()
    assert not _leaves_alone(layer)
    assert torch.equal(layer.weight, before) and not hasattr(layer, "packed") and layer.weight.weight_loader == "kept"


def test_writes_into_a_layer_loaded_straight_are_counted_until_it_is_whole():
    from weightpull.integrations.vllm.apply import _DirectLoads, _Reference

    model = torch.nn.Module()
    model.a, model.b, model.c = (torch.nn.Linear(4, 4, bias=False) for _ in range(3))
    model.tied = torch.nn.Module()
    model.tied.weight = model.a.weight  # shares a's tensor, as a tied LM head does
    reference = _Reference(True, set())
    loads = _DirectLoads([model.a, model.b, model.c, model.tied], reference)
    published = _Published([("x", torch.ones(4, 4))])
    with torch.no_grad(), _Reads(published, loads):
        for _, x in published:
            model.a.weight.copy_(x)  # whole, and its twin with it
            model.b.weight[:2].copy_(x[:2])  # half
    # Whole: a and its twin, fingerprinted as loaded at the next flush (one launch for all).
    assert sorted(reference.pending) == sorted(map(id, (model.a, model.tied))) and not reference.expected
    reference.flush()
    assert sorted(reference.expected) == sorted(map(id, (model.a, model.tied))) and not reference.pending
    missing, partial = [], []
    loads.unloaded(model, missing, partial)
    assert (missing, partial) == (["c"], ["b"])
    with torch.no_grad():
        model.a.weight.add_(1)  # after it was whole: the check sees it
    import pytest

    from weightpull.errors import ApplyCheckError

    with pytest.raises(ApplyCheckError, match=r"a\.weight"):
        reference.compare(model)


def test_a_write_into_a_whole_layer_before_the_flush_is_still_seen():
    """The fingerprints as loaded are taken for all whole layers at once, but before any
    in-place operation (not only `copy_`) writes one of them again: so a layer clobbered
    while other layers still load is named by the check."""
    import pytest

    from weightpull.errors import ApplyCheckError
    from weightpull.integrations.vllm.apply import _DirectLoads, _Reference

    model = torch.nn.Module()
    model.a, model.b = (torch.nn.Linear(4, 4, bias=False) for _ in range(2))
    reference = _Reference(True, set())
    loads = _DirectLoads([model.a, model.b], reference)
    published = _Published([("x", torch.ones(4, 4))])
    with torch.no_grad(), _Reads(published, loads):
        for _, x in published:
            model.a.weight.copy_(x)  # a is whole: pending
            model.a.weight.mul_(3)  # a clobber by another operation, before b loads
            model.b.weight.copy_(x)
    reference.flush()
    with pytest.raises(ApplyCheckError, match=r"a\.weight") as failed:
        reference.compare(model)
    assert "b.weight" not in str(failed.value)
