#!/bin/sh
# The measurements of docs/benchmarks.md's "Session 6" section, one after the
# other, on a quiet machine (root, for the testbed).  Each line is the median of
# 3 invocations (bench/invocations.py); results in bench/results/s6/.
set -e
cd "$(dirname "$0")/../.."
OUT=bench/results/s6
. bench/campaigns/common.sh
case "${1:-all}" in
  all|core)
    inv tb-n4-mtu9000 --testbed --link 1gbit --mtu 9000 --workers 4 --sizes 64 --repeats 5 --systems dense gloo
    inv tb-n4-mtu1500 --testbed --link 1gbit --workers 4 --sizes 64 --repeats 5 --systems dense gloo
    inv tb-n4-mtu9000-sparse --testbed --link 1gbit --mtu 9000 --workers 4 --sizes 64 --repeats 3 --densities 0.1 --systems sparse dense
    inv tb-n4-mtu9000-loss1 --testbed --link 1gbit --mtu 9000 --workers 4 --sizes 64 --repeats 5 --loss 0.01 --systems dense
    inv tb-n4-mtu9000-wire16 --testbed --link 1gbit --mtu 9000 --workers 4 --sizes 64 --repeats 5 --systems dense16 gloo gloo-fp16
    ;;
esac
case "${1:-all}" in
  all|more)
    inv tb-n8-500mbit-mtu1500 --testbed --link 500mbit --workers 8 --sizes 64 --repeats 3 --systems dense gloo
    inv lo-n4-100mib --workers 4 --sizes 100 --repeats 5 --systems dense gloo
    ;;
esac
case "${1:-all}" in
  all|ddp)
    $PY bench/train.py --workers 4 --testbed --link 1gbit --mtu 9000 --runs 3 \
        --only 'digits gloo' 'digits switchml' 'digits switchml 16-bit wire' \
        --digits-args '--epochs 3 --hidden 2048' --out $OUT/train-testbed-digits-hidden2048.json
    $PY bench/train.py --workers 4 --testbed --link 1gbit --mtu 9000 --runs 3 \
        --only 'bag-of-words gloo' 'bag-of-words switchml sparse' 'bag-of-words switchml dense' \
        --sparse-args '--epochs 1' --out $OUT/train-testbed-bag-of-words.json
    ;;
esac
