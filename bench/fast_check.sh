#!/usr/bin/env bash
# One run on a machine of many cores: a worker, a switch and the testbed at link
# speeds of 10 and 25 Gbit/s, against gloo (docs/benchmarks.md, "Fast links in
# one run").
#
#   bash bench/fast_check.sh                 # on the 16-core machine, from a checkout
#   bash bench/fast_check.sh --small         # the same stages scaled down (2 cores)
#   bash bench/fast_check.sh --pack-tools D  # put ip, tc and their libraries in D
#
# Stages, each under `timeout` and within one budget for the whole run:
#   build        python setup.py build_ext --inplace; the three C cores must import
#   testbed-10g  4 hosts, 10 Gbit/s links, MTU 9000, 256 MiB, switch defaults,
#                switchml and gloo, median of 3 invocations (root, ip, tc)
#   engine       one rank's goodput: bench/worker_core.py, a job of one rank on
#                loopback with 1, 2, 4 and 6 I/O threads, a switch of 8 data
#                threads, 256 MiB, 3 invocations each
#   loopback     switchml bench --workers 4 8 --sizes 64, default settings,
#                median of 3 invocations
#   testbed-25g  the testbed stage at 25 Gbit/s
# then bench/fast_summary.py prints every figure beside its aim.
#
# Environment:
#   OUT                  results folder (default: ./fast-check-<time> in the checkout)
#   PYTHON               the interpreter (default: the first of python3, python that
#                        imports torch)
#   FAST_CHECK_BUDGET_S  seconds for the whole run (default 500)
#   FAST_CHECK_STAGES    the stages to run (default: all five, in the order above)
#   FAST_CHECK_TOOLS     a folder whose bin/ holds ip and tc (--pack-tools makes it),
#                        for a machine without iproute2

set -u -o pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT" || exit 2

if [ "${1:-}" = --pack-tools ]; then
    # ip and tc with the libraries they load, but the C library (the target's own);
    # bin/ holds wrappers that give the binaries their libraries, and no one else
    dest=${2:?usage: bash bench/fast_check.sh --pack-tools DIR}
    mkdir -p "$dest/bin" "$dest/libexec" "$dest/lib" || exit 2
    for tool in ip tc; do
        path=$(command -v "$tool") || { echo "no $tool here" >&2; exit 2; }
        cp "$path" "$dest/libexec/"
        ldd "$path" | awk '$3 ~ /^\// {print $3}' | grep -v -E '/(libc|libm|ld-linux[^/]*)\.so' \
            | xargs -r cp -L -t "$dest/lib/"
        # the loader's --library-path, not LD_LIBRARY_PATH: what `ip netns exec` runs
        # must not inherit these libraries
        printf '#!/bin/sh\nhere=$(dirname "$0")/..\nexec /lib64/ld-linux-x86-64.so.2 --library-path "$here/lib" "$here/libexec/%s" "$@"\n' \
            "$tool" > "$dest/bin/$tool"
        chmod +x "$dest/bin/$tool"
    done
    ls "$dest/bin" "$dest/lib"
    exit 0
fi

SMALL=0
case "${1:-}" in
    --small) SMALL=1 ;;
    "") ;;
    *) echo "usage: bash bench/fast_check.sh [--small | --pack-tools DIR]" >&2; exit 2 ;;
esac

# shellcheck source=bench/check_stages.sh
. "$ROOT/bench/check_stages.sh"
start_run fast-check "${FAST_CHECK_BUDGET_S:-500}" || exit 2
trap 'rm -f "$MARK"' EXIT

if ! find_python; then
    echo "fast_check: no python here imports torch (gloo); set PYTHON" >&2
    exit 2
fi
export PYTHON
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
[ -n "${FAST_CHECK_TOOLS:-}" ] && export PATH="$FAST_CHECK_TOOLS/bin:$PATH"

{
    say "fast_check in $ROOT, results in $OUT, budget ${BUDGET}s$([ "$SMALL" = 1 ] && echo ', --small')"
    describe_machine
    for tool in ip tc; do
        echo "$tool: $(command -v $tool || echo missing) $($tool -V 2>&1 | head -1)"
    done
} 2>&1 | tee "$OUT/environment.txt"
if ! has cryptography; then
    say "cryptography missing: jobs run open (no job secret); SWITCHML_JOB_SECRET unset"
    unset SWITCHML_JOB_SECRET
fi

want() { [[ " ${FAST_CHECK_STAGES:-build testbed-10g engine loopback testbed-25g} " == *" $1 "* ]]; }

if [ "$SMALL" = 1 ]; then
    LINKS=(1gbit 500mbit); TB_MIB=64; ENGINE_MIB=64; THREADS="1 2"; SWITCH_THREADS=1
    LOOPBACK=(--workers 2 4 --sizes 16)
else
    LINKS=(10gbit 25gbit); TB_MIB=256; ENGINE_MIB=256; THREADS="1 2 4 6"; SWITCH_THREADS=8
    LOOPBACK=(--workers 4 8 --sizes 64)
fi

engine() {
    for threads in $THREADS; do
        for run in 1 2 3; do
            # one rank alone: its engine, not two ranks' sharing the cores
            "$PYTHON" bench/worker_core.py --engines c --workers 1 --threads "$threads" \
                --switch-threads "$SWITCH_THREADS" --mib "$ENGINE_MIB" \
                --json "$OUT/engine/threads$threads-run$run.json" || return
        done
    done
}
export -f engine
export OUT THREADS SWITCH_THREADS ENGINE_MIB
mkdir -p "$OUT/engine"

# testbed LINK: 4 hosts behind links of that rate, switch defaults, the sums checked
# in the first invocation
testbed() {
    stage "testbed-$2" "$3" "$PYTHON" bench/invocations.py --runs 3 --check-first-only \
        --out "$OUT/testbed-$2" -- --testbed --link "$1" --mtu 9000 --workers 4 \
        --sizes "$TB_MIB" --repeats 5 --systems dense gloo --no-plots
}
can_testbed() {
    if [ "$(id -u)" != 0 ]; then
        skipped "$1" "the testbed needs root"
    elif ! command -v ip >/dev/null || ! command -v tc >/dev/null; then
        skipped "$1" "no ip or tc (FAST_CHECK_TOOLS: bench/fast_check.sh --pack-tools)"
    else
        return 0
    fi
    return 1
}

want build && stage build 90 bash -c check_build
want testbed-10g && can_testbed testbed-10g && testbed "${LINKS[0]}" 10g 150
want engine && stage engine 130 bash -c engine
want loopback && stage loopback 130 "$PYTHON" bench/invocations.py --runs 3 \
    --check-first-only --out "$OUT/loopback" -- "${LOOPBACK[@]}" --systems dense gloo --no-plots
want testbed-25g && can_testbed testbed-25g && testbed "${LINKS[1]}" 25g 150

say "summary"
"$PYTHON" bench/fast_summary.py "$OUT" | tee "$OUT/summary.txt"
say "done: $OUT"
