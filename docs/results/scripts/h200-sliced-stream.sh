#!/usr/bin/env bash
# The streamed sliced pull of docs/guides/sharding.md ("Measured"), on the one-GPU H200 machine
# (`nvidia-h200`; run from the repository root; carry .whl/ with attrs, cattrs, typing_extensions
# and pyzmq cp312 wheels, made as docs/results/scripts/h200-gpu.sh says, pyzmq beside them: the
# streamed part's trainer marks its buckets in a served registry). One `bench sharded` run of the
# 8b preset over cuda_ipc, every process on cuda:0: two trainer shards and a TP=2 replica's two
# ranks pulling their slices beside one rank pulling the whole; then one trainer publishing the
# whole version while the ranks read their slices behind its copy, beside the same pull after
# the publish and rank 0 streaming the whole version. Peak GPU memory about 100 GB (the streamed
# part: the trainer's model and two slots, 49 GB; each rank's slice mirror and a whole one).
# $OUT/sliced-stream-8b.json gets the bench's JSON line.
set -u
OUT=${OUT:-/tmp/weightpull-sliced-stream}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl &&
    export PYTHONPATH=/tmp/site || exit 1
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null ||
    python3 -m pip install -q --no-deps --no-build-isolation --no-index . >/dev/null || exit 1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader

echo "=== bench: python3 -m weightpull bench sharded --preset ${PRESET:-8b} --transport cuda_ipc --shards 2 --ranks 2 --json"
timeout "${BENCH_LIMIT:-540}" python3 -m weightpull bench sharded --preset "${PRESET:-8b}" --transport cuda_ipc \
    --shards 2 --ranks 2 --repeat "${REPEAT:-5}" --json >"$OUT/sliced-stream-8b.json" 2>"$OUT/sliced-stream-8b.err"
echo "bench exit $?"
tail -25 "$OUT/sliced-stream-8b.err"
