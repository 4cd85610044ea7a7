"""`weightpull bench model --preset tiny`: the fields, their types, and ratios that agree with the
figures they come from. Never a timed assertion: the machine's speed is not under test."""

import json
import subprocess
import sys

import pytest

pytest.importorskip("torch")

from weightpull.integrations.bench.presets import PRESETS  # noqa: E402

FIGURES = ("publish_block_ms", "pull_gbps", "raw_gbps", "apply_pause_ms", "publish_to_serving_ms", "limit_gbps")


def weightpull(*args):
    return subprocess.run([sys.executable, "-m", "weightpull", *args], capture_output=True, text=True, timeout=300)


def bench(*args):
    return weightpull("bench", "model", *args)


def positive(x):
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0


def test_presets_share_one_generator():
    assert [len(PRESETS[p].shapes()) for p in ("tiny", "0.6b", "8b")] == [24, 310, 399]
    assert PRESETS["8b"].bf16_bytes() == 16_381_470_720  # Qwen3-8B in bf16, lm_head untied


def test_tiny_preset_json_against_limits_and_baselines():
    proc = bench("--preset", "tiny", "--transport", "fake", "--versions", "2", "--json")
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    # the fields of `--size`, and the new ones
    assert {
        "transport",
        "size_bytes",
        "pull_gbps",
        "raw_gbps",
        "limit_gbps",
        "ratio_to_raw",
        "to_device_gbps",
        "publish_block_ms",
        "apply_pause_ms",
        "publish_to_serving_ms",
        "limits",
        "baselines",
    } <= r.keys()
    assert r["transport"] == "fake" and r["preset"] == "tiny" and r["tensors"] == 24 and r["versions"] == 2
    assert r["size_bytes"] >= r["tensor_bytes"] == PRESETS["tiny"].bf16_bytes()
    # each path serially, then streamed (read while written), then applied in place: all byte-exact
    assert [(t["transport"], t["stream"], t["in_place"]) for t in r["transports"]] == [
        ("fake", False, False),
        ("fake", True, False),
        ("fake", False, True),
    ]
    assert all(t["byte_exact"] is True for t in r["transports"])
    in_place = r["transports"][2]
    assert in_place["mirror"] is None and in_place["pull_gbps"] is None and positive(in_place["lent_ms"])
    assert in_place["ratio_to_serial"] == round(in_place["publish_to_serving_ms"] / r["publish_to_serving_ms"], 3)
    limit = in_place["limits"]["publish_block_ms"] + in_place["limits"]["apply_pause_ms"]
    assert in_place["in_place_limit_ms"] == pytest.approx(limit, abs=0.011)
    for v in in_place["per_version_ms"]:  # serving after the trainer's publish and the apply from its slot
        assert v["serving"] + 0.03 >= max(v["block"], v["apply"])
    streamed = r["transports"][1]
    assert streamed["serial_publish_to_serving_ms"] == r["publish_to_serving_ms"]
    assert streamed["ratio_to_serial"] == round(streamed["publish_to_serving_ms"] / r["publish_to_serving_ms"], 3)
    assert streamed["limits"]["overlapped_ms"] is None  # on a CPU the gain is the ratio to the serial sum
    for key in FIGURES:
        assert positive(r[key]), key
    assert r["to_device_gbps"] is None  # a host mirror: no copy leg to the GPU
    assert r["ratio_to_raw"] == round(r["pull_gbps"] / r["raw_gbps"], 3)
    assert r["ratio_to_limit"] == round(r["pull_gbps"] / r["limit_gbps"], 3)
    assert len(r["per_version_ms"]) == 4  # one per trainer slot to warm up, then the measured ones
    # serving comes after the trainer's block, the pull and the apply of that same version
    for v in r["per_version_ms"]:
        assert v["serving"] + 0.03 >= max(v["block"], v["apply"] + v["pull"])  # each rounded to 0.01 ms

    limits = r["limits"]
    assert limits["pull_gbps"] == r["limit_gbps"] == limits["memcpy_gbps"]
    parts = ("publish_block_ms", "slot_copy_ms", "pull_ms", "apply_pause_ms")
    assert limits["publish_to_serving_ms"] == pytest.approx(sum(limits[k] for k in parts), abs=0.011)
    assert all(positive(limits[k]) for k in parts)

    by_name = {b["name"]: b for b in r["baselines"]}
    assert by_name.keys() == {"gloo", "nccl", "verl-ipc"}
    gloo = by_name["gloo"]
    assert gloo["byte_exact"] is True and gloo["buckets"] == 1
    assert all(
        positive(gloo[k]) for k in ("publish_block_ms", "apply_pause_ms", "publish_to_serving_ms", "update_gbps")
    )
    assert "skipped" in by_name["nccl"] and "skipped" in by_name["verl-ipc"]  # no GPU here

    assert "weightpull fake" in proc.stderr and "baseline gloo" in proc.stderr and "limit (" in proc.stderr
    assert "in place (applied straight from the slot; x" in proc.stderr
    assert "fake v2" in proc.stderr  # the progress bar named each step


def test_preset_and_size_exclude_each_other():
    proc = weightpull("bench", "--preset", "tiny", "--size", "1M")  # the old spelling, which had both
    assert proc.returncode == 2 and "pass one" in proc.stderr  # usage errors
    proc = bench("--preset", "tiny", "--size", "1M")
    assert proc.returncode == 2 and "unrecognized arguments: --size" in proc.stderr
    proc = bench("--preset", "huge", "--no-baselines")
    assert proc.returncode == 2 and "unknown preset" in proc.stderr


def test_the_old_spelling_still_runs_and_warns():
    """`weightpull bench --preset` is `weightpull bench model --preset` for a release, with a warning."""
    proc = weightpull("bench", "--preset", "tiny", "--transport", "fake", "--versions", "1", "--no-baselines", "--json")
    assert proc.returncode == 0, proc.stderr
    assert (
        "warning: `weightpull bench --preset` is deprecated" in proc.stderr
        and "`weightpull bench model`" in proc.stderr
    )
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["preset"] == "tiny" and r["byte_exact"] is True and r["baselines"] == []
