import json
import os
import re
import signal
import subprocess
import sys

import pytest

from weightpull import list_transports

NIXL = any(d.name == "nixl" and d.available for d in list_transports())
SMALL = ("--size-mib", "16", "--versions", "4")
PROGRESS = re.compile(r"\[ *\d+\.\d\ds\] ")  # the start of each of the demo's progress lines


def run(*args, check=True):
    return subprocess.run(
        [sys.executable, "-m", "weightpull", *args], capture_output=True, text=True, check=check, timeout=300
    )


def replica_alive(pid):
    """Whether `pid` is still one of the demo's replica processes (not a reused pid)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"--replica" in f.read()
    except FileNotFoundError:
        return False


def test_help_lists_the_commands():
    out = run("--help").stdout
    assert "demo" in out and "drivers" in out
    assert "--replica " not in run("demo", "--help").stdout  # the demo's own, hidden


def test_drivers_json():
    infos = json.loads(run("drivers", "--json").stdout.splitlines()[-1])
    assert {"name": "fake", "available": True}.items() <= next(i for i in infos if i["name"] == "fake").items()


@pytest.mark.slow
@pytest.mark.parametrize(
    "transport",
    [
        pytest.param("nixl", marks=pytest.mark.skipif(not NIXL, reason="the nixl driver does not load here")),
        "fake",
    ],
)
def test_demo_json_summary_and_checks(transport):
    pytest.importorskip("torch")
    # nixl is the default where it loads: its run passes no --transport.
    proc = run("demo", "--json", *SMALL, *(("--transport", "fake") if transport == "fake" else ()), check=False)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["ok"] is True and summary["bit_exact"] is True, proc.stderr
    assert summary["transport"] == transport
    assert summary["versions_published"] == 4 and summary["replicas"] == 2
    applied = summary["versions_applied"]
    assert len(applied) == 2 and all(a[-1] == 4 for a in applied) and applied[0] == [1, 2, 3, 4]
    assert len(applied[1]) < 4  # the slow replica skipped versions
    assert summary["torn_reads_rejected"] >= 1 and summary["lease_renewals"][1] > 0
    assert isinstance(summary["pull_gbps"], float) and summary["pull_gbps"] > 0
    assert "rejected a torn read (torn on purpose)" in proc.stderr
    trainer, replicas = summary["trainer_pid"], summary["replica_pids"]
    if transport == "fake":
        assert replicas == [trainer, trainer]
    else:  # each replica ran in a process of its own, and none outlives the demo
        assert len({trainer, *replicas}) == 3 and proc.stderr.count("up in process") == 2
        assert not any(replica_alive(pid) for pid in replicas)


def _demo_until(line_wanted):
    """Start the nixl demo; return it and its replicas' pids once `line_wanted` shows.
    Unbuffered, as on CI, where a line written in two pieces would interleave with others."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "weightpull", "demo", "--transport", "nixl", *SMALL],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    pids, seen = [], []
    for line in proc.stderr:
        seen.append(line)
        assert len(PROGRESS.findall(line)) <= 1, f"two processes' lines ran together: {line!r}"
        if "up in process" in line:
            pids.append(int(line.split("up in process ")[1].split(",")[0]))
        if line_wanted in line:
            return proc, pids
    proc.wait()
    raise AssertionError("".join(seen))


@pytest.mark.slow
@pytest.mark.skipif(not NIXL, reason="the nixl driver does not load here")
def test_ctrl_c_stops_the_demo_and_its_replica_processes():
    pytest.importorskip("torch")
    proc, pids = _demo_until("published v1")
    assert len(pids) == 2 and all(replica_alive(pid) for pid in pids)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130 and "interrupted" in err and "Traceback" not in err, err
    assert not any(replica_alive(pid) for pid in pids)


@pytest.mark.slow
@pytest.mark.skipif(not NIXL, reason="the nixl driver does not load here")
def test_a_replica_process_that_dies_fails_the_demo_and_stops_the_other():
    pytest.importorskip("torch")
    proc, pids = _demo_until("published v1")
    os.kill(pids[1], signal.SIGKILL)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 1 and "was killed by SIGKILL" in err and out == "", err
    assert not any(replica_alive(pid) for pid in pids)


def test_progress_writes_each_line_whole():
    """The demo's processes share one stderr pipe. Unbuffered (PYTHONUNBUFFERED, as on CI),
    print() writes a line and its newline in two writes, between which another process's
    line could land: the cause of a flaky Ctrl-C test, whose replica pids ran together."""
    from weightpull.integrations.demo import Progress

    writes = []

    class Stream:
        write, flush = writes.append, staticmethod(lambda: None)

    Progress(Stream(), t0=0.0)("replica-0", "up in process 42, pulling over nixl")
    assert len(writes) == 1 and writes[0].endswith("up in process 42, pulling over nixl\n")


def test_demo_refuses_bad_arguments():
    proc = run("demo", "--replicas", "1", check=False)
    assert (
        proc.returncode == 2
        and proc.stderr == "error: argument --replicas: must be at least 2, got 1 (see weightpull demo --help)\n"
    )


def test_status_shows_a_streaming_versions_buckets_committed():
    from weightpull.integrations.cli import _status_sections
    from weightpull.records import RegistryStatus, VersionInfo
    from weightpull.states import VersionState

    streaming = VersionInfo(4, VersionState.STREAMING, "trainer", 0, 1 << 20, 0.5, 1, committed=3)
    ready = VersionInfo(3, VersionState.READY, "trainer", 1, 1 << 20, 9.0, 0)
    sections = dict((title, rows) for title, _, rows in _status_sections(RegistryStatus(3, (ready, streaming), (), {})))
    states = [row[1] for row in sections["versions"]]
    assert states == ["READY", "STREAMING (3 buckets committed)"]
