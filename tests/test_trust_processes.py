"""Principals and liveness across processes, against a real `weightpull registry serve`
with a key per principal (issue 13, item 6). The trainer runs tests/trust_publisher.py.

- A publisher SIGKILLed mid-copy, its version WRITING or STREAMING (alive, though stalled,
  nothing of it ends): within about the liveness TTL its half-written version ends
  ABORTED and its READY one is withdrawn, each with the reason; readers get typed errors
  naming it, an update agent keeps serving what it has, neither looping nor failing;
  restarted under the same principal, the trainer continues the numbering (its manifest
  records the step it asked) and its next version is pulled bit-exact. A reader streaming
  the dead version meanwhile is told as it ends, not at its long poll's end (and the
  smallest form of that, in one process).
- A flood of random well-formed requests, every operation of the protocol, from a second
  authenticated client of each role (`replica-evil`, `rogue`) while a trainer publishes and
  a replica pulls: every refusal is typed, the server lives, nothing of the others' moves
  (`Flooder` says what it sends and judges). WEIGHTPULL_FLOOD_SECONDS and
  WEIGHTPULL_FLOOD_SEED run it longer or otherwise.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import anyio
import attrs
import pytest

from weightpull import (
    Lease,
    Manifest,
    NoReadyVersionError,
    PauseMode,
    Publisher,
    Pulled,
    Puller,
    RegistryStatus,
    TornReadError,
    UpdateAgent,
    VersionState,
    WeightpullError,
    create_transport,
    list_transports,
)
from weightpull.errors import (
    LeaseNotFoundError,
    PermissionDeniedError,
    RegistryUnavailableError,
    VersionNotFoundError,
)
from weightpull.principals import Role, root
from weightpull.records import Reservation
from weightpull.registry_machine import MAX_VERSION_JUMP

pytest.importorskip("zmq")
from weightpull.drivers.zmq_registry import wire  # noqa: E402
from weightpull.drivers.zmq_registry.client import ZmqRegistry  # noqa: E402

from .conftest import host_tensors  # noqa: E402
from .served import ServedRegistry, env, make_keys  # noqa: E402

pytestmark = pytest.mark.anyio

NIXL = any(d.name == "nixl" and d.available for d in list_transports())
ROOT = Path(__file__).parent.parent
TTL = 1.5  # the registry's --liveness-ttl
PRINCIPALS = (
    ("publisher", "trainer"),
    ("publisher", "rogue"),
    ("reader", "replica-0"),
    ("reader", "replica-evil"),
    ("admin", "ops"),
)


def client(served: ServedRegistry, name: str, **kw) -> ZmqRegistry:
    kw.setdefault("timeout", 1.0)
    kw.setdefault("retry_for", 10.0)
    kw.setdefault("heartbeat", None)
    return ZmqRegistry(served.address, **served.key(name), **kw)


def check_bytes(pulled: Pulled, sizes: tuple[int, ...]) -> None:
    """The copy is exactly what the trainer published for the step its manifest records."""
    assert pulled.manifest.step is not None
    for name, tensor in host_tensors(pulled.manifest.step, sizes).items():
        assert bytes(pulled.view(name)) == tensor.data, f"v{pulled.version}: {name} differs"


# -- a publisher SIGKILLed mid-copy ------------------------------------------------------------


class Trainer:
    """tests/trust_publisher.py in a process of its own, as publisher `trainer`."""

    def __init__(self, served: ServedRegistry, stream: bool) -> None:
        assert served.keys is not None
        keyed = env(
            None,
            WEIGHTPULL_KEY=str(served.keys / "trainer.key_secret"),
            WEIGHTPULL_SERVER_KEY=str(served.keys / "registry.key"),
        )
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.trust_publisher", served.address, *(["--stream"] if stream else [])],
            env=keyed,
            cwd=ROOT,
            text=True,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )

    async def line(self, timeout: float = 20.0) -> list[str]:
        assert self.proc.stdout is not None
        with anyio.fail_after(timeout):
            text = await anyio.to_thread.run_sync(self.proc.stdout.readline, abandon_on_cancel=True)
        assert text, f"the trainer exited ({self.proc.poll()})"
        return text.split()

    async def send(self, command: str, step: int) -> list[str]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{command} {step}\n")
        self.proc.stdin.flush()
        return await self.line()

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None and not pipe.closed:
                pipe.close()


class Engine:
    """An engine for the update agent: its prefetch pulls the version, checked bit-exact."""

    def __init__(self, puller: Puller, sizes: tuple[int, ...]) -> None:
        self.puller, self.sizes = puller, sizes
        self.prefetched: list[int] = []
        self.applied: list[int] = []

    async def prefetch(self, version: int) -> None:
        self.prefetched.append(version)
        pulled = await self.puller.pull(version)
        check_bytes(pulled, self.sizes)

    async def pause(self, mode: PauseMode) -> None:
        pass

    async def apply(self, version: int) -> None:
        self.applied.append(version)

    async def label(self, version: int) -> None:
        pass

    async def resume(self) -> None:
        pass


async def states(registry: ZmqRegistry) -> dict[int, tuple[VersionState, str]]:
    return {v.version: (v.state, v.reason) for v in (await registry.status()).versions}


@pytest.mark.skipif(not NIXL, reason="the nixl driver is not available here")
@pytest.mark.parametrize("stream", [False, True], ids=["writing", "streaming"])
async def test_a_publisher_killed_mid_copy_ends_its_versions_and_comes_back_numbering_on(tmp_path, stream):
    from .trust_publisher import SIZES, STALL_AFTER

    served = ServedRegistry(tmp_path, keys=make_keys(tmp_path / "keys", *PRINCIPALS), args=("--liveness-ttl", str(TTL)))
    served.start()
    reader = client(served, "replica-0", heartbeat=0.3)  # a replica's heartbeat, once it reports serving
    transport = create_transport("nixl")
    puller = Puller(reader, transport, holder="replica-0", ttl=5.0)
    engine = Engine(puller, SIZES)
    agent = UpdateAgent("replica-0", reader, engine, retry_delay=0.05)
    trainer = Trainer(served, stream)
    restarted: Trainer | None = None
    try:
        async with anyio.create_task_group() as tg:
            assert await trainer.line() == ["ready", "trainer"]
            assert await trainer.send("publish", 1) == ["published", "1", "1"]
            tg.start_soon(agent.run)
            assert await agent.wait_for_version(1, timeout=10) == 1

            assert await trainer.send("stall", 2) == ["stalled", "2"]
            midway = VersionState.STREAMING if stream else VersionState.WRITING
            with anyio.fail_after(5):  # a streamed version shows each bucket copied before the stall
                while (await reader.progress(2)).committed < (STALL_AFTER if stream else 0):
                    await anyio.sleep(0.05)
            # Slow but alive past the TTL (its heartbeat runs): nothing ends.
            await anyio.sleep(TTL + 0.5)
            assert await states(reader) == {1: (VersionState.READY, ""), 2: (midway, "")}
            assert (await reader.status()).alive["trainer"] > 0

            trainer.kill()
            killed = time.monotonic()
            lapsed = "publisher 'trainer' lapsed"
            with anyio.fail_after(TTL + 2):
                while (seen := await states(reader))[2][0] is midway:
                    await anyio.sleep(0.1)
            took = time.monotonic() - killed
            assert seen[2][0] is VersionState.ABORTED and lapsed in seen[2][1], seen
            assert seen[1][0] is VersionState.RETIRED and seen[1][1].startswith(f"withdrawn: {lapsed}"), seen
            assert TTL - 0.5 < took < TTL + 2
            status = await reader.status()
            assert status.newest_ready is None and status.alive["trainer"] <= 0

            with pytest.raises(NoReadyVersionError, match=f"v1 was withdrawn: {lapsed}"):
                await reader.acquire(ttl=5.0, holder="replica-0")
            started = time.monotonic()
            with pytest.raises(NoReadyVersionError, match=f"v1 was withdrawn: {lapsed}"):
                await puller.pull()  # a plain pull: told at once, no read of the dead peer
            assert time.monotonic() - started < 1.0
            # The update agent keeps serving v1 and waits for a readable version: no loop.
            assert agent.failure is None and agent.serving == 1
            assert engine.prefetched == [1] and agent.stats.pull_failures == 0

            # Restarted under the same principal: the next number, the step it asked recorded.
            restarted = Trainer(served, stream)
            assert await restarted.line() == ["ready", "trainer"]
            assert await restarted.send("publish", 2) == ["published", "3", "2"]
            assert await agent.wait_for_version(3, timeout=10) == 3
            assert engine.prefetched == [1, 3] and engine.applied == [1, 3] and agent.stats.pull_failures == 0
            pulled = await puller.pull()
            assert (pulled.version, pulled.manifest.step, pulled.manifest.publisher) == (3, 2, "trainer")
            check_bytes(pulled, SIZES)
            status = await reader.status()
            assert [(v.version, v.state) for v in status.versions] == [(3, VersionState.READY)]  # old ones dropped
            assert status.newest_ready == 3 and status.serving == {"replica-0": 3}
            tg.cancel_scope.cancel()
    finally:
        for proc in (trainer, restarted):
            if proc is not None:
                proc.close()
        await puller.aclose()
        await transport.aclose()
        await reader.aclose()
        served.stop()


@pytest.mark.skipif(not NIXL, reason="the nixl driver is not available here")
async def test_a_reader_streaming_from_a_publisher_killed_mid_copy_is_told_within_the_ttl(tmp_path):
    from .trust_publisher import SIZES, STALL_AFTER

    served = ServedRegistry(tmp_path, keys=make_keys(tmp_path / "keys", *PRINCIPALS), args=("--liveness-ttl", str(TTL)))
    served.start()
    reader, watcher = client(served, "replica-0"), client(served, "ops")
    transport = create_transport("nixl")
    puller = Puller(reader, transport, holder="replica-0", ttl=5.0, stream=True)
    trainer = Trainer(served, stream=True)
    outcome: list[BaseException | Pulled] = []
    assert len(SIZES) > STALL_AFTER  # a bucket is left to wait for
    try:
        assert await trainer.line() == ["ready", "trainer"]
        assert await trainer.send("stall", 1) == ["stalled", "1"]
        with anyio.fail_after(5):
            while (await watcher.progress(1)).committed < STALL_AFTER:
                await anyio.sleep(0.05)

        async with anyio.create_task_group() as tg:

            async def read() -> None:
                try:
                    outcome.append(await puller.pull(1))
                except Exception as exc:
                    outcome.append(exc)

            tg.start_soon(read)
            await anyio.sleep(0.5)  # it has read the buckets copied, and waits for the next
            assert not outcome
            trainer.kill()
            killed = time.monotonic()
            with anyio.fail_after(TTL + 2):  # a watcher (a dashboard, say) reads status meanwhile
                while not outcome:
                    await watcher.status()
                    await anyio.sleep(0.1)
            assert time.monotonic() - killed < TTL + 2
        (torn,) = outcome
        assert isinstance(torn, TornReadError) and "publisher 'trainer' lapsed" in str(torn), repr(torn)
    finally:
        trainer.close()
        await puller.aclose()
        await transport.aclose()
        for reg in (reader, watcher):
            await reg.aclose()
        served.stop()


async def test_a_lapse_wakes_a_reader_waiting_on_the_dead_publishers_stream():
    """The smallest form of the defect above, in one process."""
    from weightpull import InProcessRegistry, Manifest, plan_layout
    from weightpull.errors import VersionStateError
    from weightpull.layout import TensorSpec
    from weightpull.principals import Principal

    registry = InProcessRegistry(liveness_ttl=0.3)
    trainer = registry.as_principal(Principal.publisher("trainer"))
    reader = registry.as_principal(Principal.reader("replica-0"))
    layout = plan_layout([TensorSpec("a", "uint8", (8,)), TensorSpec("b", "uint8", (8,))], bucket_bytes=8, align=8)
    assert len(layout.buckets) == 2
    await trainer.begin(1, publisher="trainer", slot=0)
    await trainer.stream(Manifest(1, layout, "fake", b"{}", 0, "trainer"))
    await trainer.mark(1, 1)
    ended: list[BaseException] = []

    async def wait() -> None:
        with pytest.raises(VersionStateError, match="lapsed") as info:
            await reader.wait_for_buckets(1, 2, timeout=10.0)
        ended.append(info.value)

    with anyio.fail_after(2):
        async with anyio.create_task_group() as tg:
            tg.start_soon(wait)
            await anyio.sleep(0.5)  # the trainer died: not heard from for longer than its TTL
            await reader.keepalive()  # any request judges liveness: v1 ends ABORTED...
            assert (await reader.progress(1)).state is VersionState.ABORTED
    assert ended  # ...and the reader waiting on it is told at once


# -- a flood of random well-formed requests from a second client of each role ------------------

FLOOD_SECONDS = float(os.environ.get("WEIGHTPULL_FLOOD_SECONDS", "4"))
FLOOD_SEED = int(os.environ.get("WEIGHTPULL_FLOOD_SEED", "13"))
FLOOD_SIZES = (3000, 500, 7000)
# What a flooder's act on another's name, version or lease may meet: the refusal, or that
# the thing was gone by then (reclaimed, pruned). Never success.
HOSTILE_OUTCOMES = (PermissionDeniedError, VersionNotFoundError, LeaseNotFoundError)


class Flooder:
    """A second authenticated client of its role sending random well-formed requests,
    every operation of the protocol, with arguments drawn from what `status` shows it
    (others' lease ids, version numbers, holder, replica and publisher names) and its own
    names. It judges each outcome: an act on another's name, version or lease must fail
    as `HOSTILE_OUTCOMES` say; every error must be a typed `WeightpullError` other than
    the server's internal error, and the server must always answer.

    It sends every kind of act but one: a valid publish of its own (a commit of its own
    version, in its own slot, under its own name). That is what a publisher key is for,
    and it retires the previous newest READY version, anyone's (docs/guides/registry-service.md,
    threat model); its invariants are the principals fuzzer's (fuzz/test_principals.py)."""

    def __init__(self, served: ServedRegistry, name: str, seed: int) -> None:
        self.reg = client(served, name)
        self.me = self.reg.principal
        self.rng = random.Random(seed)
        self.view: RegistryStatus | None = None
        self.manifests: dict[int, Manifest] = {}  # others' manifests it has read
        self.leases: list[Lease] = []  # its own
        self.sent: Counter[str] = Counter()
        self.outcomes: Counter[tuple[str, str]] = Counter()
        self.wrong: list[str] = []  # what broke a rule
        self.hostile = False  # whether the act under way is on another's name, version or lease
        self.acts = {
            "ping": self._ping,
            "keepalive": self._keepalive,
            "begin": self._begin,
            "commit": self._commit,
            "stream": self._stream,
            "abort": self._abort,
            "retire": self._retire,
            "reclaim": self._reclaim,
            "mark": self._mark,
            "commit_stream": self._commit_stream,
            "reserve": self._reserve,
        }
        self.acts |= {  # reads, and acts on leases and reports
            "newest": lambda: self.reg.newest(),
            "get": self._get,
            "progress": lambda: self.reg.progress(self.version(), source=self.source()),
            "wait_for_buckets": lambda: self.reg.wait_for_buckets(
                self.version(), self.rng.randrange(4), timeout=self.rng.choice([0.0, 0.02]), source=self.source()
            ),
            "wait_for_version": lambda: self.reg.wait_for_version(self.version(), timeout=self.rng.choice([0.0, 0.02])),
            "acquire": self._acquire,
            "renew": self._renew,
            "release": self._release,
            "release_checked": lambda: self._release(checked=True),
            "is_valid": lambda: self.reg.is_valid(self.lease()[1]),
            "report_serving": self._report_serving,
            "status": self._status,
            "offer": self._offer,
            "mark_offer": self._mark_offer,
            "withdraw": self._withdraw,
            "readers_at": lambda: self.reg.readers_at(self.version(), self.name()),
            "reservations": lambda: self.reg.reservations(),
            "part_digests": lambda: self.reg.part_digests(self.version(), self.part()),
        }
        assert self.acts.keys() == wire.OPS.keys(), "a flooder sends every operation of the protocol"

    # -- what it can see -----------------------------------------------------------------------

    def names(self) -> list[str]:
        seen = {"trainer", "rogue", "replica-0", "replica-evil", "ops", self.me.name}
        if self.view is not None:
            seen |= {x.holder for x in self.view.leases} | set(self.view.serving) | set(self.view.alive)
            seen |= {v.publisher for v in self.view.versions if v.publisher}  # a shard's tombstone has none
        return sorted(seen)

    def name(self) -> str:
        base = self.rng.choice(self.names())
        return self.rng.choice([base, base, f"{root(base)}/rank{self.rng.randrange(2)}", f"{self.me.name}/m1"])

    def owner(self, version: int) -> str | None:
        """Whose `version` is, by what status showed (numbers are never reused)."""
        for v in self.view.versions if self.view is not None else ():
            if v.version == version:
                return root(v.publisher) or None  # a shard's tombstone names none (here: rogue's)
        return None

    def version(self) -> int:
        seen = [v.version for v in self.view.versions] if self.view is not None else []
        top = max(seen, default=0)
        return self.rng.choice([*seen, *seen, top + 1, top + self.rng.randrange(1, 4), 0])

    def part(self) -> str:
        """A slice layout's key: a plausible one, or one too long."""
        return self.rng.choice(["tp2-rank0", "tp2-rank1", "x" * self.rng.choice([1, 300])])

    def lease(self) -> tuple[bool, Lease]:
        """A lease: another's that status listed (True), its own, or one it forged."""
        mine = [(False, x.id, x.version, x.holder) for x in self.leases[-8:]]
        seen = [(True, x.id, x.version, x.holder) for x in self.view.leases] if self.view is not None else []
        forged = [(False, f"forged-{self.rng.randrange(10**6)}", self.version(), self.name())]
        listed, lease_id, version, holder = self.rng.choice([*seen, *seen, *mine, *forged])
        return listed and not self.me.owns(holder), Lease(lease_id, version, holder, 1.0, 0.0)

    def ttl(self) -> float:
        # Short: a lease renewed for long keeps a publisher's slots full, which a reader
        # key is documented to allow (threat model); out of range, refused.
        return self.rng.choice([0.05, 0.3, 1.0, 0.0, -1.0, 1e6])

    def mark_hostile(self, version: int | None = None, names: tuple[str, ...] = ()) -> None:
        """The act under way is on another's: a version not its own, a name it does not own."""
        owner = None if version is None else self.owner(version)
        theirs = owner is not None and owner != self.me.name
        self.hostile = theirs or not all(self.me.owns(n) for n in names)

    # -- the acts ----------------------------------------------------------------------------------

    async def _ping(self) -> None:
        await self.reg.ping()

    async def _keepalive(self) -> None:
        names = tuple(self.name() for _ in range(self.rng.randrange(1, 3)))
        self.mark_hostile(names=names)
        await self.reg.keepalive(names)

    async def _begin(self) -> None:
        publisher = self.name()
        top = max([v.version for v in self.view.versions] if self.view is not None else [0], default=0)
        asked = self.rng.choice([None, self.version(), top + MAX_VERSION_JUMP, top + MAX_VERSION_JUMP + 2])
        shard = self.rng.choice([None, None, (self.rng.randrange(2), 2)]) if asked is not None else None
        self.mark_hostile(names=(publisher,))
        self.hostile |= self.me.role is Role.READER
        await self.reg.begin(asked, publisher=publisher, slot=self.rng.randrange(6), shard=shard)

    async def _manifest(self) -> Manifest:
        """Another's manifest as it is, or turned onto another's version still being
        written or onto one of its own, under its name or another's; never a valid
        commit or stream of its own (a stream it began validly, it could commit_stream:
        a valid publish, see the class)."""
        if not self.manifests:
            newest = await self.reg.newest()
            assert newest is not None  # the trainer published before the flood
            self.manifests[newest.version] = newest
        theirs = self.manifests[self.rng.choice(sorted(self.manifests))]
        view = self.view.versions if self.view is not None else ()
        targets = [v for v in view if v.state in (VersionState.WRITING, VersionState.STREAMING) and v.publisher]
        if not targets or self.rng.random() < 0.3:
            manifest = theirs
        else:
            target = self.rng.choice(targets)
            publisher = self.rng.choice([target.publisher, theirs.publisher, self.me.name])
            slot = target.slot
            if root(target.publisher) == self.me.name and publisher == target.publisher:
                slot += 1  # not a valid publish of its own (see the class)
            manifest = attrs.evolve(theirs, version=target.version, publisher=publisher, slot=slot, digests=None)
        self.mark_hostile(manifest.version, (manifest.publisher,))
        self.hostile |= self.me.role is Role.READER
        return manifest

    async def _commit(self) -> None:
        await self.reg.commit(await self._manifest())

    async def _stream(self) -> None:
        await self.reg.stream(await self._manifest())

    async def _abort(self) -> None:
        version = self.version()
        if self.rng.random() < 0.3:  # a shard's abort by the number its shards ask: of its own alone
            self.hostile = self.me.role is Role.READER
            await self.reg.abort(version, "flood", shard=(self.rng.randrange(2), 2))
            return
        await self._on_version(lambda: self.reg.abort(version, "flood"), version)

    async def _retire(self) -> None:
        version = self.version()
        await self._on_version(lambda: self.reg.retire(version), version)

    async def _reclaim(self) -> None:
        version = self.version()
        await self._on_version(lambda: self.reg.reclaim(version), version)

    async def _mark(self) -> None:
        version = self.version()
        await self._on_version(lambda: self.reg.mark(version, self.rng.randrange(4)), version)

    async def _commit_stream(self) -> None:
        version = self.version()
        await self._on_version(lambda: self.reg.commit_stream(version), version)

    async def _reserve(self) -> None:
        """Slots reserved under its own names or another's; a reader's, never."""
        publisher = self.name()
        self.mark_hostile(names=(publisher,))
        self.hostile |= self.me.role is Role.READER
        sources = tuple(self.rng.randbytes(self.rng.randrange(1, 64)) for _ in range(self.rng.randrange(1, 3)))
        await self.reg.reserve(Reservation(publisher, "fake", sources, self.rng.randrange(1 << 20)))

    async def _on_version(self, call, version: int) -> None:
        self.mark_hostile(version)
        self.hostile |= self.me.role is Role.READER
        await call()

    async def _get(self) -> None:
        manifest = await self.reg.get(self.version())
        if root(manifest.publisher) != self.me.name:
            self.manifests[manifest.version] = manifest

    async def _acquire(self) -> None:
        holder = self.name()
        version = self.rng.choice([None, None, self.version()])
        self.mark_hostile(names=(holder,))
        lease = await self.reg.acquire(version, ttl=self.ttl(), holder=holder, streaming=self.rng.random() < 0.3)
        self.leases.append(lease)

    async def _renew(self) -> None:
        self.hostile, lease = self.lease()
        await self.reg.renew(lease)

    async def _release(self, checked: bool = False) -> None:
        """Releasing a lease the registry no longer knows does nothing, and succeeds
        (idempotent): another's, released so, must have gone with its version."""
        theirs, lease = self.lease()
        if checked:
            held = await self.reg.release_checked(lease)
            if theirs and held:
                self.hostile = True  # it held another's lease, and ended it
        else:
            await self.reg.release(lease)
        if theirs and lease.version in {v.version for v in (await self.reg.status()).versions}:
            self.hostile = True  # it was there to refuse

    async def _report_serving(self) -> None:
        replica = self.name()
        self.mark_hostile(names=(replica,))
        await self.reg.report_serving(replica, self.version())

    async def _offer(self) -> None:
        """A relay's offer, under its own names or another's, of any version, whole or of
        its first buckets (a version still streaming, or a lie)."""
        holder = self.name()
        self.mark_hostile(names=(holder,))
        descriptor = self.rng.randbytes(self.rng.randrange(1, 64))
        landed = self.rng.choice([None, None, self.rng.randrange(6)])
        sliced = self.rng.random() < 0.3  # one rank's slice, vouched for by digests of its own or by none
        digests = self.rng.choice([None, tuple(f"{self.rng.getrandbits(64):016x}" for _ in range(2))])
        await self.reg.offer(
            self.version(),
            holder=holder,
            host="h",
            descriptor=descriptor,
            cap=self.rng.choice([None, 1]),
            landed=landed,
            **({"part": self.part(), "digests": digests} if sliced else {}),
        )

    async def _mark_offer(self) -> None:
        """A relay's count of buckets held, under its own names or another's, of any version."""
        holder = self.name()
        self.mark_hostile(names=(holder,))
        await self.reg.mark_offer(self.version(), self.rng.randrange(6), holder=holder)

    def source(self) -> str | None:
        """Where a streaming read waits: the version's slot, or a relay by name (anyone's: only reads)."""
        return self.rng.choice([None, None, self.name()])

    async def _withdraw(self) -> None:
        holder = self.name()
        self.mark_hostile(names=(holder,))
        await self.reg.withdraw(self.version(), holder=holder)

    async def _status(self) -> None:
        self.view = await self.reg.status()

    # -- the loop --------------------------------------------------------------------------------

    async def run(self, until: float) -> None:
        ops = sorted(self.acts)
        while time.monotonic() < until:
            if self.view is None or self.rng.random() < 0.1:
                await self._status()
            op = self.rng.choice(ops)
            self.sent[op] += 1
            self.hostile = False
            try:
                await self.acts[op]()
            except WeightpullError as exc:
                self.outcomes[op, type(exc).__name__] += 1
                if type(exc).__module__ != "weightpull.errors" or "internal error" in str(exc):
                    self.wrong.append(f"{self.me} {op}: untyped or internal: {exc!r}")
                if isinstance(exc, RegistryUnavailableError):
                    self.wrong.append(f"{self.me} {op}: the server did not answer: {exc!r}")
                elif self.hostile and not isinstance(exc, HOSTILE_OUTCOMES):
                    self.wrong.append(f"{self.me} {op} on another's: {exc!r}, not a refusal")
            except Exception as exc:
                self.wrong.append(f"{self.me} {op}: an untyped error {exc!r}")
            else:
                self.outcomes[op, "ok"] += 1
                if self.hostile:
                    self.wrong.append(f"{self.me} was let {op} on another's name, version or lease")


async def test_a_flood_from_a_second_client_of_each_role_moves_nothing_of_the_others(tmp_path):
    served = ServedRegistry(tmp_path, keys=make_keys(tmp_path / "keys", *PRINCIPALS))
    served.start()
    trainer_reg = client(served, "trainer", heartbeat=0.5)
    reader_reg = client(served, "replica-0", heartbeat=0.5)
    watcher = client(served, "ops")
    flooders = [Flooder(served, "replica-evil", FLOOD_SEED), Flooder(served, "rogue", FLOOD_SEED + 1)]
    publisher = Publisher(
        trainer_reg, create_transport("fake"), rollout_dtype=None, num_slots=4, bucket_bytes=4096, wait_timeout=15
    )
    puller = Puller(reader_reg, create_transport("fake"), holder="replica-0", ttl=5.0)
    published: dict[int, int] = {}  # version -> the step the trainer published as it
    newest: list[int] = []  # the trainer's versions, as each publish returned
    pulls: list[tuple[int, int]] = []
    reported: list[int] = []
    checks = 0
    try:
        async with publisher:
            first = await publisher.publish(1, host_tensors(1, FLOOD_SIZES))
            published[first.version], newest[:] = 1, [first.version]
            pinned = await reader_reg.acquire(ttl=30.0, holder="replica-0/pinned")  # held all along
            pinned_at = time.monotonic()
            until = time.monotonic() + FLOOD_SECONDS

            async def train() -> None:
                step = 1
                while time.monotonic() < until:
                    step += 1
                    result = await publisher.publish(step, host_tensors(step, FLOOD_SIZES))
                    assert not result.skipped and result.manifest is not None and result.manifest.step == step
                    published[result.version] = step
                    newest.append(result.version)
                    await anyio.sleep(0.05)

            async def read() -> None:
                while time.monotonic() < until:
                    pulled = await puller.pull()  # a torn read (a lease ended by another) fails here
                    assert pulled.manifest.publisher == "trainer", pulled.manifest
                    check_bytes(pulled, FLOOD_SIZES)
                    pulls.append((pulled.version, pulled.manifest.step))
                    reported.append(pulled.version)  # before: the watcher may see it as soon as it is sent
                    await reader_reg.report_serving("replica-0", pulled.version)

            async def watch() -> None:
                """The trainer's newest READY version is never withdrawn or reclaimed by
                another: only superseded by its own next one, or reclaimed by itself."""
                nonlocal checks
                while time.monotonic() < until:
                    mine = newest[-1]
                    status = await watcher.status()
                    versions = {v.version: v for v in status.versions}
                    ready = versions.get(status.newest_ready) if status.newest_ready is not None else None
                    assert ready is not None and ready.publisher == "trainer" and ready.version >= mine, status
                    assert ready.state is VersionState.READY, ready
                    if mine in versions:
                        info = versions[mine]
                        assert info.state is VersionState.READY or ready.version > mine, info
                    else:
                        assert newest[-1] > mine, f"v{mine} was reclaimed while the newest: {status}"
                    for v in status.versions:
                        if v.publisher == "trainer":  # nothing of its ended by another, nor by a lapse
                            assert v.reason == "" and v.state is not VersionState.ABORTED, v
                    assert status.serving.get("replica-0") in (None, *reported), status.serving
                    checks += 1
                    await anyio.sleep(0.05)

            async with anyio.create_task_group() as tg:
                for flooder in flooders:
                    tg.start_soon(flooder.run, until)
                tg.start_soon(train)
                tg.start_soon(read)
                tg.start_soon(watch)

            # The legitimate work went on, bit-exact, through the flood.
            assert len(newest) >= 5 and len(pulls) >= 5 and checks >= 10, (len(newest), len(pulls), checks)
            assert all(published[version] == step for version, step in pulls)
            for flooder in flooders:
                assert not flooder.wrong, "\n".join(flooder.wrong[:20])
                assert set(flooder.sent) == set(wire.OPS), (
                    f"{flooder.me} never sent {set(wire.OPS) - set(flooder.sent)}"
                )
                refused = sum(n for (_, kind), n in flooder.outcomes.items() if kind == "PermissionDeniedError")
                done = sum(n for (_, kind), n in flooder.outcomes.items() if kind == "ok")
                assert refused >= 20 and done >= 20, (flooder.me, flooder.outcomes)

            status = await watcher.status()
            assert status.newest_ready == newest[-1]
            assert {v.version: v.state for v in status.versions}[newest[-1]] is VersionState.READY
            assert status.serving["replica-0"] == reported[-1]
            flooded = [name for name in status.serving if name != "replica-0"]
            assert all(any(f.me.owns(name) for f in flooders) for name in flooded), status.serving
            (held,) = [x for x in status.leases if x.id == pinned.id]  # neither ended nor renewed by another
            assert held.holder == "replica-0/pinned" and await reader_reg.is_valid(pinned)
            assert 30.0 - (time.monotonic() - pinned_at) - 1.0 < held.expires_in <= 30.0 - FLOOD_SECONDS
            assert served.alive() and await watcher.ping() == served.epoch
            assert "internal error" not in served.log() and "Traceback" not in served.log()
    finally:
        await puller.aclose()
        for reg in (trainer_reg, reader_reg, watcher, *(f.reg for f in flooders)):
            await reg.aclose()
        served.stop()
