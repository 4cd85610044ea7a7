"""`weightpull bench sharded` on the CPU: fake shards and ranks as threads, the tiny preset."""

from __future__ import annotations

import subprocess
import sys

import pytest

from weightpull.integrations.bench import sharded, sharded_stream


def test_each_rank_reads_about_half_and_every_slice_is_bit_exact():
    lines: list[str] = []
    r = sharded.run("tiny", "fake", 3, 2, 1, lines.append)
    assert r["bit_exact"] and not r["mismatched"]
    replicated = sum(p["bytes"] for p in r["per_rank"]) - r["whole_bytes"]
    assert 0 < replicated < 0.01 * r["whole_bytes"]  # the norms, read by both ranks
    assert all(0.49 < p["share"] < 0.51 for p in r["per_rank"])
    assert r["two_d"]["rows"] > r["two_d"]["reads_2d"] > 0  # row-parallel shares: 2-D reads
    # streamed: a trainer publishing whole while the ranks read, each way timed once after warming up
    st = r["streamed"]
    assert st["bit_exact"] and not st["mismatched"]
    assert all(len(st["rounds"][way]) == 1 and st["publish_to_held_s"][way] > 0 for way in sharded_stream.WAYS)
    held = st["publish_to_held_s"]
    assert st["streamed_vs_whole"] == pytest.approx(held["sliced_streamed"] / held["whole_streamed"], abs=1e-3)
    assert st["streamed_vs_after"] == pytest.approx(held["sliced_streamed"] / held["sliced_after"], abs=1e-3)
    table = sharded.table(r)
    assert any("bit-exact" in line for line in table) and any("ratio streamed/whole" in line for line in table)


def test_a_streamed_slice_unlike_its_whole_pull_is_reported(monkeypatch):
    """The streamed check compares every rank's slice with its own whole pull, sliced: an
    oracle that disagrees (here, off by one in every element) shows as mismatched."""

    def off_by_one(whole, param, device):
        return sharded.expected(whole, param, device) + 1

    monkeypatch.setattr(sharded_stream, "expected", off_by_one)  # the ranks are threads of this process
    r = sharded.run("tiny", "fake", 2, 2, 1, lambda line: None)
    assert not r["streamed"]["bit_exact"] and not r["bit_exact"]
    assert set(r["streamed"]["mismatched"]) == {0, 1} and not r["mismatched"]  # the unstreamed check is sharded's own
    assert any(line.startswith("MISMATCHED") for line in sharded.table(r))


def test_the_command_line_refuses_an_unknown_preset():
    cmd = [sys.executable, "-m", "weightpull", "bench", "sharded", "--preset", "nope"]
    bad = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "unknown preset 'nope'" in bad.stderr
