"""The staleness clock: how far behind the trainer the weights of a rollout are.

Weight versions are the clock. The trainer's newest version is `now`; a trajectory is as
old as `now` minus the version it *started* on, and a group (the samples of one prompt)
as old as the oldest version any of its trajectories started on. Eviction, metrics and
sampling checks all ask one `StalenessClock`, so they never disagree about what is too
stale. Sans-IO: nothing here waits or reads time.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import attrs

from ..errors import InvalidArgumentError, StaleSampleError


def _versions(value: Iterable[int]) -> tuple[int, ...]:
    versions = tuple(value)
    if not versions or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in versions):
        raise InvalidArgumentError(f"a trajectory needs one or more non-negative int versions, got {versions!r}")
    return versions


@attrs.frozen
class Trajectory:
    """One completed generation, and the weight versions that produced it, in order:
    one version, unless an update paused in `keep` mode while it ran.

    Args:
        prompt_id: The prompt it answers.
        tokens: What was generated.
        versions: The weight versions it was generated on, in order; one or more
            non-negative ints.
        group: The prompt group it belongs to.
        replica: The replica that generated it.

    Raises:
        InvalidArgumentError: `versions` is empty or holds a non-int or negative one.
    """

    prompt_id: str
    tokens: tuple[int, ...] = attrs.field(converter=tuple)
    versions: tuple[int, ...] = attrs.field(converter=_versions)
    group: str = ""
    replica: str = ""

    @property
    def start_version(self) -> int:
        return self.versions[0]


def _trajectories(value: Iterable[Trajectory]) -> tuple[Trajectory, ...]:
    return tuple(value)


@attrs.frozen
class Group:
    """The trajectories of one prompt group, consumed together.

    Args:
        id: The group's id.
        trajectories: One or more.

    Raises:
        InvalidArgumentError: `trajectories` is empty.
    """

    id: str
    trajectories: tuple[Trajectory, ...] = attrs.field(converter=_trajectories)

    def __attrs_post_init__(self) -> None:
        if not self.trajectories:
            raise InvalidArgumentError(f"group {self.id!r} has no trajectories")

    @property
    def start_version(self) -> int:
        """The oldest version any of its trajectories started on: the group's age."""
        return min(t.start_version for t in self.trajectories)


Aged = Trajectory | Group


class StalenessClock:
    """The trainer's version, and the one definition of age measured against it.

    Args:
        max_staleness: The oldest a group may be (in versions) to be trained on; >= 0.
        now: The trainer's version to start at; >= 0.

    Raises:
        InvalidArgumentError: Either is not a non-negative int.
    """

    def __init__(self, max_staleness: int, now: int = 0) -> None:
        for what, value in (("max_staleness", max_staleness), ("now", now)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise InvalidArgumentError(f"{what} must be a non-negative int, got {value!r}")
        self.max_staleness = max_staleness
        self.now = now

    def advance(self, version: int) -> None:
        """The trainer moved on to `version`.

        Raises:
            InvalidArgumentError: `version` is older than `now` (the clock never goes back).
        """
        if not isinstance(version, int) or version < self.now:
            raise InvalidArgumentError(f"the staleness clock is at {self.now}; it cannot move to {version!r}")
        self.now = version

    def age(self, item: Aged) -> int:
        """How many versions behind `now` the item started."""
        return self.now - item.start_version

    def is_stale(self, item: Aged) -> bool:
        """Whether it is older than `max_staleness`."""
        return self.age(item) > self.max_staleness

    def min_weight_version(self) -> int:
        """The `min_weight_version` to tag a prompt submitted now with: the oldest
        weights it may start on and still be fresh enough at this version."""
        return max(0, self.now - self.max_staleness)

    def evict(self, groups: Iterable[Group]) -> tuple[list[Group], list[Group]]:
        """(fresh, evicted): split a buffer of groups by age."""
        fresh: list[Group] = []
        evicted: list[Group] = []
        for g in groups:
            (evicted if self.is_stale(g) else fresh).append(g)
        return fresh, evicted

    def check(self, groups: Sequence[Group]) -> None:
        """Refuse a training sample holding any group older than `max_staleness`.

        Raises:
            StaleSampleError: Naming how many groups are stale, and the oldest.
        """
        stale = [g for g in groups if self.is_stale(g)]
        if stale:
            worst = max(stale, key=self.age)
            raise StaleSampleError(
                f"{len(stale)} of {len(groups)} groups are older than {self.max_staleness} versions at "
                f"v{self.now} (oldest: group {worst.id!r}, started on v{worst.start_version})"
            )

    def metrics(self, groups: Sequence[Group]) -> dict[str, Any]:
        """`staleness/max`, `staleness/mean` and `staleness/stale_fraction` of `groups`."""
        ages = [self.age(g) for g in groups]
        if not ages:
            return {"staleness/max": 0, "staleness/mean": 0.0, "staleness/stale_fraction": 0.0}
        return {
            "staleness/max": max(ages),
            "staleness/mean": sum(ages) / len(ages),
            "staleness/stale_fraction": sum(a > self.max_staleness for a in ages) / len(ages),
        }
