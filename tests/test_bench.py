import json
import subprocess
import sys

import pytest

from weightpull import InvalidArgumentError
from weightpull.integrations.bench.pull import content
from weightpull.integrations.bench.util import parse_size, transport_options

KEYS = {"transport", "size_bytes", "pull_gbps", "raw_gbps", "limit_gbps", "ratio_to_raw"}


def weightpull(*args):
    return subprocess.run([sys.executable, "-m", "weightpull", *args], capture_output=True, text=True, timeout=120)


def bench(*args):
    return weightpull("bench", "pull", *args)


@pytest.mark.parametrize(
    ("text", "nbytes"), [("1G", 1 << 30), ("256M", 256 << 20), ("512MiB", 512 << 20), ("64k", 65536), ("4096", 4096)]
)
def test_sizes(text, nbytes):
    assert parse_size(text) == nbytes


@pytest.mark.parametrize("text", ["", "0", "1.5G", "-1M", "12X"])
def test_bad_sizes(text):
    with pytest.raises(InvalidArgumentError, match="size"):
        parse_size(text)


def test_options_and_content():
    assert transport_options(["threads=4", "pinned=true", "name=x", "progress_interval=0.5"]) == {
        "threads": 4,
        "pinned": True,
        "name": "x",
        "progress_interval": 0.5,
    }
    with pytest.raises(InvalidArgumentError):
        transport_options(["threads"])
    data = content(3 << 20)
    assert len(data) == 3 << 20 and data[1 << 20 : (1 << 20) + 8] == (1).to_bytes(8, "little")


@pytest.mark.parametrize("transport", ["fake", "nixl"])
def test_bench_json(transport):
    proc = bench("--transport", transport, "--size", "8M", "--bucket-size", "2M", "--repeat", "2", "--json")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert KEYS <= result.keys()
    assert result["transport"] == transport and result["size_bytes"] == 8 << 20 and result["buckets"] == 4
    assert result["byte_exact"] is True
    assert result["publisher_process"] is (transport != "fake")
    for key in ("pull_gbps", "raw_gbps", "limit_gbps"):
        assert result[key] > 0
    assert result["ratio_to_raw"] == round(result["pull_gbps"] / result["raw_gbps"], 3)
    assert "round 2/2" in proc.stderr and "pull/raw" in proc.stderr


def test_bench_refuses_what_it_cannot_do():
    proc = bench("--transport", "fake", "--mirror", "cuda", "--size", "1M")
    assert proc.returncode == 2 and "host memory only" in proc.stderr  # a usage error
    proc = bench("--size", "lots")
    assert proc.returncode == 2 and "size must be" in proc.stderr


def test_the_old_spelling_still_runs_and_warns():
    """`weightpull bench --size` is `weightpull bench pull --size` for a release, with a warning."""
    proc = weightpull("bench", "--size", "2M", "--bucket-size", "1M", "--repeat", "1", "--json")
    assert proc.returncode == 0, proc.stderr
    assert (
        "warning: `weightpull bench --size` is deprecated" in proc.stderr
        and "`weightpull bench pull --size`" in proc.stderr
    )
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert KEYS <= result.keys() and result["byte_exact"] is True and result["size_bytes"] == 2 << 20
    proc = weightpull("bench", "--size", "1M", "--preset", "tiny")
    assert proc.returncode == 2 and "--preset measures a model-shaped set" in proc.stderr


def test_the_new_spellings_do_not_warn():
    proc = bench("--size", "1M", "--repeat", "1")
    assert proc.returncode == 0, proc.stderr
    assert "deprecated" not in proc.stderr


def test_bench_help_names_every_figure():
    proc = weightpull("bench", "--help")
    assert proc.returncode == 0 and "deprecated" not in proc.stderr
    for figure in ("pull", "model", "gpu", "fsdp", "registry"):
        assert figure in proc.stdout


@pytest.mark.parametrize(("module", "figure"), [("gpu_bench", "gpu"), ("fsdp_bench", "fsdp")])
def test_the_old_module_paths_warn(module, figure):
    pytest.importorskip("torch")
    proc = subprocess.run(
        [sys.executable, "-m", f"weightpull.integrations.{module}", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert f"`python -m weightpull.integrations.{module}` is deprecated" in proc.stderr
    assert f"weightpull bench {figure}" in proc.stdout  # the new command's help
    code = f"import weightpull.integrations.{module}"
    proc = subprocess.run(
        [sys.executable, "-W", "error::DeprecationWarning", "-c", code], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 1 and f"weightpull.integrations.{module} is deprecated" in proc.stderr


def test_the_core_imports_no_bench():
    code = "import sys, weightpull, weightpull.integrations.cli; print(sorted(m for m in sys.modules if 'bench' in m))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60).stdout
    assert out.strip() == "[]"
