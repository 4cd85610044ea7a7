"""`weightpull bench sharded` on the CPU: fake shards and ranks as threads, the tiny preset."""

from __future__ import annotations

import subprocess
import sys

from weightpull.integrations.bench import sharded


def test_each_rank_reads_about_half_and_every_slice_is_bit_exact():
    lines: list[str] = []
    r = sharded.run("tiny", "fake", 3, 2, 1, lines.append)
    assert r["bit_exact"] and not r["mismatched"]
    replicated = sum(p["bytes"] for p in r["per_rank"]) - r["whole_bytes"]
    assert 0 < replicated < 0.01 * r["whole_bytes"]  # the norms, read by both ranks
    assert all(0.49 < p["share"] < 0.51 for p in r["per_rank"])
    assert r["two_d"]["rows"] > r["two_d"]["reads_2d"] > 0  # row-parallel shares: 2-D reads
    assert any("bit-exact" in line for line in sharded.table(r))


def test_the_command_line_refuses_an_unknown_preset():
    cmd = [sys.executable, "-m", "weightpull", "bench", "sharded", "--preset", "nope"]
    bad = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "unknown preset 'nope'" in bad.stderr
