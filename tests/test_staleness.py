import pytest

from weightpull.errors import InvalidArgumentError, StaleSampleError
from weightpull.rl.staleness import Group, StalenessClock, Trajectory


def traj(*versions: int, prompt: str = "p") -> Trajectory:
    return Trajectory(prompt, (1, 2), versions)


def test_a_group_is_as_old_as_the_oldest_version_its_trajectories_started_on():
    clock = StalenessClock(max_staleness=2, now=10)
    group = Group("g", [traj(9), traj(7, 8), traj(10)])
    assert group.start_version == 7
    assert clock.age(group) == 3 and clock.is_stale(group)
    assert clock.age(traj(7, 8)) == 3  # a trajectory's age counts from where it started


def test_eviction_metrics_and_sampling_checks_read_one_clock():
    clock = StalenessClock(max_staleness=1, now=5)
    fresh, old = Group("fresh", [traj(5), traj(4)]), Group("old", [traj(5), traj(3)])
    clock.check([fresh])
    assert clock.evict([fresh, old]) == ([fresh], [old])
    assert clock.metrics([fresh, old]) == {"staleness/max": 2, "staleness/mean": 1.5, "staleness/stale_fraction": 0.5}
    with pytest.raises(StaleSampleError, match="group 'old', started on v3"):
        clock.check([fresh, old])
    clock.advance(6)  # the trainer moves on: the same groups age, everywhere at once
    assert clock.evict([fresh, old]) == ([], [fresh, old])
    assert clock.metrics([fresh])["staleness/max"] == 2


def test_prompts_are_tagged_with_the_oldest_version_still_fresh():
    clock = StalenessClock(max_staleness=2)
    assert clock.min_weight_version() == 0
    clock.advance(7)
    assert clock.min_weight_version() == 5


@pytest.mark.parametrize(
    "bad",
    [
        lambda: StalenessClock(-1),
        lambda: StalenessClock(1, now=3).advance(2),
        lambda: Trajectory("p", (), ()),
        lambda: Group("g", []),
    ],
)
def test_bad_values_are_refused(bad):
    with pytest.raises(InvalidArgumentError):
        bad()
