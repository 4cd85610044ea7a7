"""The health check: is anyone left to produce what a trainer waits for?

A trainer that samples rollouts waits on producers it never calls: rollout workers, each
with its update agent, and the dispatcher feeding them. When every one of them has died,
failed, or gone silent past `timeout`, the wait would last forever; `Health.check` turns
it into `NoProducerError`, naming what became of each. Sans-IO: it is handed the
producers and the time.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import attrs

from ..errors import InvalidArgumentError, NoProducerError


@attrs.frozen
class Producer:
    """A rollout worker, an update agent or a dispatcher, as last heard from."""

    name: str
    last_beat: float  # when it was last heard from (the health check's clock)
    failure: str | None = None  # why it stopped, when it said


def agent_producers(agents: Iterable[Any], now: float) -> list[Producer]:
    """In-process update agents (`weightpull.rl.UpdateAgent`): alive until one fails."""
    return [
        Producer(a.name, now if a.failure is None else -math.inf, None if a.failure is None else repr(a.failure))
        for a in agents
    ]


class Health:
    """Whether any producer is left: a trainer's wait on rollouts fails instead of hanging.

    Args:
        timeout: Seconds a producer may stay silent before it counts as gone; > 0.

    Raises:
        InvalidArgumentError: `timeout` is not > 0.
    """

    def __init__(self, timeout: float) -> None:
        if not isinstance(timeout, int | float) or not timeout > 0:
            raise InvalidArgumentError(f"the health timeout must be > 0 seconds, got {timeout!r}")
        self.timeout = float(timeout)

    def alive(self, producers: Sequence[Producer], now: float) -> list[Producer]:
        """The producers that have not failed and were heard from within the timeout."""
        return [p for p in producers if p.failure is None and now - p.last_beat <= self.timeout]

    def check(
        self,
        producers: Sequence[Producer],
        now: float,
        *,
        since: float | None = None,
        dispatcher_failure: str | None = None,
    ) -> None:
        """Fail when no producer is left.

        Args:
            producers: Every producer, as last heard from.
            now: The time on the producers' clock.
            since: When the wait began: with no producer heard from at all, it is waited
                for `timeout` seconds from then.
            dispatcher_failure: Why the dispatcher failed, if it did.

        Raises:
            NoProducerError: The dispatcher failed, or every producer failed or went
                silent for longer than the timeout; names what became of each.
        """
        if dispatcher_failure is not None:
            raise NoProducerError(f"the dispatcher failed ({dispatcher_failure}): no rollout will come")
        if self.alive(producers, now):
            return
        if not producers:
            if since is not None and now - since <= self.timeout:
                return
            raise NoProducerError(f"no rollout worker was heard from within {self.timeout:g} s")
        fates = "; ".join(
            f"{p.name}: failed ({p.failure})"
            if p.failure is not None
            else f"{p.name}: silent for {now - p.last_beat:.1f} s (timeout {self.timeout:g} s)"
            for p in producers
        )
        raise NoProducerError(f"no rollout worker is left to produce samples: {fates}")
