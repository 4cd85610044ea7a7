#!/usr/bin/env bash
# The GPU figures of docs/guides/gpu.md, and the GPU tests. Run from the repository root on the
# H200 machine (torch 2.11, numpy, pytest). The core also needs cattrs (and attrs >= 25.4),
# which that machine lacks and cannot download: carry their wheels in .whl/ (the device
# tool's `carry`), made here with
#   pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl \
#       cattrs==26.2.0 attrs==26.1.0 typing_extensions==4.16.0
# $OUT/gpu-bench.json gets the bench's JSON line.
set -u
OUT=${OUT:-/tmp/weightpull-gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
fi
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null ||
    python3 -m pip install -q --no-deps --no-build-isolation --no-index . >/dev/null || exit 1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, 'gpus', torch.cuda.device_count(), 'cpus', __import__('os').cpu_count())"

echo "=== tests: WEIGHTPULL_DRIVERS=cuda_ipc,cuda_ipc_host pytest tests/conformance tests/gpu tests/test_cuda_ipc.py tests/test_gpu_mirrors.py"
WEIGHTPULL_DRIVERS=cuda_ipc,cuda_ipc_host timeout "${TEST_LIMIT:-200}" python3 -m pytest -q -p no:cacheprovider --timeout=90 \
    tests/conformance tests/gpu tests/test_cuda_ipc.py tests/test_gpu_mirrors.py 2>&1 | tail -40
echo "tests exit ${PIPESTATUS[0]}"

echo "=== bench: python3 -m weightpull bench gpu --json ${BENCH_ARGS:-}"
timeout "${BENCH_LIMIT:-240}" python3 -m weightpull bench gpu --json ${BENCH_ARGS:-} >"$OUT/gpu-bench.json"
echo "bench exit $?"
