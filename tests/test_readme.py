"""The README's embedding example runs as written."""

import re
import subprocess
import sys
from pathlib import Path

import pytest


def test_readme_example_runs():
    pytest.importorskip("torch")
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    code = re.search(r"```python\n(.*?)```", readme, re.S).group(1)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1", "torch.bfloat16"]
