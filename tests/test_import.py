import json
import subprocess
import sys


def test_import_weightpull_pulls_in_no_heavy_dependency():
    code = (
        "import sys, json, weightpull, weightpull.drivers.fake;"
        "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = set(json.loads(out.stdout))
    assert {"anyio", "attrs", "weightpull"} <= loaded
    for heavy in ("torch", "nixl", "nixl_cu12", "nixl_cu13", "zmq", "vllm", "numpy"):
        assert heavy not in loaded, heavy


def test_import_weightpull_warns_of_nothing():
    # The old paths warn when used; loading the top level, the loop and the errors must not.
    code = "import weightpull, weightpull.rl, weightpull.errors; from weightpull import *"
    subprocess.run([sys.executable, "-W", "error", "-c", code], check=True, timeout=120)
