"""Joins and calls under a flood of control connections, on the testbed (root).

    python bench/flood.py --out flood.json
    python bench/flood.py --connections 0          # join times without a flood

A switch (``switchml switch --max-jobs 8``: the most jobs that fit, with its
other settings' defaults, in ``ulimit -n 1024``, soft and hard) in the
testbed's switch namespace.  Hosts 0 and 1 run a
*member* job (one rank each) that joins first and makes a checked int32 call
every 50 ms all through the run, and *probe* jobs (one rank each): a fresh
job joins, makes one checked call and leaves, one after the other, for
``--seconds``.  After ``--quiet`` seconds, host 2 opens ``--connections``
control connections (``bench/control_flood.py``), each sending part of a line
and holding it.  Prints each probe's join and call (the slower rank's, from
the join's start to the sum) before and during the flood, the member's calls
and errors, the flood's connections and how long the switch let them live, and
the switch's memory and descriptors; writes them as JSON (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from bench.soak import call_values, exact_sum, open_descriptors, rss_kib  # noqa: E402
from switchml.bench.common import at_least, within  # noqa: E402
from switchml.testbed.core import add_host_queue_argument  # noqa: E402

#: Elements of a probe's call and of the member's.
PROBE_ELEMENTS = 1000
MEMBER_ELEMENTS = 5000
MEMBER_EVERY_S = 0.05


def probe(args) -> None:
    """A rank of the probe jobs: join, one checked call, leave, until the end."""
    import numpy as np

    import switchml

    print(json.dumps({"event": "started", "pid": os.getpid()}), flush=True)
    probes, failures = [], []
    end = time.monotonic() + args.seconds
    cycle = 0
    finished = False
    while not finished:
        start = time.monotonic()
        values = call_values(args.rank, cycle, PROBE_ELEMENTS)
        values[0] = start >= end  # the ranks stop after the same cycle: when either asks
        try:
            with switchml.Worker(None, args.rank, 2, job=f"probe-{cycle}", timeout=10) as w:
                out = w.allreduce(values)
                took = time.monotonic() - start
            finished = out[0] > 0
            ok = np.array_equal(out[1:], exact_sum(2, cycle, PROBE_ELEMENTS)[1:])
            probes.append({"cycle": cycle, "t": start, "s": took, "exact": bool(ok)})
        except switchml.SwitchMLError as exc:
            failures.append({"cycle": cycle, "t": start, "error": f"{type(exc).__name__}: {exc}"})
            finished = start >= end
        cycle += 1
    print(json.dumps({"event": "done", "probes": probes, "failures": failures}), flush=True)


def member(args) -> None:
    """A rank of the member job: a checked call every 50 ms until the end."""
    import numpy as np

    import switchml

    calls = wrong = 0
    slowest = 0.0
    errors: list = []
    with switchml.Worker(None, args.rank, 2, job="member", timeout=10) as w:
        print(json.dumps({"event": "started", "pid": os.getpid()}), flush=True)
        end = time.monotonic() + args.seconds + 2.0
        try:
            while time.monotonic() < end:
                start = time.monotonic()
                out = w.allreduce(call_values(args.rank, calls, MEMBER_ELEMENTS))
                slowest = max(slowest, time.monotonic() - start)
                wrong += not np.array_equal(out, exact_sum(2, calls, MEMBER_ELEMENTS))
                calls += 1
                time.sleep(MEMBER_EVERY_S)
        except switchml.SwitchMLError as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
    print(json.dumps({"event": "done", "calls": calls, "wrong": wrong, "errors": errors,
                      "slowest_call_s": slowest}), flush=True)


def _limit_descriptors():
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))


def _summary(times: list) -> dict:
    if not times:
        return {"count": 0}
    return {"count": len(times), "median_s": statistics.median(times), "max_s": max(times)}


def run(args) -> dict:
    from switchml.testbed import Testbed

    here = [sys.executable, os.path.abspath(__file__), "--seconds", str(args.seconds)]
    with Testbed(3, args.link, mtu=args.mtu, host_queue=args.host_queue,
                 prefix="smlflood") as tb:
        switch = tb.popen("switch", [sys.executable, "-m", "switchml.cli", "switch",
                                     "--max-jobs", str(args.max_jobs), "--log-level", "error"],
                          stdout=subprocess.PIPE, text=True, preexec_fn=_limit_descriptors)
        assert switch.stdout is not None
        line = switch.stdout.readline()
        if "listening on" not in line:
            raise SystemExit(f"the switch did not start: {line}")
        roles = {f"{role}{rank}": tb.popen(rank, here + ["--role", role, "--rank", str(rank)],
                                           stdout=subprocess.PIPE, text=True)
                 for role in ("member", "probe") for rank in (0, 1)}
        for proc in roles.values():
            json.loads(proc.stdout.readline())  # started
        rss_before, fds_before = rss_kib(switch.pid), open_descriptors(switch.pid)
        time.sleep(args.quiet)
        flood_report = None
        rss_most = rss_before
        flood_start = time.monotonic()
        if args.connections:
            flood = tb.popen(2, [sys.executable, os.path.join(HERE, "control_flood.py"),
                                 tb.switch_address, str(tb.switch.rsplit(":", 1)[1]),
                                 tb.address(2), str(args.connections),
                                 str(max(1.0, args.seconds - args.quiet))],
                             stdout=subprocess.PIPE, text=True)
            while flood.poll() is None:
                rss_most = max(rss_most, rss_kib(switch.pid))
                time.sleep(0.2)
            flood_report = json.loads(flood.stdout.read())
        flood_end = time.monotonic()
        done = {name: json.loads(proc.stdout.readlines()[-1]) for name, proc in roles.items()}
        rss_after, fds_after = rss_kib(switch.pid), open_descriptors(switch.pid)
        stats = json.loads(tb.run(0, [sys.executable, "-m", "switchml.cli", "stats", "--json"],
                                  capture_output=True, text=True).stdout)
        switch.terminate()
        switch.wait(timeout=10)
    # a probe cycle takes as long as its slower rank
    cycles: dict = {}
    for name in ("probe0", "probe1"):
        for p in done[name]["probes"]:
            c = cycles.setdefault(p["cycle"], {"t": p["t"], "s": 0.0, "exact": True})
            c["t"] = min(c["t"], p["t"])
            c["s"] = max(c["s"], p["s"])
            c["exact"] = c["exact"] and p["exact"]
    quiet = [c["s"] for c in cycles.values() if c["t"] < flood_start]
    flooded = [c["s"] for c in cycles.values() if flood_start <= c["t"] < flood_end]
    members = [done["member0"], done["member1"]]
    return {
        "command": "python bench/flood.py " + " ".join(sys.argv[1:]),
        "settings": {k: v for k, v in vars(args).items() if k not in ("role", "rank")},
        "join_and_call_quiet": _summary(quiet),
        "join_and_call_flooded": _summary(flooded),
        "probes_inexact": sum(not c["exact"] for c in cycles.values()),
        "probe_failures": [f for n in ("probe0", "probe1") for f in done[n]["failures"]],
        "member": {"calls": min(m["calls"] for m in members),
                   "wrong": sum(m["wrong"] for m in members),
                   "errors": [e for m in members for e in m["errors"]],
                   "slowest_call_s": max(m["slowest_call_s"] for m in members)},
        "flood": flood_report,
        "flood_s": flood_end - flood_start,
        "switch": {"rss_kib_before": rss_before, "rss_kib_most": rss_most,
                   "rss_kib_after": rss_after, "rss_growth_mib": (rss_most - rss_before) / 1024,
                   "fds_before": fds_before, "fds_after": fds_after,
                   "control_closed": stats.get("control", {}).get("closed")},
    }


def show(result: dict) -> None:
    for key in ("join_and_call_quiet", "join_and_call_flooded"):
        s = result[key]
        if s["count"]:
            print(f"{key}: {s['count']} jobs, median {s['median_s'] * 1e3:.1f} ms, "
                  f"most {s['max_s'] * 1e3:.1f} ms")
        else:
            print(f"{key}: no jobs")
    print(f"probes inexact: {result['probes_inexact']}, failed: {len(result['probe_failures'])}")
    m = result["member"]
    print(f"member: {m['calls']} calls, {m['wrong']} wrong, {len(m['errors'])} errors, "
          f"slowest {m['slowest_call_s'] * 1e3:.1f} ms")
    if result["flood"]:
        f = result["flood"]
        print(f"flood: {f['opened']} of {f['started']} connections opened, "
              f"{f['closed_by_switch']} closed by the switch, the longest lived "
              f"{f['longest_s']:.2f} s, {f['still_open']} still open")
    s = result["switch"]
    print(f"switch: RSS {s['rss_kib_before'] / 1024:.1f} MiB before, "
          f"{s['rss_kib_most'] / 1024:.1f} MiB at most, {s['rss_kib_after'] / 1024:.1f} after; "
          f"descriptors {s['fds_before']} before, {s['fds_after']} after")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--connections", type=at_least(0), default=10_000,
                   help="flood connections from host 2 (0: none)")
    p.add_argument("--seconds", type=within(0, above_low=True), default=60.0,
                   help="how long the probes run")
    p.add_argument("--quiet", type=within(0), default=15.0,
                   help="seconds of probes before the flood starts (less than --seconds)")
    p.add_argument("--max-jobs", type=int, default=8,
                   help="the switch's --max-jobs (its default does not fit 1024 descriptors)")
    p.add_argument("--link", default="1gbit")
    p.add_argument("--mtu", type=int, default=9000)
    add_host_queue_argument(p)
    p.add_argument("--out", default=None, help="write the figures as JSON here")
    p.add_argument("--role", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.role is None and args.quiet >= args.seconds:
        p.error("--quiet: less than --seconds (the flood starts after it)")
    if args.role == "probe":
        return probe(args)
    if args.role == "member":
        return member(args)
    if os.geteuid() != 0:
        raise SystemExit("bench/flood.py needs root (network namespaces)")
    result = run(args)
    show(result)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    # a run whose checks failed is a failed run, whatever its figures
    failed = [what for what, bad in (
        ("probes failed", result["probe_failures"]), ("probes inexact", result["probes_inexact"]),
        ("member sums wrong", result["member"]["wrong"]),
        ("member errors", result["member"]["errors"]),
        ("no jobs while quiet", not result["join_and_call_quiet"]["count"]),
        ("no jobs under the flood", not result["join_and_call_flooded"]["count"])) if bad]
    if failed:
        raise SystemExit("FAILED: " + ", ".join(failed))


if __name__ == "__main__":
    main()
