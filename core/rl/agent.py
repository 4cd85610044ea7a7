"""The update agent: one per replica, beside its engine.

It watches the registry. When the newest version is `min_version_lag` ahead of the one the
replica serves (the first version always), it has the replica prefetch that version into
its mirror while generation goes on, then pauses generation, applies the mirror to the
weights, labels the engine's outputs with the version, resumes, and reports the version
to the registry. Only the pause, apply, label and resume sit inside the pause.

The engine is reached through `EngineControl`, so the agent knows no engine: the vLLM
binding lives in `weightpull.integrations.vllm`, and tests drive a fake on a FakeClock.
"""

from __future__ import annotations

import enum
import logging
import math
from typing import Protocol, runtime_checkable

import anyio
import attrs

from ..clock import Clock, MonotonicClock, within
from ..errors import (
    AgentFailedError,
    ApplyError,
    InvalidArgumentError,
    PeerGoneError,
    PublisherLapsedError,
    PullError,
    RegionNotRegisteredError,
    RegistryError,
    TornReadError,
    TransportError,
    VersionWaitTimeoutError,
    WeightpullError,
    first_error,
)
from ..puller import check_line, line_args
from ..records import PullReport
from ..registry import Registry

log = logging.getLogger(__name__)


class PauseMode(enum.Enum):
    """What happens to requests in flight when an update pauses generation."""

    ABORT = "abort"  # abort them (the caller retries): one version per trajectory
    WAIT = "wait"  # let them finish on the old weights first: one version per trajectory
    KEEP = "keep"  # freeze them and go on after the update: two versions in one trajectory


@runtime_checkable
class EngineControl(Protocol):
    """What the agent drives on its replica's engine.

    An engine binding implements it (`weightpull.integrations.vllm.VllmEngine` for vLLM);
    tests implement it with a fake. It may also offer `prepare()`, awaited once before the
    first version (to map reserved slots and size the mirror ahead), and `last_pull()`, a
    `PullReport` of its last prefetch (`Puller.last_pull`) or None, which the agent sends
    with `report_serving` for the registry's status.
    """

    async def prefetch(self, version: int) -> None:
        """Return once the replica's mirror holds `version`, verified; generation goes
        on meanwhile. Raises `PullError` (a torn read...) when the copy is unusable."""

    async def pause(self, mode: PauseMode) -> None:
        """Stop generating; `mode` says what becomes of the requests in flight."""

    async def apply(self, version: int) -> None:
        """Load the mirrored `version` into the weights and reset the caches built on the
        old ones. On failure, restore the last good version and raise `ApplyError`
        (`restored` None if even that failed)."""

    async def label(self, version: int) -> None:
        """Tag what the engine generates from now on with `version`."""

    async def resume(self) -> None:
        """Generate again (on the new weights, or the restored ones after a failed apply)."""


# A pull can fail for reasons that pass: a torn read, a version retired before it was
# leased, a transport hiccup. The agent tries the newest version again, a few times.
LAPSE_POLL = 1.0  # seconds between looks at a lapsed publisher's line: is it back?

_RETRYABLE = (PullError, RegistryError, TransportError)
# Its source is gone (the publisher's process exited, or it dropped the slot): that
# version can never be read, so the agent waits for a newer one instead of retrying.
_SOURCE_GONE = (PeerGoneError, RegionNotRegisteredError)


@attrs.define
class AgentStats:
    """What an `UpdateAgent` did so far (`UpdateAgent.stats`); `UpdateAgent.metrics` flattens it."""

    applied: list[int] = attrs.Factory(list)
    pause_s: list[float] = attrs.Factory(list)  # pause -> resume, per update
    prefetch_s: list[float] = attrs.Factory(list)
    pull_failures: int = 0  # prefetches that failed and were tried again
    torn_reads: int = 0  # of which torn: the lease lapsed mid-read, the copy was rejected
    apply_failures: int = 0  # applies that failed and were rolled back to the last good version
    last_apply_error: str | None = None
    newest_seen: int | None = None  # the newest READY version the agent was handed


class UpdateAgent:
    """Keeps one replica on a recent version: prefetch while generating, then a short pause.

    Run it beside the replica's engine (`await agent.run()` in a task group). When the
    newest READY version is `min_version_lag` ahead of the one served, the engine
    prefetches it into its mirror, then the agent pauses generation, applies, labels and
    resumes, and reports the version to the registry. A pull that fails for a reason that
    passes is tried again on the newest version; a version whose source is gone, or whose
    apply failed and was rolled back, is skipped for a newer one.

    Args:
        name: The replica's name, as reported to the registry and in logs.
        registry: The registry to watch and report to.
        engine: The replica's engine, driven through `EngineControl`.
        min_version_lag: Update once the newest version is this many versions ahead of
            the served one (the first version always); an int >= 1.
        pause_mode: What happens to requests in flight during the pause (`PauseMode`, or
            "abort", "wait", "keep").
        max_pull_attempts: Failed prefetches in a row before the agent fails; >= 1.
        max_apply_failures: Failed (rolled back) applies in a row before the agent
            fails; >= 1.
        retry_delay: Seconds between a failed prefetch and the next try.
        clock: The clock to wait on (default: `MonotonicClock`).
        publisher: The line of versions to follow (a publisher's principal name);
            None follows the registry's default line.

    Raises:
        InvalidArgumentError: An argument is out of range; the message names it.
    """

    def __init__(
        self,
        name: str,
        registry: Registry,
        engine: EngineControl,
        *,
        min_version_lag: int = 1,
        pause_mode: PauseMode | str = PauseMode.ABORT,
        max_pull_attempts: int = 5,
        max_apply_failures: int = 3,
        retry_delay: float = 0.1,
        clock: Clock | None = None,
        publisher: str | None = None,
    ) -> None:
        if not isinstance(min_version_lag, int) or min_version_lag < 1:
            raise InvalidArgumentError(f"min_version_lag must be an int >= 1, got {min_version_lag!r}")
        if max_pull_attempts < 1:
            raise InvalidArgumentError(f"max_pull_attempts must be >= 1, got {max_pull_attempts!r}")
        if not (isinstance(retry_delay, (int, float)) and math.isfinite(retry_delay) and retry_delay >= 0):
            raise InvalidArgumentError(f"retry_delay must be a finite number of seconds >= 0, got {retry_delay!r}")
        if max_apply_failures < 1:
            raise InvalidArgumentError(f"max_apply_failures must be >= 1, got {max_apply_failures!r}")
        try:
            self.pause_mode = PauseMode(pause_mode)
        except ValueError:
            raise InvalidArgumentError(f"pause_mode must be abort, wait or keep; got {pause_mode!r}") from None
        self.name = name
        self.registry = registry
        self.engine = engine
        self.publisher = check_line(publisher)  # the line followed (None: the registry's default line)
        self.min_version_lag = min_version_lag
        self.max_pull_attempts = max_pull_attempts
        self.max_apply_failures = max_apply_failures
        self.retry_delay = retry_delay
        self.clock = clock or MonotonicClock()
        self.serving: int | None = None
        self.failure: BaseException | None = None
        self.lapsed: PublisherLapsedError | None = None  # the followed publisher's lapse, until it is back
        self.stats = AgentStats()
        self._forced = -1  # wait_for_version asked for at least this version
        self._failed_pulls = 0  # in a row
        self._failed_applies = 0  # in a row
        self._failed_version = -1  # the newest version whose apply failed or whose source is gone: never tried again
        # Made lazily (they need a running event loop). `_changed` is set, then replaced,
        # whenever the served version or the failure changes; `_poke` re-aims the watch.
        self._changed: anyio.Event | None = None
        self._poke: anyio.Event | None = None
        self._running = False
        self._lapse_checks = 0  # lapses seen: a waiter that finds one waits for the agent to look again

    # -- the loop ------------------------------------------------------------------------

    async def run(self) -> None:
        """Keep the replica on a recent version until cancelled.

        On an error the agent is marked failed (`failure`; every waiter gets
        `AgentFailedError`) and the error propagates, so the task group running it, and
        the job, fail. A lapse of the publisher it follows is no failure: the agent keeps
        serving its version (`lapsed` names the lapse; its waiters get
        `PublisherLapsedError` at once) and goes on once the publisher is heard from again,
        a restarted trainer included.

        Raises:
            InvalidArgumentError: The agent is already running.
            PullError: `max_pull_attempts` prefetches in a row failed (or a
                `RegistryError`, `TransportError`: the last failure).
            ApplyError: `max_apply_failures` applies in a row failed, or one left the
                engine on no defined weights.
        """
        if self._running:
            raise InvalidArgumentError(f"agent {self.name!r} is already running")
        self._running = True
        try:
            await self._prepare()
            while True:
                version = await self._next_version()
                if await self._prefetch(version):
                    await self._update(version)
        except anyio.get_cancelled_exc_class():
            raise
        except BaseException as exc:
            self.failure = exc
            log.error("agent %s failed: %r", self.name, exc)
            raise
        finally:
            self._running = False
            self._notify()

    async def _prepare(self) -> None:
        """Let an engine that can (an optional `prepare()`, e.g. its puller's) map the
        publishers' reserved slots and size its mirror before the first version. Only
        quicker: a failure is logged and the first pull does it."""
        prepare = getattr(self.engine, "prepare", None)
        if prepare is None:
            return
        try:
            await prepare()
        except WeightpullError as exc:
            log.warning("agent %s: could not prepare ahead of the first version: %s", self.name, exc)

    def _target(self) -> int:
        """The version the replica waits for: `min_version_lag` past the one it serves,
        sooner if `wait_for_version` asked."""
        if self.serving is None:
            target = 0
        else:
            target = self.serving + self.min_version_lag
            if self._forced > self.serving:
                target = min(target, self._forced)
        return max(target, self._failed_version + 1)

    async def _next_version(self) -> int:
        """The newest READY version once it reaches the target; re-aimed when poked. While
        the publisher followed has lapsed, it looks again every `LAPSE_POLL` seconds (or
        when a waiter pokes it) until that publisher is heard from again."""
        while True:
            try:
                found = await self._wait_newest()
            except PublisherLapsedError as lapse:
                if self.lapsed is None:
                    log.warning("agent %s: still serving v%s; %s", self.name, self.serving, lapse)
                self.lapsed = lapse
                self._lapse_checks += 1
                self._notify()
                self._poke = poke = anyio.Event()
                await within(self.clock, LAPSE_POLL, poke.wait)  # looked at again when due, or at once for a waiter
                continue
            if self.lapsed is not None:
                log.info("agent %s: the publisher is back", self.name)
                self.lapsed = None
                self._notify()
            if found is not None:
                return found

    async def _wait_newest(self) -> int | None:
        """Wait for the target, or for `wait_for_version` to move it (then None)."""
        self._poke = poke = anyio.Event()
        found: list[int] = []
        try:
            await self._race(poke, found)
        except BaseExceptionGroup as group:  # the wait's own error, as it came: its waiters are told its type
            if isinstance(lapse := first_error(group), PublisherLapsedError):
                raise lapse from None
            raise
        return found[0] if found else None

    async def _race(self, poke: anyio.Event, found: list[int]) -> None:
        async with anyio.create_task_group() as tg:

            async def newest() -> None:
                manifest = await self.registry.wait_for_version(self._target(), **line_args(self.publisher))
                found.append(manifest.version)
                self.stats.newest_seen = max(found[-1], self.stats.newest_seen or found[-1])
                tg.cancel_scope.cancel()

            async def poked() -> None:
                await poke.wait()
                tg.cancel_scope.cancel()

            tg.start_soon(newest)
            tg.start_soon(poked)

    async def _prefetch(self, version: int) -> bool:
        """Mirror `version` while generation goes on. False after a failure that may
        pass (the loop then looks for the newest version again); raises after
        `max_pull_attempts` of them in a row."""
        started = self.clock.now()
        try:
            await self.engine.prefetch(version)
        except _SOURCE_GONE as exc:
            self.stats.pull_failures += 1
            self._failed_version = max(self._failed_version, version)
            self._failed_pulls = 0
            log.warning("agent %s: v%s cannot be read (%s); waiting for a newer version", self.name, version, exc)
            return False
        except _RETRYABLE as exc:
            self.stats.pull_failures += 1
            self.stats.torn_reads += isinstance(exc, TornReadError)
            self._failed_pulls += 1
            log.warning(
                "agent %s: prefetch of v%s failed (%d in a row): %s", self.name, version, self._failed_pulls, exc
            )
            if self._failed_pulls >= self.max_pull_attempts:
                raise
            await self.clock.sleep(self.retry_delay)
            return False
        self._failed_pulls = 0
        self.stats.prefetch_s.append(self.clock.now() - started)
        return True

    async def _update(self, version: int) -> None:
        """The pause: nothing slow happens inside it. An apply that fails but gave the
        engine back its last good version resumes on it, and the agent waits for a newer
        version; `max_apply_failures` in a row, or a failure that left the engine on no
        defined weights (it stays paused), fail the agent."""
        started = self.clock.now()
        await self.engine.pause(self.pause_mode)
        try:
            await self.engine.apply(version)
        except ApplyError as exc:
            self.stats.apply_failures += 1
            self.stats.last_apply_error = f"v{version}: {exc.__cause__ or exc}"
            self._failed_applies += 1
            self._failed_version = max(self._failed_version, version)
            self._notify()
            if exc.restored is None or self._failed_applies >= self.max_apply_failures:
                raise
            log.error("agent %s: %s; serving %s again, waiting for a newer version", self.name, exc, exc.restored)
            await self.engine.resume()
            return
        self._failed_applies = 0
        await self.engine.label(version)
        await self.engine.resume()
        self.stats.pause_s.append(self.clock.now() - started)
        self.stats.applied.append(version)
        self.serving = version
        self._notify()
        log.info("agent %s: serving v%s (paused %.0f ms)", self.name, version, self.stats.pause_s[-1] * 1e3)
        pull = self._last_pull()
        await self.registry.report_serving(self.name, version, **({} if pull is None else {"pull": pull}))

    def _last_pull(self) -> PullReport | None:
        """The engine's report of its last prefetch, where it gives one (`last_pull()`)."""
        last_pull = getattr(self.engine, "last_pull", None)
        report = last_pull() if callable(last_pull) else None
        return report if isinstance(report, PullReport) else None

    # -- what a trainer's logger takes -----------------------------------------------------

    def metrics(self) -> dict[str, float | int]:
        """The agent's figures as a flat dict, for a trainer's logger (one call per step).

        Returns:
            `agent/updates`, `agent/pull_failures`, `agent/torn_reads`,
            `agent/apply_failures` (totals since the agent started), and once known
            `agent/serving_version`, `agent/versions_behind`, `agent/pause_s` and
            `agent/prefetch_s` (the last update's seconds).
        """
        stats = self.stats
        behind = (
            (stats.newest_seen - self.serving) if stats.newest_seen is not None and self.serving is not None else None
        )
        out: dict[str, float | int] = {
            "agent/updates": len(stats.applied),
            "agent/pull_failures": stats.pull_failures,
            "agent/torn_reads": stats.torn_reads,
            "agent/apply_failures": stats.apply_failures,
        }
        if self.serving is not None:
            out["agent/serving_version"] = self.serving
        if behind is not None:
            out["agent/versions_behind"] = behind
        if stats.pause_s:
            out["agent/pause_s"] = stats.pause_s[-1]
        if stats.prefetch_s:
            out["agent/prefetch_s"] = stats.prefetch_s[-1]
        return out

    # -- waiting on the agent --------------------------------------------------------------

    def _notify(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    def _check(self) -> None:
        if self.failure is not None:
            raise AgentFailedError(f"the update agent of {self.name!r} failed: {self.failure!r}") from self.failure

    def _event(self) -> anyio.Event:
        if self._changed is None:
            self._changed = anyio.Event()
        return self._changed

    async def wait_changed(self) -> None:
        """Return when the served version changes.

        Raises:
            AgentFailedError: The agent has failed, or fails meanwhile (chained to why).
        """
        self._check()
        await self._event().wait()
        self._check()

    async def wait_for_version(self, version: int, timeout: float | None = None) -> int:
        """Load `version` or a newer one now, whatever `min_version_lag` says.

        For a trainer that must know its replicas serve a version (to validate a
        checkpoint, say).

        Args:
            version: The least version to serve; a non-negative int.
            timeout: Seconds to wait at most; None waits as long as it takes.

        Returns:
            The version served, once it is at least `version`.

        Raises:
            InvalidArgumentError: `version` is not a non-negative int.
            VersionWaitTimeoutError: It was not served within `timeout`.
            PublisherLapsedError: The publisher the agent follows has lapsed, or
                lapses meanwhile (naming it): no newer version will come from it until it
                is back. The agent keeps serving its version and goes on once it is.
            AgentFailedError: The agent has failed, or fails meanwhile.
        """
        if not isinstance(version, int) or version < 0:
            raise InvalidArgumentError(f"version must be a non-negative int, got {version!r}")
        if version > self._forced:
            self._forced = version
            if self._poke is not None:
                self._poke.set()
        deadline = None if timeout is None else self.clock.now() + timeout
        checks = self._lapse_checks  # a lapse seen before this wait is looked at again first
        if self.lapsed is not None and self._poke is not None:
            self._poke.set()
        while True:
            self._check()
            if self.serving is not None and self.serving >= version:
                return self.serving
            if self.lapsed is not None and self._lapse_checks > checks:
                raise PublisherLapsedError(
                    f"{self.name} cannot serve v{version} (serving: {self.serving}): {self.lapsed}",
                    publisher=self.lapsed.publisher,
                )
            remaining = None if deadline is None else deadline - self.clock.now()
            if remaining is not None and remaining <= 0:
                raise VersionWaitTimeoutError(
                    f"{self.name} did not serve v{version} or newer within {timeout} s (serving: {self.serving})"
                )
            await within(self.clock, remaining, self._event().wait)
