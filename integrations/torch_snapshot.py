"""Publishing from a synchronous torch training loop, blocking the trainer only for a
snapshot.

`SnapshotPublisher.publish(version, tensors)` casts the tensors (fp32 to the rollout
dtype) into a staging buffer on their own device, which it allocated once, and returns
once that snapshot is complete. The copy from staging into a host slot, its fence and
the announcement run on a background event loop (a thread): the version is announced
only after every device-to-host copy landed. The trainer's blocking time per publish is
measured and kept (`blocking`, and each `Ticket`).

The staging buffer is reused, so a publish first waits until the previous one's copy
out of it finished: in a training loop whose steps outlast that copy, this never waits.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import anyio.from_thread
import attrs
import torch

from weightpull.errors import InvalidArgumentError, PublishError, WeightpullError
from weightpull.layout import Placement, TensorSpec, plan_layout
from weightpull.publisher import Publisher, PublishResult
from weightpull.registry import Registry, connect_registry
from weightpull.sharding import Sharding
from weightpull.tensors import cast_target, landed_now, normalize_dtype
from weightpull.transport import Region, Transport
from weightpull.transports import create_transport

from . import fp8 as fp8_cast
from .fp8 import Fp8Part
from .torch_delta import encode_region
from .torch_digests import wsum64_digests
from .torch_tensors import TorchAdapter, tensor_at, torch_dtype

log = logging.getLogger(__name__)


def spec_of(name: str, tensor: torch.Tensor | Fp8Part, rollout_dtype: str | None) -> TensorSpec:
    """`tensor` as published: fp32 cast to the rollout dtype; a block-fp8 part as itself."""
    if isinstance(tensor, Fp8Part):
        return TensorSpec(name, tensor.dtype, tensor.shape)
    return TensorSpec(name, cast_target(normalize_dtype(tensor.dtype), rollout_dtype), tuple(tensor.shape))


@attrs.define
class BlockingTime:
    """How long publish() held the trainer: the metric to watch."""

    last_s: float = 0.0
    max_s: float = 0.0
    total_s: float = 0.0
    count: int = 0

    def add(self, seconds: float) -> None:
        self.last_s = seconds
        self.max_s = max(self.max_s, seconds)
        self.total_s += seconds
        self.count += 1


@attrs.frozen
class Ticket:
    """One publish, as the trainer sees it: how long it blocked, and the announcement
    still under way (None where this rank announces nothing)."""

    version: int
    blocking_s: float
    future: concurrent.futures.Future[PublishResult] | None = attrs.field(default=None, repr=False)

    def done(self) -> bool:
        return self.future is None or self.future.done()

    def result(self, timeout: float | None = None) -> PublishResult | None:
        """Wait for the announcement; its result, or its error."""
        return None if self.future is None else self.future.result(timeout)


class _Described:
    """The trainer's adapter, describing each tensor as the snapshot's specs publish it:
    the staging buffer holds them cast already (an fp8 weight's scales stay float32)."""

    def __init__(self, inner: TorchAdapter, specs: dict[str, TensorSpec]) -> None:
        self.inner, self.specs = inner, specs

    def describe(self, name: str, value: torch.Tensor, rollout_dtype: str | None) -> TensorSpec:
        # The publish checked these tensors against `specs` already: no second TensorSpec each.
        return self.specs.get(name) or self.inner.describe(name, value, rollout_dtype)

    async def write(self, items: Sequence[tuple[torch.Tensor, Placement]], region: Region) -> None:
        await self.inner.write(items, region)

    async def fence(self) -> None:
        await self.inner.fence()


class _Landed(_Described):
    """The adapter of one streaming publish: the trainer's own, which also resolves
    `copied` once the last of `count` tensors' copies landed."""

    def __init__(
        self, inner: TorchAdapter, specs: dict[str, TensorSpec], count: int, copied: concurrent.futures.Future[None]
    ) -> None:
        super().__init__(inner, specs)
        self.left, self.copied = count, copied

    async def write(self, items: Sequence[tuple[torch.Tensor, Placement]], region: Region) -> None:
        await self.inner.write(items, region)
        self.left -= len(items)

    async def fence(self) -> None:
        await self.inner.fence()
        self._done()

    def landing(self) -> Callable[[], None]:
        return _LastLanding(self, self.inner.landing(), self.left == 0)

    def _done(self) -> None:
        if self.left == 0 and not self.copied.done():
            self.copied.set_result(None)


class _LastLanding:
    """One bucket's landing; the last bucket's also resolves the publish's `copied` once
    seen landed, whether waited for (a worker thread) or asked (the queueing loop)."""

    def __init__(self, owner: _Landed, wait: Callable[[], None], last: bool) -> None:
        self.owner, self.wait, self.last = owner, wait, last

    def __call__(self) -> None:
        self.wait()
        if self.last:
            self.owner._done()

    def done(self) -> bool:
        if not landed_now(self.wait):
            return False
        if self.last:
            self.owner._done()
        return True


class Staging:
    """Cast copies of named tensors, in one buffer on one device, laid out once."""

    def __init__(self, specs: Sequence[TensorSpec], device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.layout = plan_layout(specs)
        # Zeros, not empty: its pages are touched now, not in the first publish's copy.
        self.buffer = torch.zeros(self.layout.total_bytes, dtype=torch.uint8, device=self.device)
        region = Region(self.layout.total_bytes, str(self.device), self.buffer)
        self.views = {p.spec.name: tensor_at(region, p) for p in self.layout.placements}

    def fill(self, tensors: Iterable[tuple[str, torch.Tensor | Fp8Part]]) -> None:
        """Copy each tensor in, casting as it goes (an iterator may make each on the way,
        as a gather does; a block-fp8 part quantizes its weight), and return once every
        copy is complete on the device."""
        filled = set()
        with torch.no_grad():
            for name, tensor in tensors:
                view = self.views.get(name)
                if view is None or tuple(view.shape) != tuple(tensor.shape):
                    raise InvalidArgumentError(
                        f"{name!r} of shape {list(tensor.shape)} is not a tensor this staging holds "
                        f"({list(view.shape) if view is not None else 'no such name'})"
                    )
                view.copy_(tensor.tensor() if isinstance(tensor, Fp8Part) else tensor.detach())
                filled.add(name)
        if len(filled) != len(self.views):
            raise InvalidArgumentError(f"publish left out {sorted(set(self.views) - filled)}")
        if self.device.type == "cuda":
            done = torch.cuda.Event()
            done.record()  # on the trainer's stream, after its own work on these tensors
            done.synchronize()

    def items(self) -> list[tuple[str, torch.Tensor]]:
        return list(self.views.items())


class SnapshotPublisher:
    """A `Publisher` on a background event loop, fed from a staging buffer.

    `registry` is a `Registry`, or an address for `connect_registry`; `transport` a
    `Transport`, or a driver name (made with `transport_options`). `device` holds the
    staging buffer, `slot_device` the slots (a GPU for drivers that read GPU memory
    directly, such as cuda_ipc). `specs` are the
    tensors each publish will pass (name, dtype, shape; fp32 is cast on the way). With
    `fp8`, each linear weight is published in block-scaled fp8 (e4m3 values and their
    128 x 128 scales, `weightpull.integrations.fp8`), quantized on its own device in the
    snapshot, and the rest cast to the rollout dtype, for replicas serving such a
    checkpoint. Other options go to the `Publisher`: `digests="wsum64"` on a GPU slot is computed there,
    with torch (`torch_digests.wsum64_digests`, the `digester` passed unless given).
    Use it from one thread; `close()` when done (which closes the registry too if it
    made it, or if `close_registry`)."""

    def __init__(
        self,
        registry: Registry | str | None,
        transport: Transport | str,
        specs: Iterable[TensorSpec],
        *,
        device: torch.device | str = "cpu",
        slot_device: str = "cpu",
        rollout_dtype: Any = "bfloat16",
        transport_options: dict[str, Any] | None = None,
        close_registry: bool = False,
        stream: bool = False,
        sharding: Sharding | None = None,
        fp8: bool = False,
        **publisher_options: Any,
    ) -> None:
        self.rollout_dtype = None if rollout_dtype is None else normalize_dtype(rollout_dtype, "rollout_dtype")
        if fp8 and sharding is not None:
            raise InvalidArgumentError(
                "fp8 versions are published whole: a shard's rows would split the 128 x 128 blocks of its scales"
            )
        self.fp8 = fp8
        given = list(specs)
        if fp8:
            self.specs = fp8_cast.specs(given, self.rollout_dtype)
            # the casts the slot copies run: a quantized weight's parts are copied as they are
            sources = {s.name: s.dtype for s in given}
            self._casts = {
                (s.dtype if s.dtype == fp8_cast.FP8 else sources.get(s.name, s.dtype), s.dtype) for s in self.specs
            }
        else:
            self.specs = [attrs.evolve(s, dtype=cast_target(s.dtype, self.rollout_dtype)) for s in given]
            self._casts = {(g.dtype, s.dtype) for g, s in zip(given, self.specs, strict=True)}
        self._specs_by_name = {s.name: s for s in self.specs}
        self._checked: list[tuple[str, Any, Any]] | None = None  # the key of the tensors last found right
        self.device = torch.device(device)
        self.stream = stream
        self._staging: Staging | None = None
        self.blocking = BlockingTime()
        self._portal_cm = anyio.from_thread.start_blocking_portal()
        self._portal = self._portal_cm.__enter__()
        self._owned: list[Any] = []  # what close() shuts, because this made it
        if registry is None or isinstance(registry, str):  # an address (None: $WEIGHTPULL_REGISTRY)
            registry = connect_registry(registry)
            close_registry = True
        if close_registry:
            self._owned.append(registry)
        if isinstance(transport, str):
            transport = create_transport(transport, **(transport_options or {}))
            self._owned.append(transport)
        # Copies on a side stream, queued behind none of the trainer's kernels: the current
        # stream of the background loop's thread (ours alone), which queues them all.
        self._side = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        if self._side is not None:
            self._portal.call(torch.cuda.set_stream, self._side)
        self._adapter = TorchAdapter(self._side)
        publisher_options.setdefault("digester", wsum64_digests)  # a GPU slot's digests, computed there
        publisher_options.setdefault("encoder", encode_region)  # and its deltas (deltas=True)
        self.publisher = Publisher(
            registry,
            transport,
            rollout_dtype=self.rollout_dtype,
            adapter=self._adapter,
            device=slot_device,
            stream=stream,
            **publisher_options,
        )
        self._serving = self._portal.start_task_soon(self.publisher.serve)  # peers' reads may need our progress
        # The slots now, off the trainer's first step: page-locking them takes seconds.
        self._portal.call(functools.partial(self.publisher.reserve, self.specs, shard=sharding))
        if not stream or sharding is not None:  # a publish that snapshots needs the staging buffer: make it now too
            _ = self.staging
        else:  # a streamed one casts into the slots: their views, and a first run of each cast, now too
            layout = self.publisher.slot_layout  # as `reserve` just planned it
            assert layout is not None
            casts = {(torch_dtype(source), torch_dtype(target)) for source, target in self._casts}
            for slot in self.publisher.slots:
                if slot.region is not None:
                    self._adapter.warm(slot.region, layout, casts, self.device)
        self._last: Ticket | None = None
        self._reported: Ticket | None = None  # whose failure was logged

    @property
    def name(self) -> str:
        return self.publisher.name

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run the coroutine function `fn(*args)` on the publisher's event loop, where its
        registry client lives, and return its result (blocking)."""
        return self._portal.call(fn, *args)

    @property
    def staging(self) -> Staging:
        """The staging buffer, allocated at first use (a streaming publish of whole
        versions needs none: it casts straight into the slot)."""
        if self._staging is None:
            self._staging = Staging(self.specs, self.device)
        return self._staging

    def publish(
        self, version: int, tensors: Iterable[tuple[str, torch.Tensor]], *, shard: Sharding | None = None
    ) -> Ticket:
        """Snapshot `tensors` and return; the version is announced in the background.
        With `shard`, they are this rank's part of a sharded version."""
        started = time.perf_counter()
        self.wait()
        if self.fp8:
            tensors = fp8_cast.expand(tensors)
        if self.stream and shard is None:
            items = list(tensors)
            try:
                self._check(items)
            except InvalidArgumentError as exc:
                self._portal.call(self._abort, version, repr(exc), (0, 1))
                raise
            return self._publish_streaming(version, items, started)
        self.publisher.adapter = _Described(self._adapter, self._specs_by_name)
        try:
            self.staging.fill(tensors)
        except BaseException as exc:
            # Record the failure: as a shard, the siblings then stop waiting on us; alone,
            # as a version of one shard, aborted before it began.
            self._portal.call(self._abort, version, repr(exc), (shard.index, shard.count) if shard else (0, 1))
            if isinstance(exc, Exception) and not isinstance(exc, WeightpullError):
                raise PublishError(f"snapshotting v{version} failed: {exc!r}") from exc
            raise
        publish = functools.partial(self.publisher.publish, version, self.staging.items(), shard=shard)
        ticket = Ticket(version, time.perf_counter() - started, self._portal.start_task_soon(publish))
        self.blocking.add(ticket.blocking_s)
        self._last = ticket
        return ticket

    def _check(self, items: list[tuple[str, torch.Tensor]]) -> None:
        """The tensors a streaming publish passes are those it was made for, as the
        staging buffer insists for the others."""
        # What was checked last, by a key cheap to make: a model's specs each publish cost ~1 ms.
        key = [(n, getattr(t, "dtype", None), getattr(t, "shape", None)) for n, t in items]
        if key == self._checked:
            return
        got = [spec_of(n, t, self.rollout_dtype) for n, t in items]
        if got != self.specs:
            wrong = sorted({s.name for s in got} ^ {s.name for s in self.specs}) or [
                g.name for g, w in zip(got, self.specs, strict=False) if g != w
            ]
            raise InvalidArgumentError(f"publish passed tensors other than those it was made for: {wrong[:5]}")
        self._checked = key

    def _publish_streaming(self, version: int, items: list[tuple[str, torch.Tensor]], started: float) -> Ticket:
        """Cast straight into a slot, bucket by bucket, while readers stream behind; return
        once every copy landed (the trainer may then change the tensors), leaving the
        commit to the background loop."""
        if self.device.type == "cuda":  # the side stream's casts follow the trainer's work on these tensors
            assert self._side is not None
            self._side.wait_stream(torch.cuda.current_stream(self.device))
        copied: concurrent.futures.Future[None] = concurrent.futures.Future()
        adapter = _Landed(self._adapter, self._specs_by_name, len(items), copied)
        self.publisher.adapter = adapter
        publish = functools.partial(self.publisher.publish, version, items)
        future = self._portal.start_task_soon(publish)
        concurrent.futures.wait([future, copied], return_when=concurrent.futures.FIRST_COMPLETED)
        if future.done() and future.exception() is not None:
            self.publisher.adapter = self._adapter
            exc = future.exception()
            raise exc if isinstance(exc, WeightpullError) else PublishError(f"publishing v{version} failed: {exc!r}")
        ticket = Ticket(version, time.perf_counter() - started, future)
        self.blocking.add(ticket.blocking_s)
        self._last = ticket
        return ticket

    def wait(self, timeout: float | None = None) -> PublishResult | None:
        """Wait until the last publish is announced (or failed: its error is logged and
        stays on its ticket). Its result, or None."""
        ticket, future = self._last, self._last and self._last.future
        if ticket is None or future is None:
            return None
        concurrent.futures.wait([future], timeout)
        error = future.exception(0) if future.done() else None
        if error is not None:
            if self._reported is not ticket:
                self._reported = ticket
                log.warning("%s: publishing v%s failed: %r", self.name, ticket.version, error)
            return None
        return future.result(0) if future.done() else None

    async def _abort(self, version: int, reason: str, shard: tuple[int, int]) -> None:
        try:
            await self.publisher.registry.abort(version, reason, shard=shard)
        except WeightpullError as exc:
            log.warning("%s: could not abort v%s: %s", self.name, version, exc)

    def close(self) -> None:
        """Finish the publish under way, then deregister the slots (versions published
        stop being readable) and stop the background loop."""
        try:
            self.wait()
            self._serving.cancel()
            self._portal.call(self.publisher.aclose)
            for owned in reversed(self._owned):
                if hasattr(owned, "aclose"):
                    self._portal.call(owned.aclose)
        finally:
            self._portal_cm.__exit__(None, None, None)

    def __enter__(self) -> SnapshotPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
