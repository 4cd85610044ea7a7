#!/usr/bin/env bash
# Delta versions on the one-GPU H200 machine (`nvidia-h200`: 16 cores), for docs/guides/bytes.md:
# the GPU delta tests (the torch patcher on the GPU, a Puller and the vLLM worker's mirror pair
# on cuda:0 patching each version there), then `bench.patch` on 1 to 16 threads and on cuda:0,
# which turns simulate's 16-core patch and check rates into measurements. Run from the
# repository root; carry .whl/ with the attrs, cattrs and typing_extensions cp312 wheels
# (made as docs/results/scripts/h200-gpu.sh says).
# $OUT/patch-h200.json gets the bench's JSON line, $OUT/patch-h200.txt its table.
set -u
OUT=${OUT:-/tmp/weightpull-deltas}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl &&
    export PYTHONPATH=/tmp/site || exit 1
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null ||
    python3 -m pip install -q --no-deps --no-build-isolation --no-index . >/dev/null || exit 1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, os; print('torch', torch.__version__, 'cpus', os.cpu_count())"

echo "=== tests: pytest tests/gpu/test_gpu_deltas.py tests/gpu/test_gpu_mirror_pair.py"
timeout "${TEST_LIMIT:-240}" python3 -m pytest -q -p no:cacheprovider --timeout=120 \
    tests/gpu/test_gpu_deltas.py tests/gpu/test_gpu_mirror_pair.py 2>&1 | tail -30
echo "tests exit ${PIPESTATUS[0]}"

SIZE=${SIZE:-2G} THREADS=${THREADS:-1,2,4,8,16}
echo "=== bench: python3 -m weightpull.integrations.bench.patch --size $SIZE --threads $THREADS --repeat 3 --device cuda:0"
timeout "${BENCH_LIMIT:-300}" python3 -m weightpull.integrations.bench.patch --size "$SIZE" --threads "$THREADS" \
    --repeat 3 --device cuda:0 --json >"$OUT/patch-h200.json"
echo "bench exit $?"
python3 -c "import json, sys; from weightpull.integrations.bench.patch import table
r = json.load(open(sys.argv[1])); r['seconds'] = {k: {int(t): s for t, s in v.items()} for k, v in r['seconds'].items()}
print(table(r))" "$OUT/patch-h200.json" | tee "$OUT/patch-h200.txt"
