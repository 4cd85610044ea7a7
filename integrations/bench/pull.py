"""`weightpull bench pull`: pull bandwidth against limits measured in the same run.

A publisher publishes one version of `size` bytes; a puller pulls it `repeat` times. Each
round also times the transport's own raw read of the same bytes without weightpull (`raw`:
nixl's own reader; for `fake`, raw is a memcpy of the slot), interleaved with the pulls so
that drift hits both alike. The limit is an in-process memcpy, or, when a GPU is involved,
that machine's copy between the same two kinds of memory (`limits`).

The publisher runs in a process of its own, as it does in deployment, except for drivers
that live in one process (`fake`). Every pulled copy is checked byte for byte against a
digest of the bytes meant to be published, made apart from weightpull.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable
from typing import Any

import anyio
import attrs

from weightpull.errors import InvalidArgumentError
from weightpull.integrations.processes import owns_children
from weightpull.layout import DEFAULT_BUCKET_BYTES
from weightpull.manifest import Manifest
from weightpull.publisher import Publisher
from weightpull.puller import Pulled, Puller
from weightpull.registry import InProcessRegistry
from weightpull.tensors import HostTensor
from weightpull.transports import create_transport, transport_class

from . import limits
from .child import Child
from .raw import own_reader
from .util import IN_PROCESS, gbps, machine

TENSOR_BYTES = 16 << 20  # the synthetic model's largest tensor: four to a default bucket


@attrs.frozen
class BenchConfig:
    transport: str = "fake"
    size: int = 1 << 30
    repeat: int = 5
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    slot: str = "cpu"  # the publisher's slot: cpu, or cuda
    mirror: str = "cpu"  # cpu; cuda (the transport reads into GPU memory); staged (see HostStaged)
    options: dict[str, Any] = attrs.Factory(dict)  # keyword arguments for the transport

    def check(self) -> None:
        if self.size <= 0 or self.repeat < 1 or self.bucket_bytes <= 0:
            raise InvalidArgumentError("size, repeat and bucket size must be positive")
        if self.slot not in ("cpu", "cuda"):
            raise InvalidArgumentError(f"slot must be cpu or cuda, got {self.slot!r}")
        if self.mirror not in ("cpu", "cuda", "staged"):
            raise InvalidArgumentError(f"mirror must be cpu, cuda or staged, got {self.mirror!r}")


# -- the bytes published --------------------------------------------------------------------


def content(nbytes: int) -> bytearray:
    """Random bytes, each MiB stamped with its index, so a misplaced bucket shows."""
    block = os.urandom(min(nbytes, 1 << 20))
    data = bytearray(block * (nbytes // len(block)) + block[: nbytes % len(block)])
    for i in range(0, nbytes - 8, 1 << 20):
        data[i : i + 8] = (i >> 20).to_bytes(8, "little")
    return data


def digest(data: Any) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def _tensors(cfg: BenchConfig, data: bytearray) -> dict[str, Any]:
    view = memoryview(data)
    step = max(256, min(TENSOR_BYTES, cfg.bucket_bytes // 4) // 256 * 256)  # aligned: no padding
    spans = [(off, min(step, cfg.size - off)) for off in range(0, cfg.size, step)]
    if cfg.slot == "cpu":
        return {f"t{i}": HostTensor("uint8", (n,), view[off : off + n]) for i, (off, n) in enumerate(spans)}
    import torch

    whole = torch.frombuffer(data, dtype=torch.uint8).to(cfg.slot)
    return {f"t{i}": whole[off : off + n] for i, (off, n) in enumerate(spans)}


async def _publish(cfg: BenchConfig) -> tuple[Publisher, Manifest, str]:
    data = content(cfg.size)
    publisher = Publisher(
        InProcessRegistry(),
        create_transport(cfg.transport, **cfg.options),
        rollout_dtype=None,
        bucket_bytes=cfg.bucket_bytes,
        device=cfg.slot,
        name=f"bench-publisher-{os.getpid()}",
    )
    result = await publisher.publish(1, _tensors(cfg, data))
    assert result.manifest is not None and result.manifest.nbytes == cfg.size
    return publisher, result.manifest, digest(data)


def _serve(conn: Any, cfg: dict[str, Any]) -> None:
    anyio.run(_serve_publisher, conn, BenchConfig(**cfg))


async def _serve_publisher(conn: Any, cfg: BenchConfig) -> None:
    publisher, manifest, want = await _publish(cfg)
    conn.send(("ready", manifest.to_dict(), want))
    async with anyio.create_task_group() as tg:
        tg.start_soon(publisher.serve)  # the owner's progress, which some reads need
        await anyio.to_thread.run_sync(conn.recv)  # until told to stop
        tg.cancel_scope.cancel()
    await publisher.aclose()
    await publisher.transport.aclose()


class PublisherProcess:
    """The bench's publisher in a process of its own: one version of `cfg.size` bytes."""

    def __init__(self, cfg: BenchConfig) -> None:
        self.child = Child("the publisher process", _serve, attrs.asdict(cfg))

    def ready(self) -> tuple[Manifest, str]:
        """The version's manifest, and the digest of the bytes meant to be published."""
        manifest, want = self.child.expect("ready")
        return Manifest.from_dict(manifest), want

    def stop(self) -> None:
        self.child.stop(timeout=30)


# -- the run ------------------------------------------------------------------------------------


def _mirror_digest(pulled: Pulled, nbytes: int) -> str:
    if pulled.region.view is not None:
        return digest(pulled.region.host_view()[:nbytes])
    return digest(pulled.region.memory[:nbytes].cpu().numpy().tobytes())


async def to_device_seconds(staged: Any, pulled: Pulled) -> float:
    """HostStaged's copy leg alone: every bucket from the pinned shadow to the GPU."""
    start = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for b in pulled.layout.buckets:
            tg.start_soon(staged.to_device, pulled.region, b.offset, b.nbytes)
    return time.perf_counter() - start


@owns_children
async def run_bench(cfg: BenchConfig, say: Callable[[str], None] = lambda line: None) -> dict[str, Any]:
    cfg.check()
    transport_class(cfg.transport)  # fails early, naming the missing extra
    gpu = cfg.slot != "cpu" or cfg.mirror != "cpu"
    in_process = cfg.transport in IN_PROCESS
    if in_process and gpu:
        raise InvalidArgumentError(f"the {cfg.transport} transport holds host memory only")

    say(f"measuring the limits for {cfg.size / 2**20:.0f} MiB")
    memcpy_s = await anyio.to_thread.run_sync(limits.memcpy_seconds, cfg.size, cfg.repeat)
    limit_name, limit_s = "in-process memcpy", memcpy_s
    if gpu:
        dst = "cpu" if cfg.mirror == "cpu" else "cuda"  # staged ends on the GPU too
        limit_name, limit_s = await anyio.to_thread.run_sync(
            limits.device_copy_seconds, cfg.size, cfg.slot, dst, cfg.repeat
        )

    say(
        f"publishing {cfg.size / 2**20:.0f} MiB over {cfg.transport} "
        f"({'in this process' if in_process else 'from a publisher process'}; slot on {cfg.slot})"
    )
    publisher_proc = None
    if in_process:
        publisher, manifest, want = await _publish(cfg)
        slot_region = publisher.slots[manifest.slot].region
        assert slot_region is not None
        raw: Any = limits.Memcpy(slot_region.host_view())
        raw_name = "memcpy of the slot"
    else:
        publisher_proc = PublisherProcess(cfg)
        manifest, want = await anyio.to_thread.run_sync(publisher_proc.ready)
        raw, raw_name = None, "none offered by the driver"
    try:
        own = own_reader(cfg.transport)  # (none for an in-process driver)
        if own is not None:  # staged: the host-to-host leg alone
            raw = own(manifest.source, device="cuda" if cfg.mirror == "cuda" else "cpu", pinned=cfg.mirror == "staged")
            raw_name = f"{cfg.transport}'s own read"
        registry = InProcessRegistry()  # the manifest as a served registry would hand it over
        await registry.begin(1, publisher=manifest.publisher, slot=manifest.slot)
        await registry.commit(manifest)
        transport = create_transport(cfg.transport, **cfg.options)
        if cfg.mirror == "staged":
            from weightpull.integrations.torch_staging import HostStaged

            transport = HostStaged(transport)
        puller = Puller(
            registry,
            transport,
            device="cpu" if cfg.mirror == "cpu" else "cuda",
            staging=False if cfg.mirror == "cuda" else None,
            ttl=60.0,
        )

        pull_s: list[float] = []
        raw_s: list[float] = []
        pulled = await puller.pull()  # warm: mirror, connection, prepared transfers
        if raw:
            await anyio.to_thread.run_sync(raw.read)
        for i in range(cfg.repeat):
            if raw:
                raw_s.append(await anyio.to_thread.run_sync(raw.read))
            start = time.perf_counter()
            pulled = await puller.pull()
            pull_s.append(time.perf_counter() - start)
            say(
                f"round {i + 1}/{cfg.repeat}: pull {cfg.size / pull_s[-1] / 1e9:.2f} GB/s"
                + (f", raw {cfg.size / raw_s[-1] / 1e9:.2f} GB/s" if raw_s else "")
            )
        exact = await anyio.to_thread.run_sync(_mirror_digest, pulled, cfg.size) == want
        h2d_s = (
            [await to_device_seconds(transport, pulled) for _ in range(cfg.repeat)] if cfg.mirror == "staged" else []
        )
        await puller.aclose()
        await transport.aclose()
        if raw:
            raw.close()
    finally:
        if publisher_proc is not None:
            await anyio.to_thread.run_sync(publisher_proc.stop)
        else:
            await publisher.aclose()
            await publisher.transport.aclose()

    pull_gbps = gbps(cfg.size, pull_s)
    raw_gbps = gbps(cfg.size, raw_s) if raw_s else None
    limit_gbps = gbps(cfg.size, limit_s)
    return {
        "transport": cfg.transport,
        "size_bytes": cfg.size,
        "bucket_bytes": cfg.bucket_bytes,
        "buckets": len(manifest.layout.buckets),
        "repeat": cfg.repeat,
        "slot": cfg.slot,
        "mirror": cfg.mirror,
        "options": cfg.options,
        "publisher_process": not in_process,
        "pull_gbps": pull_gbps,
        "raw_gbps": raw_gbps,
        "raw": raw_name,
        "limit_gbps": limit_gbps,
        "limit": limit_name,
        "memcpy_gbps": gbps(cfg.size, memcpy_s),
        "to_device_gbps": gbps(cfg.size, h2d_s) if h2d_s else None,
        "ratio_to_raw": round(pull_gbps / raw_gbps, 3) if raw_gbps else None,
        "ratio_to_limit": round(pull_gbps / limit_gbps, 3),
        "pull_s": [round(s, 5) for s in pull_s],
        "raw_s": [round(s, 5) for s in raw_s],
        "byte_exact": exact,
        "machine": machine(),
    }


def summary_lines(r: dict[str, Any]) -> list[str]:
    def g(x: float | None) -> str:
        return "   -   " if x is None else f"{x:7.2f}"

    where = "a publisher process" if r["publisher_process"] else "this process"
    lines = [
        f"{r['transport']}: {r['size_bytes'] / 2**20:.0f} MiB in {r['buckets']} buckets from {where} "
        f"(slot on {r['slot']}, mirror {r['mirror']}); medians of {r['repeat']}, GB/s = 10^9 B/s",
        f"  pull   {g(r['pull_gbps'])} GB/s  weightpull: lease, every bucket, lease check",
        f"  raw    {g(r['raw_gbps'])} GB/s  {r['raw']}, the same bytes without weightpull",
        f"  limit  {g(r['limit_gbps'])} GB/s  {r['limit']}",
        *(
            [f"  to GPU {g(r['to_device_gbps'])} GB/s  HostStaged's bucket-by-bucket copy leg alone"]
            if r["to_device_gbps"]
            else []
        ),
        f"  pull/raw {r['ratio_to_raw'] if r['ratio_to_raw'] is not None else '-'}, "
        f"pull/limit {r['ratio_to_limit']}, byte-exact: {'yes' if r['byte_exact'] else 'NO'}",
    ]
    return lines
