"""The suite's xdist scheduler (tests/scheduling.py): a worker that dies mid-run fails
the test it died on if it dies there twice, quoting the worker's fatal-error dump; a test
that crashed its worker once and passes on a fresh one passes, the crash printed at the
end; and the run ends with every other test run. With xdist 3.8's own
`LoadScopeScheduling` this run never ends. And the queue's order: the vLLM unit first,
the tail last, its longest tests first."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("xdist")

ROOT = Path(__file__).resolve().parents[1]

CONFTEST = """
from tests.conftest import (
    pytest_configure, pytest_handlecrashitem, pytest_terminal_summary, pytest_unconfigure, pytest_xdist_make_scheduler
)
"""


def run_project(tmp_path: Path, crashing: str) -> tuple[int, str, Path]:
    """Ten tests in eight files on two workers, `test_03.py` holding `crashing`; the exit
    status, the output and the folder of the workers' logs."""
    (tmp_path / "conftest.py").write_text(CONFTEST)
    files = {f"test_{i:02d}.py": "def test_one():\n    pass\n" for i in range(8)}  # units of one test
    files["test_03.py"] = (
        f"import os, pathlib\n\ndef test_before():\n    pass\n\n{crashing}\ndef test_after():\n    pass\n"
    )
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    tmp = tmp_path / "tmp"  # where the workers' stderr logs go
    tmp.mkdir()
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "2", "-p", "no:cacheprovider", str(tmp_path)],
        cwd=tmp_path,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "TMPDIR": str(tmp)},
        capture_output=True,
        text=True,
        timeout=60,  # past it, the run hung: the fault this scheduler mends
    )
    return run.returncode, run.stdout + run.stderr, tmp


def test_a_test_that_crashes_its_worker_twice_fails_with_its_last_words_and_the_run_ends(tmp_path):
    status, out, tmp = run_project(tmp_path, "def test_crash():\n    os.abort()\n")
    assert status == 1, out
    assert "1 failed, 9 passed" in out, out
    assert "test_03.py::test_crash" in out and "crashed while running" in out, out
    # The failure quotes the dump: which test, in which frame, not only the test's name.
    report = out.split("= FAILURES =", 1)[1].split("short test summary info", 1)[0]
    words = report.split("--- the end of its stderr ---", 1)[1]
    assert "Fatal Python error: Aborted" in words and "line 7 in test_crash" in words, out
    assert "site-packages/_pytest/" not in words  # the runner's own frames left out
    assert out.count("crashed running test_03.py::test_crash (") == 2, out  # both crashes, at the end
    assert not list(tmp.glob("weightpull-tests-*")), "the workers' logs were left behind"


def test_a_test_whose_worker_crashed_once_runs_again_on_a_fresh_one(tmp_path):
    flag = tmp_path / "crashed-once"
    status, out, tmp = run_project(
        tmp_path,
        f"def test_crash():\n    if not pathlib.Path({str(flag)!r}).exists():\n        pathlib.Path({str(flag)!r}).touch()\n        os.abort()\n",
    )
    assert status == 0, out
    assert "10 passed" in out, out
    said = out.split("crashed running test_03.py::test_crash (run again on a fresh worker)", 1)[1]
    assert "Fatal Python error: Aborted" in said and "in test_crash" in said, out


def test_the_vllm_unit_is_queued_first_and_the_tail_last_its_longest_tests_first_each_before_a_short_one():
    from tests.scheduling import queue_key

    stopped = "tests/test_demo_processes.py::test_a_stopped_demo_leaves_no_process_behind"
    queued = [
        "tests/test_vllm.py::test_fp32_publish_each_replica_greedy_equals_transformers",
        "tests/test_vllm_apply.py::test_fsdp_publisher_of_a_tied_llama_under_checkpoint_names_reaches_vllm_whole",
        "tests/test_registry.py::test_versions_are_announced_in_order",
        "tests/test_loop_demo.py::test_loop_demo_json",
        "tests/test_loop_demo.py::test_the_loop_needs_vllm_replicas",
        "tests/test_vllm_demo.py::test_vllm_demo_json",
        "tests/test_loop_demo.py::test_kill_at_is_for_the_loop_alone",
        f"{stopped}[vllm-demo-pid-sigterm]",
        f"{stopped}[nixl-demo-group-sigterm]",
        f"{stopped}[bench-pid-sigterm]",
    ]
    collected = [queued[i] for i in (8, 9, 2, 4, 6, 0, 5, 7, 3, 1)]  # the order of equals is kept
    assert sorted(collected, key=queue_key) == queued
