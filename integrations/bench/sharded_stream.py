"""`bench sharded`'s streamed part: a TP replica's ranks pull their slices while the trainer
still copies the version into its slot, against the same pull once the publish ended, and
against one rank streaming the whole version.

A trainer (one process; a thread for `fake`) holds the whole model on its device and
publishes each version with `Publisher(stream=True)` into slots reserved ahead, marking
each bucket in a served registry (loopback, in a thread of this process) as it lands.
Each round publishes a new version, three ways in turn:

- **sliced, streamed**: every rank's `SlicePuller(stream=True)` asks for the version
  before the trainer starts, and reads each of its reads once the buckets it lies in are
  marked: the trainer's copy and the ranks' reads overlap;
- **sliced, after the publish**: the trainer publishes, then the ranks pull (what a
  replica that reads only READY versions does);
- **whole, streamed**: rank 0 streams the whole version (`Puller(stream=True)`), what
  each TP worker does without slices.

Each round's figure is from the trainer's start until the last rank held its copy (one
machine: `time.monotonic` is one clock across its processes). The first rounds of each
way warm up (the slots, the mirrors, the connections), one per slot; the rest are
medians. Then every rank's slice of one more streamed version is checked, bit for bit,
against its own pull of that version whole, sliced by torch, and that whole pull against
the trainer's per-tensor sums.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable
from typing import Any

import anyio
import torch

from weightpull import Publisher, Puller, create_transport
from weightpull.errors import NoReadyVersionError, VersionNotFoundError, VersionStateError
from weightpull.integrations.torch_tensors import as_tensors
from weightpull.layout import TensorSpec
from weightpull.registry import connect_registry
from weightpull.slice_puller import SlicePuller

from .child import Child
from .flow import sums
from .presets import PRESETS
from .sharded import BUCKET_BYTES, _rows, _sync, expected
from .tensor_parallel import tp_slice

WAYS = ("sliced_streamed", "sliced_after", "whole_streamed")
WARM = 2  # rounds of each way left out of the medians: one per trainer slot


# -- the registry and the trainer -------------------------------------------------------------


def _registry_main(conn: Any) -> None:
    """A registry served on loopback (unauthenticated: every party is this bench's), until told to stop."""
    from weightpull.drivers.zmq_registry.server import RegistryServer

    async def serve() -> None:
        async with anyio.create_task_group() as tg:
            address = await tg.start(RegistryServer("tcp://127.0.0.1:0", insecure_dev=True).serve)
            conn.send(("ready", address))
            await anyio.to_thread.run_sync(conn.recv)
            tg.cancel_scope.cancel()

    anyio.run(serve)


async def _trainer(conn: Any, preset: str, transport: str, device: str, address: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    shapes = PRESETS[preset].shapes()
    tensors = {name: _rows(name, 0, shape, device) for name, shape in shapes}  # the whole model, seeded
    t = create_transport(transport)
    async with connect_registry(address) as registry:
        publisher = Publisher(
            registry, t, rollout_dtype=None, bucket_bytes=BUCKET_BYTES, device=device, name="trainer", stream=True
        )
        await publisher.reserve([TensorSpec(n, "bfloat16", s) for n, s in shapes])  # slots made ahead
        conn.send(("ready", sums(tensors)))
        async with anyio.create_task_group() as tg:
            tg.start_soon(t.serve)  # a driver whose reads need the owner's progress gets it
            while (message := await anyio.to_thread.run_sync(conn.recv))[0] == "publish":
                started = time.monotonic()
                result = await publisher.publish(message[1], tensors)
                _sync(device)
                conn.send(("published", started, time.monotonic(), result.manifest is not None))
            tg.cancel_scope.cancel()
        await publisher.aclose()
    await t.aclose()


def _trainer_main(conn: Any, *args: Any) -> None:
    anyio.run(_trainer, conn, *args)


# -- a rank -----------------------------------------------------------------------------------


async def _when_begun(pull: Callable[[int], Any], version: int) -> Any:
    """`pull(version)` once the version exists (asked before the trainer began it)."""
    while True:
        try:
            return await pull(version)
        except (VersionNotFoundError, VersionStateError, NoReadyVersionError):
            await anyio.sleep(2e-4)


async def _rank(conn: Any, cfg: dict[str, Any]) -> None:
    rank, ranks, device = cfg["rank"], cfg["ranks"], cfg["device"]
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    t = create_transport(cfg["transport"])
    shapes = PRESETS[cfg["preset"]].shapes()
    rank_slice = tp_slice(shapes, rank, ranks)
    async with connect_registry(cfg["registry"]) as registry:
        sliced = SlicePuller(registry, t, rank_slice, device=device, ttl=60.0, bucket_bytes=BUCKET_BYTES, stream=True)
        whole = Puller(registry, t, device=device, ttl=60.0, stream=True) if rank == 0 else None
        conn.send(("ready",))
        while (message := await anyio.to_thread.run_sync(conn.recv))[0] != "stop":
            kind, version = message
            if kind == "check":  # its slice of `version` against its own whole pull of it, sliced by torch
                conn.send(("checked", *await _check(registry, t, sliced, whole, rank_slice, version, device)))
                continue
            puller = whole if kind == "whole_streamed" else sliced
            assert puller is not None
            if kind == "sliced_after":  # READY by now
                await puller.pull(version)
            else:
                await _when_begun(puller.pull, version)
            _sync(device)
            conn.send(("pulled", time.monotonic()))
        await sliced.aclose()
        if whole is not None:
            await whole.aclose()
    await t.aclose()


async def _check(
    registry: Any, t: Any, sliced: SlicePuller, whole: Puller | None, rank_slice: Any, version: int, device: str
) -> tuple[list[str], list[int]]:
    """The parameters of this rank's slice of `version` unlike its whole pull of the same
    version sliced by torch, and that whole pull's per-tensor sums. Rank 0 pulls it into
    the mirror of its streamed whole pulls; the others into one made for it."""
    pulled = await sliced.pull(version)
    async with contextlib.AsyncExitStack() as stack:
        if whole is None:
            whole = await stack.enter_async_context(Puller(registry, t, device=device, ttl=60.0))
        full = await whole.pull(version)
        tensors = as_tensors(full.layout, full.region)
        mine = as_tensors(pulled.plan.mirror, pulled.region)
        bad = [p.name for p in rank_slice.params if not torch.equal(mine[p.name], expected(tensors, p, device))]
        return bad, sums(tensors)


def _rank_main(conn: Any, cfg: dict[str, Any]) -> None:
    anyio.run(_rank, conn, cfg)


# -- the run ----------------------------------------------------------------------------------


def run(
    preset: str, transport: str, ranks: int, repeat: int, device: Callable[[int], str], say: Callable[[str], None]
) -> dict[str, Any]:
    """The three ways timed in turn, `repeat` rounds each after `WARM` (see the module's
    docstring); every slice checked. The caller owns the children (`owns_children`)."""
    thread = transport == "fake"  # its peers share one process
    children: list[Child] = []
    try:
        registry = Child("the registry", _registry_main, thread=True)
        children.append(registry)
        (address,) = registry.expect("ready", 120)
        say(f"streamed: a trainer publishes the {preset} preset whole, streaming, over {transport}")
        trainer = Child("the streaming trainer", _trainer_main, preset, transport, device(0), address, thread=thread)
        children.append(trainer)
        (want,) = trainer.expect("ready", 900)
        cfgs = [
            {
                "rank": r,
                "ranks": ranks,
                "device": device(r),
                "transport": transport,
                "preset": preset,
                "registry": address,
            }
            for r in range(ranks)
        ]
        rank_children = [Child(f"streaming rank {r}", _rank_main, cfg, thread=thread) for r, cfg in enumerate(cfgs)]
        children += rank_children
        for c in rank_children:
            c.expect("ready", 900)
        seconds: dict[str, list[float]] = {way: [] for way in WAYS}
        version = 0
        for round_ in range(WARM + repeat):
            for way in WAYS:
                version += 1
                pulling = rank_children[:1] if way == "whole_streamed" else rank_children
                if way != "sliced_after":  # asked before the trainer begins
                    for c in pulling:
                        c.conn.send((way, version))
                started, _, ok = trainer.ask(("publish", version), "published")
                if not ok:
                    raise RuntimeError(f"the trainer could not publish v{version}")
                if way == "sliced_after":
                    for c in pulling:
                        c.conn.send((way, version))
                ended = max(c.expect("pulled", 600)[0] for c in pulling)
                if round_ >= WARM:
                    seconds[way].append(ended - started)
        say("streamed: every rank's slice checked against its whole pull")
        version += 1
        for c in rank_children:
            c.conn.send(("sliced_streamed", version))
        trainer.ask(("publish", version), "published")
        for c in rank_children:
            c.expect("pulled", 600)
        checks = [c.ask(("check", version), "checked") for c in rank_children]
    finally:
        for c in reversed(children):
            try:
                c.stop()
            except Exception:  # noqa: BLE001 - it may have died; the error above says why
                pass
    medians = {way: round(statistics.median(s), 4) for way, s in seconds.items()}
    # each rank's parameters unlike its whole pull's, and that whole pull if unlike the trainer's tensors
    bad = {r: b + (["(the whole version)"] if got != want else []) for r, (b, got) in enumerate(checks)}
    bad = {r: b for r, b in bad.items() if b}
    return {
        "publish_to_held_s": medians,
        "rounds": {way: [round(x, 4) for x in s] for way, s in seconds.items()},
        "streamed_vs_after": round(medians["sliced_streamed"] / medians["sliced_after"], 3),
        "streamed_vs_whole": round(medians["sliced_streamed"] / medians["whole_streamed"], 3),
        "mismatched": bad,
        "bit_exact": not bad,
    }
