#!/bin/sh
# The measurements of docs/benchmarks.md's "Session 7" section, one after the
# other, on a quiet machine (root, for the testbed).  Each line is the median of
# 3 invocations (bench/invocations.py); results in bench/results/s7/.
# Session 7's code: the learnt fast-retransmit threshold, per-datagram testbed
# loss (the veths' UDP segmentation offload off where there is loss, on without).
set -e
cd "$(dirname "$0")/../.."
OUT=bench/results/s7
. bench/campaigns/common.sh
case "${1:-all}" in
  all|core)
    inv tb-n4-mtu9000 --testbed --link 1gbit --mtu 9000 --workers 4 --sizes 64 --repeats 5 --systems dense gloo
    inv tb-n4-mtu1500 --testbed --link 1gbit --workers 4 --sizes 64 --repeats 5 --systems dense gloo
    inv tb-n4-mtu9000-loss1 --testbed --link 1gbit --mtu 9000 --workers 4 --sizes 64 --repeats 5 --loss 0.01 --systems dense
    # the loss run's own loss-free reference: the same testbed (offload off)
    inv tb-n4-mtu9000-offload-off --testbed --link 1gbit --mtu 9000 --workers 4 --sizes 64 --repeats 5 --udp-offload off --systems dense gloo
    inv tb-n4-mtu9000-sparse --testbed --link 1gbit --mtu 9000 --workers 4 --sizes 64 --repeats 3 --densities 0.1 --systems sparse dense
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
        --only 'digits gloo' 'digits switchml' \
        --digits-args '--epochs 3 --hidden 2048' --out $OUT/train-testbed-digits-hidden2048.json
    ;;
esac
case "${1:-all}" in
  all|servers)
    # issue 15: no programmable switch, K switch servers behind links like the hosts'
    inv tb-n4-servers4-mtu9000 --testbed --link 1gbit --mtu 9000 --workers 4 --switches 4 --sizes 64 --repeats 5 --systems dense gloo
    inv tb-n4-servers2-mtu9000 --testbed --link 1gbit --mtu 9000 --workers 4 --switches 2 --sizes 64 --repeats 3 --systems dense
    inv tb-n4-servers1-mtu9000 --testbed --link 1gbit --mtu 9000 --workers 4 --switches 1 --sizes 64 --repeats 3 --systems dense
    ;;
esac
case "${1:-all}" in
  all|scale)
    # issue 15: 16 hosts at a rate two cores carry; one switch on the bridge, K
    # striped switch processes on the bridge, K = 4 switch servers
    inv tb-n16-100mbit --testbed --link 100mbit --mtu 9000 --workers 16 --sizes 64 --repeats 3 --systems dense gloo
    inv tb-n16-100mbit-striped2 --testbed --link 100mbit --mtu 9000 --workers 16 --sizes 64 --repeats 3 --striped 2 --systems dense
    inv tb-n16-100mbit-striped4 --testbed --link 100mbit --mtu 9000 --workers 16 --sizes 64 --repeats 3 --striped 4 --systems dense
    inv tb-n16-100mbit-servers4 --testbed --link 100mbit --mtu 9000 --workers 16 --sizes 64 --repeats 2 --switches 4 --systems dense
    ;;
esac
