#!/bin/sh
# The measurements of docs/benchmarks.md's "Session 8" section, one after the
# other, on a quiet machine (root, for the testbed).  Each line is the median of
# 3 invocations (bench/invocations.py) unless it says --runs 1; results in
# bench/results/s8/.  Session 8's code: tail probes that fill the window's room
# (past it one at a time), a standing queue at 1.5 least RTTs, no spurious
# judgement before the first round trip, the RTO kept backed off after a
# premature timeout; racks under a spine (rack switches on the Python data plane).
set -e
cd "$(dirname "$0")/../.."
OUT=bench/results/s8
. bench/campaigns/common.sh
case "${1:-all}" in
  all|core)
    inv tb-n4-mtu9000 --testbed --link 1gbit --mtu 9000 --workers 4 --sizes 64 --repeats 5 --systems dense gloo
    inv tb-n4-mtu9000-loss1 --testbed --link 1gbit --mtu 9000 --workers 4 --sizes 64 --repeats 5 --loss 0.01 --systems dense
    # the loss run's own loss-free reference: the same testbed (offload off)
    inv tb-n4-mtu9000-offload-off --testbed --link 1gbit --mtu 9000 --workers 4 --sizes 64 --repeats 5 --udp-offload off --systems dense
    inv tb-n4-mtu1500 --testbed --link 1gbit --workers 4 --sizes 64 --repeats 5 --systems dense gloo
    ;;
esac
case "${1:-all}" in
  all|scale)
    # issue 15: 16 hosts at a rate two cores carry
    inv tb-n16-100mbit --testbed --link 100mbit --mtu 9000 --workers 16 --sizes 64 --repeats 3 --systems dense gloo
    inv tb-n16-100mbit-striped2 --testbed --link 100mbit --mtu 9000 --workers 16 --sizes 64 --repeats 3 --striped 2 --systems dense
    inv tb-n16-100mbit-striped4 --testbed --link 100mbit --mtu 9000 --workers 16 --sizes 64 --repeats 3 --striped 4 --systems dense
    once tb-n16-100mbit-servers4 --testbed --link 100mbit --mtu 9000 --workers 16 --sizes 64 --repeats 1 --switches 4 --systems dense
    ;;
esac
case "${1:-all}" in
  all|racks)
    # issue 15: two racks of 8 hosts, 4:1 oversubscribed uplinks (200 Mbit/s each)
    inv tb-n16-100mbit-racks2-os4 --testbed --link 100mbit --mtu 9000 --workers 16 --racks 2 --oversubscription 4 --sizes 64 --repeats 2 --systems dense gloo
    inv tb-n16-100mbit-racks2-os4-flat --testbed --link 100mbit --mtu 9000 --workers 16 --racks 2 --oversubscription 4 --flat --sizes 64 --repeats 1 --systems dense
    # and at 1:1 (800 Mbit/s uplinks)
    inv tb-n16-100mbit-racks2-os1 --testbed --link 100mbit --mtu 9000 --workers 16 --racks 2 --sizes 64 --repeats 2 --systems dense gloo
    once tb-n16-100mbit-racks2-os1-flat --testbed --link 100mbit --mtu 9000 --workers 16 --racks 2 --flat --sizes 64 --repeats 1 --systems dense
    ;;
esac
case "${1:-all}" in
  all|more)
    inv tb-n4-servers4-mtu9000 --testbed --link 1gbit --mtu 9000 --workers 4 --switches 4 --sizes 64 --repeats 5 --systems dense gloo
    inv tb-n8-500mbit-mtu1500 --testbed --link 500mbit --workers 8 --sizes 64 --repeats 3 --systems dense gloo
    ;;
esac
case "${1:-all}" in
  all|rest)
    # what the window's and probes' changes may move: two jobs' shares, latency,
    # sparse, loopback, DDP
    $PY bench/two_jobs.py --hosts 4 --link 1gbit --mtu 9000 --mib 64 --repeats 8 --json $OUT/two-jobs-mtu9000.json
    inv lat-tb-n4-mtu9000 --testbed --link 1gbit --mtu 9000 --workers 4 --sizes 0.000003814697265625 0.0009765625 0.015625 0.25 1 4 --repeats 20 --systems dense gloo
    ;;
esac
case "${1:-all}" in
  all|rest|rest2)
    inv lat-lo-n4 --workers 4 --sizes 0.000003814697265625 0.0009765625 0.015625 0.25 1 4 --repeats 20 --systems dense gloo
    inv tb-n4-mtu9000-sparse --testbed --link 1gbit --mtu 9000 --workers 4 --sizes 64 --repeats 3 --densities 0.1 --systems sparse dense
    inv lo-n4-100mib --workers 4 --sizes 100 --repeats 5 --systems dense gloo
    $PY bench/train.py --workers 4 --testbed --link 1gbit --mtu 9000 --runs 3 \
        --only 'digits gloo' 'digits switchml' \
        --digits-args '--epochs 3 --hidden 2048' --out $OUT/train-testbed-digits-hidden2048.json
    ;;
esac
