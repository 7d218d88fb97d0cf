"""A DDP job whose switch is killed and restarted again and again, on the testbed.

    python bench/chaos.py --kills 5 --runs 10 --out chaos.json      # root

An emulated cluster (switchml.testbed: ``--hosts`` hosts of ``--ranks-per-host``
ranks, ``--link`` links, ``--mtu``) with ``switchml switch`` in its switch
namespace trains examples/train_ddp.py (the digits MLP, ``--epochs`` and
``--hidden``) on the "switchml" backend at its defaults, twice per run: once
undisturbed, once while the switch is SIGKILLed ``--kills`` times, each time
started again on its port ``--down`` seconds later and left up ``--up`` seconds
(the first kill ``--first`` seconds after the job started).  A run passes when
the disturbed job ends on every rank, its replicas are bit for bit identical,
every kill fell while it ran, its calls came back to the switch after every
fallback (a kill that falls while they are still on gloo, or that the workers ride
out by rejoining, makes none), and its test accuracy equals the undisturbed job's (its loss within
``--loss-tolerance``, since calls summed by gloo round differently).  Prints a
line per run and writes them as JSON (``--out``); exits 1 if a run failed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from switchml.bench.common import at_least  # noqa: E402


def start_switch(tb):
    """``switchml switch`` in the testbed's switch namespace, on its port."""
    from switchml.testbed import SWITCH_PORT

    return tb.popen("switch", [sys.executable, "-m", "switchml.cli", "switch", "--host",
                               tb.switch_address, "--port", str(SWITCH_PORT),
                               "--log-level", "error"], stdout=subprocess.DEVNULL)


def _train(tb, args, out: str, env: dict) -> list:
    """Start the job (one torchrun a host); its processes."""
    from bench.train import _clean_env

    script = [os.path.join(ROOT, "examples", "train_ddp.py"), "--backend", "switchml",
              "--quiet", "--json", out, "--epochs", str(args.epochs),
              "--hidden", str(args.hidden)]
    return [tb.popen(h, tb.torchrun_command(h, script), env={**_clean_env(), **env},
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for h in range(tb.hosts)]


def _wait(procs, timeout: float) -> list:
    """Each host's stderr tail where its torchrun failed."""
    errors = []
    for host, proc in enumerate(procs):
        try:
            _, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
            errors.append(f"host {host}: no end within {timeout:g}s (a hang)")
            continue
        if proc.returncode != 0:
            errors.append(f"host {host}: exit {proc.returncode}: {err[-1500:]}")
    return errors


def one_run(args, tmp: str) -> dict:
    """An undisturbed job and a disturbed one on a new testbed and switch."""
    from switchml.testbed import Testbed

    env = {"SWITCHML_RETRY_S": str(args.retry)}
    with Testbed(hosts=args.hosts, link=args.link, mtu=args.mtu,
                 ranks_per_host=args.ranks_per_host) as tb:
        switch = start_switch(tb)
        time.sleep(1.0)
        calm = os.path.join(tmp, "calm.json")
        errors = _wait(_train(tb, args, calm, env), args.timeout)
        if errors:
            raise SystemExit("the undisturbed job failed:\n" + "\n".join(errors))
        disturbed = os.path.join(tmp, "chaos.json")
        procs = _train(tb, args, disturbed, env)
        began = time.monotonic()
        kills = []  # (seconds since the start, whether the job still ran)
        time.sleep(args.first)
        for _ in range(args.kills):
            running = all(p.poll() is None for p in procs)
            switch.kill()
            switch.wait(10)
            kills.append((round(time.monotonic() - began, 2), running))
            time.sleep(args.down)
            switch = start_switch(tb)
            time.sleep(args.up)
        errors = _wait(procs, args.timeout)
        switch.kill()
        switch.wait(10)
    with open(calm) as f:
        before = json.load(f)
    after = None
    if not errors:
        with open(disturbed) as f:
            after = json.load(f)
    return {"kills": kills, "errors": errors, "undisturbed": _brief(before),
            "disturbed": _brief(after) if after else None}


def _brief(summary: dict) -> dict:
    return {k: summary[k] for k in ("steps", "loss", "test_accuracy", "train_s",
                                    "replicas_identical", "switchml_failover")}


def verdict(run: dict, args) -> list:
    """What a run got wrong (empty: it passed)."""
    wrong = list(run["errors"])
    after, before = run["disturbed"], run["undisturbed"]
    if after is None:
        return wrong or ["no summary"]
    if not all(running for _, running in run["kills"]):
        wrong.append(f"a kill fell after the job ended: {run['kills']}")
    if not after["replicas_identical"]:
        wrong.append("the replicas differ")
    failover = after["switchml_failover"]
    if not 1 <= failover.get("fallbacks", 0) == failover.get("returns"):
        wrong.append(f"left the switch {failover.get('fallbacks')} times and came back "
                     f"{failover.get('returns')} times")
    if after["test_accuracy"] != before["test_accuracy"]:
        wrong.append(f"test accuracy {after['test_accuracy']:.4f}, undisturbed "
                     f"{before['test_accuracy']:.4f}")
    if abs(after["loss"] - before["loss"]) > args.loss_tolerance * abs(before["loss"]):
        wrong.append(f"loss {after['loss']:.6f}, undisturbed {before['loss']:.6f}")
    return wrong


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hosts", type=int, default=4)
    p.add_argument("--ranks-per-host", type=int, default=1)
    p.add_argument("--link", default="1gbit")
    p.add_argument("--mtu", type=int, default=9000)
    p.add_argument("--epochs", type=int, default=10, help="train_ddp.py's (22 steps each)")
    p.add_argument("--hidden", type=int, default=2048, help="train_ddp.py's")
    p.add_argument("--kills", type=int, default=5)
    p.add_argument("--first", type=float, default=8.0,
                   help="seconds from the job's start to the first kill")
    p.add_argument("--down", type=float, default=2.0,
                   help="seconds the switch stays dead (more than --retry: the ranks go to "
                        "gloo rather than rejoin it)")
    p.add_argument("--up", type=float, default=3.0, help="seconds it then stays up")
    p.add_argument("--retry", type=float, default=1.0, help="SWITCHML_RETRY_S")
    p.add_argument("--loss-tolerance", type=float, default=1e-3,
                   help="relative difference of the final loss allowed")
    p.add_argument("--runs", type=at_least(1), default=1)
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds a job may take before it counts as a hang")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    sys.path.insert(0, ROOT)
    runs = []
    for i in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="switchml-chaos-") as tmp:
            run = one_run(args, tmp)
        run["wrong"] = verdict(run, args)
        runs.append(run)
        after = run["disturbed"] or {}
        print(f"run {i + 1}: {'ok' if not run['wrong'] else 'FAILED'}  kills at "
              f"{[t for t, _ in run['kills']]} s  steps {after.get('steps')}  accuracy "
              f"{after.get('test_accuracy')} (undisturbed "
              f"{run['undisturbed']['test_accuracy']})  loss {after.get('loss')} "
              f"({run['undisturbed']['loss']})  {after.get('switchml_failover')}  "
              f"train {after.get('train_s', 0):.1f} s ({run['undisturbed']['train_s']:.1f})",
              flush=True)
        for line in run["wrong"]:
            print("   ", line, flush=True)
    report_runs("chaos.py", args, runs)


def report_runs(script: str, args, runs: list) -> None:
    """Write ``runs`` (each with its ``wrong``) as JSON to ``--out``, print how many
    passed and exit 1 unless all did."""
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": f"python bench/{script} " + " ".join(sys.argv[1:]),
                       "machine": f"{platform.machine()}, {os.cpu_count()} cores",
                       "date": time.strftime("%Y-%m-%d %H:%M"), "settings": vars(args),
                       "runs": runs}, f, indent=1)
    passed = sum(not r["wrong"] for r in runs)
    print(f"{passed} of {len(runs)} runs passed")
    sys.exit(0 if passed == len(runs) else 1)


if __name__ == "__main__":
    main()
