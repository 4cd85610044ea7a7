import json
import subprocess
import sys

import pytest


def run(*args, check=True):
    return subprocess.run([sys.executable, "-m", "weightpull", *args], capture_output=True, text=True, check=check, timeout=300)


def test_help_lists_the_commands():
    out = run("--help").stdout
    assert "demo" in out and "drivers" in out


def test_drivers_json():
    infos = json.loads(run("drivers", "--json").stdout.splitlines()[-1])
    assert {"name": "fake", "available": True}.items() <= infos[0].items()


@pytest.mark.slow
def test_demo_json_summary_and_checks():
    pytest.importorskip("torch")
    proc = run("demo", "--json", "--size-mib", "16", "--versions", "4")
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["ok"] is True and summary["bit_exact"] is True
    assert summary["transport"] == "fake"
    assert summary["versions_published"] == 4 and summary["replicas"] == 2
    applied = summary["versions_applied"]
    assert len(applied) == 2 and all(a[-1] == 4 for a in applied) and applied[0] == [1, 2, 3, 4]
    assert len(applied[1]) < 4  # the slow replica skipped versions
    assert summary["torn_reads_rejected"] >= 1 and summary["lease_renewals"][1] > 0
    assert isinstance(summary["pull_gbps"], float) and summary["pull_gbps"] > 0
    assert "rejected a torn read (torn on purpose)" in proc.stderr


def test_demo_refuses_bad_arguments():
    proc = run("demo", "--replicas", "1", check=False)
    assert proc.returncode != 0 and "at least 2 replicas" in proc.stderr
