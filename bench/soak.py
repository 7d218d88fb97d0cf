"""A long run on the testbed: exact results, flat memory and descriptors (root).

    python bench/soak.py --minutes 30 --out soak.json
    python bench/soak.py --minutes 1 --sample 5        # a short look

A switch (``switchml switch``) in the testbed's switch namespace, every link
losing ``--loss`` of its datagrams (1% by default).  Job *steady*: one rank in
each of ``--hosts`` hosts, an int32 allreduce of ``--elements`` values every
``--every`` seconds (0.1) for ``--minutes``, each result checked against its
exact sum.  Job *churn*: a rank in each host joins, makes one checked call and
leaves, every ``--churn-every`` seconds (3), for as long.  Every ``--sample``
seconds the switch's and the workers' resident memory (RSS) and open
descriptors are read from /proc.  Prints the figures (results, wrong results,
the first and last samples after the warm-up and the growth between them) and
writes them as JSON (``--out``).  A benchmark, not a test: its figures go in
docs/reliability.md with this command line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from switchml.bench.common import within  # noqa: E402

#: Seconds of samples left out of the growth figures: imports, first joins, buffers;
#: and at the end, while the jobs close.
WARMUP_S = 20.0
WINDDOWN_S = 5.0


def call_values(rank: int, call: int, elements: int):
    import numpy as np

    return (np.arange(elements, dtype=np.int64) * (rank + 1) + call).astype(np.int32)


def exact_sum(world: int, call: int, elements: int):
    import numpy as np

    total = sum(call_values(r, call, elements).astype(np.int64) for r in range(world))
    return total.astype(np.int32)  # int32 sums wrap as the switch's do


def steady(args) -> None:
    """A rank of job ``steady``: a checked call every ``--every`` s, as many as the
    run's minutes hold (a count, the same on every rank: a deadline of each rank's
    own left one rank's last call waiting for the others for the timeout)."""
    import numpy as np

    import switchml

    calls = wrong = 0
    slowest = 0.0
    total = max(1, round(args.minutes * 60 / args.every))
    with switchml.Worker(None, args.rank, args.hosts, job="steady", timeout=30) as w:
        print(json.dumps({"event": "joined", "pid": os.getpid()}), flush=True)
        next_call = time.monotonic()
        while calls < total:
            start = time.monotonic()
            out = w.allreduce(call_values(args.rank, calls, args.elements))
            slowest = max(slowest, time.monotonic() - start)
            wrong += not np.array_equal(out, exact_sum(args.hosts, calls, args.elements))
            calls += 1
            next_call += args.every
            time.sleep(max(0.0, next_call - time.monotonic()))
    print(json.dumps({"event": "done", "calls": calls, "wrong": wrong,
                      "slowest_call_s": slowest}), flush=True)


def churn(args) -> None:
    """A rank of job ``churn``: join, one checked call, leave, every ``--churn-every`` s,
    as many times as the run's minutes hold (the same count on every rank)."""
    import numpy as np

    import switchml

    print(json.dumps({"event": "joined", "pid": os.getpid()}), flush=True)
    cycles = wrong = 0
    failures: list = []
    total = max(1, round(args.minutes * 60 / args.churn_every))
    while cycles < total:
        start = time.monotonic()
        try:
            with switchml.Worker(None, args.rank, args.hosts, job="churn", timeout=30) as w:
                out = w.allreduce(call_values(args.rank, cycles, 1000))
                wrong += not np.array_equal(out, exact_sum(args.hosts, cycles, 1000))
        except switchml.SwitchMLError as exc:
            failures.append(f"{type(exc).__name__}: {exc}")
        cycles += 1
        time.sleep(max(0.0, start + args.churn_every - time.monotonic()))
    print(json.dumps({"event": "done", "cycles": cycles, "wrong": wrong,
                      "failures": failures[:5], "failed": len(failures)}), flush=True)


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(next(line for line in f if line.startswith("VmRSS")).split()[1])


def open_descriptors(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _growth(samples: list, key: str) -> dict:
    """The first and last value of ``samples``, the most, and the growth in %."""
    first, last = samples[0][key], samples[-1][key]
    return {"first": first, "last": last, "max": max(s[key] for s in samples),
            "growth_pct": 100.0 * (last - first) / first if first else 0.0}


def run(args) -> dict:
    from switchml.testbed import Testbed

    here = [sys.executable, os.path.abspath(__file__), "--minutes", str(args.minutes),
            "--hosts", str(args.hosts), "--elements", str(args.elements),
            "--every", str(args.every), "--churn-every", str(args.churn_every)]
    with Testbed(args.hosts, args.link, loss=args.loss, prefix="smlsoak") as tb:
        switch = tb.popen("switch", [sys.executable, "-m", "switchml.cli", "switch",
                                     "--log-level", "warning"],
                          stdout=subprocess.PIPE, text=True)
        assert switch.stdout is not None
        line = switch.stdout.readline()
        if "listening on" not in line:
            raise SystemExit(f"the switch did not start: {line}")
        roles = {}
        for rank in range(args.hosts):
            for role in ("steady", "churn"):
                roles[f"{role}{rank}"] = tb.popen(rank, here + ["--role", role, "--rank",
                                                                str(rank)],
                                                  stdout=subprocess.PIPE, text=True)
        pids = {}
        for name, proc in roles.items():
            pids[name] = json.loads(proc.stdout.readline())["pid"]
        pids["switch"] = switch.pid  # ip netns exec runs the switch in its own process
        start = time.monotonic()
        samples = []
        while any(p.poll() is None for p in roles.values()):
            sample = {"t": round(time.monotonic() - start, 1)}
            for name, pid in pids.items():
                try:
                    sample[f"{name}_rss_kib"] = rss_kib(pid)
                    sample[f"{name}_fds"] = open_descriptors(pid)
                except (OSError, StopIteration):
                    pass  # ended
            samples.append(sample)
            time.sleep(args.sample)
        done = {}
        for name, proc in roles.items():
            lines = proc.stdout.readlines()
            if proc.returncode or not lines:
                raise SystemExit(f"the {name} role failed (exit status {proc.returncode}); "
                                 f"its last output: {lines[-1:] or 'none'}")
            done[name] = json.loads(lines[-1])
        stats = json.loads(tb.run(0, [sys.executable, "-m", "switchml.cli", "stats", "--json"],
                                  capture_output=True, text=True).stdout)
        switch.terminate()
        switch.wait(timeout=10)
    # The samples while every job ran, after the warm-up: the run's steady state.
    end = args.minutes * 60 - WINDDOWN_S
    kept = [s for s in samples if WARMUP_S <= s["t"] <= end
            and all(f"{n}_rss_kib" in s for n in pids)]
    window = [WARMUP_S, end]
    if not kept:  # a run too short for the window: every sample, start-up's too
        kept = [s for s in samples if all(f"{n}_rss_kib" in s for n in pids)]
        window = [0.0, args.minutes * 60]
    return {
        "command": "python bench/soak.py " + " ".join(sys.argv[1:]),
        "settings": {k: v for k, v in vars(args).items() if k not in ("role", "rank")},
        # the job's calls: each rank makes every one of them (the least, should one
        # rank's last call not have ended)
        "steady": {"calls": min(d["calls"] for n, d in done.items() if n.startswith("steady")),
                   "wrong": sum(d["wrong"] for n, d in done.items() if n.startswith("steady")),
                   "slowest_call_s": max(d["slowest_call_s"] for n, d in done.items()
                                         if n.startswith("steady"))},
        "churn": {"cycles": min(d["cycles"] for n, d in done.items() if n.startswith("churn")),
                  "wrong": sum(d["wrong"] for n, d in done.items() if n.startswith("churn")),
                  "failed": sum(d["failed"] for n, d in done.items() if n.startswith("churn")),
                  "failures": [f for n, d in done.items() if n.startswith("churn")
                               for f in d["failures"]][:5]},
        "memory_and_descriptors": {name: {"rss_kib": _growth(kept, f"{name}_rss_kib"),
                                          "fds": _growth(kept, f"{name}_fds")}
                                   for name in pids},
        "switch_jobs_started": stats["totals"].get("jobs_started", 0),
        # the switch's lifetime total (ended jobs keep only the last of each name)
        "switch_retransmissions_answered": stats["totals"].get("retransmissions_answered", 0),
        "samples_window_s": window,
        "samples": samples,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=within(0, above_low=True), default=30.0)
    p.add_argument("--hosts", type=int, default=2, help="ranks of each job, one a host")
    p.add_argument("--link", default="1gbit")
    p.add_argument("--loss", type=float, default=0.01)
    p.add_argument("--elements", type=int, default=100_000,
                   help="int32 values of each call of job steady")
    p.add_argument("--every", type=within(0, above_low=True), default=0.1,
                   help="seconds between its calls")
    p.add_argument("--churn-every", type=within(0, above_low=True), default=3.0,
                   help="seconds between the joins of job churn")
    p.add_argument("--sample", type=float, default=10.0, help="seconds between samples")
    p.add_argument("--out", default=None, help="write the figures as JSON here")
    p.add_argument("--role", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.role == "steady":
        return steady(args)
    if args.role == "churn":
        return churn(args)
    result = run(args)
    print(f"job steady: {result['steady']['calls']} calls, {result['steady']['wrong']} wrong, "
          f"slowest {result['steady']['slowest_call_s']:.3f} s")
    print(f"job churn: {result['churn']['cycles']} joins and leaves, "
          f"{result['churn']['wrong']} wrong, {result['churn']['failed']} failed "
          f"{result['churn']['failures']}")
    print(f"switch: {result['switch_jobs_started']} jobs started, "
          f"{result['switch_retransmissions_answered']} retransmissions answered")
    first, last = result["samples_window_s"]
    print(f"from {first:g} s to {last:g} s in:")
    for name, figures in result["memory_and_descriptors"].items():
        rss, fds = figures["rss_kib"], figures["fds"]
        print(f"  {name:8} RSS {rss['first'] / 1024:7.1f} -> {rss['last'] / 1024:7.1f} MiB "
              f"({rss['growth_pct']:+.1f}%, most {rss['max'] / 1024:.1f}), descriptors "
              f"{fds['first']} -> {fds['last']} (most {fds['max']})")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.out}")
    if result["steady"]["wrong"] or result["churn"]["wrong"] or result["churn"]["failed"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
