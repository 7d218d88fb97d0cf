"""samples/s of the two DDP examples on switchml and on gloo, launched by torchrun.

    python bench/train.py --workers 2 4 --runs 3 --out train.json
    python bench/train.py --workers 4 --testbed --link 1gbit      # root: emulated cluster

For every worker count it runs, one after the other on the same machine:
examples/train_ddp.py (digits MLP) on gloo, on switchml (sparse "auto") and on
switchml's 16-bit wire, and
examples/train_sparse.py (bag-of-words embedding table) on gloo and on switchml
with the sparse path and with the dense path.  Each run reports samples/s over
its training epochs, allreduce time per step (DDP buckets timed by a comm hook,
the same hook on both backends), test accuracy and switchml bytes per step.
Each of ``--runs`` invocations launches every configuration once, on a new
testbed with a new switch at its default settings; the run with the median
samples/s over the invocations is kept, and ratios to gloo come from those
medians.  "compute" is a step's forward and backward with DDP's communication
off (``no_sync``), so 1 - compute/step is the share of gloo's step that
communication costs.

With ``--testbed`` the ranks run in the host namespaces of an emulated cluster
(switchml.testbed), ``--ranks-per-host`` K in each under one torchrun per host
(``--nnodes N/K --node-rank i --nproc-per-node K``), as on N/K machines, and
switchml uses one switch in the switch namespace.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: (name, script, backend arguments); the script's own defaults otherwise.
CONFIGS = [
    ("digits gloo", "train_ddp.py", ["--backend", "gloo"]),
    ("digits switchml", "train_ddp.py", ["--backend", "switchml", "--sparse", "auto"]),
    ("digits switchml 16-bit wire", "train_ddp.py",
     ["--backend", "switchml", "--sparse", "false", "--bits", "16"]),
    ("bag-of-words gloo", "train_sparse.py", ["--backend", "gloo"]),
    ("bag-of-words switchml sparse", "train_sparse.py",
     ["--backend", "switchml", "--sparse", "true"]),
    ("bag-of-words switchml dense", "train_sparse.py",
     ["--backend", "switchml", "--sparse", "false"]),
]


def _clean_env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWITCHML_")}
    env["OMP_NUM_THREADS"] = "1"
    return env


def run_example(script: str, workers: int, args: list, extra: list) -> dict:
    """One torchrun launch on this host; rank 0's JSON summary."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "summary.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={workers}", os.path.join(ROOT, "examples", script),
               "--quiet", "--json", out, *args, *extra]
        proc = subprocess.run(cmd, env=_clean_env(), capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
        with open(out) as f:
            return json.load(f)


def _on_loopback(workers: int, script: str, args: list, extra: list) -> dict:
    return run_example(script, workers, args, extra)


def run_on_testbed(tb, script: str, args: list, extra: list) -> dict:
    """One torchrun per host namespace (``--nnodes``), as on separate machines."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "summary.json")
        procs = []
        for host in range(tb.hosts):
            cmd = tb.torchrun_command(host, [os.path.join(ROOT, "examples", script),
                                             "--quiet", "--json", out, *args, *extra])
            procs.append(tb.popen(host, cmd, env={**_clean_env(), **tb.env(host)},
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        errors = []
        for host, proc in enumerate(procs):
            _, err = proc.communicate()
            if proc.returncode != 0:
                errors.append(f"host {host}: {err[-2000:]}")
        if errors:
            raise RuntimeError(f"{script} {' '.join(args)} failed on the testbed:\n"
                               + "\n".join(errors))
        with open(out) as f:
            return json.load(f)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, nargs="+", default=[2, 4])
    p.add_argument("--runs", type=int, default=3,
                   help="invocations, each with a new testbed and switch (median kept)")
    p.add_argument("--only", nargs="*", default=None, help="names of configurations to run")
    p.add_argument("--digits-args", default="", help="extra arguments for train_ddp.py")
    p.add_argument("--sparse-args", default="", help="extra arguments for train_sparse.py")
    p.add_argument("--testbed", action="store_true",
                   help="run on an emulated cluster of --workers hosts (root)")
    p.add_argument("--ranks-per-host", type=int, default=1, metavar="K",
                   help="with --testbed: WORKERS/K hosts of K ranks each (torchrun "
                        "--nproc-per-node K in each); the ranks of a host combine there first")
    p.add_argument("--link", default="1gbit", help="testbed link rate")
    p.add_argument("--mtu", type=int, default=None, help="testbed MTU")
    p.add_argument("--slots-per-job", type=int, default=None,
                   help="testbed switch's slots per job (default: the switch's own)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    extra = {"train_ddp.py": args.digits_args.split(), "train_sparse.py": args.sparse_args.split()}
    runs = []
    for workers in args.workers:
        trials: dict = {}
        for _ in range(args.runs):
            if args.testbed:
                with _testbed(workers, args) as tb:
                    _run_configs(workers, functools.partial(run_on_testbed, tb), args, extra,
                                 trials)
            else:
                launch = functools.partial(_on_loopback, workers)
                _run_configs(workers, launch, args, extra, trials)
        runs += _medians(workers, trials)
    _finish(runs, args, argv)


@contextlib.contextmanager
def _testbed(workers: int, args):
    """A testbed of ``workers`` ranks, ``--ranks-per-host`` a host, with a switch
    running in its switch namespace."""
    from switchml.testbed import SWITCH_PORT, Testbed

    per_host = args.ranks_per_host
    if workers % per_host:
        raise SystemExit(f"--workers {workers} is not a multiple of --ranks-per-host {per_host}")
    with Testbed(hosts=workers // per_host, link=args.link, mtu=args.mtu,
                 ranks_per_host=per_host) as tb:
        flags = [] if args.slots_per_job is None else ["--slots-per-job",
                                                       str(args.slots_per_job)]
        switch = tb.popen("switch", [sys.executable, "-m", "switchml.cli", "switch",
                                     "--host", tb.switch_address, "--port", str(SWITCH_PORT),
                                     *flags, "--log-level", "warning"],
                          stdout=subprocess.DEVNULL)
        time.sleep(1.0)  # listening well before the first join (joins also retry)
        try:
            yield tb
        finally:
            switch.terminate()
            switch.wait()


def _run_configs(workers: int, launch, args, extra, trials: dict) -> None:
    """One launch of every configuration; appends each summary to ``trials[name]``."""
    for name, script, backend_args in CONFIGS:
        if args.only and name not in args.only:
            continue
        t = launch(script, backend_args, extra[script])
        trials.setdefault(name, (script, []))[1].append(t)
        print(f"n={workers} {name:<30} {t['samples_per_s']:8.0f} samples/s  "
              f"step {t['step_ms']:7.1f} ms  compute {t['compute_ms_per_step']:6.1f} ms  "
              f"allreduce {t['allreduce_ms_per_step']:7.1f} ms/step  "
              f"accuracy {100 * t['test_accuracy']:.2f}%", flush=True)


def _medians(workers: int, trials: dict) -> list:
    """Per configuration, the invocation with the median samples/s."""
    runs = []
    for name, (script, ts) in trials.items():
        rate = statistics.median(t["samples_per_s"] for t in ts)
        best = min(ts, key=lambda t: abs(t["samples_per_s"] - rate))
        runs.append(dict(best, name=name, script=script,
                         samples_per_s_all=[t["samples_per_s"] for t in ts]))
    return runs


def _finish(runs: list, args, argv) -> None:
    for r in runs:
        gloo = next((g for g in runs if g["workers"] == r["workers"]
                     and g["script"] == r["script"] and g["name"].endswith("gloo")), None)
        r["speedup_over_gloo"] = r["samples_per_s"] / gloo["samples_per_s"] if gloo else None
        r["communication_share"] = (1 - r["compute_ms_per_step"] / r["step_ms"]
                                    if r["step_ms"] else None)
    print(table(runs))
    result = {"command": "python bench/train.py " + shlex.join(argv or sys.argv[1:]),
              "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} cores",
              "date": time.strftime("%Y-%m-%d %H:%M"),
              "network": (f"testbed, {args.link} links, {args.ranks_per_host} rank(s) a host"
                          if args.testbed else "loopback"),
              "runs": runs}
    out = args.out or os.path.join(ROOT, "bench", "results",
                                   f"train-{time.strftime('%Y%m%d-%H%M%S')}.json")
    with open(out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {out}")


def table(runs: list) -> str:
    """Markdown: one row per (workers, configuration)."""
    lines = ["| n | example and backend | samples/s (runs) | vs gloo | step ms | "
             "communication share | allreduce ms/step | switchml MB sent/step | test accuracy |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        ratio = f"{r['speedup_over_gloo']:.2f}x" if r.get("speedup_over_gloo") else ""
        sent = f"{r['switchml_mb_sent_per_step']:.2f}" if r["switchml_mb_sent_per_step"] else ""
        each = ", ".join(f"{x:.0f}" for x in r["samples_per_s_all"])
        lines.append(f"| {r['workers']} | {r['name']} | {r['samples_per_s']:.0f} ({each}) | "
                     f"{ratio} | {r['step_ms']:.1f} | {r['communication_share']:.0%} | "
                     f"{r['allreduce_ms_per_step']:.1f} | {sent} | "
                     f"{100 * r['test_accuracy']:.2f}% |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
