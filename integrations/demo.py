"""`weightpull demo`: the whole flow, checked end to end.

A trainer publishes versions of a synthetic model (fp32, published as bf16) whose
contents derive from the version. Replicas pull on their own schedules: replica 0 takes
every version, and its first read of the last one is torn on purpose (it freezes past its
lease while the bytes after the freeze change) and must be rejected; replica 1 reads
slowly, so each pull outlasts the lease TTL and the lease must be renewed, and after its
first version it updates only once two versions behind, skipping versions. The trainer checks every mirror a replica applied against the
digest it made of the bytes it meant to publish, apart from weightpull.

Over `fake` everything runs in one process. Over any other transport (`nixl`, the
default where it loads) each replica is a process of its own (`weightpull demo --replica
SPEC`, started by the trainer), reading the trainer's slots one-sidedly and finding
versions through a registry the trainer serves on loopback (development mode: no keys,
every client an admin). Both run `replica_loop`.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import signal
import statistics
import sys
import time
from typing import TYPE_CHECKING, Any, TextIO

import anyio
import anyio.abc
import attrs
from anyio.streams.buffered import BufferedByteReceiveStream

from weightpull.errors import DriverUnavailableError, InvalidArgumentError, TornReadError, WeightpullError
from weightpull.integrations.processes import Children, die_with_parent
from weightpull.publisher import Publisher
from weightpull.puller import Pulled, Puller
from weightpull.registry import REGISTRY_ENV, InProcessRegistry, Registry, connect_registry
from weightpull.transport import Transport
from weightpull.transports import create_transport, transport_class

if TYPE_CHECKING:
    from weightpull.drivers.faulty import FaultyTransport

IN_PROCESS_DRIVERS = frozenset({"fake"})  # drivers whose peers share one process: replicas stay in it
TRAINER = "trainer"  # the trainer's publisher name: the line of versions every replica follows

HIDDEN = 1024
LAYERS = 8
PARTS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
TORN, SLOW = 0, 1  # the replica with a read torn on purpose, and the slow one


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


def default_transport() -> str:
    """nixl where it loads (replicas in processes of their own), else fake."""
    try:
        transport_class("nixl")
    except WeightpullError:
        return "fake"
    return "nixl"


class DemoError(WeightpullError):
    """The demo could not run to its checks (a replica process died, ...)."""


def _torch() -> Any:
    try:
        import torch
    except ImportError as exc:
        raise DriverUnavailableError(f"weightpull demo needs torch: pip install 'weightpull[torch]' ({exc})") from None
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
    index: int
    pid: int = attrs.Factory(os.getpid)
    applied: list[int] = attrs.Factory(list)
    digests: list[str] = attrs.Factory(list)  # of each applied mirror; the trainer checks them
    torn_rejected: int = 0
    tear_caught: bool | None = None  # None until the read torn on purpose has run
    renewals: int = 0
    pull_gbps: list[float] = attrs.Factory(list)

    @property
    def name(self) -> str:
        return f"replica-{self.index}"


class Progress:
    def __init__(self, stream: TextIO, t0: float | None = None) -> None:
        # The monotonic clock is the host's, so replica processes share the trainer's t0.
        self.stream, self.t0 = stream, time.monotonic() if t0 is None else t0

    def __call__(self, who: str, msg: str) -> None:
        # One write per line. print() writes the text and its newline apart on an unbuffered
        # stream (PYTHONUNBUFFERED, as on CI), and the trainer's and replicas' lines, sharing
        # one pipe, would then interleave mid-line; a write under PIPE_BUF is atomic.
        self.stream.write(f"[{time.monotonic() - self.t0:6.2f}s] {who:<10} {msg}\n")
        self.stream.flush()


# -- a replica, in the trainer's process or in its own -------------------------------------


async def replica_loop(
    cfg: DemoConfig, index: int, registry: Registry, transport: FaultyTransport, say: Progress
) -> ReplicaReport:
    """Pull until the last version is applied, through the fault knobs that make replica
    SLOW slow and tear one read of replica TORN."""
    report = ReplicaReport(index)
    slow, torn = index == SLOW, index == TORN and cfg.tear
    faults, last = transport.faults, cfg.versions
    # The torn reader freezes for half a TTL: past its own short lease, not the others'.
    # Each replica follows the trainer's line of versions by name (docs/guides/registry-service.md#threat-model).
    puller = Puller(registry, transport, holder=report.name, ttl=cfg.ttl / 4 if torn else cfg.ttl, publisher=TRAINER)
    try:
        while not report.applied or report.applied[-1] < last:
            # After its first version, the slow replica updates only once two versions
            # behind (an agent's min_version_lag=2): it skips versions at any trainer pace.
            lag = 2 if slow and report.applied else 1
            newest = await registry.wait_for_version(min((report.applied or [0])[-1] + lag, last), publisher=TRAINER)
            if slow:  # each pull outlasts the TTL: the lease must be renewed to finish it
                faults.bandwidth = newest.nbytes / (1.25 * cfg.ttl)
            # Torn at the last version, which stays newest: the retry gets it, so replica 0
            # still takes every version while the trainer keeps publishing in another process.
            armed = torn and report.tear_caught is None and newest.version == last
            if armed:
                faults.tear_reads, faults.freeze = 1, cfg.ttl / 2
            try:
                pulled = await puller.pull()
            except TornReadError as exc:
                report.torn_rejected += 1
                if armed:
                    report.tear_caught = True
                say(report.name, f"rejected a torn read{' (torn on purpose)' if armed else ''}: {exc}")
                continue
            if armed:
                report.tear_caught = False  # the torn copy got through: the check fails
            digest = await anyio.to_thread.run_sync(mirror_digest, pulled)
            report.applied.append(pulled.version)
            report.digests.append(digest)
            report.renewals += pulled.renewals
            report.pull_gbps.append(pulled.nbytes / pulled.seconds / 1e9)
            say(
                report.name,
                f"applied v{pulled.version} in {pulled.seconds * 1e3:.0f} ms"
                f" ({pulled.renewals} renewals), digest {digest[:8]}",
            )
            await registry.report_serving(report.name, pulled.version)
    finally:
        with anyio.CancelScope(shield=True):
            await puller.aclose()
    return report


def _warm(transport: Transport) -> None:
    """Run a driver's one-time setup (a NIXL agent: ~0.4 s, blocking) now."""
    transport.deregister(transport.allocate(1))


def _faulty(name: str) -> FaultyTransport:
    from weightpull.drivers.faulty import FaultyTransport

    return FaultyTransport(create_transport(name))


async def _in_process(cfg: DemoConfig, index: int, registry: Registry, say: Progress) -> ReplicaReport:
    async with _faulty(cfg.transport) as transport:
        return await replica_loop(cfg, index, registry, transport, say)


async def _process(
    cfg: DemoConfig, index: int, env: dict[str, str], say: Progress, *, task_status: anyio.abc.TaskStatus[None]
) -> ReplicaReport:
    """Run replica `index` as `weightpull demo --replica SPEC`; started once it is ready.
    Its stdin is its lifeline: closed (by us, or by our death), the replica stops."""
    spec = json.dumps({"index": index, "t0": say.t0, "config": attrs.asdict(cfg), "parent": os.getpid()})
    command = [sys.executable, "-m", "weightpull", "demo", "--replica", spec]
    # A session of its own, so Ctrl-C reaches the trainer alone, which stops the replicas.
    async with await anyio.open_process(command, stderr=None, env=env, start_new_session=True) as proc:
        assert proc.stdout is not None
        lines = BufferedByteReceiveStream(proc.stdout)

        async def line() -> str:
            try:
                return (await lines.receive_until(b"\n", 1 << 20)).decode()
            except (anyio.EndOfStream, anyio.IncompleteRead):
                raise DemoError(f"replica-{index} (pid {proc.pid}) {_ended(await proc.wait())}") from None

        if (ready := await line()) != "ready":
            raise DemoError(f"replica-{index} said {ready!r} instead of ready")
        task_status.started()
        report = ReplicaReport(**json.loads(await line()))
        if await proc.wait():  # it exits by itself once it reported; then its stdin closes
            raise DemoError(f"replica-{index} (pid {proc.pid}) {_ended(proc.returncode)} after its report")
    return report


def _ended(code: int) -> str:
    return f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"


def replica_main(spec: str) -> int:
    """`weightpull demo --replica SPEC`: one replica process, started by the trainer."""
    s = json.loads(spec)
    die_with_parent(s.get("parent"))  # even a trainer killed outright takes us with it
    out = os.fdopen(os.dup(1), "w", buffering=1)  # our lines to the trainer: ready, the report
    os.dup2(2, 1)  # what libraries print goes to stderr, never into those lines
    anyio.run(_replica_process, DemoConfig(**s["config"]), s["index"], s["t0"], out)
    return 0


async def _replica_process(cfg: DemoConfig, index: int, t0: float, out: TextIO) -> None:
    say = Progress(sys.stderr, t0)
    registry = connect_registry(cfg.registry)
    try:
        async with _faulty(cfg.transport) as transport, anyio.create_task_group() as tg:

            async def lifeline() -> None:
                await anyio.wait_readable(sys.stdin.fileno())  # the trainer never writes: EOF
                # The trainer died or gave up on us: its registry and slots are gone, so
                # nothing is left to release (a lease on another registry lapses by TTL).
                os._exit(1)

            tg.start_soon(lifeline)
            _warm(transport)  # not inside the first lease
            await registry.newest()  # the registry answers: from here nothing published is missed
            say(f"replica-{index}", f"up in process {os.getpid()}, pulling over {cfg.transport}")
            print("ready", file=out)
            report = await replica_loop(cfg, index, registry, transport, say)
            print(json.dumps(attrs.asdict(report)), file=out)
            tg.cancel_scope.cancel()
    finally:
        with anyio.CancelScope(shield=True):
            await registry.aclose()  # type: ignore[attr-defined]


# -- the trainer ------------------------------------------------------------------------------


def _registry(cfg: DemoConfig, in_process: bool) -> tuple[Registry, Any, dict[str, str]]:
    """(the trainer's registry, a server to run for replica processes or None, their
    environment). Replica processes given no registry's address reach one served in the
    trainer's process in development mode (`--insecure-dev`): on loopback, every process
    on this host an admin, as the trainer and its replicas are here."""
    address = cfg.registry or os.environ.get(REGISTRY_ENV) or None
    if in_process or address:
        return connect_registry(address), None, dict(os.environ)
    from weightpull.drivers.zmq_registry.keys import KEY_ENV, SERVER_KEY_ENV
    from weightpull.drivers.zmq_registry.server import RegistryServer
    from weightpull.drivers.zmq_registry.wire import SECRET_ENV

    server = RegistryServer("tcp://127.0.0.1:0", insecure_dev=True, registry=InProcessRegistry())
    # The replicas speak plainly, as this server does: no key or secret of this environment.
    env = {k: v for k, v in os.environ.items() if k not in (KEY_ENV, SERVER_KEY_ENV, SECRET_ENV)}
    return server.registry, server, env


async def run_demo(cfg: DemoConfig, stream: TextIO = sys.stderr) -> dict[str, Any]:
    if cfg.replicas < 2 or cfg.versions < 2 or cfg.size_mib < 1 or not cfg.ttl > 0:
        raise InvalidArgumentError(
            "the demo needs at least 2 replicas, 2 versions, 1 MiB per version and a "
            f"positive TTL; got {cfg.replicas}, {cfg.versions}, {cfg.size_mib} and {cfg.ttl}"
        )
    say = Progress(stream)
    model = SyntheticModel(cfg.size_mib << 20)
    nbytes = model.published_bytes
    in_process = cfg.transport in IN_PROCESS_DRIVERS
    registry, server, env = _registry(cfg, in_process)
    publisher = Publisher(
        registry, create_transport(cfg.transport), num_slots=cfg.num_slots, name=TRAINER, bucket_bytes=32 << 20
    )
    truth: dict[int, str] = {}
    block_ms: list[float] = []
    reports: list[ReplicaReport] = []
    say("trainer", f"model: {len(model.params)} tensors, {nbytes / 2**20:.0f} MiB per version (fp32 -> bf16)")

    async def trainer() -> None:
        for version in range(1, cfg.versions + 1):
            await anyio.to_thread.run_sync(model.step, version)  # training, off the loop
            truth[version] = await anyio.to_thread.run_sync(model.published_digest)
            result = await publisher.publish(version, model.params)
            block_ms.append(result.blocked_s * 1e3)
            say(
                "trainer",
                f"published v{version} into slot {result.slot} (blocked {result.blocked_s * 1e3:.0f} ms),"
                f" digest {truth[version][:8]}",
            )
            await anyio.sleep(cfg.step_s)

    async def replica(index: int, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        if in_process:
            task_status.started()
            reports.append(await _in_process(cfg, index, registry, say))
        else:
            reports.append(await _process(replica_cfg, index, env, say, task_status=task_status))

    try:
        # Every process started here is stopped on the way out, also on SIGINT or SIGTERM.
        with Children():
            async with anyio.create_task_group() as tg:
                address = await tg.start(server.serve) if server else cfg.registry or os.environ.get(REGISTRY_ENV)
                replica_cfg = attrs.evolve(cfg, registry=address)
                tg.start_soon(publisher.serve)  # the replicas' reads over nixl need the owner's progress
                if not in_process:
                    say(
                        "trainer",
                        f"process {os.getpid()}, registry on {address}; starting {cfg.replicas} replica processes",
                    )
                    _warm(publisher.transport)  # while they start, not inside the first publish
                async with anyio.create_task_group() as work:
                    async with anyio.create_task_group() as starting:  # all wait for v1 before it is published
                        for i in range(cfg.replicas):
                            starting.start_soon(work.start, replica, i)
                    work.start_soon(trainer)
                tg.cancel_scope.cancel()  # the registry server and publisher.serve: no reader is left
    except* DemoError as group:  # the first, not a group: what failed is one replica
        error: BaseException = group
        while isinstance(error, BaseExceptionGroup):
            error = error.exceptions[0]
        raise error from None
    finally:
        with anyio.CancelScope(shield=True):
            await publisher.aclose()
            await publisher.transport.aclose()
            if hasattr(registry, "aclose"):
                await registry.aclose()
    return summarize(cfg, reports, truth, block_ms, nbytes, say)


def summarize(
    cfg: DemoConfig,
    reports: list[ReplicaReport],
    truth: dict[int, str],
    block_ms: list[float],
    nbytes: int,
    say: Progress,
) -> dict[str, Any]:
    """The checks and the summary, from what the replicas reported and the trainer's digests."""
    reports = sorted(reports, key=lambda r: r.index)
    last = cfg.versions
    mismatches = {r.name: [v for v, d in zip(r.applied, r.digests, strict=True) if d != truth.get(v)] for r in reports}
    speeds = [g for i, r in enumerate(reports) if i != SLOW for g in r.pull_gbps]  # not the pulls slowed on purpose
    checks = {
        "bit_exact": not any(mismatches.values()),
        "torn_read_rejected": reports[TORN].tear_caught is True if cfg.tear else True,
        "every_replica_reached_newest": all(r.applied[-1] == last for r in reports),
        "versions_applied_increase": all(r.applied == sorted(set(r.applied)) for r in reports),
        "slow_replica_renewed_its_lease": reports[SLOW].renewals > 0,
        "slow_replica_skipped_versions": len(reports[SLOW].applied) < last,
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
        "trainer_pid": os.getpid(),
        "replica_pids": [r.pid for r in reports],
        "checks": checks,
        "ok": all(checks.values()),
    }
    for r in reports:
        bad = f", MISMATCHED {mismatches[r.name]}" if mismatches[r.name] else ""
        say(r.name, f"applied {r.applied}, renewals {r.renewals}, torn reads rejected {r.torn_rejected}{bad}")
    for name, passed in checks.items():
        say("check", f"{'ok  ' if passed else 'FAIL'} {name}")
    say(
        "summary",
        f"median pull {summary['pull_gbps']:.2f} GB/s over {len(speeds)} pulls not slowed on purpose; "
        f"{'all checks passed' if summary['ok'] else 'SOME CHECKS FAILED'}",
    )
    return summary
