"""Run one ``python -m bench`` several times and report the median of the invocations.

    python bench/invocations.py --runs 3 --out runs/tb-n4-mtu9000 -- \\
        --testbed --link 1gbit --mtu 9000 --workers 4 --sizes 64 --densities 0.1

A figure in the docs is the median over separate invocations (new processes, a
new switch, a new testbed each time), not over repeats inside one run, which
share their warm state.  For every row (system, workers, size, density) it
prints the median of the runs' medians, the spread across runs, the speedup over
gloo computed from those medians, and the share of the link bound reached (for
gloo its ring bound: a comparison is fair only when gloo reaches at least 90%
of it).  Writes summary.json beside the runs' own folders.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from switchml.bench.launch import run_to_its_end
from switchml.testbed.core import signals_end_the_run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def key(row) -> tuple:
    return (row["system"], row["workers"], row["size_bytes"], row["density"],
            row.get("device", "cpu"))


def summarize_runs(runs: list) -> list:
    """One row per (system, workers, size, density): medians over the runs."""
    grouped: dict = {}
    for rows in runs:
        for row in rows:
            grouped.setdefault(key(row), []).append(row)
    out = []
    for (system, workers, size, density, device), rows in grouped.items():
        times = [r["median_s"] for r in rows]
        median = statistics.median(times)
        bound = rows[0].get("bound_s")
        faults = [r["faults_per_call"] for r in rows if r.get("faults_per_call") is not None]
        out.append({"system": system, "workers": workers, "size_mib": size / 2**20,
                    "density": density, "device": device, "api": rows[0].get("api"),
                    "runs": len(rows), "median_s": median,
                    # minor page faults a timed call took (busiest rank), each run's
                    "faults_per_call": statistics.median(faults) if faults else None,
                    "run_faults_per_call": faults,
                    "run_medians_s": times, "of_bound": bound / median if bound else None,
                    "retransmissions_per_worker": statistics.median(
                        [r["retransmissions_per_worker"] or 0 for r in rows]),
                    # False: a run's sums failed the check; None: no run's was checked
                    "checked": (False if any(r["checked"] is False for r in rows) else
                                True if any(r["checked"] for r in rows) else None),
                    "ranks_bit_identical": all(r["ranks_bit_identical"] for r in rows)})
    def medians(system):
        return {(r["workers"], r["size_mib"], r["device"]): r["median_s"] for r in out
                if r["system"] == system}
    gloo, fp16 = medians("gloo"), medians("gloo-fp16")
    for r in out:
        g = gloo.get((r["workers"], r["size_mib"], r["device"]))
        r["speedup_over_gloo"] = g / r["median_s"] if g and r["system"] != "gloo" else None
        h = fp16.get((r["workers"], r["size_mib"], r["device"]))
        if h and r["system"] == "switchml-dense16":  # the same bytes as gloo-fp16
            r["speedup_over_gloo_fp16"] = h / r["median_s"]
    return sorted(out, key=lambda r: (r["device"], r["workers"], r["size_mib"], r["system"],
                                      r["density"] or 0))


def check_cell(row: dict) -> str:
    """FAIL where a run's sums failed their check or the ranks' results differed;
    ``-`` where no run's sums were checked (--no-check); ok otherwise."""
    if row["checked"] is False or not row["ranks_bit_identical"]:
        return "FAIL"
    return "-" if row["checked"] is None else "ok"


def format_summary(rows: list) -> str:
    lines = [f"{'n':>3} {'MiB':>6} {'device':>6} {'system':>16} {'density':>7} {'median s':>9} "
             f"{'runs (s)':>26} {'of bound':>8} {'vs gloo':>8} {'retx':>6} {'faults':>6} check"]
    for r in rows:
        runs = " ".join(f"{t:.3f}" for t in r["run_medians_s"])
        g = r["speedup_over_gloo"]
        speedup = "-" if g is None else f"{g:.2f}x"
        faults = "-" if r.get("faults_per_call") is None else f"{r['faults_per_call']:.0f}"
        lines.append(
            f"{r['workers']:>3} {r['size_mib']:>6g} {r.get('device', 'cpu'):>6} "
            f"{r['system']:>16} "
            f"{'-' if r['density'] is None else format(r['density'], 'g'):>7} "
            f"{r['median_s']:>9.4f} {runs:>26} "
            f"{'-' if r['of_bound'] is None else format(r['of_bound'], '.0%'):>8} "
            f"{speedup:>8} "
            f"{r['retransmissions_per_worker']:>6.1f} "
            f"{faults:>6} "
            f"{check_cell(r)}"
            + (f"  {r['speedup_over_gloo_fp16']:.2f}x gloo-fp16"
               if r.get("speedup_over_gloo_fp16") else ""))
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="invocations (default 3)")
    parser.add_argument("--out", required=True, help="folder for the runs and summary.json")
    parser.add_argument("--check-first-only", action="store_true",
                        help="check the sums against the exact sum in the first invocation "
                             "only (--no-check in the others: at tens of MiB and 8 ranks the "
                             "check takes longer than the calls); every invocation still "
                             "checks that the ranks' results are bit-identical")
    parser.add_argument("bench_args", nargs=argparse.REMAINDER,
                        help="-- then the arguments of `python -m bench`")
    args = parser.parse_args(argv)
    bench_args = [a for a in args.bench_args if a != "--"]
    os.makedirs(args.out, exist_ok=True)
    runs = []
    for i in range(args.runs):
        folder = os.path.join(args.out, f"run{i + 1}")
        unchecked = ["--no-check"] if args.check_first_only and i > 0 else []
        command = [sys.executable, "-m", "bench", *bench_args, *unchecked,
                   "--out", folder, "--no-plots"]
        print(f"run {i + 1}/{args.runs}: {' '.join(command[1:])}", file=sys.stderr, flush=True)
        started = time.monotonic()
        code = run_to_its_end(command, cwd=ROOT)
        if code != 0:
            print(f"run {i + 1} failed (exit {code})", file=sys.stderr)
            return code
        with open(os.path.join(folder, "results.json")) as f:
            runs.append(json.load(f)["rows"])
        print(f"run {i + 1} took {time.monotonic() - started:.0f} s", file=sys.stderr)
    rows = summarize_runs(runs)
    print(format_summary(rows))
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump({"command": "python bench/invocations.py " + " ".join(sys.argv[1:]),
                   "bench_args": bench_args, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    with signals_end_the_run():  # TERM or HUP: the bench it runs is asked to stop
        sys.exit(main())
