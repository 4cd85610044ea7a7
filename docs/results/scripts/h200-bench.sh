#!/usr/bin/env bash
# The H200 figures of docs/guides/transports.md. Run from the repository root on the GPU machine,
# with the cp312 nixl-cu13 wheel in .whl/ (that machine has no package index). Each bench
# prints its JSON line to stdout; $OUT/h200.jsonl collects them, labelled.
set -u
OUT=${OUT:-/tmp/weightpull-h200}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null ||
    python3 -m pip install -q --no-deps --no-build-isolation --no-index . >/dev/null || exit 1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(), 'cpus', __import__('os').cpu_count())"

bench() {  # LABEL [VAR=VALUE...] -- `bench pull` ARGS...   ($LIMIT: seconds before it is stopped)
    local label=$1 envs=() ; shift
    [[ $label =~ ${ONLY:-.} ]] || return 0  # ONLY=REGEX runs the labels it matches
    while [ "$1" != "--" ]; do envs+=("$1"); shift; done; shift
    echo "=== $label: ${envs[*]} weightpull bench pull --json $*"
    env "${envs[@]}" timeout "${LIMIT:-150}" python3 -m weightpull bench pull --json "$@" >"$OUT/run.out" 2>"$OUT/run.err"
    echo "exit $?"
    grep -E "^\[bench\] round|GB/s|byte-exact|rror" "$OUT/run.err" | grep -v "^\[bench\] measuring" | tail -12
    # UCX_PROTO_INFO's tables: the protocol each get (one-sided read) got
    grep -h -A5 "read by ucp_get" "$OUT/run.out" "$OUT/run.err" | grep -E "read by|inf" | cut -d'|' -f2- | sort -u | head -8
    grep -h -iE "unreachable|no remote|no zero-copy" "$OUT/run.out" "$OUT/run.err" | sort -u | head -3
    grep '^{' "$OUT/run.out" | tail -1 | sed "s/^/{\"label\": \"$label\", \"env\": \"${envs[*]}\", \"result\": /; s/\$/}/" >>"$OUT/h200.jsonl"
}

# 1. Which UCX settings, if any, give NIXL a real GPU path (64 MiB GPU -> GPU).
G2G=(--transport nixl --slot cuda --mirror cuda --size 64M --repeat 2)
LIMIT=45 bench probe-default UCX_PROTO_INFO=y -- "${G2G[@]}"
LIMIT=45 bench probe-tls-ipc UCX_PROTO_INFO=y UCX_TLS=cuda_ipc,cuda_copy,tcp,sm,self -- "${G2G[@]}"
LIMIT=45 bench probe-no-tcp UCX_PROTO_INFO=y UCX_TLS=cuda_ipc,cuda_copy,cma,sm,self -- "${G2G[@]}"
LIMIT=45 bench probe-proto-v1 UCX_PROTO_ENABLE=n -- "${G2G[@]}"
LIMIT=45 bench probe-rndv-get UCX_PROTO_INFO=y UCX_RNDV_SCHEME=get_zcopy UCX_CUDA_IPC_CACHE=n UCX_MEMTYPE_CACHE=n -- "${G2G[@]}"
LIMIT=45 bench probe-busy-progress UCX_PROTO_INFO=y -- "${G2G[@]}" -o progress_interval=0

# 2. The paths each setup gets, at sizes past the 10% goal's 256 MiB.
LIMIT=90 bench gpu-to-gpu-direct -- --transport nixl --slot cuda --mirror cuda --size 256M --repeat 3
LIMIT=90 bench host-to-gpu-direct -- --transport nixl --slot cpu --mirror cuda --size 256M --repeat 3
bench host-to-host-256m -- --transport nixl --size 256M
bench host-to-host -- --transport nixl --size 1G
bench host-to-host-8-threads -- --transport nixl --size 1G -o threads=8
bench host-to-host-256m-buckets -- --transport nixl --size 1G --bucket-size 256M
bench host-to-host-4-threads -- --transport nixl --size 1G -o threads=4
bench host-to-gpu-staged-256m -- --transport nixl --mirror staged --size 256M
bench host-to-gpu-staged -- --transport nixl --mirror staged --size 1G
bench host-to-gpu-staged-256m-buckets -- --transport nixl --mirror staged --size 1G --bucket-size 256M
bench host-to-gpu-staged-4-threads -- --transport nixl --mirror staged --size 1G -o threads=4
bench host-to-gpu-staged-4g-4-threads -- --transport nixl --mirror staged --size 4G --repeat 3 -o threads=4
echo "=== done"
