"""weightpull's own path over one transport: a trainer publishing, a replica pulling and applying.

The trainer (`SnapshotPublisher`, fp32 parameters cast to bf16) runs in a process of its own,
or in a thread for drivers whose peers share one process (`fake`). This process is the
replica: for each version it pulls into a mirror (while it would still be serving), then
applies the mirror to the model's weights, one copy per tensor (its pause), and serves.
The two go in lockstep over a pipe, which stands in for the registry's announcement.
The first version on each of the trainer's two slots warms up (each slot, and the mirror,
registered once) and is left out of the medians.

Streamed (`stream`), the trainer casts straight into its slot bucket by bucket and marks
each one in a registry served by this process, and the replica starts pulling as soon as
it asked for the version, reading each bucket once it is marked: the two copies overlap.

In place (`in_place`, for a driver that lends a slot where the replica's weights are:
`Transport.view`), the trainer streams as above but the replica keeps no mirror: it borrows
the slot while the trainer writes it (`Puller.borrow(whole=False)` of a streaming puller)
and applies straight from it, each tensor once its bucket is committed, one copy where a
pull and an apply make two. Its pause runs from its first tensors to the version checked
whole.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import anyio
import attrs
import torch

from weightpull.errors import NoReadyVersionError, VersionNotFoundError, VersionStateError
from weightpull.integrations.torch_tensors import as_tensors
from weightpull.manifest import Manifest
from weightpull.puller import Puller
from weightpull.records import Reservation
from weightpull.registry import InProcessRegistry, connect_registry
from weightpull.transports import create_transport, transport_class

from .child import Child
from .presets import PRESETS
from .pull import to_device_seconds  # a staged mirror's copy leg, as `bench pull` times it
from .raw import RawRead
from .util import IN_PROCESS, PinnedFake, gbps, median_ms

STEP = 1e-3  # the stand-in optimizer step: every parameter moves
SLOTS = 2  # the trainer's; the first version on each registers it, so it warms up


@attrs.frozen
class Setup:
    transport: str
    preset: str
    versions: int  # measured, after one per slot to warm up
    device: str  # the trainer's parameters and the replica's weights: cpu or cuda:0
    host_slot: bool = False  # host slots even for a driver that reads GPU memory at device speed
    stream: bool = False  # the replica reads the version while the trainer writes it
    in_place: bool = False  # the replica applies straight from the trainer's slot (no mirror)
    registry: str | None = None  # the served registry's address (a streamed flow's, set by run_flow)

    @property
    def trainer_streams(self) -> bool:
        """The trainer casts straight into its slot and marks it (a streamed or in-place flow)."""
        return self.stream or self.in_place

    @property
    def cuda(self) -> bool:
        return self.device != "cpu"

    @property
    def slot(self) -> str:
        """GPU slots for drivers that read GPU memory at device speed, else (pinned) host."""
        gpu = self.cuda and not self.host_slot and transport_class(self.transport).reads_into_gpu
        return self.device if gpu else "cpu"

    @property
    def options(self) -> dict[str, Any]:
        return {"pinned": True} if self.cuda and self.transport == "nixl" else {}


def sync(device: str) -> None:
    if device != "cpu":
        torch.cuda.synchronize(device)


def make_tensors(preset: str, device: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(0)
    return {
        n: torch.empty(s, device=device, dtype=dtype).uniform_(-0.04, 0.04, generator=gen)  # faster than randn
        for n, s in PRESETS[preset].shapes()
    }


def sums(tensors: dict[str, torch.Tensor]) -> list[int]:
    """Per-tensor sums of the bf16 bits: cheap, and any misplaced or stale tensor shows."""
    return torch.stack([t.view(torch.int16).sum(dtype=torch.int64) for t in tensors.values()]).tolist()


# -- the trainer ------------------------------------------------------------------------------


def _trainer_transport(setup: Setup) -> Any:
    if setup.transport == "fake" and setup.cuda:  # host slots page-locked, as a real driver's
        return PinnedFake()
    return create_transport(setup.transport, **setup.options)


def _train(conn: Any, setup: Setup) -> None:
    from weightpull.integrations.torch_snapshot import SnapshotPublisher, spec_of

    if setup.cuda:
        torch.cuda.set_device(setup.device)
    params = make_tensors(setup.preset, setup.device, torch.float32)
    transport = _trainer_transport(setup)
    specs = [spec_of(n, t, "bfloat16") for n, t in params.items()]
    with SnapshotPublisher(
        setup.registry or InProcessRegistry(),
        transport,
        specs,
        device=setup.device,
        slot_device=setup.slot,
        num_slots=SLOTS,
        name=f"bench-trainer-{setup.transport}",
        stream=setup.trainer_streams,
    ) as publisher:
        reserved = publisher.publisher.reservation
        conn.send(("ready", None if reserved is None else reserved.to_dict()))
        while (msg := conn.recv())[0] == "publish":
            with torch.no_grad():
                torch._foreach_add_(list(params.values()), STEP)
            sync(setup.device)
            started = time.monotonic()
            ticket = publisher.publish(msg[1], params.items())
            result = ticket.result()
            announced = time.monotonic() - started
            conn.send(("published", started, ticket.blocking_s, announced, result.manifest.to_dict()))
        # The last version, as published: cast afresh when streamed (no staging buffer then).
        published = (
            {n: p.to(torch.bfloat16) for n, p in params.items()}
            if setup.trainer_streams
            else dict(publisher.staging.items())
        )
        conn.send(("stopped", sums(published)))
    anyio.run(transport.aclose)


def _trainer_main(conn: Any, setup: dict[str, Any]) -> None:
    _train(conn, Setup(**setup))


class Trainer:
    """The trainer, in a process of its own (or a thread, for in-process drivers)."""

    def __init__(self, setup: Setup) -> None:
        self.child = Child("the trainer", _trainer_main, attrs.asdict(setup), thread=setup.transport in IN_PROCESS)
        (reserved,) = self.child.expect("ready")
        # The slots it reserved at start (a served registry carries them; the pipe, otherwise).
        self.reservation = None if reserved is None else Reservation.from_dict(reserved)

    def publish(self, version: int) -> tuple[Any, ...]:
        return self.child.ask(("publish", version), "published")

    def start_publish(self, version: int) -> None:
        self.child.conn.send(("publish", version))

    def published(self) -> tuple[Any, ...]:
        return self.child.expect("published")

    def stop(self) -> list[int] | None:
        """Stop it; the sums of the last version it published, if it was still well."""
        stopped = self.child.stop("stopped", timeout=120)
        return stopped[0] if stopped else None


# -- the replica ------------------------------------------------------------------------------


def apply(weights: dict[str, torch.Tensor], mirror: dict[str, torch.Tensor], device: str) -> None:
    """The replica's pause: one copy per tensor, from the mirror into the weights."""
    for name, w in weights.items():
        w.copy_(mirror[name], non_blocking=True)
    sync(device)


async def run_flow(setup: Setup, tick: Callable[[str], None], note: Callable[[str], None]) -> dict[str, Any]:
    """Every version published, pulled and applied; medians of the measured versions.
    `tick` marks a version done, `note` says what runs now (so a stall shows where)."""
    if not setup.trainer_streams:
        return await _run_flow(setup, InProcessRegistry(), tick, note)
    from weightpull.drivers.zmq_registry.server import RegistryServer  # a streamed flow's marks cross processes

    async with anyio.create_task_group() as tg:
        server = RegistryServer("tcp://127.0.0.1:0", insecure_dev=True)
        address = await tg.start(server.serve)
        try:
            async with connect_registry(address) as registry:
                return await _run_flow(attrs.evolve(setup, registry=address), registry, tick, note)
        finally:
            tg.cancel_scope.cancel()


async def _pull_streaming(puller: Puller, version: int) -> Any:
    """The version once the trainer has begun streaming it (polled: the trainer was only
    just asked to publish it)."""
    while True:
        try:
            return await puller.pull(version)
        except (VersionNotFoundError, VersionStateError, NoReadyVersionError):
            await anyio.sleep(2e-4)


async def _borrow_and_apply(
    puller: Puller, version: int, weights: dict[str, torch.Tensor], views: _Views
) -> tuple[float, float]:
    """Borrow `version`'s slot as the trainer writes it and apply straight from it, each
    tensor once its bucket is committed. Returns (seconds until it was lent and its first
    tensors landed, seconds from then until the apply ended and the version was checked
    whole: the replica's pause)."""
    t, lent_s = time.monotonic(), None
    async with puller.borrow(version, wait=120, whole=False) as lent:
        slot = views.of(lent.region, lent.layout)
        async for names in lent.landed():
            if lent_s is None:
                lent_s, t = time.monotonic() - t, time.monotonic()
            for name in names:
                weights[name].copy_(slot[name], non_blocking=True)
        sync(puller.device)
    return lent_s, time.monotonic() - t


class _Views:
    """Each region's typed views (a mirror's, or each trainer slot's), made once, as a
    replica keeps them: hundreds of views cost milliseconds."""

    def __init__(self) -> None:
        self.kept: dict[int, tuple[Any, str, dict[str, torch.Tensor]]] = {}

    def of(self, region: Any, layout: Any) -> dict[str, torch.Tensor]:
        kept = self.kept.get(id(region))
        if kept is None or kept[0] is not region or kept[1] != layout.signature:
            kept = self.kept[id(region)] = (region, layout.signature, as_tensors(layout, region))
        return kept[2]


async def _run_flow(
    setup: Setup, registry: Any, tick: Callable[[str], None], note: Callable[[str], None]
) -> dict[str, Any]:
    name = setup.transport
    note(f"{name}: starting the trainer")
    trainer = await anyio.to_thread.run_sync(Trainer, setup)
    transport = create_transport(setup.transport, **setup.options)
    # In place too: the replica leases the version as it streams, and borrows it the moment it is READY.
    puller = Puller(registry, transport, device=setup.device, ttl=60.0, stream=setup.trainer_streams)
    raw = RawRead(setup.transport, puller.transport, pinned=setup.cuda)
    if not setup.trainer_streams and trainer.reservation is not None:
        await registry.reserve(trainer.reservation)
    note(f"{name}: mapping the trainer's slots ahead")
    await puller.prepare(mirror=not setup.in_place)  # as a replica's update agent does at its start
    # The replica's weights exist before any update (zeros: their pages are touched now, not in v1's apply).
    weights = {n: torch.zeros(s, dtype=torch.bfloat16, device=setup.device) for n, s in PRESETS[setup.preset].shapes()}
    rows: list[dict[str, float]] = []
    views = _Views()
    try:
        for version in range(setup.versions + SLOTS):
            note(f"{name} v{version}: publishing")
            pulled = None  # in place: no copy of it here
            if setup.in_place:  # applied straight from the trainer's slot once READY
                trainer.start_publish(version)
                pull_s, apply_s = await _borrow_and_apply(puller, version, weights, views)
                serving = time.monotonic()
            else:
                if setup.stream:  # pull as the trainer writes; the registry is the trainer's too
                    trainer.start_publish(version)
                    t = time.monotonic()
                    pulled = await _pull_streaming(puller, version)
                    pull_s = time.monotonic() - t
                else:
                    started, blocking_s, announced_s, manifest_dict = await anyio.to_thread.run_sync(
                        trainer.publish, version
                    )
                    manifest = Manifest.from_dict(manifest_dict)
                    await registry.begin(version, publisher=manifest.publisher, slot=manifest.slot)
                    await registry.commit(manifest)
                    if version:  # as the trainer's own registry does before reusing its slot
                        await registry.reclaim(version - 1)
                    note(f"{name} v{version}: pulling")
                    t = time.monotonic()
                    pulled = await puller.pull()
                    pull_s = time.monotonic() - t
                mirror = views.of(pulled.region, pulled.layout)
                t = time.monotonic()
                apply(weights, mirror, setup.device)
                serving = time.monotonic()
                apply_s = serving - t
            if setup.trainer_streams:
                started, blocking_s, announced_s, manifest_dict = await anyio.to_thread.run_sync(trainer.published)
                manifest = Manifest.from_dict(manifest_dict)
            rows.append(
                {
                    "block_s": blocking_s,
                    "announce_s": announced_s,
                    "pull_s": pull_s,
                    "apply_s": apply_s,
                    "serving_s": serving - started,
                }
            )
            if pulled is not None:
                note(f"{name} v{version}: raw read")
                rows[-1]["raw_s"] = await raw.seconds(manifest, pulled.region)  # after serving: off the clock
            tick(f"{name} v{version}")
        h2d = (
            [await to_device_seconds(puller.transport, pulled) for _ in range(3)]
            if hasattr(puller.transport, "to_device")
            else []
        )
    finally:
        raw.close()
        await puller.aclose()
        await transport.aclose()
        want = await anyio.to_thread.run_sync(trainer.stop)
    exact = sums(weights) == want
    nbytes = manifest.nbytes
    measured = rows[SLOTS:]

    def col(key: str) -> list[float]:
        return [r[key] for r in measured if key in r]

    steady_ms = median_ms(col("serving_s"))
    return {
        "transport": setup.transport,
        "stream": setup.stream,
        "in_place": setup.in_place,
        "size_bytes": nbytes,
        "buckets": len(manifest.layout.buckets),
        "slot": setup.slot,
        "mirror": (
            None
            if setup.in_place
            else setup.device
            if not hasattr(puller.transport, "to_device")
            else f"{setup.device} (staged)"
        ),
        "publisher_process": setup.transport not in IN_PROCESS,
        "publish_block_ms": median_ms(col("block_s")),
        "pull_gbps": None if setup.in_place else gbps(nbytes, col("pull_s")),  # in place: nothing copied
        "lent_ms": median_ms(col("pull_s")) if setup.in_place else None,  # asked to lent (the trainer's copy in it)
        "raw_gbps": gbps(nbytes, col("raw_s")) if col("raw_s") else None,
        "raw": raw.name,
        "to_device_gbps": gbps(nbytes, h2d) if h2d else None,
        "apply_pause_ms": median_ms(col("apply_s")),
        "publish_to_serving_ms": steady_ms,
        "announce_ms": median_ms(col("announce_s")),
        # The very first version: the slots and the mirror were reserved and mapped ahead.
        "first_publish_to_serving_s": round(rows[0]["serving_s"], 3),
        "first_to_steady": round(rows[0]["serving_s"] * 1e3 / steady_ms, 2) if steady_ms > 0 else None,
        "per_version_ms": [{k.removesuffix("_s"): round(v * 1e3, 2) for k, v in r.items()} for r in rows],
        "byte_exact": exact,
    }
