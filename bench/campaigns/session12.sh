#!/bin/sh
# The measurements of docs/benchmarks.md's "Session 12" section: session 11's
# cases (bench/campaigns/session11.sh, the same lines), run again on session
# 12's code, results in bench/results/s12/.  Session 12's code: a worker's
# timer retransmission is a query (wire version 5, kind 5), which the switch
# answers with a done (kind 6, the header alone) when the set is complete,
# instead of a second copy of the result (docs/protocol.md, Loss recovery).
# Usage: sh bench/campaigns/session12.sh [all|lo|ddp|sparse|ddp-sparse|core|loss|more|rest|racks|scale]
OUT=bench/results/s12 exec sh "$(dirname "$0")/session11.sh" "$@"
