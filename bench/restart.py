"""A switch restarted in the middle of a big call, on the testbed with loss.

    python bench/restart.py --runs 10 --loss 0.01 --out restart.json      # root

An emulated cluster (switchml.testbed: ``--hosts`` hosts, ``--link``, ``--mtu``,
``--loss`` of the datagrams dropped at random) with ``switchml switch`` in its
switch namespace; one ``switchml.Worker`` a host makes a warm-up call, then an
in-place allreduce of ``--mib`` MiB of float32 (values of many magnitudes), and
the switch is SIGKILLed ``--into`` seconds into it and started again on its port
``--down`` seconds later.  Then each rank makes the same call again, undisturbed.
A run passes when every rank's cut call is bit for bit its undisturbed one, the
same on every rank, each rank rejoined once and some rank resumed the call (the
kill fell inside it).  Prints a line per run, writes JSON (``--out``), exits 1
if a run failed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.abspath(__file__)
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)

from bench.chaos import report_runs, start_switch  # noqa: E402
from switchml.bench.common import at_least  # noqa: E402


def values(rank: int, elements: int):
    """Float32 values of many magnitudes (each 1024 their own exponent), some zero."""
    import numpy as np

    rng = np.random.default_rng(rank)
    scale = np.float32(2.0) ** rng.integers(-30, 30, elements // 1024 + 1).repeat(1024)
    out = (rng.standard_normal(elements) * scale[:elements]).astype(np.float32)
    out[5 * 1024:7 * 1024] = 0
    return out


def rank_main(args) -> None:
    """One rank: warm up, say it starts, the cut call, the same call undisturbed."""
    import numpy as np

    import switchml

    elements = int(args.mib * 2**20) // 4
    with switchml.Worker(None, args.rank, args.hosts, job="restart", timeout=args.timeout,
                         local_stage=False) as w:
        w.allreduce(np.ones(16, np.float32))
        a = values(args.rank, elements)
        open(os.path.join(args.control, f"start{args.rank}"), "w").close()
        w.allreduce(a, out=a)
        cut = hashlib.sha256(a.tobytes()).hexdigest()
        counters = w.counters
        b = w.allreduce(values(args.rank, elements))
        print(json.dumps({"rank": args.rank, "cut": cut,
                          "undisturbed": hashlib.sha256(b.tobytes()).hexdigest(),
                          "rejoins": counters["rejoins"],
                          "calls_resumed": counters["calls_resumed"]}), flush=True)


def one_run(args, control: str) -> dict:
    from switchml.testbed import Testbed

    with Testbed(hosts=args.hosts, link=args.link, mtu=args.mtu, loss=args.loss) as tb:
        switch = start_switch(tb)
        time.sleep(1.0)
        ranks = [tb.popen(h, [sys.executable, HERE, "--role", "rank", "--rank", str(h),
                              "--control", control, *_passed(args)],
                          env={"PYTHONPATH": ROOT}, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
                 for h in range(args.hosts)]
        deadline = time.monotonic() + 120
        while not all(os.path.exists(os.path.join(control, f"start{h}"))
                      for h in range(args.hosts)):
            if time.monotonic() > deadline or any(p.poll() is not None for p in ranks):
                break
            time.sleep(0.005)
        time.sleep(args.into)
        switch.kill()
        switch.wait(10)
        time.sleep(args.down)
        switch = start_switch(tb)
        reports, errors = [], []
        for h, proc in enumerate(ranks):
            out, err = proc.communicate(timeout=300)
            if proc.returncode:
                errors.append(f"host {h}: exit {proc.returncode}: {err[-1500:]}")
            else:
                reports.append(json.loads(out.splitlines()[-1]))
        switch.kill()
        switch.wait(10)
    wrong = list(errors)
    if not errors:
        if any(r["cut"] != r["undisturbed"] for r in reports):
            wrong.append("a cut call differs from its undisturbed run")
        if len({r["cut"] for r in reports}) != 1:
            wrong.append("the ranks' cut calls differ")
        if any(r["rejoins"] != 1 for r in reports):
            wrong.append(f"rejoins {[r['rejoins'] for r in reports]}")
        if not any(r["calls_resumed"] for r in reports):
            wrong.append("no rank resumed a call (the kill fell outside it)")
    return {"reports": reports, "wrong": wrong}


def _passed(args) -> list:
    return ["--hosts", str(args.hosts), "--mib", str(args.mib), "--timeout", str(args.timeout)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hosts", type=int, default=4)
    p.add_argument("--link", default="1gbit")
    p.add_argument("--mtu", type=int, default=9000)
    p.add_argument("--loss", type=float, default=0.01)
    p.add_argument("--mib", type=float, default=64.0)
    p.add_argument("--into", type=float, default=0.2,
                   help="seconds into the big call the switch is killed")
    p.add_argument("--down", type=float, default=0.3, help="seconds it stays dead")
    p.add_argument("--timeout", type=float, default=20.0, help="the workers' timeout")
    p.add_argument("--runs", type=at_least(1), default=1)
    p.add_argument("--out", default=None)
    p.add_argument("--role", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--control", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.role == "rank":
        return rank_main(args)
    runs = []
    for i in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="switchml-restart-") as control:
            run = one_run(args, control)
        runs.append(run)
        resumed = [r["calls_resumed"] for r in run["reports"]]
        print(f"run {i + 1}: {'ok' if not run['wrong'] else 'FAILED'}  calls resumed by rank "
              f"{resumed}  {'; '.join(run['wrong'])}", flush=True)
    report_runs("restart.py", args, runs)


if __name__ == "__main__":
    main()
