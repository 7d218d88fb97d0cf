#!/usr/bin/env bash
# One run on a GPU machine: build the C cores, run the CUDA tests, and measure
# switchml against gloo on CUDA and CPU tensors and under DDP (docs/benchmarks.md,
# "A GPU host in one run").
#
#   bash bench/gpu_check.sh              # on the GPU machine, from a checkout
#   bash bench/gpu_check.sh --cpu-only   # the same stages end to end, tiny, no GPU needed
#
# Stages, each under `timeout` (SIGINT, then SIGKILL 15 s later) and within one
# budget for the whole run, each line stamped with the time:
#   build       python setup.py build_ext --inplace; the three C cores must import
#   tests       pytest tests/test_torch_cuda.py tests/test_fresh_memory.py
#   bench-cuda  switchml bench --device cuda, 45 MiB, K = 2 4 8 ranks of this host,
#               switchml and gloo in each invocation, median of 3 invocations
#   bench-cpu   the same with --device cpu
#   ddp         bench/ddp_resnet.py --device cuda, K = 2 4: ResNet-18, batch 32 of 224x224,
#               3 launches of each backend in turn, the median kept; 3 more steps of
#               each first launch profiled (profiles/: Chrome traces, op tables)
#   ddp-modes   the ddp stage's switchml at K = 4 with SWITCHML_CUDA_COPIES=whole, then
#               =pipelined (3 launches each, switchml alone): fewer waits for the
#               GPU a call, where the ranks time-share one
#   cuda-modes  switchml alone, one invocation each, in this order (bench-cuda holds
#               the default's): the CUDA and the CPU bench with SWITCHML_LOCAL_SEGMENT
#               of 8 MiB, the CPU bench (the CPU call a CUDA call is set against
#               where bench-cpu did not run), the CUDA bench with
#               SWITCHML_CUDA_COPIES=whole and =pipelined
# then bench/gpu_summary.py prints the table of every figure against its aim.
#
# Environment:
#   OUT                  results folder (default: ./gpu-check-<time> in the checkout)
#   PYTHON               the interpreter (default: the first of python3, python that
#                        imports torch)
#   GPU_CHECK_BUDGET_S   seconds for the whole run (default 560: one call of a lent
#                        machine; the first five stages take about 600 s, so split
#                        them over two calls with GPU_CHECK_STAGES and summarise
#                        both folders: "build tests bench-cuda", then "build
#                        bench-cpu ddp ddp-modes")
#   GPU_CHECK_STAGES     the stages to run (default: all seven, in the order above)
#   GPU_CHECK_WORKERS    the benches' K (default "2 4 8")
#   GPU_CHECK_DEPS       a folder put first on PYTHONPATH: pure-Python packages the
#                        machine lacks (pytest and its dependencies, tqdm) or
#                        cryptography unpacked from its wheel
#
# Without the `cryptography` package torch jobs run open: switchml.torch makes no
# job secret then (a warning says so) and needs none; only a SWITCHML_JOB_SECRET
# set in the environment would ask for signatures, so the run unsets it there.
# --cpu-only hides cryptography (as on a machine without it), skips bench-cuda,
# and runs tiny sizes: 1 MiB, K = 2, DDP on the CPU with 32x32 images.

set -u -o pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT" || exit 2

CPU_ONLY=0
case "${1:-}" in
    --cpu-only) CPU_ONLY=1 ;;
    "") ;;
    *) echo "usage: bash bench/gpu_check.sh [--cpu-only]" >&2; exit 2 ;;
esac

# shellcheck source=bench/check_stages.sh
. "$ROOT/bench/check_stages.sh"
start_run gpu-check "${GPU_CHECK_BUDGET_S:-560}" || exit 2
SHIM=""
cleanup() {
    rm -f "$MARK"
    [ -n "$SHIM" ] && rm -rf "$SHIM"
}
trap cleanup EXIT

# ------------------------------------------------------------------ the interpreter
if ! find_python; then
    echo "gpu_check: no python here imports torch; set PYTHON" >&2
    exit 2
fi
export PYTHONPATH="$ROOT${GPU_CHECK_DEPS:+:$GPU_CHECK_DEPS}${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

if [ "$CPU_ONLY" = 1 ]; then
    # as on the GPU machine: no cryptography (an import of it fails)
    SHIM=$(mktemp -d)
    mkdir "$SHIM/cryptography"
    echo 'raise ImportError("hidden by bench/gpu_check.sh --cpu-only")' \
        > "$SHIM/cryptography/__init__.py"
    export PYTHONPATH="$SHIM:$PYTHONPATH"
fi

# ------------------------------------------------------------------ the machine
{
    say "gpu_check in $ROOT, results in $OUT, budget ${BUDGET}s$([ "$CPU_ONLY" = 1 ] && echo ', --cpu-only')"
    describe_machine
} 2>&1 | tee "$OUT/environment.txt"

if ! has cryptography; then
    say "cryptography missing: torch jobs run open (no job secret); SWITCHML_JOB_SECRET unset"
    unset SWITCHML_JOB_SECRET
fi
if [ "$CPU_ONLY" = 0 ] && ! "$PYTHON" -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
    say "torch sees no CUDA device: the CUDA stages will fail (or run with --cpu-only)"
fi

# ------------------------------------------------------------------ stages
want() { [[ " ${GPU_CHECK_STAGES:-build tests bench-cuda bench-cpu ddp ddp-modes cuda-modes} " == *" $1 "* ]]; }

if [ "$CPU_ONLY" = 1 ]; then
    SIZES=1; WORKERS="2"; PER_HOST=2; TESTS_K=(-k "cuda or pool")
    DDP=(--device cpu --workers 2 --batch 2 --image 32 --warmup 1 --steps 2)
else
    SIZES=45; WORKERS=${GPU_CHECK_WORKERS:-2 4 8}; PER_HOST=8; TESTS_K=()
    DDP=(--device cuda --workers 2 4 --batch 32 --image 224 --warmup 5 --steps 20 --runs 3)
fi
# K ranks of one host: --ranks-per-host at least the largest K; the median of 3
# invocations, each its median of 10 calls after 50 (a steady state: the buffers made,
# Python's and the driver's allocations at their high-water mark);
# the first invocation checks the sums (rebuilding 8 ranks' 45 MiB inputs and the
# bound takes seconds), every one that the ranks' results are bit-identical.
BENCH=(--workers $WORKERS --ranks-per-host $PER_HOST --sizes $SIZES --warmup 50 --repeats 10
       --systems dense gloo --timeout 60)

export PYTHON
# caps: what each stage took on an H100 VM of 16 cores (an invocation of a bench
# about 45 s, the tests 133 s, a DDP launch 17 s, 12 of them), with room
want build && stage build 90 bash -c check_build
if want tests; then
    if has pytest; then
        stage tests 180 "$PYTHON" -m pytest -q -p no:cacheprovider --junitxml="$OUT/tests.xml" \
            tests/test_torch_cuda.py tests/test_fresh_memory.py ${TESTS_K[@]+"${TESTS_K[@]}"}
    else
        skipped tests "pytest is not importable (put it in GPU_CHECK_DEPS)"
    fi
fi
if want bench-cuda && [ "$CPU_ONLY" = 0 ]; then
    stage bench-cuda 230 "$PYTHON" bench/invocations.py --runs 3 --check-first-only \
        --out "$OUT/bench-cuda" -- --device cuda "${BENCH[@]}"
fi
want bench-cpu && stage bench-cpu 220 "$PYTHON" bench/invocations.py --runs 3 \
    --check-first-only --out "$OUT/bench-cpu" -- --device cpu "${BENCH[@]}"
want ddp && stage ddp 330 "$PYTHON" bench/ddp_resnet.py "${DDP[@]}" --timeout 60 \
    --out "$OUT/ddp.json" --profile-dir "$OUT/profiles"

# SWITCHML_CUDA_COPIES's other ways and other segments, switchml alone, one
# invocation each, the most telling first (the stage's cap cuts the rest)
alone() {  # alone DEVICE NAME [VAR=VALUE ...]: that device's bench under those variables
    local device=$1 name=$2
    shift 2
    env "$@" "$PYTHON" bench/invocations.py --runs 1 --check-first-only \
        --out "$OUT/bench-$device-$name" -- --device "$device" --workers $WORKERS \
        --ranks-per-host "$PER_HOST" --sizes "$SIZES" --warmup 50 --repeats 10 \
        --systems dense --timeout 60
}
cuda_modes() {
    # direct copies in segments of 8 MiB (a quarter of the copies), and the CPU
    # call in the same segments: what that segment would do as the default
    alone cuda segment8m SWITCHML_LOCAL_SEGMENT=8388608
    alone cpu segment8m SWITCHML_LOCAL_SEGMENT=8388608
    # the CPU call of the same size, in the same call of the machine
    alone cpu switchml
    alone cuda whole SWITCHML_CUDA_COPIES=whole
    alone cuda pipelined SWITCHML_CUDA_COPIES=pipelined
}
# DDP at K = 4 under SWITCHML_CUDA_COPIES's other ways (switchml alone; the ddp stage
# has the default's and gloo's)
ddp_modes() {
    local mode
    for mode in whole pipelined; do
        # shellcheck disable=SC2086  # DDP_ARGS: words
        "$PYTHON" bench/ddp_resnet.py $DDP_ARGS --workers 4 --backends switchml \
            --set "SWITCHML_CUDA_COPIES=$mode" --timeout 60 --out "$OUT/ddp-$mode.json"
    done
}
export -f alone cuda_modes ddp_modes
export DDP_ARGS="${DDP[*]}"
export OUT WORKERS PER_HOST SIZES
if want ddp-modes && [ "$CPU_ONLY" = 0 ]; then
    stage ddp-modes 160 bash -c ddp_modes
fi
if want cuda-modes && [ "$CPU_ONLY" = 0 ]; then
    stage cuda-modes 240 bash -c cuda_modes
fi

say "summary"
"$PYTHON" bench/gpu_summary.py "$OUT" | tee "$OUT/summary.txt"
if compgen -G "$OUT/profiles/*.json" > /dev/null; then
    "$PYTHON" bench/trace_summary.py "$OUT"/profiles/*.json | tee "$OUT/profiles/summary.txt"
fi
say "done: $OUT"
