"""The suite's xdist scheduler (tests/scheduling.py): a worker that dies mid-run fails
the test it died on, once, and the run still ends with every other test run. With
xdist 3.8's own `LoadScopeScheduling` this run never ends."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("xdist")

ROOT = Path(__file__).resolve().parents[1]

CONFTEST = """
from tests.scheduling import ByFile

def pytest_xdist_make_scheduler(config, log):
    config.option.loadscopereorder = False
    return ByFile(config, log)
"""


def test_a_crashed_worker_fails_its_test_and_the_run_ends(tmp_path):
    (tmp_path / "conftest.py").write_text(CONFTEST)
    files = {f"test_{i:02d}.py": "def test_one():\n    pass\n" for i in range(8)}  # units of one test
    files["test_03.py"] = (
        "import os\n\ndef test_before():\n    pass\n\ndef test_crash():\n    os.abort()\n\ndef test_after():\n    pass\n"
    )
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "2", "-p", "no:cacheprovider", str(tmp_path)],
        cwd=tmp_path,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,  # past it, the run hung: the fault this scheduler mends
    )
    out = run.stdout + run.stderr
    assert run.returncode == 1, out
    assert "1 failed, 9 passed" in out, out
    assert "test_03.py::test_crash" in out and "crashed while running" in out, out
