#!/bin/sh
# Session 11's A/B of docs/benchmarks.md: session 10's code (03eda65, built in a
# worktree) against this checkout's, interleaved, on the same machine at the
# same time: the switch alone twice, then 100 MiB on loopback and 64 MiB at
# MTU 1500 on the testbed three times each.  Results in bench/results/s11/ab/
# ("s10wt-*": session 10's code, "main-*": this checkout's).
set -e
cd "$(dirname "$0")/../.."
HERE=$(pwd)
PY=${PY:-$HERE/.venv/bin/python}
OUT=$HERE/bench/results/s11/ab
OLD=${OLD:-/tmp/s10wt}
mkdir -p "$OUT"
[ -d "$OLD" ] || git worktree add -q "$OLD" 03eda65
(cd "$OLD" && $PY setup.py build_ext --inplace > /dev/null)
name() { [ "$1" = "$OLD" ] && echo s10wt || echo main; }
for i in 1 2; do
  for tree in "$OLD" "$HERE"; do
    (cd "$tree" && PYTHONPATH=$tree $PY bench/switch_core.py --json "$OUT/$(name "$tree")-core-$i.json")
  done
done
for i in 1 2 3; do
  for tree in "$OLD" "$HERE"; do
    (cd "$tree" && $PY -m bench --workers 4 --sizes 100 --repeats 5 --systems dense gloo \
        --no-plots --out "$OUT/$(name "$tree")-lo-$i")
  done
done
for i in 1 2 3; do
  for tree in "$OLD" "$HERE"; do
    (cd "$tree" && $PY -m bench --testbed --link 1gbit --workers 4 --sizes 64 --repeats 5 \
        --systems dense --no-plots --out "$OUT/$(name "$tree")-m1500-$i")
  done
done
