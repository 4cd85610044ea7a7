"""Sharded pulls: each tensor-parallel rank of a replica reads only its slice, from the
trainer's M shards, against one rank reading the whole version from the same shards.

    weightpull bench sharded [--preset 8b] [--transport cuda_ipc] [--shards 2] [--ranks 2] [--no-stream] [--json]

M trainer shards, each a process of its own (threads for `fake`) on its own device
(cuda:i with cuda_ipc), publish one version of a Qwen3-shaped set: shard i holds FSDP2's
dim-0 chunk i of every tensor, nobody the whole. N replica ranks, each a process on its own
device, pull their slice (`SlicePuller`) at the same moment, REPEAT times: the update time
of a round is its slowest rank's. In the same run rank 0 pulls the whole version from the
same shards (`Puller`, what each TP worker does today), and times its 2-D reads three ways:
as they are (the driver's own 2-D reads), one plain read per row (the Transport default),
and as contiguous reads of the same bytes (what a publisher layout that made each rank's
share contiguous would give). Every rank's slice is then checked, bit for bit, against its
own pull of the whole version sliced by torch.

The ranks' layout is vLLM's for Qwen3 (`tensor_parallel.tp_slice`: fused qkv and gate_up
column-parallel, o_proj and down_proj row-parallel, vocab-parallel embedding and LM head
padded to 64, norms replicated), built for the bench's model; a vLLM replica derives its
own from the engine (`weightpull.integrations.vllm.slices`).

Then, streamed (`sharded_stream`): one trainer publishing the whole version while the
ranks read their slices, beside the same pull after the publish and rank 0 streaming the
whole version (sharded versions do not stream: their publishers publish them whole).
"""

from __future__ import annotations

import statistics
import time
import zlib
from collections.abc import Callable
from typing import Any

import anyio
import torch

from weightpull import InProcessRegistry, Manifest, Publisher, Puller, Sharding, create_transport
from weightpull.integrations.processes import owns_children
from weightpull.integrations.torch_tensors import as_tensors
from weightpull.sharding import chunk_rows
from weightpull.slice_puller import SlicePuller
from weightpull.slices import Param, SlicePlan
from weightpull.transport import Transport

from .child import Child
from .presets import PRESETS
from .tensor_parallel import tp_slice

BUCKET_BYTES = 256 << 20


# -- what a rank's slice must hold -----------------------------------------------------------


def expected(whole: dict[str, torch.Tensor], param: Param, device: str) -> torch.Tensor:
    """`param` built from whole tensors by torch indexing: what its slice must hold."""
    out = torch.zeros(param.shape, dtype=next(iter(whole.values())).dtype, device=device)
    for piece in param.pieces:
        src = whole[piece.source][tuple(slice(a, b) for a, b in piece.box)]
        lead = len(param.shape) - src.dim()
        index = tuple(piece.at[:lead]) + tuple(slice(a, a + e) for a, e in zip(piece.at[lead:], src.shape, strict=True))
        out[index] = src
    return out


# -- the trainer's shards ---------------------------------------------------------------------


def _rows(name: str, index: int, rows: tuple[int, ...], device: str) -> torch.Tensor:
    generator = torch.Generator(device=device).manual_seed(zlib.crc32(f"{name}/{index}".encode()))
    return torch.randn(rows, generator=generator, device=device, dtype=torch.bfloat16)


async def _shard(conn: Any, preset: str, index: int, count: int, transport: str, device: str) -> None:
    shapes = PRESETS[preset].shapes()
    tensors, starts = {}, {}
    for name, shape in shapes:  # this shard's rows only: no process holds a whole tensor
        a, b = chunk_rows(shape[0], index, count)
        tensors[name] = _rows(name, index, (b - a, *shape[1:]), device)
        starts[name] = a
    t = create_transport(transport)
    publisher = Publisher(
        InProcessRegistry(), t, rollout_dtype=None, bucket_bytes=BUCKET_BYTES, device=device, name=f"trainer{index}"
    )
    result = await publisher.publish(1, tensors, shard=Sharding(index, count, dict(shapes), starts))
    del tensors
    conn.send(("ready", result.manifest.to_dict()))
    async with anyio.create_task_group() as tg:
        tg.start_soon(t.serve)
        await anyio.to_thread.run_sync(conn.recv)  # until told to stop
        tg.cancel_scope.cancel()
    await publisher.aclose()
    await t.aclose()


def _shard_main(conn: Any, *args: Any) -> None:
    anyio.run(_shard, conn, *args)


# -- a replica's rank -------------------------------------------------------------------------


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


async def _registry(manifests: list[Manifest]) -> InProcessRegistry:
    """This rank's registry, holding the version the shards announced (one lease covers it)."""
    registry = InProcessRegistry()
    for m in manifests:
        shard = m.shards[0]
        await registry.begin(m.version, publisher=m.publisher, slot=m.slot, shard=(shard.index, shard.count))
        await registry.commit(m)
    return registry


async def _ways(t: Transport, plan: SlicePlan, puller: SlicePuller, device: str, repeat: int) -> dict[str, Any]:
    """The plan's 2-D reads timed three ways (see the module's docstring)."""
    assert puller.mirror is not None
    mirror = puller.mirror
    remotes = [puller._remote(s) for s in plan.sources]
    strided = [r for r in plan.reads if r.height > 1]
    reads_2d = [(remotes[r.shard], r.src, r.src_pitch, mirror, r.dst, r.dst_pitch, r.width, r.height) for r in strided]
    contiguous = [(remotes[r.shard], r.src, mirror, r.dst, r.nbytes) for r in strided]

    async def timed(fn: Callable[[], Any], rounds: int) -> float:
        seconds = []
        for _ in range(rounds + 1):  # the first warms up
            start = time.perf_counter()
            await fn()
            _sync(device)
            seconds.append(time.perf_counter() - start)
        return statistics.median(seconds[1:])

    return {
        "reads_2d": len(strided),
        "rows": sum(r.height for r in strided),
        "bytes": sum(r.nbytes for r in strided),
        "seconds_2d": await timed(lambda: t.read_2d_many(reads_2d), repeat),
        "seconds_per_row": await timed(lambda: Transport.read_2d_many(t, reads_2d), 1),
        "seconds_contiguous": await timed(lambda: t.read_many(contiguous), repeat),
    }


async def _rank(conn: Any, cfg: dict[str, Any]) -> None:
    rank, ranks, device = cfg["rank"], cfg["ranks"], cfg["device"]
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    manifests = [Manifest.from_dict(m) for m in cfg["manifests"]]
    registry = await _registry(manifests)
    t = create_transport(cfg["transport"])
    shapes = [(s.name, s.shape) for s in manifests[0].layout.specs]
    rank_slice = tp_slice(shapes, rank, ranks)
    puller = SlicePuller(registry, t, rank_slice, device=device, ttl=60.0, bucket_bytes=BUCKET_BYTES)
    pulled = await puller.pull()  # warm: mirror, mappings, streams
    _sync(device)
    conn.send(("ready", pulled.nbytes, len(pulled.plan.reads), pulled.plan.pieces))
    while True:
        command = await anyio.to_thread.run_sync(conn.recv)
        if command[0] == "go":
            start = time.perf_counter()
            pulled = await puller.pull()
            _sync(device)
            conn.send(("pulled", time.perf_counter() - start))
        elif command[0] == "whole":  # the whole version from the same shards, into a mirror of its own
            async with Puller(registry, t, device=device, ttl=60.0) as whole:
                seconds = []
                for _ in range(command[1] + 1):
                    start = time.perf_counter()
                    await whole.pull()
                    _sync(device)
                    seconds.append(time.perf_counter() - start)
            conn.send(("whole", statistics.median(seconds[1:]) if command[1] else None))
        elif command[0] == "ways":
            ways = await _ways(t, pulled.plan, puller, device, command[1])
            conn.send(("ways", ways))
        elif command[0] == "check":  # a fresh slice pull against the whole version sliced by torch
            pulled = await puller.pull()
            async with Puller(registry, t, device=device, ttl=60.0) as whole:
                full = await whole.pull()
                tensors = as_tensors(full.layout, full.region)
                mine = as_tensors(pulled.plan.mirror, pulled.region)
                bad = [p.name for p in rank_slice.params if not torch.equal(mine[p.name], expected(tensors, p, device))]
            conn.send(("checked", bad))
        else:
            break
    await puller.aclose()
    await t.aclose()


def _rank_main(conn: Any, cfg: dict[str, Any]) -> None:
    anyio.run(_rank, conn, cfg)


# -- the run ----------------------------------------------------------------------------------


@owns_children
def run(
    preset: str,
    transport: str,
    shards: int,
    ranks: int,
    repeat: int,
    say: Callable[[str], None],
    stream: bool = True,
) -> dict[str, Any]:
    """The sharded figures (see the module's docstring), then, with `stream`, the streamed
    ones (`sharded_stream`): a trainer publishing whole, its copy and the ranks' reads
    overlapping, beside the same after the publish and one rank streaming the whole."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
    thread = transport == "fake"  # its peers share one process
    gpus = torch.cuda.device_count() if transport == "cuda_ipc" else 0
    if transport == "cuda_ipc" and not gpus:
        raise RuntimeError("bench sharded over cuda_ipc needs a CUDA device, and torch sees none here")

    def device(i: int) -> str:
        return f"cuda:{i % gpus}" if gpus else "cpu"

    children: list[Child] = []
    try:
        say(f"{shards} trainer shard(s) publish the {preset} preset over {transport}")
        trainers = [
            Child(f"trainer shard {i}", _shard_main, preset, i, shards, transport, device(i), thread=thread)
            for i in range(shards)
        ]
        children += trainers
        manifests = [t.expect("ready", 900)[0] for t in trainers]
        whole_bytes = sum(s.nbytes for s in Manifest.from_dict(manifests[0]).layout.specs)  # tensors, no padding
        say(f"{ranks} rank(s) pull their slices")
        cfgs = [
            {"rank": r, "ranks": ranks, "device": device(r), "transport": transport, "manifests": manifests}
            for r in range(ranks)
        ]
        rank_children = [Child(f"rank {r}", _rank_main, cfg, thread=thread) for r, cfg in enumerate(cfgs)]
        children += rank_children
        ready = [c.expect("ready", 900) for c in rank_children]
        rounds: list[list[float]] = []
        for _ in range(repeat):
            for c in rank_children:
                c.conn.send(("go",))
            rounds.append([c.expect("pulled")[0] for c in rank_children])
        say("rank 0 pulls the whole version from the same shards")
        whole_seconds = rank_children[0].ask(("whole", repeat), "whole")[0]
        say("rank 0 times its 2-D reads three ways")
        ways = rank_children[0].ask(("ways", repeat), "ways")[0]
        say("every rank's slice checked against the whole version")
        bad = [c.ask(("check",), "checked")[0] for c in rank_children]
    finally:
        for c in children:
            try:
                c.stop()
            except Exception:  # noqa: BLE001 - it may have died; the error above says why
                pass
    streamed = None
    if stream:  # the shards' processes are gone: their memory is free again
        from . import sharded_stream

        streamed = sharded_stream.run(preset, transport, ranks, repeat, device, say)
    update = statistics.median(max(r) for r in rounds)
    per_rank = [
        {
            "rank": r,
            "device": cfgs[r]["device"],
            "bytes": ready[r][0],
            "share": round(ready[r][0] / whole_bytes, 4),
            "reads": ready[r][1],
            "rows_as_plain_reads": ready[r][2],
            "seconds": round(statistics.median(s[r] for s in rounds), 4),
        }
        for r in range(ranks)
    ]
    return {
        "preset": preset,
        "transport": transport,
        "trainer_shards": shards,
        "ranks": ranks,
        "whole_bytes": whole_bytes,
        "per_rank": per_rank,
        "update_seconds": round(update, 4),
        "whole_seconds": round(whole_seconds, 4),
        "ratio": round(update / whole_seconds, 3),
        "two_d": {k: round(v, 4) if isinstance(v, float) else v for k, v in ways.items()},
        "mismatched": {r: b for r, b in enumerate(bad) if b},
        "bit_exact": not any(bad) and (streamed is None or streamed["bit_exact"]),
        "streamed": streamed,
    }


def table(r: dict[str, Any]) -> list[str]:
    gb = 1e9
    lines = [
        f"{r['preset']} over {r['transport']}: {r['trainer_shards']} trainer shard(s) -> {r['ranks']} rank(s); "
        f"the whole version is {r['whole_bytes'] / gb:.2f} GB",
        "rank  device   bytes read        share  reads  rows  seconds",
    ]
    for p in r["per_rank"]:
        lines.append(
            f"{p['rank']:>4}  {p['device']:<7}  {p['bytes'] / gb:8.3f} GB  {p['share']:>10.3f}  "
            f"{p['reads']:>5}  {p['rows_as_plain_reads']:>6}  {p['seconds']:.4f}"
        )
    lines.append(
        f"update (slowest rank) {r['update_seconds']:.4f} s; one rank reading the whole version "
        f"{r['whole_seconds']:.4f} s; ratio {r['ratio']:.3f}"
    )
    w = r["two_d"]
    lines.append(
        f"rank 0's {w['reads_2d']} 2-D reads ({w['rows']} rows, {w['bytes'] / gb:.3f} GB): 2-D {w['seconds_2d']:.4f} s, "
        f"one read per row {w['seconds_per_row']:.4f} s, contiguous {w['seconds_contiguous']:.4f} s"
    )
    st = r.get("streamed")
    if st:
        held, gb_whole = st["publish_to_held_s"], r["whole_bytes"] / gb
        lines += [
            f"streamed ({r['ranks']} ranks, a trainer publishing the {gb_whole:.2f} GB whole; from its start until "
            "the last rank held its copy, medians):",
            f"  sliced, read while the trainer copies  {held['sliced_streamed']:.4f} s",
            f"  sliced, read after the publish         {held['sliced_after']:.4f} s",
            f"  whole (rank 0), read while it copies   {held['whole_streamed']:.4f} s",
            f"  ratio streamed/whole {st['streamed_vs_whole']:.3f}; streamed/after {st['streamed_vs_after']:.3f}",
        ]
    mismatched = {**r["mismatched"], **({"streamed": st["mismatched"]} if st and st["mismatched"] else {})}
    lines.append("every slice bit-exact" if r["bit_exact"] else f"MISMATCHED: {mismatched}")
    return lines
