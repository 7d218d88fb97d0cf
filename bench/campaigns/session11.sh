#!/bin/sh
# The measurements of docs/benchmarks.md's "Session 11" section, one after the
# other, on a quiet machine (root, for the testbed).  Each line is the median of
# 3 invocations (bench/invocations.py); results in bench/results/s11/.
# Session 11's code: a worker's timer and tail-probe retransmissions are probes,
# the header alone, which the switch answers from its bitmap (wire version 4);
# a switch server (--shared-link, which the testbed's --switches sets) gives a
# job its ranks' share of one link's window, and a switch waits for its own
# full queue (IP_RECVERR) instead of losing results there.
set -e
cd "$(dirname "$0")/../.."
OUT=${OUT:-bench/results/s11}
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
case "${1:-all}" in
  all|sparse)
    inv tb-n4-mtu9000-sparse --testbed --link 1gbit --mtu 9000 --workers 4 --sizes 64 --repeats 3 --densities 0.1 --systems sparse dense
    ;;
esac
case "${1:-all}" in
  all|ddp-sparse)
    $PY bench/train.py --workers 4 --testbed --link 1gbit --mtu 9000 --runs 3 \
        --only 'bag-of-words gloo' 'bag-of-words switchml sparse' \
        --sparse-args '--epochs 1' --out $OUT/train-testbed-bag-of-words.json
    ;;
esac
case "${1:-all}" in
  all|core)
    inv tb-n4-mtu9000 --testbed --link 1gbit --mtu 9000 --workers 4 --sizes 64 --repeats 5 --systems dense gloo
    inv tb-n4-mtu1500 --testbed --link 1gbit --workers 4 --sizes 64 --repeats 5 --systems dense gloo
    ;;
esac
case "${1:-all}" in
  all|loss)
    inv tb-n4-mtu9000-loss1 --testbed --link 1gbit --mtu 9000 --workers 4 --sizes 64 --repeats 5 --loss 0.01 --systems dense
    # the loss run's own loss-free reference: the same testbed (offload off)
    inv tb-n4-mtu9000-offload-off --testbed --link 1gbit --mtu 9000 --workers 4 --sizes 64 --repeats 5 --udp-offload off --systems dense
    ;;
esac
case "${1:-all}" in
  all|more)
    inv tb-n8-500mbit-mtu1500 --testbed --link 500mbit --workers 8 --sizes 64 --repeats 3 --systems dense gloo
    inv tb-n4-servers4-mtu9000 --testbed --link 1gbit --mtu 9000 --workers 4 --switches 4 --sizes 64 --repeats 5 --systems dense gloo
    ;;
esac
case "${1:-all}" in
  all|rest)
    $PY bench/two_jobs.py --hosts 4 --link 1gbit --mtu 9000 --mib 64 --repeats 8 --json $OUT/two-jobs-mtu9000.json
    inv lat-tb-n4-mtu9000 --testbed --link 1gbit --mtu 9000 --workers 4 --sizes 0.000003814697265625 0.0009765625 0.015625 0.25 1 4 --repeats 20 --systems dense gloo
    $PY bench/switch_core.py --json $OUT/switch-core.json
    ;;
esac
case "${1:-all}" in
  all|racks)
    # two racks of 8 hosts, 4:1 oversubscribed uplinks (200 Mbit/s each)
    inv tb-n16-100mbit-racks2-os4 --testbed --link 100mbit --mtu 9000 --workers 16 --racks 2 --oversubscription 4 --sizes 64 --repeats 2 --systems dense gloo
    inv tb-n16-100mbit-racks2-os4-flat --testbed --link 100mbit --mtu 9000 --workers 16 --racks 2 --oversubscription 4 --flat --sizes 64 --repeats 1 --systems dense
    ;;
esac
case "${1:-all}" in
  all|scale)
    inv tb-n16-100mbit-servers4 --testbed --link 100mbit --mtu 9000 --workers 16 --sizes 64 --repeats 1 --switches 4 --systems dense
    inv tb-n16-100mbit --testbed --link 100mbit --mtu 9000 --workers 16 --sizes 64 --repeats 3 --systems dense gloo
    inv tb-n16-100mbit-striped2 --testbed --link 100mbit --mtu 9000 --workers 16 --sizes 64 --repeats 3 --striped 2 --systems dense
    inv tb-n16-100mbit-striped4 --testbed --link 100mbit --mtu 9000 --workers 16 --sizes 64 --repeats 3 --striped 4 --systems dense
    ;;
esac
