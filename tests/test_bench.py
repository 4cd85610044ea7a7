import json
import subprocess
import sys

import pytest

from weightpull import InvalidArgumentError
from weightpull.bench import _options, content, parse_size

KEYS = {"transport", "size_bytes", "pull_gbps", "raw_gbps", "limit_gbps", "ratio_to_raw"}


def bench(*args):
    return subprocess.run([sys.executable, "-m", "weightpull", "bench", *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(("text", "nbytes"), [("1G", 1 << 30), ("256M", 256 << 20), ("512MiB", 512 << 20), ("64k", 65536), ("4096", 4096)])
def test_sizes(text, nbytes):
    assert parse_size(text) == nbytes


@pytest.mark.parametrize("text", ["", "0", "1.5G", "-1M", "12X"])
def test_bad_sizes(text):
    with pytest.raises(InvalidArgumentError, match="size"):
        parse_size(text)


def test_options_and_content():
    assert _options(["threads=4", "pinned=true", "name=x", "progress_interval=0.5"]) == {"threads": 4, "pinned": True, "name": "x", "progress_interval": 0.5}
    with pytest.raises(InvalidArgumentError):
        _options(["threads"])
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
