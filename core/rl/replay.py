"""The replay buffer on weight versions, and the sampling wait that cannot hang.

Groups arrive as rollout completes them. Their age is the one `StalenessClock`'s: from
the oldest weight version any of their trajectories started on. The same clock evicts
groups grown too stale (handed back, to run again), refuses a stale sample, and makes the
metrics. `Sampler.sample` waits for enough fresh groups, asking a `Health` check at every
poll, so a trainer whose producers are all gone fails with `NoProducerError` instead of
waiting forever.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import attrs

from ..clock import Clock, MonotonicClock
from ..errors import InvalidArgumentError
from .health import Health, Producer
from .staleness import Group, StalenessClock


class ReplayBuffer:
    """Groups not yet trained on, keyed by id; a group is handed out once.

    Args:
        staleness: The clock that ages, evicts and checks the groups.
    """

    def __init__(self, staleness: StalenessClock) -> None:
        self.staleness = staleness
        self._groups: dict[str, Group] = {}
        self._seen: set[str] = set()  # handed out: never taken in again

    def __len__(self) -> int:
        return len(self._groups)

    def add(self, groups: Iterable[Group]) -> int:
        """Take in groups not seen before; how many were new."""
        added = 0
        for g in groups:
            if g.id not in self._seen and g.id not in self._groups:
                self._groups[g.id] = g
                added += 1
        return added

    def evict(self) -> list[Group]:
        """Drop and return the groups older than the clock's bound (a group run again
        after its eviction is taken in again)."""
        fresh, evicted = self.staleness.evict(self._groups.values())
        self._groups = {g.id: g for g in fresh}
        return evicted

    def take(self, n: int) -> list[Group] | None:
        """The `n` oldest fresh groups (by the version they started on), or None while
        fewer are held. Stale groups are evicted first; the sample passes the clock's check."""
        if not isinstance(n, int) or n < 1:
            raise InvalidArgumentError(f"a sample needs n >= 1 groups, got {n!r}")
        self.evict()
        if len(self._groups) < n:
            return None
        sample = sorted(self._groups.values(), key=lambda g: g.start_version)[:n]
        self.staleness.check(sample)
        for g in sample:
            del self._groups[g.id]
            self._seen.add(g.id)
        return sample

    def metrics(self, sample: Sequence[Group] = ()) -> dict[str, Any]:
        """The clock's staleness figures of `sample` (default: what the buffer holds)."""
        return {**self.staleness.metrics(list(sample) or list(self._groups.values())), "replay/size": len(self)}


@attrs.define
class SampleWait:
    """A sample (`Sampler.sample`): its groups, the seconds waited for them, and the
    groups evicted meanwhile."""

    groups: list[Group]
    waited_s: float
    evicted: list[Group]


class Sampler:
    """Fills a `ReplayBuffer` and waits for a sample, failing when none can come.

    Args:
        buffer: The buffer to fill and take from.
        source: The groups completed so far (e.g. `Ledger.ready_groups`); called at
            every poll, groups seen before are ignored.
        producers: Who can still complete groups (`Producer`s), for the health check.
        health: The check that fails the wait when no producer is left.
        on_evict: Given the groups the clock evicted, to run them again (to
            `Ledger.requeue` them, say).
        poll_s: Seconds between polls; > 0.
        clock: The clock to wait on (default: `MonotonicClock`).

    Raises:
        InvalidArgumentError: `poll_s` is not > 0.
    """

    def __init__(
        self,
        buffer: ReplayBuffer,
        source: Callable[[], Iterable[Group]],
        producers: Callable[[], Sequence[Producer]],
        health: Health,
        *,
        on_evict: Callable[[list[Group]], object] | None = None,
        poll_s: float = 0.05,
        clock: Clock | None = None,
    ) -> None:
        if not poll_s > 0:
            raise InvalidArgumentError(f"poll_s must be > 0, got {poll_s!r}")
        self.buffer = buffer
        self.source = source
        self.producers = producers
        self.health = health
        self.on_evict = on_evict
        self.poll_s = poll_s
        self.clock = clock or MonotonicClock()

    async def sample(self, n: int) -> SampleWait:
        """Wait for `n` fresh groups.

        Args:
            n: Groups in the sample; >= 1.

        Returns:
            The `n` oldest fresh groups, once held, with the wait's figures.

        Raises:
            InvalidArgumentError: `n` is not an int >= 1.
            NoProducerError: No producer is left to complete the groups.
        """
        started = self.clock.now()
        evicted: list[Group] = []
        while True:
            self.buffer.add(self.source())
            gone = self.buffer.evict()
            if gone:
                evicted += gone
                if self.on_evict is not None:
                    self.on_evict(gone)
            groups = self.buffer.take(n)
            if groups is not None:
                return SampleWait(groups, self.clock.now() - started, evicted)
            self.health.check(self.producers(), self.clock.now(), since=started)
            await self.clock.sleep(self.poll_s)
