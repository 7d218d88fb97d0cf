"""``make conformance``: torch's ``DistributedTest`` on gloo and on switchml, compared.

    python tests/conformance/run.py                      # the whole suite, both backends
    python tests/conformance/run.py -k "all_reduce"      # a pytest -k selection
    python tests/conformance/run.py --tests test_barrier # these tests (exact names)
    python tests/conformance/run.py --world 8 -k group   # WORLD_SIZE (default 3)
    python tests/conformance/run.py --out DIR            # where the reports go

Each backend runs ``tests/conformance/dist_suite.py`` under pytest (``WORLD_SIZE=3``)
with a JUnit report; the comparison (pass, fail or skip per test per backend) goes
to ``DIR/comparison.md`` and ``DIR/comparison.json``.  Exit status 1 when a test
passes on gloo and does not pass on switchml (fails, or skips where gloo ran it)
without being listed, with its reason, in ``tests/conformance/exceptions.py``;
and when a listed exception no longer differs (the list must stay true).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
SUITE = os.path.join(HERE, "dist_suite.py")
sys.path.insert(0, HERE)

from exceptions import EXCEPTIONS  # noqa: E402

BACKENDS = ("gloo", "switchml")


def _needs_shim() -> bool:
    try:
        import expecttest  # noqa: F401
    except ImportError:
        return True
    return False


def run_backend(backend: str, out: str, select: str | None, world: int, start: str,
                timeout: int, extra: list[str], tests: list[str] | None = None
                ) -> tuple[dict, float]:
    """Run the suite on ``backend``; {test: (outcome, message)} and the wall time."""
    xml = os.path.join(out, f"{backend}.xml")
    log = os.path.join(out, f"{backend}.log")
    paths = [ROOT] + ([os.path.join(HERE, "shim")] if _needs_shim() else [])
    if os.environ.get("PYTHONPATH"):
        paths.append(os.environ["PYTHONPATH"])
    with tempfile.TemporaryDirectory(prefix=f"conformance-{backend}-") as temp:
        env = dict(os.environ, BACKEND=backend, WORLD_SIZE=str(world), TEMP_DIR=temp,
                   PYTHONPATH=os.pathsep.join(paths), SWITCHML_CONFORMANCE_START=start,
                   # bounds a hung test (torch's default is 300 s a test)
                   DISTRIBUTED_TESTS_DEFAULT_TIMEOUT=str(timeout),
                   OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        env.pop("SWITCHML_SWITCH", None)  # the backend's own switch, one for the job
        targets = ([f"{SUITE}::TestDistBackendWithSpawn::{name}" for name in tests]
                   if tests else [SUITE])
        cmd = [sys.executable, "-m", "pytest", *targets, "-q", "-p", "no:cacheprovider",
               "-o", "addopts=", "-rN", f"--junitxml={xml}", *extra]
        if select:
            cmd += ["-k", select]
        began = time.monotonic()
        with open(log, "w") as f:
            subprocess.run(cmd, env=env, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
        wall = time.monotonic() - began
    return parse_junit(xml), wall


def parse_junit(path: str) -> dict:
    results = {}
    if not os.path.exists(path):
        return results
    for case in ET.parse(path).getroot().iter("testcase"):
        name = case.get("name")
        outcome, message = "pass", ""
        for child in case:
            if child.tag in ("failure", "error"):
                outcome, message = "fail", (child.get("message") or "")[:300]
                break
            if child.tag == "skipped":
                outcome, message = "skip", (child.get("message") or "")[:300]
        results[name] = (outcome, message)
    return results


def compare(runs: dict) -> tuple[list, list, list]:
    """(rows, unexplained, stale): a row per test; tests gloo passes that switchml
    does not and no exception explains; exceptions that no longer differ."""
    gloo, ours = runs["gloo"], runs["switchml"]
    rows, unexplained, stale = [], [], []
    for name in sorted(set(gloo) | set(ours)):
        g = gloo.get(name, ("missing", ""))[0]
        s = ours.get(name, ("missing", ""))[0]
        differs = g == "pass" and s != "pass"
        if differs and name not in EXCEPTIONS:
            unexplained.append(name)
        if name in EXCEPTIONS and g == "pass" and s == "pass":
            stale.append(name)
        rows.append((name, g, s, EXCEPTIONS.get(name, "") if differs else ""))
    return rows, unexplained, stale


def counts(results: dict) -> dict:
    c = {"pass": 0, "fail": 0, "skip": 0}
    for outcome, _ in results.values():
        c[outcome] = c.get(outcome, 0) + 1
    return c


def write_report(out: str, runs: dict, walls: dict, rows, unexplained, stale, select,
                 world: int, start: str) -> str:
    lines = ["# torch DistributedTest: gloo vs switchml", "",
             f"WORLD_SIZE={world}, ranks started by {start}, selection: "
             f"{select or 'the whole suite'}", "",
             "| backend | pass | fail | skip | wall |", "|---|---|---|---|---|"]
    for b in BACKENDS:
        c = counts(runs[b])
        lines.append(f"| {b} | {c['pass']} | {c['fail']} | {c['skip']} | {walls[b]:.0f} s |")
    lines += ["", f"Unexplained (pass on gloo, not on switchml): {len(unexplained)}",
              *[f"- {n}: {runs['switchml'].get(n, ('missing', ''))}" for n in unexplained],
              "", f"Listed exceptions that no longer differ: {len(stale)}",
              *[f"- {n}" for n in stale],
              "", "| test | gloo | switchml | exception |", "|---|---|---|---|"]
    lines += [f"| {n} | {g} | {s} | {why} |" for n, g, s, why in rows]
    path = os.path.join(out, "comparison.md")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(out, "comparison.json"), "w") as f:
        json.dump({"walls": walls, "counts": {b: counts(runs[b]) for b in BACKENDS},
                   "unexplained": unexplained, "stale": stale,
                   "tests": {b: runs[b] for b in BACKENDS}}, f, indent=1)
    return path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("-k", dest="select", help="pytest -k expression (default: every test)")
    p.add_argument("--out", default=os.path.join(ROOT, "conformance-results"))
    p.add_argument("--world", type=int, default=3)
    p.add_argument("--start", choices=("fork", "spawn"),
                   default=os.environ.get("SWITCHML_CONFORMANCE_START", "fork"),
                   help="how each test's ranks start (spawn: torch's way, ~10x slower)")
    p.add_argument("--timeout", type=int, default=180, help="seconds a test may take")
    p.add_argument("--backends", nargs="+", default=list(BACKENDS))
    p.add_argument("--tests", nargs="+", help="run these tests (exact names) only")
    args, extra = p.parse_known_args(argv)
    os.makedirs(args.out, exist_ok=True)
    runs, walls = {}, {}
    for backend in args.backends:
        runs[backend], walls[backend] = run_backend(backend, args.out, args.select, args.world,
                                                    args.start, args.timeout, extra,
                                                    args.tests)
        c = counts(runs[backend])
        print(f"{backend}: {c['pass']} passed, {c['fail']} failed, {c['skip']} skipped "
              f"in {walls[backend]:.0f} s", flush=True)
    if set(BACKENDS) - set(runs):
        return 0
    rows, unexplained, stale = compare(runs)
    if args.select or args.tests:
        stale = []  # a selection does not run every listed test
    selection = args.select or (" ".join(args.tests) if args.tests else None)
    path = write_report(args.out, runs, walls, rows, unexplained, stale, selection, args.world,
                        args.start)
    print(f"comparison: {path}")
    for name in unexplained:
        print(f"NOT CONFORMING: {name} passes on gloo, switchml: "
              f"{runs['switchml'].get(name, ('missing', ''))}")
    for name in stale:
        print(f"STALE EXCEPTION: {name} no longer differs; remove it from exceptions.py")
    return 1 if unexplained or stale or not runs["gloo"] else 0


if __name__ == "__main__":
    sys.exit(main())
