"""Applying a version to a vLLM model, and checking that the model computes with it.

Runs in each worker process. A layer whose first-load processing leaves its loaded
tensors as they are (`identity_layers`: on a GPU, unquantized linear layers, embeddings
and norms; probed, not assumed) is loaded straight into the tensors the kernels use,
through its own weight loaders (`path="direct"`, the default). Every other layer goes
through vLLM's layerwise checkpoint-format reload (`reload_weights`'s), driven here step
by step (initialize, `load_weights`, finalize) because, left alone, it can report success
while the model computes with a mix of versions (docs/guides/vllm.md, "Upstream defects"):

- A layer that receives no weights is quietly given its old tensors back ("Failed to
  load weights" in the log), and whatever the backend derived from them at start-up
  stays (the CPU backend's packed copy of a tied LM head). So: a parameter tied to
  another (the head to the embedding) is fed the published tensor of either name, and a
  layer left with none, or with only some, of its weights fails the apply (a layer loaded
  straight, too: its writes are counted as vLLM counts a reloaded layer's).
- A published tensor that no loader read fails the apply too (both names of a tied pair
  must then hold the same bytes).
- On an update, vLLM skips the fused-MoE experts' own post-load processing (the CPU
  backend's repack into its grouped-GEMM layout): it is run again here.
- `check=True` compares, layer by layer, the tensors the kernels use after the apply with
  what the backend's first-load processing makes of the same loaded tensors (the way a
  fresh engine would hold them): for a layer whose processing is the identity, the
  loaded tensors themselves, fingerprinted as loaded (no copy; all such layers at once
  when the loads end, or before anything writes a whole one again); for any other, a
  copy of them processed as on a first load. Fingerprints are taken on the device the weights
  live on, and compared there: one transfer to the host.

Nothing here is imported by weightpull's core; it needs vLLM and torch.
"""

from __future__ import annotations

import bisect
import copy
import time
import weakref
from collections.abc import Iterable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import attrs
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from weightpull.errors import ApplyCheckError, IncompleteApplyError, InvalidArgumentError, UnsupportedModelError

from ..torch_tensors import fingerprint_implementation, fingerprint_tensors

# How `load` loads: "direct" (layers whose processing is the identity straight into their
# tensors, the rest through vLLM's layerwise reload), "layerwise" (every layer through it),
# "reference" (every layer through it, and every layer checked against a processed copy:
# the first-load reference before identity layers were told apart).
PATHS = ("direct", "layerwise", "reference")


@attrs.frozen
class ApplyReport:
    tensors: int  # published tensors loaded
    layers: int  # layers whose loaded weights went through vLLM's reload and the backend's processing
    checked: int  # layers whose kernel tensors were compared (0 without the check)
    load_s: float
    check_s: float  # the check's share of load_s
    direct: int = 0  # layers loaded straight into the tensors the kernels use
    scratch: int = 0  # of the checked, those compared with a processed copy (processing not the identity)
    path: str = "direct"
    fingerprint_by: str = "torch"  # the check's fingerprints: "triton" (one pass) or "torch"

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
    runner: Any,
    weights: Iterable[tuple[str, torch.Tensor]],
    *,
    ties: dict[str, list[str]],
    check: bool,
    path: str = "direct",
) -> ApplyReport:
    """Load `weights` (checkpoint names) into the runner's model in place, or raise
    `IncompleteApplyError` / `ApplyCheckError` naming what did not take. On any error the
    reload is finished (vLLM's wrappers removed) and the model holds a mix: the caller
    loads a whole version again. `path` is one of `PATHS` (the bench compares them)."""
    from vllm.model_executor.model_loader.reload import layerwise

    if path not in PATHS:
        raise InvalidArgumentError(f"unknown apply path {path!r}: one of {', '.join(PATHS)}")
    model = runner.get_model()
    started = time.perf_counter()
    identity = set() if path == "reference" else identity_layers(model)
    straight = [m for m in model.modules() if m in identity] if path == "direct" and _may_load_straight(model) else []
    rest = _Part(model, straight)
    published = _Published(weights)
    reference = _Reference(check, identity)
    direct = _DirectLoads(straight, reference)
    layerwise.initialize_layerwise_reload(rest)
    finalized = False
    try:
        with ExitStack() as stack:
            stack.enter_context(_Reads(published, direct))
            for layer in rest.modules():
                stack.enter_context(_processing_hooks(layer, reference))
            model.load_weights(iter(published))
            _feed_tied(model, ties, published, direct)
            reference.flush()  # the direct layers as loaded, before vLLM processes the others
            missing, partial = _unloaded(rest, layerwise)
            direct.unloaded(model, missing, partial)
            layerwise.finalize_layerwise_reload(rest, runner.model_config)
            finalized = True
        _raise_incomplete(missing, partial, published.unread(), published.tie_conflicts(ties))
        check_s = reference.compare(model)
    finally:
        if not finalized:
            layerwise.finalize_layerwise_reload(rest, runner.model_config)
    for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):  # what reload_weights resets
        getattr(runner, reset, lambda: None)()
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # the copies it queued are part of the apply's time
    return ApplyReport(
        tensors=len(published.tensors),
        layers=reference.processed,
        checked=reference.checked,
        load_s=time.perf_counter() - started,
        check_s=check_s,
        direct=len(straight),
        scratch=reference.scratch,
        path=path,
        fingerprint_by=fingerprint_implementation(device),
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
    (for `copy_`, its source only), and `direct` what each operation is about to write
    (any in-place one: a layer already whole is fingerprinted as loaded first) and what
    each `copy_` wrote (the loads it counts)."""

    def __init__(self, published: _Published, direct: _DirectLoads | None = None) -> None:
        super().__init__()
        self.published = published
        self.direct = direct

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        copy = func is torch.ops.aten.copy_.default
        for arg in args[1:] if copy else args:
            if isinstance(arg, torch.Tensor) and not arg.is_meta and arg.numel():
                start = arg.data_ptr()
                self.published.mark_read(start, start + arg.numel() * arg.element_size())
        if self.direct is not None:
            for target in _mutated(func, args, kwargs):
                self.direct.before_write(target)
        out = func(*args, **(kwargs or {}))
        if copy and self.direct is not None and not args[0].is_meta:
            self.direct.wrote(args[0])
        return out


def _mutated(func: Any, args: Any, kwargs: Any) -> Iterator[torch.Tensor]:
    """The tensors `func` writes in place (its schema's mutable arguments: `copy_`'s,
    `add_`'s, an `out=`)."""
    for i, spec in enumerate(func._schema.arguments):
        if spec.alias_info is None or not spec.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else (kwargs or {}).get(spec.name)
        if isinstance(value, torch.Tensor) and not value.is_meta:
            yield value


def _feed_tied(model: torch.nn.Module, ties: dict[str, list[str]], published: _Published, direct: _DirectLoads) -> None:
    """A layer whose only weights are tied to another's (an LM head tied to the
    embedding) gets no tensor from `load_weights` when the published set names only the
    other, or when the model's loader skips the head: feed it through its own loader."""
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    for name, others in ties.items():
        module_name, _, param_name = name.rpartition(".")
        layer = model.get_submodule(module_name)
        if direct.holds(layer):
            if direct.started(layer):
                continue  # loaded already (a tied twin's writes count for both)
        else:
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


# -- layers whose processing is the identity, loaded straight -------------------------------

_IDENTITY: weakref.WeakKeyDictionary[torch.nn.Module, list[torch.nn.Module]] = weakref.WeakKeyDictionary()


def identity_layers(model: torch.nn.Module) -> set[torch.nn.Module]:
    """The model's layers whose first-load processing leaves their loaded tensors as they
    are (`_leaves_alone`): probed once per model, on the first apply."""
    if model not in _IDENTITY:
        _IDENTITY[model] = [m for m in model.modules() if _leaves_alone(m)]
    return set(_IDENTITY[model])


def _leaves_alone(layer: torch.nn.Module) -> bool:
    """Whether a fresh engine holds `layer`'s tensors exactly as its weight loaders leave
    them. Decided by what the backend's processing does, not by its name (vLLM changes,
    and one class does different things on different platforms: the CPU backend repacks
    unquantized linear weights for oneDNN, a GPU leaves them): the layer has parameters
    only, each as the model created it (shape, dtype, strides: no repack or padding kept),
    and either no quant method (vLLM processes a layer through its quant method only) or
    one whose first-load processing, run on a copy of the layer holding fresh random
    tensors, touched no tensor, byte, or attribute of the layer or of the method. Anything
    else (attention, whose processing runs at the reload's end; a fused MoE; a method
    that fails on random values) goes through vLLM's reload, as before."""
    from vllm.model_executor.layers.attention import is_deferred_attention_layer
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    params = {k: p for k, p in layer._parameters.items() if p is not None}
    created, created_buffers = get_layerwise_info(layer).restore_metadata
    if not params or created_buffers or any(b is not None for b in layer._buffers.values()):
        return False
    if is_deferred_attention_layer(layer) or created.keys() != params.keys():
        return False
    if any(_layout(params[k]) != _layout(created[k]) for k in params):
        return False  # the kernels' tensors are not the loaded ones (repacked, padded)
    method = getattr(layer, "quant_method", None)
    if not isinstance(method, QuantizeMethodBase):
        return True
    try:
        return _processing_leaves_alone(layer, method, params)
    except Exception:  # what it does is unknown: vLLM's reload runs it
        return False


def _processing_leaves_alone(layer: torch.nn.Module, method: Any, params: dict[str, torch.Tensor]) -> bool:
    scratch = copy.copy(layer)
    scratch._parameters = {k: _random_param(p) for k, p in params.items()}
    scratch._buffers = {}
    scratch._modules = dict(layer._modules)
    fresh = _first_load_method(method)
    loaded = dict(scratch._parameters)
    where = {k: (t.data_ptr(), _layout(t)) for k, t in loaded.items()}
    prints = fingerprint_tensors(list(loaded.values()))
    layer_attrs, method_attrs = _attributes(scratch), _attributes(fresh)
    type(method).process_weights_after_loading(fresh, scratch)
    now = {k: t for k, t in scratch._parameters.items() if t is not None}
    return (
        _attributes(scratch) == layer_attrs
        and _attributes(fresh) == method_attrs
        and now.keys() == loaded.keys()
        and all(now[k] is loaded[k] and (now[k].data_ptr(), _layout(now[k])) == where[k] for k in loaded)
        and not any(b is not None for b in scratch._buffers.values())
        and bool(torch.equal(fingerprint_tensors(list(now.values())), prints))
    )


def _layout(t: torch.Tensor) -> tuple:
    return tuple(t.shape), t.dtype, tuple(t.stride())


def _attributes(obj: Any) -> dict[str, int]:
    """Which object each attribute names: processing that sets, drops or rebinds one
    (a packed handle, a kernel, a flag) shows."""
    return {k: id(v) for k, v in vars(obj).items()}


def _random_param(p: torch.Tensor) -> torch.Tensor:
    data = torch.empty_strided(p.shape, p.stride(), dtype=p.dtype, device=p.device)
    if data.is_floating_point():
        data.normal_()
    else:
        data.random_(0, 100)
    return _as_param_like(data, p)


def _as_param_like(data: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """`data` as a parameter of `p`'s class with `p`'s attributes (weight_loader, the
    layout attributes processing reads)."""
    out = torch.nn.Parameter(data, requires_grad=False)
    out.__class__ = p.__class__
    out.__dict__.update(p.__dict__)
    return out


def _may_load_straight(model: torch.nn.Module) -> bool:
    # A torchao model's load_weights runs vLLM's reload over the whole model itself.
    return not getattr(model, "_do_torchao_reload", False)


class _Part(torch.nn.Module):
    """The model's modules but `leave_out`, as vLLM's layerwise reload walks a model
    (`modules()`): the layers loaded straight are neither put on the meta device nor
    re-materialised. Their own children are not walked either: only the model is."""

    def __init__(self, model: torch.nn.Module, leave_out: list[torch.nn.Module]) -> None:
        super().__init__()
        out = set(map(id, leave_out))
        self._members = [(n, m) for n, m in model.named_modules() if id(m) not in out]

    def named_modules(self, memo: Any = None, prefix: str = "", remove_duplicate: bool = True) -> Iterator:
        return iter(self._members)


class _DirectLoads:
    """Layers loaded straight into the tensors the kernels use: the elements each of
    their parameters was written (by `copy_`, capped at its size, as vLLM counts a
    reloaded layer's loads), and, once a layer is whole, its fingerprints as loaded
    (`_Reference.loaded`). Tied parameters share a tensor: a write counts for each."""

    def __init__(self, layers: list[torch.nn.Module], reference: _Reference) -> None:
        from vllm.model_executor.model_loader.reload.utils import get_tensor_load_numel

        self.reference = reference
        # storage address -> (layer, name, the parameter's bytes in it)
        self.owners: dict[int, list[tuple[torch.nn.Module, str, int, int]]] = {}
        self.written: dict[tuple[int, str], int] = {}
        self.sizes: dict[tuple[int, str], int] = {}
        self.whole: set[int] = set()
        self.layers = {id(m): m for m in layers}
        for layer in layers:
            for name, p in layer._parameters.items():
                if p is not None:
                    span = (p.data_ptr(), p.data_ptr() + p.numel() * p.element_size())
                    self.owners.setdefault(p.untyped_storage().data_ptr(), []).append((layer, name, *span))
                    self.written[(id(layer), name)] = 0
                    self.sizes[(id(layer), name)] = get_tensor_load_numel(p)

    def holds(self, layer: torch.nn.Module) -> bool:
        return id(layer) in self.layers

    def started(self, layer: torch.nn.Module) -> bool:
        return any(self.written[(id(layer), n)] for n, p in layer._parameters.items() if p is not None)

    def _written_layers(self, dst: torch.Tensor) -> Iterator[tuple[torch.nn.Module, str]]:
        start = dst.data_ptr()
        end = start + dst.numel() * dst.element_size()
        for layer, name, first, last in self.owners.get(dst.untyped_storage().data_ptr(), ()):
            if not (end <= first or last <= start):  # else another parameter in the same storage
                yield layer, name

    def before_write(self, dst: torch.Tensor) -> None:
        """A write into a layer already whole (a tied twin's, or a clobber): its fingerprints
        as loaded are taken first, so that the check compares against them."""
        if self.reference.pending and any(self.reference.is_pending(layer) for layer, _ in self._written_layers(dst)):
            self.reference.flush()

    def wrote(self, dst: torch.Tensor) -> None:
        for layer, name in self._written_layers(dst):
            key = (id(layer), name)
            self.written[key] = min(self.written[key] + dst.numel(), self.sizes[key])
            if id(layer) not in self.whole and self._complete(layer):
                self.whole.add(id(layer))
                self.reference.loaded(layer)

    def _complete(self, layer: torch.nn.Module) -> bool:
        return all(
            self.written[(id(layer), n)] >= self.sizes[(id(layer), n)]
            for n, p in layer._parameters.items()
            if p is not None
        )

    def unloaded(self, model: torch.nn.Module, missing: list[str], partial: list[str]) -> None:
        """Add the layers that got no weights to `missing`, those that got some to `partial`."""
        for name, layer in model.named_modules():
            if self.holds(layer) and id(layer) not in self.whole:
                (partial if self.started(layer) else missing).append(name or type(layer).__name__)


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
    freshly loaded tensors, compared after the reload with the tensors the kernels use.
    For a layer whose processing is the identity (`identity`), the loaded tensors
    themselves; for any other, a processed copy of them."""

    def __init__(self, enabled: bool, identity: set[torch.nn.Module]) -> None:
        self.enabled = enabled
        self.identity = identity
        # id(layer) -> (layer, each tensor's name -> (shape, dtype), their fingerprints on the device)
        self.expected: dict[int, tuple[torch.nn.Module, dict[str, tuple], torch.Tensor]] = {}
        # Layers loaded straight and whole, their fingerprints as loaded not yet taken: taken
        # for all of them at once (`flush`), not one launch each (399 for an 8B model,
        # bound by the host's launches: 28 ms against 9 ms for the set on an H200).
        self.pending: dict[int, torch.nn.Module] = {}
        self.processed = 0
        self.checked = 0
        self.scratch = 0
        self.seconds = 0.0

    def record(self, layer: torch.nn.Module, method: Any) -> None:
        """`layer` is loaded and about to be processed by vLLM's reload."""
        from vllm.model_executor.layers.attention import is_deferred_attention_layer

        if not self.enabled or is_deferred_attention_layer(layer):
            return  # attention layers hold no checkpoint weights here, only scales
        started = time.perf_counter()
        if layer in self.identity:
            self._expect([(layer, layer)])  # processing leaves these as they are: no copy
        else:
            scratch = _scratch(layer)
            # Defined on the class, not the (wrapped) instance: the unwrapped processing.
            type(method).process_weights_after_loading(_first_load_method(method), scratch)
            self._expect([(layer, scratch)])
            self.scratch += 1
        self.seconds += time.perf_counter() - started

    def loaded(self, layer: torch.nn.Module) -> None:
        """`layer`, loaded straight into the kernels' tensors, is whole: its fingerprints
        as loaded are taken at the next `flush`, before anything writes it again."""
        if self.enabled:
            self.pending[id(layer)] = layer

    def is_pending(self, layer: torch.nn.Module) -> bool:
        return id(layer) in self.pending

    def flush(self) -> None:
        """The fingerprints as loaded of every pending layer, in one launch per word width."""
        if not self.pending:
            return
        started = time.perf_counter()
        layers = list(self.pending.values())
        self.pending.clear()
        self._expect([(layer, layer) for layer in layers])
        self.seconds += time.perf_counter() - started

    def _expect(self, pairs: list[tuple[torch.nn.Module, torch.nn.Module]]) -> None:
        """What each layer's kernel tensors must be: the fingerprints of its source's own
        tensors (the layer itself, or a copy processed as on a first load), all at once."""
        layers = [(layer, _own_tensors(source)) for layer, source in pairs]
        flat = [t for _, tensors in layers for t in tensors.values()]
        if not flat:
            return
        prints, at = fingerprint_tensors(flat), 0
        for layer, tensors in layers:
            if tensors:
                shapes = {k: (tuple(t.shape), t.dtype) for k, t in tensors.items()}
                self.expected[id(layer)] = (layer, shapes, prints[at : at + len(tensors)])
                at += len(tensors)

    def compare(self, model: torch.nn.Module) -> float:
        """Raise `ApplyCheckError` naming every parameter whose kernel bytes differ: every
        layer's fingerprints taken at once, compared on the device, one transfer."""
        if not self.enabled:
            return 0.0
        self.flush()  # none is left pending after a load; a direct call may leave some
        started = time.perf_counter()
        names = {id(m): n for n, m in model.named_modules()}
        wrong, labels, tensors, picks, prints = [], [], [], [], []
        at = 0
        for key, (layer, shapes, expected) in self.expected.items():
            now = _own_tensors(layer)
            for i, (name, shape) in enumerate(shapes.items()):
                label = f"{names.get(key, type(layer).__name__)}.{name}"
                if name not in now:
                    continue  # processing removed it from the layer: nothing the kernels use
                if (tuple(now[name].shape), now[name].dtype) != shape:
                    wrong.append(label)
                else:
                    labels.append(label)
                    tensors.append(now[name])
                    picks.append(at + i)
            prints.append(expected)
            at += len(shapes)
            self.checked += 1
        if tensors:
            got = fingerprint_tensors(tensors)
            want = torch.cat([p.to(got.device) for p in prints])[torch.tensor(picks, device=got.device)]
            wrong += [label for label, differs in zip(labels, (got != want).tolist(), strict=True) if differs]
        self.expected.clear()
        self.seconds += time.perf_counter() - started
        if wrong:
            raise ApplyCheckError(
                f"after the apply, {len(wrong)} tensors the kernels use differ from what the same loading "
                f"makes of the pulled copy on a first load: {_few(wrong)}"
            )
        return self.seconds


def _first_load_method(method: Any) -> Any:
    """A copy of `method` as it stands before a first load (a fused MoE's kernel is built
    from the weights then)."""
    fresh = copy.copy(method)
    if hasattr(fresh, "moe_kernel"):
        fresh.moe_kernel = None
    return fresh


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


def _own_tensors(layer: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The layer's own tensors (its submodules' are theirs)."""
    return {k: t for k, t in (*layer._parameters.items(), *layer._buffers.items()) if t is not None}
