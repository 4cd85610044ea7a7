"""GPU pulls of an 8B-shaped model, against the machine's own copy limits.

    weightpull bench gpu [--repeat 5] [--bucket-sizes 64M,256M] [--json]

The model is Qwen3-8B's 399 tensor shapes in bf16 (16.4 GB), random values. Two setups:

1. `cuda_ipc`: a publisher in a process of its own publishes into a GPU slot (one per bucket
   size); this process pulls it into a GPU mirror (`Puller(device="cuda:0")`). The limit is
   one device-to-device copy of as many bytes, in this process.
2. host mirror -> GPU mirror: a `fake` publisher's host slot, pulled into a GPU mirror, which
   the puller feeds through `HostStaged` (each bucket read into a pinned host shadow, then
   copied to the GPU while the next is read). Timed whole, and its copy leg alone (every
   bucket from the pinned shadow to the GPU, as the pull issues them). The limit is one
   pinned host-to-device copy of as many bytes.

3. the apply check: what `PullSpec(check_apply=True)` adds to a vLLM replica's pause
   (each layer fingerprinted as loaded, then all of them at once), beside the apply's own
   device copies; the reference check (a copy and two fingerprints); the Triton kernel's
   rate over the set, per tensor, and under a few launch settings.

Every pulled copy is checked against fingerprints the publisher made of its own tensors
(exact on any device: `weightpull.integrations.torch_tensors.fingerprints`).
GB/s are 10^9 bytes/s, medians over the rounds. Needs a CUDA device and torch.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import anyio
import torch

from weightpull import InProcessRegistry, Manifest, Publisher, Puller, create_transport
from weightpull.integrations.processes import owns_children
from weightpull.integrations.torch_tensors import as_tensors, fingerprint_implementation, fingerprint_tensors
from weightpull.integrations.torch_tensors import fingerprints as checksums  # exact on any device
from weightpull.layout import Layout

from .child import Child
from .limits import cuda_copy_seconds, timed
from .presets import PRESETS
from .pull import to_device_seconds
from .raw import RawRead
from .util import gbps


def qwen3_8b_shapes() -> list[tuple[str, tuple[int, ...]]]:
    """Qwen3-8B's 399 weights, from the bench's one shape generator."""
    return PRESETS["8b"].shapes()


def make_tensors(shapes: list[tuple[str, tuple[int, ...]]], device: str, seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator(device=device).manual_seed(seed)
    return {
        name: torch.randn(shape, generator=generator, device=device, dtype=torch.bfloat16) for name, shape in shapes
    }


def mirror_checksums(layout: Layout, region: Any) -> dict[str, int]:
    return checksums(as_tensors(layout, region))


# -- the publisher process (cuda_ipc) ---------------------------------------------------------


async def _serve(
    conn: Any, bucket_sizes: list[int], device: str, shapes: list[tuple[str, tuple[int, ...]]], slot_device: str
) -> None:
    tensors = make_tensors(shapes, device)
    sums = checksums(tensors)
    transport = create_transport("cuda_ipc")
    publishers, manifests = [], []
    for bucket_bytes in bucket_sizes:  # one slot per bucket size; the tensors are the same
        publisher = Publisher(
            InProcessRegistry(),
            transport,
            rollout_dtype=None,
            bucket_bytes=bucket_bytes,
            device=slot_device,
            name=f"gpu-bench-{os.getpid()}",
        )
        result = await publisher.publish(1, tensors)
        publishers.append(publisher)
        manifests.append(result.manifest.to_dict())
    del tensors
    conn.send(("ready", manifests, sums))
    await anyio.to_thread.run_sync(conn.recv)  # until told to stop
    for publisher in publishers:
        await publisher.aclose()
    await transport.aclose()


def _publisher_main(conn: Any, *args: Any) -> None:
    anyio.run(_serve, conn, *args)


class PublisherProcess:
    """A cuda_ipc publisher of random bf16 tensors on `device` (the 8B-shaped set unless
    `shapes` says otherwise) in a process of its own: one version, one slot per bucket size,
    on `slot_device` (default: `device`; "cpu" for host slots)."""

    def __init__(
        self,
        bucket_sizes: list[int],
        device: str = "cuda:0",
        shapes: list[tuple[str, tuple[int, ...]]] | None = None,
        slot_device: str | None = None,
    ) -> None:
        self.child = Child(
            "the publisher process",
            _publisher_main,
            bucket_sizes,
            device,
            shapes or qwen3_8b_shapes(),
            slot_device or device,
        )

    def ready(self) -> tuple[list[Manifest], dict[str, int]]:
        manifests, sums = self.child.expect("ready")
        return [Manifest.from_dict(m) for m in manifests], sums

    def stop(self) -> None:
        self.child.stop()


# -- measuring --------------------------------------------------------------------------------


def copy_seconds(dst: torch.Tensor, src: torch.Tensor, repeat: int) -> list[float]:
    """One `copy_` of `src` into `dst`, timed with CUDA events, after one to warm up."""
    return timed(lambda: cuda_copy_seconds(dst, src), repeat)


async def _registry_with(manifest: Manifest) -> InProcessRegistry:
    """This process's registry, holding the version the publisher process announced."""
    registry = InProcessRegistry()
    await registry.begin(manifest.version, publisher=manifest.publisher, slot=manifest.slot)
    await registry.commit(manifest)
    return registry


async def _timed_pulls(puller: Puller, repeat: int) -> tuple[Any, list[float]]:
    pulled = await puller.pull()  # warm: mirror, mappings, streams
    seconds = []
    for _ in range(repeat):
        start = time.perf_counter()
        pulled = await puller.pull()
        seconds.append(time.perf_counter() - start)
    return pulled, seconds


async def _whole_reads(transport: Any, manifest: Manifest, region: Any, repeat: int) -> list[float]:
    raw = RawRead("cuda_ipc", transport)  # the driver's one read of the whole slot
    try:
        return [await raw.seconds(manifest, region) for _ in range(repeat + 1)][1:]  # the first warms up
    finally:
        raw.close()


async def bench_cuda_ipc(bucket_sizes: list[int], repeat: int, say: Callable[[str], None]) -> list[dict[str, Any]]:
    proc = PublisherProcess(bucket_sizes)
    try:
        manifests, want = await anyio.to_thread.run_sync(proc.ready)
        results = []
        for bucket_bytes, manifest in zip(bucket_sizes, manifests, strict=True):
            transport = create_transport("cuda_ipc")
            puller = Puller(await _registry_with(manifest), transport, device="cuda:0", ttl=60.0)
            pulled, seconds = await _timed_pulls(puller, repeat)
            exact = mirror_checksums(pulled.layout, pulled.region) == want
            nbytes = manifest.nbytes
            limit = copy_seconds(torch.empty_like(pulled.region.memory), pulled.region.memory, repeat)
            raw = await _whole_reads(transport, manifest, pulled.region, repeat)
            results.append(
                {
                    "setup": "cuda_ipc: GPU slot (publisher process) -> GPU mirror",
                    "bucket_bytes": bucket_bytes,
                    "buckets": len(manifest.layout.buckets),
                    "nbytes": nbytes,
                    "pull_gbps": gbps(nbytes, seconds, 1),
                    "pull_s": [round(s, 5) for s in seconds],
                    "limit": "device-to-device copy_ in one call",
                    "limit_gbps": gbps(nbytes, limit, 1),
                    "exact": exact,
                    "raw": "the driver's one read of the whole slot, no weightpull",
                    "raw_gbps": gbps(nbytes, raw, 1),
                }
            )
            say(
                f"cuda_ipc, {bucket_bytes >> 20} MiB buckets: pull {results[-1]['pull_gbps']} GB/s "
                f"(raw {results[-1]['raw_gbps']}, limit {results[-1]['limit_gbps']}), "
                f"checksums {'match' if exact else 'DIFFER'}"
            )
            await puller.aclose()
            await transport.aclose()
            torch.cuda.empty_cache()
        return results
    finally:
        await anyio.to_thread.run_sync(proc.stop)


async def bench_host_to_gpu(bucket_bytes: int, repeat: int, say: Callable[[str], None]) -> dict[str, Any]:
    tensors = make_tensors(qwen3_8b_shapes(), "cuda:0")
    want = checksums(tensors)
    registry = InProcessRegistry()
    publisher = Publisher(registry, create_transport("fake"), rollout_dtype=None, bucket_bytes=bucket_bytes)
    await publisher.publish(1, tensors)
    del tensors
    torch.cuda.empty_cache()
    puller = Puller(registry, create_transport("fake"), device="cuda:0", ttl=60.0)
    staged = puller.transport  # HostStaged, picked by the puller for a host-landing driver
    pulled, seconds = await _timed_pulls(puller, max(1, repeat // 2))
    exact = mirror_checksums(pulled.layout, pulled.region) == want
    nbytes = pulled.nbytes
    leg = [await to_device_seconds(staged, pulled) for _ in range(repeat)]
    shadow = staged._staged[pulled.region].host  # the pinned host mirror
    limit = copy_seconds(pulled.region.memory, shadow, repeat)
    result = {
        "setup": f"host mirror -> GPU mirror ({type(staged).__name__} over fake)",
        "bucket_bytes": bucket_bytes,
        "buckets": len(pulled.layout.buckets),
        "nbytes": nbytes,
        "copy_leg_gbps": gbps(nbytes, leg, 1),
        "copy_leg_s": [round(s, 4) for s in leg],
        "pull_gbps": gbps(nbytes, seconds, 1),
        "limit": "pinned host-to-device copy_ in one call",
        "limit_gbps": gbps(nbytes, limit, 1),
        "exact": exact,
    }
    say(
        f"host -> GPU mirror: copy leg {result['copy_leg_gbps']} GB/s (limit {result['limit_gbps']}), whole pull "
        f"{result['pull_gbps']} GB/s (the fake's host memcpy bounds it), checksums {'match' if exact else 'DIFFER'}"
    )
    await puller.aclose()
    await publisher.aclose()
    return result


def bench_apply_check(repeat: int, say: Callable[[str], None]) -> dict[str, Any]:
    """What the vLLM worker's check after an apply (`PullSpec(check_apply=True)`) adds to
    the pause, at Qwen3-8B's shapes on the GPU, beside the apply itself (one device copy
    per tensor, from a GPU mirror). The check as the apply runs it for layers whose
    first-load processing is the identity (every layer of an unquantized model on a GPU):
    every layer fingerprinted as loaded once the copies end, then every layer's kernel
    tensors at the apply's end, each set at once, compared on the device, one transfer. Beside it the reference check
    (what every layer had before: a copy of the loaded tensors and two fingerprints), the
    fingerprint's rate by the set kernel and by one launch per tensor, and the set
    kernel's rate under a few launch settings (`fingerprint_kernel`'s BLOCK, SPAN, WARPS)."""
    shapes = qwen3_8b_shapes()
    mirror = make_tensors(shapes, "cuda:0", seed=1)
    weights = {name: torch.empty_like(t) for name, t in mirror.items()}
    names = list(mirror)

    def wall(fn: Callable[[], Any]) -> Callable[[], float]:
        def seconds() -> float:
            torch.cuda.synchronize()
            started = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            return time.perf_counter() - started

        return seconds

    def apply() -> None:
        for n in names:
            weights[n].copy_(mirror[n])

    def apply_checked() -> bool:
        for n in names:
            weights[n].copy_(mirror[n])
        loaded = fingerprint_tensors([weights[n] for n in names])  # every layer as loaded, at once
        now = fingerprint_tensors([weights[n] for n in names])  # the kernels' tensors at the apply's end
        return not bool((now != loaded).any())  # the one transfer

    def reference() -> None:
        for t in weights.values():
            t.clone()
        checksums(weights)
        checksums(weights)

    apply_s = statistics.median(timed(wall(apply), repeat))
    checked_s = statistics.median(timed(wall(apply_checked), repeat))
    reference_s = statistics.median(timed(wall(reference), repeat))
    batch_s = statistics.median(timed(wall(lambda: fingerprint_tensors(list(weights.values()))), repeat))
    one_s = statistics.median(timed(wall(lambda: [fingerprint_tensors([t]) for t in weights.values()]), repeat))
    nbytes = sum(t.numel() * t.element_size() for t in mirror.values())
    exact = apply_checked() and checksums(weights) == checksums(mirror)
    exact = exact and fingerprint_tensors(list(weights.values())).tolist() == [
        fingerprint_tensors([t]).item() for t in weights.values()
    ]  # the set kernel and one launch per tensor agree
    weights[shapes[-1][0]].view(-1)[0] += 1  # one changed weight must show
    caught = checksums(weights) != checksums(mirror)
    check = checked_s - apply_s
    result = {
        "bytes": nbytes,
        "apply_ms": round(apply_s * 1e3, 2),
        "check_ms": round(check * 1e3, 2),
        "check_over_apply": round(check / apply_s, 2),
        "pause_over_apply": round(checked_s / apply_s, 2),
        "reference_check_ms": round(reference_s * 1e3, 2),
        "reference_over_apply": round(reference_s / apply_s, 2),
        "fingerprint_ms": round(batch_s * 1e3, 2),
        "fingerprint_gbps": round(nbytes / batch_s / 1e9, 1),
        "fingerprint_per_tensor_ms": round(one_s * 1e3, 2),
        "fingerprint_by": fingerprint_implementation(),  # "triton": one pass; "torch": several
        "kernel_settings": _kernel_settings(list(weights.values()), nbytes, repeat),
        "exact": exact and caught,
    }
    say(
        f"apply check: apply {result['apply_ms']} ms, check {result['check_ms']} ms (the layers as loaded, then "
        f"at the end, each set at once): check/apply {result['check_over_apply']}x, pause/apply {result['pause_over_apply']}x; "
        f"the reference check (a copy + 2 fingerprints) {result['reference_check_ms']} ms, "
        f"{result['reference_over_apply']}x; fingerprints of the set {result['fingerprint_ms']} ms "
        f"({result['fingerprint_gbps']} GB/s, by {result['fingerprint_by']}), one launch per tensor "
        f"{result['fingerprint_per_tensor_ms']} ms; "
        f"fingerprints {'match, and a changed weight shows' if result['exact'] else 'WRONG'}"
    )
    for k in result["kernel_settings"]:
        rate = f"{k['gbps']} GB/s" if k["gbps"] is not None else f"does not build here ({k['error']})"
        say(f"  set kernel BLOCK {k['block']}, SPAN {k['span']}, {k['warps']} warps: {rate}")
    return result


def _kernel_settings(tensors: list[torch.Tensor], nbytes: int, repeat: int) -> list[dict[str, Any]]:
    """The set kernel's rate under a few launch settings (each compiles once), the values
    checked equal to the default's; a setting that does not build here is reported as
    such, and the module's settings (and its kernels' state) are put back after each."""
    if fingerprint_implementation() != "triton":
        return []
    from weightpull.integrations import fingerprint_kernel as fk
    from weightpull.integrations import torch_tensors

    default = (fk.BLOCK, fk.SPAN, fk.WARPS)
    failed_before = (list(fk.SET_KERNEL_FAILED), list(torch_tensors._KERNEL_FAILED))
    want = fingerprint_tensors(tensors)
    out = []
    for block, spans, warps in ((1024, 16, 4), (2048, 16, 8), (4096, 8, 8), (4096, 16, 16), (8192, 8, 16)):
        setting: dict[str, Any] = {"block": block, "span": block * spans, "warps": warps}
        fk.BLOCK, fk.SPAN, fk.WARPS = block, block * spans, warps
        try:
            fingerprint_tensors(tensors)  # compiles
            failed = (fk.SET_KERNEL_FAILED, torch_tensors._KERNEL_FAILED) != failed_before
            if failed:  # it fell back to another path: not this setting's rate
                error = (fk.SET_KERNEL_FAILED + torch_tensors._KERNEL_FAILED)[-1]
                setting |= {"gbps": None, "same": True, "error": error}
            else:
                seconds = statistics.median(timed(lambda: _synced(lambda: fingerprint_tensors(tensors)), repeat))
                same = bool(torch.equal(fingerprint_tensors(tensors), want))
                setting |= {"gbps": round(nbytes / seconds / 1e9, 1), "same": same}
        finally:
            fk.BLOCK, fk.SPAN, fk.WARPS = default
            fk.SET_KERNEL_FAILED[:], torch_tensors._KERNEL_FAILED[:] = (list(f) for f in failed_before)
            torch_tensors._kernel.cache_clear()
        out.append(setting)
    return out


def _synced(fn: Callable[[], Any]) -> float:
    torch.cuda.synchronize()
    started = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - started


@owns_children
async def run(repeat: int, bucket_sizes: list[int], say: Callable[[str], None]) -> dict[str, Any]:
    shapes = qwen3_8b_shapes()
    say(
        f"{len(shapes)} tensors, {sum(2 * math.prod(s) for _, s in shapes) / 1e9:.2f} GB in bf16 "
        f"on {torch.cuda.get_device_name()} (torch {torch.__version__})"
    )
    return {
        "machine": {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cpus": os.cpu_count()},
        "tensors": len(shapes),
        "cuda_ipc": await bench_cuda_ipc(bucket_sizes, repeat, say),
        "host_to_gpu": await bench_host_to_gpu(bucket_sizes[0], repeat, say),
        "apply_check": bench_apply_check(repeat, say),
    }


def ok(result: dict[str, Any]) -> bool:
    """Every pulled copy, and the check's fingerprints, exact."""
    return (
        all(r["exact"] for r in result["cuda_ipc"])
        and result["host_to_gpu"]["exact"]
        and result["apply_check"]["exact"]
        and all(k["same"] for k in result["apply_check"]["kernel_settings"])
    )
