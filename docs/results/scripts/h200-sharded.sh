#!/usr/bin/env bash
# The sharded figures of docs/guides/sharding.md, on the two-GPU H200 machine (`nvidia-h200-x2`; run
# from the repository root; carry .whl/ with attrs, cattrs, typing_extensions and pyzmq cp312
# wheels, made as docs/results/scripts/h200-gpu.sh says). First the 2-D read's conformance test over cuda_ipc
# (GPU and host slots), then one `bench sharded` run: two trainer shards (cuda:0, cuda:1) of
# the 8b preset, a TP=2 replica as two processes (cuda:0, cuda:1) each pulling its slice,
# beside one rank pulling the whole version from the same shards. $OUT/sharded-8b.json gets
# the bench's JSON line.
set -u
OUT=${OUT:-/tmp/weightpull-sharded}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl &&
    export PYTHONPATH=/tmp/site || exit 1
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null ||
    python3 -m pip install -q --no-deps --no-build-isolation --no-index . >/dev/null || exit 1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader

echo "=== tests: WEIGHTPULL_DRIVERS=cuda_ipc,cuda_ipc_host pytest tests/conformance -k 2d"
WEIGHTPULL_DRIVERS=cuda_ipc,cuda_ipc_host timeout "${TEST_LIMIT:-120}" python3 -m pytest -q -p no:cacheprovider \
    tests/conformance -k 2d 2>&1 | tail -15
echo "tests exit ${PIPESTATUS[0]}"

echo "=== bench: python3 -m weightpull bench sharded --preset ${PRESET:-8b} --transport cuda_ipc --shards 2 --ranks 2 --json"
timeout "${BENCH_LIMIT:-420}" python3 -m weightpull bench sharded --preset "${PRESET:-8b}" --transport cuda_ipc \
    --shards 2 --ranks 2 --repeat "${REPEAT:-5}" --json >"$OUT/sharded-8b.json" 2>"$OUT/sharded-8b.err"
echo "bench exit $?"
tail -20 "$OUT/sharded-8b.err"
