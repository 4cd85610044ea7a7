#!/usr/bin/env bash
# The streamed figures of docs/guides/streaming.md, on the H200 machine (run from the repository
# root; carry .whl/ with attrs, cattrs, typing_extensions and pyzmq cp312 wheels: the
# streamed runs use a served registry). One `bench model` run: each cuda_ipc path
# serially, then streamed, then (a GPU slot) applied in place, beside the limits and the
# baselines measured in the same run. BENCH_ARGS=--no-host-slots leaves out host slots.
set -u
OUT=${OUT:-/tmp/weightpull-stream}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl &&
    export PYTHONPATH=/tmp/site || exit 1
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null ||
    python3 -m pip install -q --no-deps --no-build-isolation --no-index . >/dev/null || exit 1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader

echo "=== tests: pytest tests/gpu/test_gpu_stream.py tests/gpu/test_gpu_pulls.py tests/test_stream.py tests/test_reserve.py tests/test_borrow.py"
timeout "${TEST_LIMIT:-150}" python3 -m pytest -q -p no:cacheprovider --timeout=90 \
    tests/gpu/test_gpu_stream.py tests/gpu/test_gpu_pulls.py tests/test_stream.py tests/test_reserve.py \
    tests/test_borrow.py 2>&1 | tail -15
echo "tests exit ${PIPESTATUS[0]}"

echo "=== bench: python3 -m weightpull bench model --preset ${PRESET:-8b} --transport cuda_ipc --versions ${VERSIONS:-5} ${BENCH_ARGS:-} --json"
timeout "${BENCH_LIMIT:-400}" python3 -m weightpull bench model --preset "${PRESET:-8b}" --transport cuda_ipc \
    --versions "${VERSIONS:-5}" --json ${BENCH_ARGS:-} >"$OUT/stream-bench.json" 2>"$OUT/stream-bench.err"
echo "bench exit $?"
grep -v "step/s\]" "$OUT/stream-bench.err" | tail -25
