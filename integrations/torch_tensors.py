"""The torch side of the publisher and the puller: cast-and-copy into a slot, and views
of a mirror as tensors. The only module of the core's path that imports torch."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import anyio
import torch

from weightpull.layout import Layout, Placement, TensorSpec
from weightpull.tensors import cast_target, normalize_dtype
from weightpull.transport import Region

from .fp8 import Fp8Part


def torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def tensor_at(region: Region, placement: Placement) -> torch.Tensor:
    """A typed view of `placement`'s bytes inside `region` (host or device), no copy."""
    spec = placement.spec
    dtype = torch_dtype(spec.dtype)
    if spec.nbytes == 0:
        return torch.empty(spec.shape, dtype=dtype, device=region.device)
    if region.view is not None and region.view.readonly:  # a borrowed slot's: read, never written
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "The given buffer is not writable", UserWarning)
            raw = torch.frombuffer(region.view, dtype=torch.uint8, count=spec.nbytes, offset=placement.offset)
    elif region.view is not None:
        raw = torch.frombuffer(region.view, dtype=torch.uint8, count=spec.nbytes, offset=placement.offset)
    else:
        raw = region.memory[placement.offset : placement.end]
    return raw.view(dtype).view(spec.shape)


def as_tensors(layout: Layout, region: Region) -> dict[str, torch.Tensor]:
    """Every tensor of a pulled mirror, by name, as views into it (no copy).

    Args:
        layout: The version's layout (`Pulled.layout`).
        region: The mirror it was pulled into (`Pulled.region`).

    Returns:
        Each tensor by name, of its published dtype and shape, on the region's device.
    """
    return {p.spec.name: tensor_at(region, p) for p in layout.placements}


class TorchAdapter:
    """Copies torch tensors (CPU or CUDA) into a slot, casting fp32 to the rollout dtype,
    and a weight's block-fp8 parts (`weightpull.integrations.fp8.expand`) as the weight's
    e4m3 values and its scales, quantized on the weight's device at their first copy.
    Host copies run in a worker thread (torch releases the GIL); device->host copies
    are queued non-blocking and fenced by a CUDA event, on `stream` if given (a side
    stream keeps them from queueing ahead of the trainer's own kernels), else on the
    calling thread's current stream. Copies queue quickest from a thread whose current
    stream `stream` is."""

    def __init__(self, stream: torch.cuda.Stream | None = None) -> None:
        self.stream = stream
        self._pending: list[torch.cuda.Event] = []
        # Each slot's typed views, made once: a model's hundreds of views cost milliseconds
        # per publish otherwise. Keyed by the region itself, so a new one starts afresh.
        self._views: dict[int, tuple[Region, dict[Placement, torch.Tensor]]] = {}

    def _view(self, region: Region, placement: Placement) -> torch.Tensor:
        kept = self._views.get(id(region))
        if kept is None or kept[0] is not region:
            if len(self._views) >= 8:  # slots come and go with a model that outgrew them
                self._views.clear()
            kept = self._views[id(region)] = (region, {})
        view = kept[1].get(placement)
        if view is None:
            view = kept[1][placement] = tensor_at(region, placement)
        return view

    def warm(
        self,
        region: Region,
        layout: Layout,
        casts: Iterable[tuple[torch.dtype, torch.dtype]],
        device: torch.device,
    ) -> None:
        """Before the first publish into `region`: make the views a version of `layout`
        writes, and run each cast (source dtype, slot dtype) once on scratch tensors of
        `device`, so that the first streamed publish queues as fast as the rest (a fresh
        process loads each kernel at its first launch)."""
        for placement in layout.placements:
            self._view(region, placement)
        with torch.no_grad():
            for source, target in casts:  # a million elements: the vectorised kernel a model's tensors take
                into = torch.empty(1 << 20, dtype=target, device=region.device)
                into.copy_(torch.zeros(1 << 20, dtype=source, device=device), non_blocking=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def describe(self, name: str, value: torch.Tensor | Fp8Part, rollout_dtype: str | None) -> TensorSpec:
        if isinstance(value, Fp8Part):  # cast to its own dtype, whatever the rollout dtype
            return TensorSpec(name, value.dtype, value.shape)
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"tensor {name!r} is a {type(value).__name__}, not a torch.Tensor")
        dtype = cast_target(normalize_dtype(value.dtype), rollout_dtype)
        return TensorSpec(name, dtype, tuple(value.shape))

    async def write(self, items: Sequence[tuple[torch.Tensor | Fp8Part, Placement]], region: Region) -> None:
        on_device = region.view is None or any(t.is_cuda for t, _ in items)

        def copy_all() -> None:
            # Host copies: one call per bucket (the worker thread's per-call cost is the pace).
            pairs = [(self._view(region, p), self._source(v)) for v, p in items if p.spec.nbytes]
            if pairs:
                with torch.no_grad():
                    torch._foreach_copy_([d for d, _ in pairs], [s for _, s in pairs])

        def copy_each() -> None:
            # On a GPU, a copy_ per tensor: its cast kernel runs at memory speed, where
            # _foreach_copy_'s casting one ran 25% slower on an H200 (15.7 ms against 12.5
            # for an 8B model's fp32->bf16), and queueing each costs less than the GPU's work.
            with torch.no_grad():
                for value, placement in items:
                    if placement.spec.nbytes:
                        self._view(region, placement).copy_(self._source(value), non_blocking=True)

        if on_device:
            # Entering a stream costs ~50 us a bucket on an H200's host (more than the copies
            # take to queue), so not when it is the thread's current one already, as on the
            # thread a SnapshotPublisher queues from. An int device asks quickest.
            stream = self.stream
            if stream is None or torch.cuda.current_stream(stream.device_index) == stream:
                copy_each()
            else:
                with torch.cuda.stream(stream):
                    copy_each()
            event = torch.cuda.Event()
            event.record(stream)  # None: the current stream, the copies' own
            self._pending.append(event)
        else:
            await anyio.to_thread.run_sync(copy_all)

    @staticmethod
    def _source(value: torch.Tensor | Fp8Part) -> torch.Tensor:
        """What a published tensor's bytes are copied from: itself, or its fp8 part's tensor."""
        return value.tensor() if isinstance(value, Fp8Part) else value.detach()

    async def fence(self) -> None:
        pending, self._pending = self._pending, []
        for event in pending:
            await anyio.to_thread.run_sync(event.synchronize)

    def landing(self) -> Callable[[], None]:
        """What blocks until the copies issued so far landed (the last one's event), and
        no later: a streaming publisher marks each bucket once its own copies landed
        (asking `done()` as it queues, then blocking in a worker thread for the rest)."""
        pending, self._pending = self._pending, []  # one stream: the last event lands last
        return _EventLanding(pending[-1]) if pending else _LANDED


class _EventLanding:
    """Waits for one CUDA event: blocking when called, or asked without blocking."""

    def __init__(self, event: torch.cuda.Event) -> None:
        self.event = event

    def __call__(self) -> None:
        self.event.synchronize()

    def done(self) -> bool:
        return bool(self.event.query())


class _AlreadyLanded:
    """Host copies land before `write` returns: nothing to wait for."""

    def __call__(self) -> None:
        pass

    def done(self) -> bool:
        return True


_LANDED = _AlreadyLanded()


# -- fingerprints: is this the same bytes, wherever it lives --------------------------------

_PERIOD = 65521  # a prime: a shift by whole rows of a power-of-two width changes the sum
# Words summed at once by torch's ops: on the host ~1 M (the cached weights and the product
# 8 MiB each: a vLLM worker keeps no 128 MiB table for its apply check), on a GPU, where
# the Triton kernel is the usual path, ~16.8 M (fewer launches).
_CHUNK = _PERIOD * 16
_GPU_CHUNK = _PERIOD * 256


def fingerprints(tensors: Mapping[str, torch.Tensor]) -> dict[str, int]:
    """Per tensor, the sum of its words each times an odd weight, 2 * (its index mod
    65521) + 1, modulo 2**64: computed on the device the tensor lives on, and exact, so
    equal bytes give equal fingerprints on any device. A one-bit change anywhere changes
    it (the bit's 2**b times an odd weight is never a multiple of 2**64), and so do most
    changes of more, and words moved to other places. The sums come to the host in one
    transfer per device."""
    by_device: dict[torch.device, list[str]] = {}
    for name, t in tensors.items():
        by_device.setdefault(t.device, []).append(name)
    out: dict[str, int] = {}
    for names in by_device.values():
        out.update(zip(names, fingerprint_tensors([tensors[n] for n in names]).tolist(), strict=True))
    return {name: out[name] for name in tensors}


def fingerprint_tensors(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """`fingerprints` of `tensors` (all on one device), as an int64 tensor on that device,
    in order: nothing crosses to the host, so a caller can compare many on the device and
    transfer once. A CUDA set takes the Triton kernel, one launch per word width."""
    if not tensors:
        return torch.zeros(0, dtype=torch.int64)
    words = [_words(t) for t in tensors]
    if tensors[0].is_cuda and _kernel() is not None:
        try:
            return _kernel().fingerprint_many(words)
        except Exception as exc:  # the kernel does not compile here: the torch path, and said so
            _kernel_failed(exc)
    return torch.stack([_sum(w) for w in words])


def _fingerprint(t: torch.Tensor) -> torch.Tensor:
    words = _words(t)
    if t.is_cuda and words.numel() and _kernel() is not None:
        try:
            return _kernel().fingerprint(words)  # one pass over the bytes, the same value
        except Exception as exc:
            _kernel_failed(exc)
    return _sum(words)


def _words(t: torch.Tensor) -> torch.Tensor:
    """`t`'s bytes as the widest words its size allows: 8-byte words need no widening, and
    move the least."""
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
    width = next(w for w in (8, 4, 2, 1) if raw.numel() % w == 0)
    if raw.storage_offset() % width:  # a view starting mid-word (a slice of bytes): its words, aligned
        raw = raw.clone()
    return raw.view({8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[width])


def _sum(words: torch.Tensor) -> torch.Tensor:
    """The fingerprint by torch ops, a chunk at a time (several passes over the bytes)."""
    total = torch.zeros((), dtype=torch.int64, device=words.device)
    size = _GPU_CHUNK if words.is_cuda else _CHUNK
    weights = _weights(words.device, size)
    for start in range(0, words.numel(), size):  # a chunk starts at a multiple of the period
        chunk = words[start : start + size]
        total += (chunk * weights[: chunk.numel()]).sum()  # int64, wrapping modulo 2**64
    return total


@functools.cache
def _weights(device: torch.device, size: int) -> torch.Tensor:
    # Odd: multiplying by an odd number is one-to-one modulo 2**64, so no bit is lost.
    return torch.arange(size, device=device, dtype=torch.int64).remainder_(_PERIOD).mul_(2).add_(1)


_KERNEL_FAILED: list[str] = []  # why the Triton kernel was given up in this process, if it was


@functools.cache
def _kernel() -> Any:
    """The Triton kernel's module, where Triton imports (a CUDA machine); else None, and
    CUDA tensors take the torch path (exact too, in several passes)."""
    if _KERNEL_FAILED:
        return None
    try:
        from . import fingerprint_kernel
    except ImportError:
        return None
    return fingerprint_kernel


def _kernel_failed(exc: Exception) -> None:
    """A kernel that fails to build or launch here is given up for the process (the
    torch path gives the same values), loudly: `fingerprint_implementation` names why."""
    _KERNEL_FAILED.append(f"{type(exc).__name__}: {str(exc)[:200]}")
    _kernel.cache_clear()
    warnings.warn(
        f"weightpull's Triton fingerprint kernel failed, using torch's ops: {_KERNEL_FAILED[-1]}", stacklevel=3
    )


def fingerprint_implementation(device: torch.device | str = "cuda") -> str:
    """Which path fingerprints of tensors on `device` (a CUDA one unless told) take here:
    "triton" (one pass over the bytes), or "torch" (several; with the reason where the
    Triton kernel failed here)."""
    if torch.device(device).type == "cuda" and _kernel() is not None:
        return "triton"
    return f"torch (the Triton kernel failed: {_KERNEL_FAILED[0]})" if _KERNEL_FAILED else "torch"
