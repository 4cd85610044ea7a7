import anyio
import pytest

from weightpull import FakeClock, MonotonicClock
from weightpull.clock import within

from .conftest import autojump

pytestmark = pytest.mark.anyio


async def test_fake_clock_wakes_sleepers_in_deadline_order():
    clock = FakeClock()
    woke = []

    async def sleeper(name, s):
        await clock.sleep(s)
        woke.append((name, clock.now()))

    async with anyio.create_task_group() as tg:
        tg.start_soon(sleeper, "b", 2.0)
        tg.start_soon(sleeper, "a", 1.0)
        await anyio.wait_all_tasks_blocked()
        clock.advance(1.5)
        await anyio.wait_all_tasks_blocked()
        assert woke == [("a", 1.5)]
        clock.advance(0.5)
    assert woke == [("a", 1.5), ("b", 2.0)]


async def test_fake_clock_refuses_to_go_back():
    with pytest.raises(ValueError):
        FakeClock().advance(-1)


async def test_autojump_moves_time_only_when_everything_waits():
    clock = FakeClock()
    async with autojump(clock):
        await clock.sleep(100)
        assert clock.now() == 100
        await clock.sleep(0.5)
        assert clock.now() == 100.5


async def test_within_returns_result_or_times_out_on_the_given_clock():
    clock = FakeClock()

    async def slow():
        await clock.sleep(10)
        return "late"

    async def fast():
        await clock.sleep(1)
        return "done"

    async with autojump(clock):
        assert await within(clock, 5, fast) == (True, "done")
        assert await within(clock, 5, slow) == (False, None)
        assert clock.now() == 6
        assert await within(clock, None, fast) == (True, "done")


async def test_monotonic_clock_moves_forward():
    clock = MonotonicClock()
    t0 = clock.now()
    await clock.sleep(0.01)
    assert clock.now() - t0 >= 0.005


async def test_a_cancelled_sleep_is_no_deadline_for_autojump():
    clock = FakeClock()
    with anyio.move_on_after(0.01):
        await clock.sleep(50)
    assert clock.next_deadline() is None
    async with autojump(clock):
        await clock.sleep(1)
    assert clock.now() == 1
