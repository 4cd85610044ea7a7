"""What a user would pick instead: pushes, where the trainer sends and every replica waits.

- `gloo` / `nccl`: torch.distributed broadcast of buckets from the trainer (rank 0) to a
  replica (rank 1), as verl's NCCL checkpoint engine does: tensors cast to bf16 and packed
  into a bucket, the bucket broadcast, the replica copying each tensor out into its weights.
- `verl-ipc`: verl's push over CUDA IPC with ZeroMQ handles (`BucketedWeightSender` /
  `BucketedWeightReceiver`): per update the trainer allocates one GPU bucket and sends its
  IPC handle; per bucket it packs tensors, synchronizes and sends the bucket's metadata, and
  waits until the replica has copied them into its weights and answered. The replica pauses
  for the whole update. A pipe stands in for the ZeroMQ REQ/REP pair (same round trips; the
  GPU machine has no pyzmq).

Each runs two processes; the trainer's block, the replica's pause and publish-to-serving
are measured as for weightpull (update 0 warms up). Buckets are 512 MiB (verl's default),
doubled until the largest tensor fits, as verl asks its users to.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import time
from collections.abc import Callable
from typing import Any

import torch

from weightpull.integrations.processes import child_main, owns_children, parent_pid

from .flow import STEP, make_tensors, sums, sync
from .presets import PRESETS
from .util import free_port, gbps, median_ms

KINDS = {
    "gloo": "torch.distributed broadcast of buckets over gloo (two processes)",
    "nccl": "torch.distributed broadcast of buckets over NCCL (two GPUs)",
    "verl-ipc": "verl's push of buckets over CUDA IPC, handles and metadata over a pipe (ZeroMQ's stand-in)",
}


def bucket_bytes(preset: str) -> int:
    largest = max(2 * torch.Size(s).numel() for _, s in PRESETS[preset].shapes())
    size = 512 << 20
    while size < largest:
        size *= 2
    return min(size, PRESETS[preset].bf16_bytes())


def buckets(preset: str, size: int) -> list[list[tuple[str, tuple[int, ...], int]]]:
    """Tensors in order, packed into buckets of at most `size` bytes: (name, shape, offset)."""
    out: list[list[tuple[str, tuple[int, ...], int]]] = [[]]
    offset = 0
    for name, shape in PRESETS[preset].shapes():
        n = 2 * torch.Size(shape).numel()
        if offset + n > size:
            out.append([])
            offset = 0
        out[-1].append((name, shape, offset))
        offset += n
    return out


def _view(buffer: torch.Tensor, shape: tuple[int, ...], offset: int) -> torch.Tensor:
    n = 2 * torch.Size(shape).numel()
    return buffer[offset : offset + n].view(torch.bfloat16).view(shape)


def _end(plan: list[tuple[str, tuple[int, ...], int]]) -> int:
    name, shape, offset = plan[-1]
    return offset + 2 * torch.Size(shape).numel()


def _broadcast(rank: int, tensors: dict[str, torch.Tensor], plan: list, buffer: torch.Tensor, device: str) -> None:
    import torch.distributed as dist

    for bucket in plan:
        if rank == 0:
            for name, shape, offset in bucket:
                _view(buffer, shape, offset).copy_(tensors[name])
        dist.broadcast(buffer[: _end(bucket)], src=0)
        if rank == 1:
            for name, shape, offset in bucket:
                tensors[name].copy_(_view(buffer, shape, offset), non_blocking=True)
    sync(device)


def _ipc_send(tensors: dict[str, torch.Tensor], plan: list, size: int, peer: Any, device: str) -> None:
    from torch.multiprocessing.reductions import reduce_tensor

    buffer = torch.empty(size, dtype=torch.uint8, device=device)  # per update, as verl's sender does
    peer.send(reduce_tensor(buffer))
    peer.recv()
    for i, bucket in enumerate(plan):
        for name, shape, offset in bucket:
            _view(buffer, shape, offset).copy_(tensors[name], non_blocking=True)
        sync(device)
        peer.send(({name: (shape, offset) for name, shape, offset in bucket}, i == len(plan) - 1))
        peer.recv()
    del buffer
    torch.cuda.ipc_collect()
    torch.cuda.empty_cache()


def _ipc_receive(weights: dict[str, torch.Tensor], peer: Any, device: str) -> None:
    rebuild, args = peer.recv()
    buffer = rebuild(*args)
    peer.send(b"")
    last = False
    while not last:
        meta, last = peer.recv()
        for name, (shape, offset) in meta.items():
            weights[name].copy_(_view(buffer, shape, offset), non_blocking=True)
        sync(device)
        peer.send(b"")
    del buffer
    torch.cuda.ipc_collect()
    torch.cuda.empty_cache()


def _rank(rank: int, kind: str, preset: str, updates: int, port: int, peer: Any, out: Any) -> None:
    import torch.distributed as dist

    device = "cpu" if kind == "gloo" else f"cuda:{rank if kind == 'nccl' else 0}"
    if device != "cpu":
        torch.cuda.set_device(device)
    size = bucket_bytes(preset)
    plan = buckets(preset, size)
    tensors = make_tensors(preset, device, torch.float32 if rank == 0 else torch.bfloat16)
    if kind != "verl-ipc":
        dist.init_process_group(kind, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        buffer = torch.empty(size, dtype=torch.uint8, device=device)
    for update in range(updates + 1):
        if rank == 0:
            with torch.no_grad():
                torch._foreach_add_(list(tensors.values()), STEP)
            sync(device)
        if kind == "verl-ipc":  # both start together: the replica's pause begins with the update
            peer.send(b"")
            peer.recv()
        else:
            dist.barrier()
        started = time.monotonic()
        if kind == "verl-ipc":
            _ipc_send(tensors, plan, size, peer, device) if rank == 0 else _ipc_receive(tensors, peer, device)
        else:
            _broadcast(rank, tensors, plan, buffer, device)
        out.send((rank, update, started, time.monotonic()))
    out.send((rank, "sums", sums({n: t.to(torch.bfloat16) for n, t in tensors.items()}), len(plan)))
    if kind != "verl-ipc":
        dist.destroy_process_group()


def rank_main(*args: Any) -> None:
    try:
        _rank(*args)
    except BaseException as exc:
        args[-1].send((args[0], "error", f"{type(exc).__name__}: {exc}", None))
        raise


@owns_children
def run_baseline(kind: str, preset: str, updates: int, tick: Callable[[str], None]) -> dict[str, Any]:
    ctx = multiprocessing.get_context("spawn")
    a, b = ctx.Pipe()
    port = free_port()
    outs: list[Any] = []  # rank i's pipe at index i
    procs = []
    for rank, peer in ((0, a), (1, b)):  # a pipe each: two writers could interleave long messages
        out, child_out = ctx.Pipe(duplex=False)
        procs.append(
            ctx.Process(
                target=child_main,
                args=(parent_pid(), rank_main, rank, kind, preset, updates, port, peer, child_out),
                daemon=True,
            )
        )
        procs[-1].start()
        child_out.close()
        outs.append(out)
    times: dict[tuple[int, int], tuple[float, float]] = {}
    sums_: dict[int, Any] = {}
    nbuckets = 0
    try:
        while len(sums_) < 2:
            ready = multiprocessing.connection.wait([o for o in outs if o is not None], timeout=600)
            if not ready:
                raise RuntimeError(f"the {kind} baseline stalled")
            try:
                rank, what, x, y = ready[0].recv()
            except EOFError:  # that rank exited: fine after its last message
                if outs.index(ready[0]) not in sums_:
                    raise RuntimeError(f"a {kind} baseline process died") from None
                outs[outs.index(ready[0])] = None
                continue
            if what == "error":
                raise RuntimeError(f"the {kind} baseline's rank {rank} failed: {x}")
            if what == "sums":
                sums_[rank], nbuckets = x, y
                continue
            times[(rank, what)] = (x, y)
            if rank == 1:
                tick(f"{kind} update {what}")
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
    measured = range(1, updates + 1) if updates else range(1)
    block = [times[(0, u)][1] - times[(0, u)][0] for u in measured]
    pause = [times[(1, u)][1] - times[(1, u)][0] for u in measured]
    serving = [times[(1, u)][1] - times[(0, u)][0] for u in measured]
    nbytes = PRESETS[preset].bf16_bytes()
    return {
        "name": kind,
        "what": KINDS[kind],
        "bucket_bytes": bucket_bytes(preset),
        "buckets": nbuckets,
        "update_gbps": gbps(nbytes, serving),
        "publish_block_ms": median_ms(block),
        "apply_pause_ms": median_ms(pause),
        "publish_to_serving_ms": median_ms(serving),
        "byte_exact": sums_[0] == sums_[1],
    }


def available(cuda: bool) -> dict[str, str | None]:
    """Each baseline this machine can run (None), or why not."""
    gpus = torch.cuda.device_count() if cuda else 0
    return {
        "gloo": None if not cuda else "on a GPU machine the GPU baselines stand for it",
        "nccl": None if gpus >= 2 else f"needs two GPUs; this machine has {gpus}",
        "verl-ipc": None if cuda else "needs a CUDA GPU",
    }
