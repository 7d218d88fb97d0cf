#!/bin/sh
# Session 11's A/B of docs/benchmarks.md: session 10's code (03eda65, built in a
# worktree) against this checkout's, interleaved, on the same machine at the
# same time: the switch alone twice, then 100 MiB on loopback and 64 MiB at
# MTU 1500 on the testbed three times each.  Results in bench/results/s11/ab/
# ("s10wt-*": session 10's code, "main-*": this checkout's).
# Another session's A/B: BASE (the commit), OLD (its worktree), OUT (the folder),
# CASES (of "core lo m1500"); session 12's:
#   BASE=77c7de7 OLD=/tmp/s11wt OUT=bench/results/s12/ab CASES="lo m1500" sh bench/campaigns/session11_ab.sh
set -e
cd "$(dirname "$0")/../.."
HERE=$(pwd)
PY=${PY:-$HERE/.venv/bin/python}
OUT=$HERE/${OUT:-bench/results/s11/ab}
BASE=${BASE:-03eda65}
OLD=${OLD:-/tmp/s10wt}
CASES=${CASES:-core lo m1500}
mkdir -p "$OUT"
[ -d "$OLD" ] || git worktree add -q "$OLD" "$BASE"
(cd "$OLD" && $PY setup.py build_ext --inplace > /dev/null)
name() { [ "$1" = "$OLD" ] && echo "$(basename "$OLD")" || echo main; }
case " $CASES " in *" core "*)
for i in 1 2; do
  for tree in "$OLD" "$HERE"; do
    (cd "$tree" && PYTHONPATH=$tree $PY bench/switch_core.py --json "$OUT/$(name "$tree")-core-$i.json")
  done
done;; esac
case " $CASES " in *" lo "*)
for i in 1 2 3; do
  for tree in "$OLD" "$HERE"; do
    (cd "$tree" && PYTHONPATH=$tree $PY -m bench --workers 4 --sizes 100 --repeats 5 \
        --systems dense gloo --no-plots --out "$OUT/$(name "$tree")-lo-$i")
  done
done;; esac
case " $CASES " in *" m1500 "*)
for i in 1 2 3; do
  for tree in "$OLD" "$HERE"; do
    (cd "$tree" && PYTHONPATH=$tree $PY -m bench --testbed --link 1gbit --workers 4 --sizes 64 \
        --repeats 5 --systems dense --no-plots --out "$OUT/$(name "$tree")-m1500-$i")
  done
done;; esac
