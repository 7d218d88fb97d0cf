#!/bin/sh
# The measurements of docs/benchmarks.md's "Session 10" section, one after the
# other, on a quiet machine (root, for the testbed).  Each line is the median of
# 3 invocations (bench/invocations.py) unless it says --runs 1; results in
# bench/results/s10/.  Session 10's code: the C engine quantises with cvtps2dq,
# four values at a time (its costliest loop before).
set -e
cd "$(dirname "$0")/../.."
OUT=bench/results/s10
. bench/campaigns/common.sh
case "${1:-all}" in
  all|lo)
    inv lo-n4-100mib --workers 4 --sizes 100 --repeats 5 --systems dense gloo
    inv lat-lo-n4 --workers 4 --sizes 0.000003814697265625 0.0009765625 0.015625 0.25 1 4 --repeats 20 --systems dense gloo
    ;;
esac
case "${1:-all}" in
  all|ddp)
    $PY bench/train.py --workers 4 --testbed --link 1gbit --mtu 9000 --runs 3 \
        --only 'digits gloo' 'digits switchml' \
        --digits-args '--epochs 3 --hidden 2048' --out $OUT/train-testbed-digits-hidden2048.json
    ;;
esac
