"""docs/guides/loop.md's adoption example runs as written: publish, enqueue, sample."""

import re
import subprocess
import sys
from pathlib import Path


def test_the_three_calls_run_as_the_docs_write_them():
    page = (Path(__file__).resolve().parents[1] / "docs" / "guides" / "loop.md").read_text()
    code = re.search(r"```python\n(.*?)```", page, re.S).group(1)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["1 s1-0 s1-1 0", "2 s2-0 s2-1 0", "3 s3-0 s3-1 0"]
