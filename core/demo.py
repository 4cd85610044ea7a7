"""`weightpull demo`: the whole flow in one process, checked end to end.

A trainer publishes versions of a synthetic model (fp32, published as bf16) whose
contents derive from the version. Replicas pull on their own schedules: replica 0 takes
every version, and one of its reads is torn on purpose (it freezes past its lease while
the next write lands) and must be rejected; replica 1 reads slowly, so each pull
outlasts the lease TTL and the lease must be renewed, and it falls behind and skips
versions. Every applied mirror is compared with the bytes the trainer meant to publish,
computed apart from weightpull.
"""

from __future__ import annotations

import ctypes
import hashlib
import statistics
import sys
import time
from typing import Any, TextIO

import anyio
import attrs

from .errors import TornReadError
from .publisher import Publisher
from .puller import Pulled, Puller
from .registry import connect_registry
from .transports import create_transport

HIDDEN = 1024
LAYERS = 8
PARTS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


@attrs.frozen
class DemoConfig:
    transport: str = "fake"
    size_mib: int = 256  # bytes published per version (bf16)
    versions: int = 6
    replicas: int = 2
    tear: bool = True
    ttl: float = 2.0  # the lease TTL; the replica whose read is torn uses a quarter of it
    step_s: float = 0.4  # the trainer's time per training step
    num_slots: int = 3
    registry: str | None = None  # a served registry's address; None: $WEIGHTPULL_REGISTRY, else in-process


def _torch() -> Any:
    try:
        import torch
    except ImportError as exc:
        raise SystemExit("weightpull demo needs torch: pip install 'weightpull[torch]'") from exc
    return torch


def _host_bytes(t: Any) -> memoryview:
    """A zero-copy view of a contiguous CPU tensor's bytes (no numpy needed)."""
    return memoryview((ctypes.c_char * (t.numel() * t.element_size())).from_address(t.data_ptr())).cast("B")


class SyntheticModel:
    """fp32 parameters shaped like a small decoder, rewritten in place at each step."""

    def __init__(self, published_bytes: int) -> None:
        torch = self.torch = _torch()
        rows = max(1, published_bytes // (2 * HIDDEN * LAYERS * len(PARTS)))
        self.params: dict[str, Any] = {}
        for i in range(LAYERS):
            for part in PARTS:
                self.params[f"model.layers.{i}.{part}.weight"] = torch.empty(rows, HIDDEN)
            self.params[f"model.layers.{i}.input_layernorm.weight"] = torch.empty(HIDDEN)
        self._cols = torch.arange(HIDDEN, dtype=torch.float32) / 64

    def step(self, version: int) -> None:
        """The contents of `version`: a pure function of the version and the names."""
        for k, p in enumerate(self.params.values()):
            grid = p.view(-1, HIDDEN)
            rows = self.torch.arange(grid.shape[0], dtype=self.torch.float32).unsqueeze(1) / 8
            grid.copy_(self._cols + rows).add_(version * 0.5 + k)

    def published_digest(self) -> str:
        """The bf16 cast every replica must end up holding, made without weightpull."""
        h = hashlib.blake2b(digest_size=16)
        for p in self.params.values():
            cast = p.to(self.torch.bfloat16)  # bound: the view below does not keep it alive
            h.update(_host_bytes(cast))
        return h.hexdigest()

    @property
    def published_bytes(self) -> int:
        return sum(p.numel() * 2 for p in self.params.values())


def mirror_digest(pulled: Pulled) -> str:
    h = hashlib.blake2b(digest_size=16)
    for placement in pulled.layout.placements:
        h.update(pulled.view(placement.spec.name))
    return h.hexdigest()


@attrs.define
class ReplicaReport:
    name: str
    applied: list[int] = attrs.Factory(list)
    torn_rejected: int = 0
    tear_caught: bool | None = None  # None until the read torn on purpose has run
    renewals: int = 0
    mismatches: list[int] = attrs.Factory(list)
    pull_gbps: list[float] = attrs.Factory(list)


class Progress:
    def __init__(self, stream: TextIO) -> None:
        self.stream, self.t0 = stream, time.monotonic()

    def __call__(self, who: str, msg: str) -> None:
        print(f"[{time.monotonic() - self.t0:6.2f}s] {who:<10} {msg}", file=self.stream, flush=True)


async def run_demo(cfg: DemoConfig, stream: TextIO = sys.stderr) -> dict[str, Any]:
    if cfg.transport != "fake":
        raise SystemExit(f"the in-process demo runs over the fake transport; {cfg.transport!r} comes with its driver")
    if cfg.replicas < 2 or cfg.versions < 2:
        raise SystemExit("the demo needs at least 2 replicas and 2 versions")
    say = Progress(stream)
    model = SyntheticModel(cfg.size_mib << 20)
    registry = connect_registry(cfg.registry)
    publisher = Publisher(registry, create_transport(cfg.transport), num_slots=cfg.num_slots, name="trainer", bucket_bytes=32 << 20)
    truth: dict[int, str] = {}
    block_ms: list[float] = []
    last = cfg.versions
    nbytes = model.published_bytes
    say("trainer", f"model: {len(model.params)} tensors, {nbytes / 2**20:.0f} MiB per version (fp32 -> bf16)")

    async def trainer() -> None:
        for version in range(1, last + 1):
            await anyio.to_thread.run_sync(model.step, version)  # training, off the loop
            truth[version] = await anyio.to_thread.run_sync(model.published_digest)
            result = await publisher.publish(version, model.params)
            block_ms.append(result.blocked_s * 1e3)
            say("trainer", f"published v{version} into slot {result.slot} (blocked {result.blocked_s * 1e3:.0f} ms)")
            await anyio.sleep(cfg.step_s)

    async def replica(index: int) -> ReplicaReport:
        report = ReplicaReport(f"replica-{index}")
        slow, torn = index == 1, index == 0 and cfg.tear
        transport = create_transport(cfg.transport)
        if slow:  # each pull outlasts the TTL: the lease must be renewed to finish it
            transport.faults.bandwidth = nbytes / (1.25 * cfg.ttl)
        # The torn reader freezes for half a TTL: past its own short lease, not the others'.
        ttl = cfg.ttl / 4 if torn else cfg.ttl
        puller = Puller(registry, transport, holder=report.name, ttl=ttl)
        while not report.applied or report.applied[-1] < last:
            await registry.wait_for_version((report.applied or [0])[-1] + 1)
            armed = torn and len(report.applied) == 1 and report.tear_caught is None
            if armed:
                transport.faults.tear_reads, transport.faults.freeze = 1, cfg.ttl / 2
            try:
                pulled = await puller.pull()
            except TornReadError as exc:
                report.torn_rejected += 1
                report.tear_caught = report.tear_caught or armed
                say(report.name, f"rejected a torn read{' (torn on purpose)' if armed else ''}: {exc}")
                continue
            if armed:
                report.tear_caught = False  # the torn copy got through: the check fails
            ok = await anyio.to_thread.run_sync(mirror_digest, pulled) == truth[pulled.version]
            if not ok:
                report.mismatches.append(pulled.version)
            report.applied.append(pulled.version)
            report.renewals += pulled.renewals
            report.pull_gbps.append(pulled.nbytes / pulled.seconds / 1e9)
            say(report.name, f"applied v{pulled.version} in {pulled.seconds * 1e3:.0f} ms"
                f" ({pulled.renewals} renewals){'' if ok else ' MISMATCH'}")
            await registry.report_serving(report.name, pulled.version)
            if slow:
                await anyio.sleep(2 * cfg.step_s)  # generating, while versions go by
        await puller.aclose()
        await transport.aclose()
        return report

    reports: list[ReplicaReport] = []

    async def run_replica(i: int) -> None:
        reports.append(await replica(i))

    async with anyio.create_task_group() as tg:
        tg.start_soon(trainer)
        for i in range(cfg.replicas):
            tg.start_soon(run_replica, i)
    await publisher.aclose()
    if hasattr(registry, "aclose"):
        await registry.aclose()
    reports.sort(key=lambda r: r.name)

    speeds = [g for r in reports for g in r.pull_gbps]
    checks = {
        "bit_exact": all(not r.mismatches for r in reports),
        "torn_read_rejected": reports[0].tear_caught is True if cfg.tear else True,
        "every_replica_reached_newest": all(r.applied[-1] == last for r in reports),
        "versions_applied_increase": all(r.applied == sorted(set(r.applied)) for r in reports),
        "slow_replica_renewed_its_lease": reports[1].renewals > 0,
        "slow_replica_skipped_versions": len(reports[1].applied) < last,
    }
    summary = {
        "transport": cfg.transport,
        "size_bytes": nbytes,
        "versions_published": len(truth),
        "replicas": len(reports),
        "versions_applied": [r.applied for r in reports],
        "torn_reads_rejected": sum(r.torn_rejected for r in reports),
        "lease_renewals": [r.renewals for r in reports],
        "bit_exact": checks["bit_exact"],
        "pull_gbps": round(statistics.median(speeds), 3) if speeds else 0.0,
        "publish_block_ms": [round(ms, 1) for ms in block_ms],
        "checks": checks,
        "ok": all(checks.values()),
    }
    for r in reports:
        say(r.name, f"applied {r.applied}, renewals {r.renewals}, torn reads rejected {r.torn_rejected}")
    for name, passed in checks.items():
        say("check", f"{'ok  ' if passed else 'FAIL'} {name}")
    say("summary", f"median pull {summary['pull_gbps']:.2f} GB/s over {len(speeds)} pulls; "
        f"{'all checks passed' if summary['ok'] else 'SOME CHECKS FAILED'}")
    return summary
