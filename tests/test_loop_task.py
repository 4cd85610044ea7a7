"""The loop's task, prompts and settings (no processes)."""

import pytest

from weightpull.errors import InvalidArgumentError
from weightpull.integrations.loop import task
from weightpull.integrations.loop.settings import LoopConfig
from weightpull.integrations.loop.trainer import step_prompts


def test_per_digit_rewards():
    prompt = [task.BOS, task.DIGIT0 + 1, task.DIGIT0 + 2, task.DIGIT0 + 3, task.SEP]
    assert task.answer(prompt) == [task.DIGIT0 + 3, task.DIGIT0 + 2, task.DIGIT0 + 1]
    assert task.rewards(prompt, [task.DIGIT0 + 3, 0, task.DIGIT0 + 1]) == [1.0, 0.0, 1.0]
    assert task.rewards(prompt, [task.DIGIT0 + 3]) == [1.0, 0.0, 0.0]  # short: the rest is wrong


def test_a_steps_prompts_are_the_same_after_a_restart():
    cfg = LoopConfig()
    first, again = step_prompts(cfg, 5, 3), step_prompts(cfg, 5, 3)
    assert [(p.id, p.payload) for p in first] == [(p.id, p.payload) for p in again]
    assert len(first) == cfg.groups_per_step and all(p.group == p.id and p.min_weight_version == 3 for p in first)
    assert step_prompts(cfg, 6, 3)[0].payload != first[0].payload


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"steps": 3}, "steps >= 4"),
        ({"samples": 1}, "samples must be >= 2"),
        ({"groups_per_step": 1}, "groups_per_step must be >= 2"),
        ({"kill_at": 30}, "kill_at"),
        ({"max_inflight": 0}, "max_inflight"),
    ],
)
def test_bad_settings_are_named(bad, message):
    with pytest.raises(InvalidArgumentError, match=message):
        LoopConfig(**bad)
