"""Applying a version to a vLLM model, and checking that the model computes with it.

Runs in each worker process. vLLM's layerwise checkpoint-format reload (`reload_weights`)
is driven here step by step (initialize, `load_weights`, finalize) because, left alone,
it can report success while the model computes with a mix of versions (docs/guides/vllm.md,
"Upstream defects"):

- A layer that receives no weights is quietly given its old tensors back ("Failed to
  load weights" in the log), and whatever the backend derived from them at start-up
  stays (the CPU backend's packed copy of a tied LM head). So: a parameter tied to
  another (the head to the embedding) is fed the published tensor of either name, and a
  layer left with none, or with only some, of its weights fails the apply.
- A published tensor that no loader read fails the apply too (both names of a tied pair
  must then hold the same bytes).
- On an update, vLLM skips the fused-MoE experts' own post-load processing (the CPU
  backend's repack into its grouped-GEMM layout): it is run again here.
- `check=True` compares, layer by layer, the tensors the kernels use after the apply with
  what the backend's first-load processing makes of the same loaded tensors (the way a
  fresh engine would hold them). Fingerprints are taken on the device the weights live on.

Nothing here is imported by weightpull's core; it needs vLLM and torch.
"""

from __future__ import annotations

import bisect
import copy
import time
from collections.abc import Iterable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import attrs
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from weightpull.errors import ApplyCheckError, IncompleteApplyError, UnsupportedModelError

from ..torch_tensors import fingerprints


@attrs.frozen
class ApplyReport:
    tensors: int  # published tensors loaded
    layers: int  # layers whose loaded weights went through the backend's processing
    checked: int  # layers whose kernel tensors were compared (0 without the check)
    load_s: float
    check_s: float  # the check's share of load_s

    def as_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)


def tied_parameters(model: torch.nn.Module) -> dict[str, list[str]]:
    """Each parameter that shares its tensor with others (an LM head tied to the
    embedding), to the names of those others. Read once, before any reload."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return {n: [m for m in group if m != n] for group in names.values() if len(group) > 1 for n in group}


# What `load` drives of vLLM's layerwise reload (vllm 0.32; older releases lack it).
_LAYERWISE = ("initialize_layerwise_reload", "finalize_layerwise_reload", "get_layerwise_info")


def refuse_unsupported(model: torch.nn.Module) -> None:
    """Refuse, at start-up, what weightpull cannot update whole: a vLLM without the
    layerwise reload `load` drives, or a fused-MoE layer whose experts post-process their
    weights under a quantization method whose update path has not been verified here."""
    import vllm
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    try:
        from vllm.model_executor.model_loader.reload import layerwise
    except ImportError:
        layerwise = None
    if layerwise is None or not all(hasattr(layerwise, name) for name in _LAYERWISE):
        raise UnsupportedModelError(
            f"vLLM {vllm.__version__} lacks the layerwise reload weightpull applies "
            "versions through (vllm.model_executor.model_loader.reload.layerwise, as in 0.32)"
        )

    bad = sorted(
        name
        for name, layer in model.named_modules()
        if _experts_process(layer) is not None and not isinstance(layer.quant_method, UnquantizedFusedMoEMethod)
    )
    if bad:
        raise UnsupportedModelError(
            f"weightpull cannot verify an update of the fused-MoE layers {bad[:4]}{' ...' if len(bad) > 4 else ''} "
            "(quantized experts with post-load processing that vLLM skips on an update); "
            "serve this model unquantized, or update it by restarting the engine"
        )


def load(
    runner: Any, weights: Iterable[tuple[str, torch.Tensor]], *, ties: dict[str, list[str]], check: bool
) -> ApplyReport:
    """Load `weights` (checkpoint names) into the runner's model in place, or raise
    `IncompleteApplyError` / `ApplyCheckError` naming what did not take. On any error the
    reload is finished (vLLM's wrappers removed) and the model holds a mix: the caller
    loads a whole version again."""
    from vllm.model_executor.model_loader.reload import layerwise

    model = runner.get_model()
    started = time.perf_counter()
    published = _Published(weights)
    reference = _Reference(check)
    layerwise.initialize_layerwise_reload(model)
    finalized = False
    try:
        with ExitStack() as stack:
            stack.enter_context(_Reads(published))
            for layer in model.modules():
                stack.enter_context(_processing_hooks(layer, reference))
            model.load_weights(iter(published))
            _feed_tied(model, ties, published)
            missing, partial = _unloaded(model, layerwise)
            layerwise.finalize_layerwise_reload(model, runner.model_config)
            finalized = True
        _raise_incomplete(missing, partial, published.unread(), published.tie_conflicts(ties))
        check_s = reference.compare(model)
    finally:
        if not finalized:
            layerwise.finalize_layerwise_reload(model, runner.model_config)
    for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):  # what reload_weights resets
        getattr(runner, reset, lambda: None)()
    return ApplyReport(
        len(published.tensors), reference.processed, reference.checked, time.perf_counter() - started, check_s
    )


def checkpoint_iterator(runner: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """The weights the engine started from, read from its checkpoint as vLLM reads them."""
    from vllm.model_executor.model_loader import get_model_loader

    loader = get_model_loader(runner.vllm_config.load_config)
    return iter(loader.get_all_weights(runner.model_config, runner.get_model()))


# -- what was published, and what was read of it ---------------------------------------------


class _Published:
    """The published tensors as they pass into `load_weights`, and which of them some
    tensor operation of the load read: one that none read loaded nowhere."""

    def __init__(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        self._weights = weights
        self.tensors: dict[str, torch.Tensor] = {}
        self._ranges: list[tuple[int, int, str]] = []  # (start, end, name), sorted
        self._read: set[str] = set()

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self._weights:
            self.tensors[name] = tensor
            if tensor.numel():
                start = tensor.data_ptr()
                bisect.insort(self._ranges, (start, start + tensor.numel() * tensor.element_size(), name))
            else:
                self._read.add(name)  # nothing to load
            yield name, tensor

    def mark_read(self, start: int, end: int) -> None:
        # Published tensors are disjoint, so the ranges' ends are sorted like their starts.
        i = max(bisect.bisect_right(self._ranges, (start, float("inf"), "")) - 1, 0)
        while i < len(self._ranges) and self._ranges[i][0] < end:
            if start < self._ranges[i][1]:
                self._read.add(self._ranges[i][2])
            i += 1

    def unread(self) -> list[str]:
        return [name for name in self.tensors if name not in self._read]

    def tie_conflicts(self, ties: dict[str, list[str]]) -> list[str]:
        """Tied names published with different bytes: the engine can hold only one."""
        out = []
        for name, others in ties.items():
            for other in others:
                a, b = self.tensors.get(name), self.tensors.get(other)
                if name < other and a is not None and b is not None and not torch.equal(a, b.to(a.device)):
                    out.append(f"{name} != {other}")
        return out


class _Reads(TorchDispatchMode):
    """While the weights load, tells `published` what memory each tensor operation reads
    (for `copy_`, its source only)."""

    def __init__(self, published: _Published) -> None:
        super().__init__()
        self.published = published

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        for arg in args[1:] if func is torch.ops.aten.copy_.default else args:
            if isinstance(arg, torch.Tensor) and not arg.is_meta and arg.numel():
                start = arg.data_ptr()
                self.published.mark_read(start, start + arg.numel() * arg.element_size())
        return func(*args, **(kwargs or {}))


def _feed_tied(model: torch.nn.Module, ties: dict[str, list[str]], published: _Published) -> None:
    """A layer whose only weights are tied to another's (an LM head tied to the
    embedding) gets no tensor from `load_weights` when the published set names only the
    other, or when the model's loader skips the head: feed it through its own loader."""
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    for name, others in ties.items():
        module_name, _, param_name = name.rpartition(".")
        layer = model.get_submodule(module_name)
        info = get_layerwise_info(layer)
        if not info.can_load() or info.load_numel > 0:
            continue  # loaded already (or processed: its info was reset)
        source = next((published.tensors[n] for n in (name, *others) if n in published.tensors), None)
        if source is not None:
            param = getattr(layer, param_name)
            param.weight_loader(param, source)


def _unloaded(model: torch.nn.Module, layerwise: Any) -> tuple[list[str], list[str]]:
    """Layers with weights to load that got none, and layers that got only some."""
    from vllm.model_executor.layers.attention import is_deferred_attention_layer

    missing, partial = [], []
    for name, layer in model.named_modules():
        info = layerwise.get_layerwise_info(layer)
        if not info.can_load() or not info.load_numel_total or is_deferred_attention_layer(layer):
            continue  # processed (complete), nothing to load, or the attention's scales
        if not any(p is not None for p in layer._parameters.values()):
            continue  # buffers only (a rotary cache): never in a checkpoint
        (partial if info.load_numel else missing).append(name or type(layer).__name__)
    return missing, partial


def _raise_incomplete(missing: list[str], partial: list[str], unread: list[str], conflicts: list[str]) -> None:
    parts = []
    if missing:
        parts.append(f"layers that got no weights (they would keep the previous version's): {_few(missing)}")
    if partial:
        parts.append(f"layers that got only some of their weights: {_few(partial)}")
    if unread:
        parts.append(f"published tensors that loaded nowhere: {_few(unread)}")
    if conflicts:
        parts.append(f"tied tensors published with different bytes: {_few(conflicts)}")
    if parts:
        raise IncompleteApplyError("; ".join(parts))


def _few(names: list[str], n: int = 6) -> str:
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")


# -- processing: the MoE repack vLLM skips, and the first-load reference -------------------


def _experts_process(layer: torch.nn.Module) -> Any:
    """The fused-MoE experts' own post-load processing, where the layer has one that does
    something (the CPU backend's repack); else None."""
    from vllm.model_executor.layers.fused_moe.modular_kernel import FusedMoEExperts

    kernel = getattr(getattr(layer, "quant_method", None), "moe_kernel", None)
    experts = getattr(kernel, "fused_experts", None)
    if experts is None or type(experts).process_weights_after_loading is FusedMoEExperts.process_weights_after_loading:
        return None
    return experts.process_weights_after_loading


@contextmanager
def _processing_hooks(layer: torch.nn.Module, reference: _Reference) -> Iterator[None]:
    """While the reload runs, wrap the layer's quant method's `process_weights_after_loading`
    (an instance attribute, removed afterwards): the experts' repack after it, and the
    first-load reference before it."""
    method = getattr(layer, "quant_method", None)
    if method is None or not hasattr(method, "process_weights_after_loading"):
        yield
        return
    original = method.process_weights_after_loading
    repack = _experts_process(layer)

    def process(target: torch.nn.Module) -> None:
        reference.record(target, method)
        original(target)
        if repack is not None:  # vLLM runs it on the first load only
            repack(target)
        reference.processed += 1

    method.process_weights_after_loading = process
    try:
        yield
    finally:
        del method.process_weights_after_loading


class _Reference:
    """Fingerprints of what the backend's first-load processing makes of each layer's
    freshly loaded tensors, compared after the reload with the tensors the kernels use."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.expected: dict[int, tuple[torch.nn.Module, dict[str, tuple]]] = {}
        self.processed = 0
        self.checked = 0
        self.seconds = 0.0

    def record(self, layer: torch.nn.Module, method: Any) -> None:
        from vllm.model_executor.layers.attention import is_deferred_attention_layer

        if not self.enabled or is_deferred_attention_layer(layer):
            return  # attention layers hold no checkpoint weights here, only scales
        started = time.perf_counter()
        scratch = _scratch(layer)
        fresh = copy.copy(method)
        if hasattr(fresh, "moe_kernel"):
            fresh.moe_kernel = None  # first load: the kernel is built from these weights
        # Defined on the class, not the (wrapped) instance: the unwrapped processing.
        type(method).process_weights_after_loading(fresh, scratch)
        self.expected[id(layer)] = (layer, _fingerprints(scratch))
        self.seconds += time.perf_counter() - started

    def compare(self, model: torch.nn.Module) -> float:
        """Raise `ApplyCheckError` naming every parameter whose kernel bytes differ."""
        if not self.enabled:
            return 0.0
        started = time.perf_counter()
        names = {id(m): n for n, m in model.named_modules()}
        wrong = []
        for key, (layer, expected) in self.expected.items():
            got = _fingerprints(layer)
            for tensor, print_ in expected.items():
                if tensor in got and got[tensor] != print_:
                    wrong.append(f"{names.get(key, type(layer).__name__)}.{tensor}")
            self.checked += 1
        self.expected.clear()
        self.seconds += time.perf_counter() - started
        if wrong:
            raise ApplyCheckError(
                f"after the apply, {len(wrong)} tensors the kernels use differ from what the same loading "
                f"makes of the pulled copy on a first load: {_few(wrong)}"
            )
        return self.seconds


def _scratch(layer: torch.nn.Module) -> torch.nn.Module:
    """A copy of `layer` with its own copies of its loaded tensors, that processing can
    rewrite without touching the layer (its submodules are shared, and left alone)."""
    scratch = copy.copy(layer)
    scratch._parameters = {k: None if p is None else _clone_param(p) for k, p in layer._parameters.items()}
    scratch._buffers = {k: None if b is None else b.clone() for k, b in layer._buffers.items()}
    scratch._modules = dict(layer._modules)
    return scratch


def _clone_param(p: torch.Tensor) -> torch.Tensor:
    clone = torch.nn.Parameter(p.detach().clone(), requires_grad=False)
    clone.__dict__.update(p.__dict__)  # weight_loader and the layout attributes processing reads
    return clone


def _fingerprints(layer: torch.nn.Module) -> dict[str, tuple]:
    """Shape, dtype and fingerprint of the layer's own tensors (its submodules' are theirs)."""
    tensors = {k: t for k, t in (*layer._parameters.items(), *layer._buffers.items()) if t is not None}
    return {k: (tuple(tensors[k].shape), tensors[k].dtype, f) for k, f in fingerprints(tensors).items()}
