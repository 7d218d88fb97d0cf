"""The campaign: every figure README.md and docs/performance.md cite, and how to
measure it again.

    python -m bench campaign              # every case (root, for the testbed), then --report
    python -m bench campaign core lo      # the cases of groups core and lo, or cases by id
    python -m bench campaign --list       # the cases and their commands; runs nothing
    python -m bench campaign --report     # the docs' tables and the plots from the results

Each case below is one command; its results go to ``bench/results/campaign/ID``
(``ID/summary.json``: the median of 3 invocations of ``switchml bench``, through
bench/invocations.py) or ``ID.json``.  ``--report`` rewrites the blocks between
``<!-- campaign:NAME -->`` and ``<!-- /campaign -->`` in README.md and
docs/performance.md from those results, and draws the plots; tests/test_campaign.py
fails when a block differs from what the results give, or when a doc names a
case that is not declared here.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
from dataclasses import dataclass

from switchml.bench.launch import run_to_its_end
from switchml.testbed.core import signals_end_the_run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: The share of its ring's bound gloo must reach in a run for a speedup over it
#: to be stated as one (the project's rule for honest comparisons).
FAIR_GLOO_SHARE = 0.9
RESULTS = os.path.join("bench", "results", "campaign")
#: The documents whose generated blocks --report rewrites.
DOCUMENTS = ("README.md", os.path.join("docs", "performance.md"))
#: Tensor sizes of the latency cases: 1 value, 1 KiB, 16 KiB, 256 KiB, 1 MiB, 4 MiB.
LATENCY_MIB = ("0.000003814697265625", "0.0009765625", "0.015625", "0.25", "1", "4")

TB_1G_9000 = ("--testbed", "--link", "1gbit", "--mtu", "9000")
TB_500M_9000 = ("--testbed", "--link", "500mbit", "--mtu", "9000")
#: Block densities of the density plot's sweep.
DENSITIES = ("0.01", "0.03", "0.1", "0.3", "0.5")


@dataclass(frozen=True)
class Case:
    """One measurement: ``kind`` says which bench runs ``args``.

    suite: ``switchml bench ARGS``, ``runs`` invocations (bench/invocations.py);
    train: bench/train.py; two_jobs: bench/two_jobs.py; beside_tcp:
    bench/beside_tcp.py; switch_core: bench/switch_core.py.  ``system`` is the
    suite row the figure is of; ``reference`` a case the figure is compared with,
    as ``compare`` says.
    """

    id: str
    group: str
    title: str
    kind: str
    args: tuple
    runs: int = 3
    system: str = "switchml-dense"
    reference: str | None = None
    compare: str | None = None  # loss-free | flat | one-switch | one-rank
    #: False: a plot's points only, in no table
    table: bool = True
    #: The least cores the case needs (its links faster than fewer carry): on a
    #: machine of fewer it is skipped, saying so.  0: any.  Its figures state the
    #: machine they ran on (its results' own), not machine.json's.
    cores: int = 0
    #: Whether only the first invocation checks the sums (bench/invocations.py
    #: --check-first-only): at 256 MiB the check takes longer than the calls.
    check_first_only: bool = False


CASES = (
    # 4 hosts at 1 Gbit/s
    Case("tb-n4-mtu9000", "core", "4 hosts, 1 Gbit/s, MTU 9000, 64 MiB", "suite",
         TB_1G_9000 + ("--workers", "4", "--sizes", "64", "--repeats", "5",
                       "--systems", "dense", "gloo")),
    Case("tb-n4-mtu1500", "core", "4 hosts, 1 Gbit/s, MTU 1500, 64 MiB", "suite",
         ("--testbed", "--link", "1gbit", "--workers", "4", "--sizes", "64", "--repeats", "5",
          "--systems", "dense", "gloo")),
    Case("tb-n4-mtu9000-offload-off", "loss",
         "the same, the veths' segmentation offload off (the loss case's reference)", "suite",
         TB_1G_9000 + ("--workers", "4", "--sizes", "64", "--repeats", "5",
                       "--udp-offload", "off", "--systems", "dense")),
    Case("tb-n4-mtu9000-loss1", "loss", "4 hosts, 1 Gbit/s, MTU 9000, 1% loss on every link",
         "suite", TB_1G_9000 + ("--workers", "4", "--sizes", "64", "--repeats", "5",
                                "--loss", "0.01", "--systems", "dense"),
         reference="tb-n4-mtu9000-offload-off", compare="loss-free"),
    Case("tb-n4-mtu9000-sparse", "sparse",
         "4 hosts, 1 Gbit/s, MTU 9000, block-sparse at density 0.1", "suite",
         TB_1G_9000 + ("--workers", "4", "--sizes", "64", "--repeats", "3",
                       "--densities", "0.1", "--systems", "sparse", "dense"),
         system="switchml-sparse"),
    # the plots' sweeps: link rate and block density at 4 hosts
    Case("tb-n4-500mbit", "plots", "4 hosts, 500 Mbit/s, MTU 9000, 64 MiB", "suite",
         TB_500M_9000 + ("--workers", "4", "--sizes", "64", "--repeats", "3",
                         "--systems", "dense", "gloo"), table=False),
    Case("tb-n4-100mbit", "plots", "4 hosts, 100 Mbit/s, MTU 9000, 64 MiB", "suite",
         ("--testbed", "--link", "100mbit", "--mtu", "9000", "--workers", "4", "--sizes", "64",
          "--repeats", "3", "--systems", "dense", "gloo"), table=False),
    Case("tb-n4-mtu9000-densities", "plots",
         "4 hosts, 1 Gbit/s, MTU 9000, block-sparse at densities 0.01 to 0.5", "suite",
         TB_1G_9000 + ("--workers", "4", "--sizes", "64", "--repeats", "3", "--densities",
                       *DENSITIES, "--systems", "sparse", "dense", "gloo"),
         system="switchml-sparse", table=False),
    Case("tb-n4-servers4-mtu9000", "more", "4 hosts and 4 switch servers, 1 Gbit/s, MTU 9000",
         "suite", TB_1G_9000 + ("--workers", "4", "--switches", "4", "--sizes", "64",
                                "--repeats", "5", "--systems", "dense", "gloo")),
    Case("tb-n8-500mbit-mtu1500", "more", "8 hosts, 500 Mbit/s, MTU 1500, 64 MiB", "suite",
         ("--testbed", "--link", "500mbit", "--workers", "8", "--sizes", "64", "--repeats", "3",
          "--systems", "dense", "gloo")),
    # 16 hosts at 100 Mbit/s
    Case("tb-n16-100mbit", "scale", "16 hosts, 100 Mbit/s, MTU 9000, 64 MiB", "suite",
         ("--testbed", "--link", "100mbit", "--mtu", "9000", "--workers", "16", "--sizes", "64",
          "--repeats", "3", "--systems", "dense", "gloo")),
    Case("tb-n16-100mbit-striped2", "scale", "the same, striped over 2 switch processes",
         "suite", ("--testbed", "--link", "100mbit", "--mtu", "9000", "--workers", "16",
                   "--sizes", "64", "--repeats", "3", "--striped", "2", "--systems", "dense"),
         reference="tb-n16-100mbit", compare="one-switch"),
    Case("tb-n16-100mbit-striped4", "scale", "the same, striped over 4 switch processes",
         "suite", ("--testbed", "--link", "100mbit", "--mtu", "9000", "--workers", "16",
                   "--sizes", "64", "--repeats", "3", "--striped", "4", "--systems", "dense"),
         reference="tb-n16-100mbit", compare="one-switch"),
    Case("tb-n16-100mbit-servers4", "scale",
         "16 hosts on 4 switch servers, 100 Mbit/s, MTU 9000 (bound max(S, n·S/K)/B)", "suite",
         ("--testbed", "--link", "100mbit", "--mtu", "9000", "--workers", "16", "--sizes", "64",
          "--repeats", "1", "--switches", "4", "--systems", "dense")),
    Case("tb-n16-100mbit-racks2-os4-flat", "racks",
         "2 racks of 8 hosts, 4:1 uplinks, no rack switches (the flat job)", "suite",
         ("--testbed", "--link", "100mbit", "--mtu", "9000", "--workers", "16", "--racks", "2",
          "--oversubscription", "4", "--flat", "--sizes", "64", "--repeats", "1",
          "--systems", "dense")),
    Case("tb-n16-100mbit-racks2-os4", "racks",
         "2 racks of 8 hosts under a spine, 4:1 uplinks, rack switches", "suite",
         ("--testbed", "--link", "100mbit", "--mtu", "9000", "--workers", "16", "--racks", "2",
          "--oversubscription", "4", "--sizes", "64", "--repeats", "2", "--systems", "dense",
          "gloo"), reference="tb-n16-100mbit-racks2-os4-flat", compare="flat"),
    # several ranks a host: the local stage, against as many hosts of one rank
    Case("tb-h2x1-1gbit", "local", "2 hosts of 1 rank, 1 Gbit/s, MTU 9000, 64 MiB", "suite",
         TB_1G_9000 + ("--workers", "2", "--sizes", "64", "--repeats", "5",
                       "--systems", "dense")),
    Case("tb-h2x2-1gbit", "local", "2 hosts of 2 ranks, 1 Gbit/s, MTU 9000, 64 MiB", "suite",
         TB_1G_9000 + ("--workers", "4", "--ranks-per-host", "2", "--sizes", "64",
                       "--repeats", "5", "--systems", "dense", "gloo"),
         reference="tb-h2x1-1gbit", compare="one-rank"),
    Case("tb-h4x1-500mbit", "local", "4 hosts of 1 rank, 500 Mbit/s, MTU 9000, 32 MiB", "suite",
         TB_500M_9000 + ("--workers", "4", "--sizes", "32", "--repeats", "5",
                         "--systems", "dense")),
    Case("tb-h4x2-500mbit", "local", "4 hosts of 2 ranks, 500 Mbit/s, MTU 9000, 32 MiB",
         "suite", TB_500M_9000 + ("--workers", "8", "--ranks-per-host", "2", "--sizes", "32",
                                  "--repeats", "5", "--systems", "dense", "gloo"),
         reference="tb-h4x1-500mbit", compare="one-rank"),
    Case("tb-h2x1-500mbit", "local", "2 hosts of 1 rank, 500 Mbit/s, MTU 9000, 32 MiB", "suite",
         TB_500M_9000 + ("--workers", "2", "--sizes", "32", "--repeats", "5",
                         "--systems", "dense")),
    Case("tb-h2x4-500mbit", "local", "2 hosts of 4 ranks, 500 Mbit/s, MTU 9000, 32 MiB",
         "suite", TB_500M_9000 + ("--workers", "8", "--ranks-per-host", "4", "--sizes", "32",
                                  "--repeats", "5", "--systems", "dense", "gloo"),
         reference="tb-h2x1-500mbit", compare="one-rank"),
    Case("lo-h1x4-100mib", "local", "one host of 4 ranks (loopback), 100 MiB", "suite",
         ("--workers", "4", "--ranks-per-host", "4", "--sizes", "100", "--repeats", "5",
          "--systems", "dense", "gloo")),
    Case("lat-tb-h2x2", "local", "latency, 2 hosts of 2 ranks, 1 Gbit/s, MTU 9000", "suite",
         TB_1G_9000 + ("--workers", "4", "--ranks-per-host", "2", "--sizes", *LATENCY_MIB,
                       "--repeats", "20", "--systems", "dense", "gloo")),
    # loopback
    Case("lo-n4-100mib", "lo", "loopback, 4 workers and the switch on the 2 cores, 100 MiB",
         "suite", ("--workers", "4", "--sizes", "100", "--repeats", "5",
                   "--systems", "dense", "gloo")),
    # latency, 1 value to 4 MiB
    Case("lat-tb-n4-mtu9000", "rest", "latency, 4 hosts, 1 Gbit/s, MTU 9000", "suite",
         TB_1G_9000 + ("--workers", "4", "--sizes", *LATENCY_MIB, "--repeats", "20",
                       "--systems", "dense", "gloo")),
    Case("lat-lo-n4", "lo", "latency, loopback, 4 workers", "suite",
         ("--workers", "4", "--sizes", *LATENCY_MIB, "--repeats", "20",
          "--systems", "dense", "gloo")),
    # the rest
    Case("two-jobs-mtu9000", "rest",
         "two jobs of 4 ranks sharing every link, a queue per flow in each host, 1 Gbit/s, "
         "MTU 9000", "two_jobs",
         ("--hosts", "4", "--link", "1gbit", "--mtu", "9000", "--mib", "64", "--repeats", "8")),
    Case("beside-tcp-mtu9000", "rest",
         "a job of 4 ranks beside a bulk CUBIC flow host 0 to host 1, a queue per flow in "
         "each host, 1 Gbit/s, MTU 9000, 64 MiB", "beside_tcp",
         ("--hosts", "4", "--link", "1gbit", "--mtu", "9000", "--mib", "64", "--repeats", "8",
          "--runs", "3")),
    Case("two-jobs-fifo-mtu9000", "rest",
         "two jobs of 4 ranks sharing every link, one FIFO in each host, 1 Gbit/s, MTU 9000",
         "two_jobs",
         ("--hosts", "4", "--link", "1gbit", "--mtu", "9000", "--mib", "64", "--repeats", "8",
          "--host-queue", "fifo")),
    Case("beside-tcp-fifo-mtu9000", "rest",
         "a job of 4 ranks beside a bulk CUBIC flow host 0 to host 1, one FIFO in each host, "
         "1 Gbit/s, MTU 9000, 64 MiB", "beside_tcp",
         ("--hosts", "4", "--link", "1gbit", "--mtu", "9000", "--mib", "64", "--repeats", "8",
          "--runs", "3", "--host-queue", "fifo")),
    Case("switch-core", "rest", "one switch core, C data plane", "switch_core", ()),
    Case("train-testbed-digits-hidden2048", "ddp",
         "DDP, digits MLP (dense gradients), 4 hosts, 1 Gbit/s, MTU 9000", "train",
         ("--workers", "4", "--testbed", "--link", "1gbit", "--mtu", "9000", "--runs", "3",
          "--only", "digits gloo", "digits switchml",
          "--digits-args", "--epochs 3 --hidden 2048")),
    Case("train-testbed-h2x2-digits", "local-ddp",
         "DDP, digits MLP (dense gradients), 2 hosts of 2 ranks, 1 Gbit/s, MTU 9000", "train",
         ("--workers", "4", "--ranks-per-host", "2", "--testbed", "--link", "1gbit", "--mtu",
          "9000", "--runs", "3", "--only", "digits gloo", "digits switchml",
          "--digits-args", "--epochs 3 --hidden 2048")),
    Case("train-testbed-bag-of-words", "ddp-sparse",
         "DDP, bag-of-words (block-sparse gradients), 4 hosts, 1 Gbit/s, MTU 9000", "train",
         ("--workers", "4", "--testbed", "--link", "1gbit", "--mtu", "9000", "--runs", "3",
          "--only", "bag-of-words gloo", "bag-of-words switchml sparse",
          "--sparse-args", "--epochs 1")),
    # fast links: a machine of 16 cores (bench/fast_check.sh runs the same commands)
    Case("tb-n4-10gbit", "fast", "4 hosts, 10 Gbit/s, MTU 9000, 256 MiB", "suite",
         ("--testbed", "--link", "10gbit", "--mtu", "9000", "--workers", "4", "--sizes", "256",
          "--repeats", "5", "--systems", "dense", "gloo", "--no-plots"),
         cores=16, check_first_only=True),
    Case("tb-n4-25gbit", "fast", "4 hosts, 25 Gbit/s, MTU 9000, 256 MiB", "suite",
         ("--testbed", "--link", "25gbit", "--mtu", "9000", "--workers", "4", "--sizes", "256",
          "--repeats", "5", "--systems", "dense", "gloo", "--no-plots"),
         cores=16, check_first_only=True),
)
BY_ID = {case.id: case for case in CASES}
GROUPS = tuple(dict.fromkeys(case.group for case in CASES))


# ------------------------------------------------------------------ running
def output(case: Case, results: str = RESULTS) -> str:
    """Where ``case``'s results go: a folder (suite) or a JSON file."""
    return os.path.join(results, case.id + ("" if case.kind == "suite" else ".json"))


def command(case: Case, results: str = RESULTS, python: str = "python") -> list:
    """The command that measures ``case`` into ``results``, from the repository root."""
    out = output(case, results)
    if case.kind == "suite":
        checks = ["--check-first-only"] if case.check_first_only else []
        return [python, "bench/invocations.py", "--runs", str(case.runs), *checks, "--out", out,
                "--", *case.args]
    script, flag = {"train": ("train.py", "--out"), "two_jobs": ("two_jobs.py", "--json"),
                    "beside_tcp": ("beside_tcp.py", "--json"),
                    "switch_core": ("switch_core.py", "--json")}[case.kind]
    return [python, f"bench/{script}", *case.args, flag, out]


def select(names: list) -> list:
    """The cases that ``names`` (case ids or groups; none: all) pick, in declared order."""
    unknown = [n for n in names if n not in BY_ID and n not in GROUPS]
    if unknown:
        raise SystemExit(f"campaign: no case or group {', '.join(unknown)}; groups: "
                         f"{', '.join(GROUPS)}; cases: python -m bench campaign --list")
    return [c for c in CASES if not names or c.id in names or c.group in names]


def machine() -> dict:
    """What the figures ran on."""
    cpu = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f
                       if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    memory = None
    if hasattr(os, "sysconf") and "SC_PHYS_PAGES" in os.sysconf_names:
        memory = round(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30)
    versions = {}
    for name in ("numpy", "torch"):
        try:
            versions[name] = __import__(name).__version__
        except ImportError:
            versions[name] = None
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gib": memory,
            "platform": platform.platform(), "python": platform.python_version(), **versions}


def run(cases: list, results: str, python: str) -> int:
    os.makedirs(os.path.join(ROOT, results), exist_ok=True)
    cores = os.cpu_count() or 1
    for case in cases:
        if case.cores > cores:
            print(f"campaign: {case.id} skipped: it needs {case.cores} cores, this machine "
                  f"has {cores}", file=sys.stderr)
    cases = [c for c in cases if c.cores <= cores]
    if any(not c.cores for c in cases):  # the machine of every figure that states none
        with open(os.path.join(ROOT, results, "machine.json"), "w") as f:
            json.dump(machine(), f, indent=2)
    for case in cases:
        argv = command(case, results, python)
        print(f"campaign: {case.id}: {' '.join(argv)}", file=sys.stderr, flush=True)
        code = run_to_its_end(argv, cwd=ROOT)
        if code != 0:
            print(f"campaign: {case.id} failed (exit {code})", file=sys.stderr)
            return code
    return 0


# ------------------------------------------------------------------ figures
def load(case: Case, results: str = RESULTS) -> dict:
    path = output(case, os.path.join(ROOT, results))
    with open(os.path.join(path, "summary.json") if case.kind == "suite" else path) as f:
        return json.load(f)


def row(case: Case, results: str = RESULTS, system: str | None = None,
        mib: float | None = None) -> dict | None:
    """The summary row of ``system`` (the case's by default) in a suite case."""
    system = system or case.system
    for r in load(case, results)["rows"]:
        if r["system"] == system and (mib is None or r["size_mib"] == mib):
            return r
    return None


def seconds(r: dict) -> str:
    runs = ", ".join(f"{t:.3f}" for t in r["run_medians_s"])
    return f"{r['median_s']:.3f} s" + (f" ({runs})" if len(r["run_medians_s"]) > 1 else "")


def suite_figures(case: Case, results: str = RESULTS) -> tuple:
    """(switchml, gloo, result) cells of a suite case's row."""
    mine = row(case, results)
    assert mine is not None, f"{case.id}: no {case.system} row"
    gloo = row(case, results, "gloo")
    result = []
    if mine.get("speedup_over_gloo"):
        if gloo and gloo.get("of_bound") and gloo["of_bound"] < FAIR_GLOO_SHARE:
            # a comparison holds where gloo reaches its ring's bound nearly: not here
            result.append(f"{mine['speedup_over_gloo']:.2f}x gloo (gloo under "
                          f"{FAIR_GLOO_SHARE:.0%} of its bound: no fair comparison)")
        else:
            result.append(f"**{mine['speedup_over_gloo']:.2f}x** gloo")
    if mine.get("of_bound"):
        result.append(f"{mine['of_bound']:.0%} of its bound")
    if case.reference:
        ref = row(BY_ID[case.reference], results)
        assert ref is not None
        ratio = ref["median_s"] / mine["median_s"]
        result.append({"loss-free": f"{ratio:.1%} of the loss-free speed",
                       "flat": f"{ratio:.2f}x the flat job",
                       "one-switch": f"{1 / ratio - 1:+.1%} against one switch",
                       "one-rank": f"{1 / ratio - 1:+.1%} against {ref['workers']} hosts of "
                                   "1 rank"}[case.compare])
    if case.system == "switchml-sparse":
        dense = row(case, results, "switchml-dense")
        if dense:
            result.append(f"dense {dense['median_s']:.3f} s")
    gloo_cell = "-"
    if gloo:
        gloo_cell = seconds(gloo) + (f", {gloo['of_bound']:.0%} of its bound"
                                     if gloo.get("of_bound") else "")
    return seconds(mine), gloo_cell, "; ".join(result)


def train_figures(case: Case, results: str = RESULTS) -> tuple:
    runs = load(case, results)["runs"]
    gloo = next(r for r in runs if r["backend"] == "gloo")
    mine = next(r for r in runs if r["backend"] == "switchml")

    def rate(r):
        return f"{r['samples_per_s']:.0f} samples/s"
    return rate(mine), rate(gloo), f"**{mine['samples_per_s'] / gloo['samples_per_s']:.2f}x** gloo"


def two_jobs_figures(case: Case, results: str = RESULTS) -> tuple:
    data = load(case, results)
    shares = " and ".join(f"{j['of_equal_share']:.2f}" for j in data["jobs"].values())
    return (f"{data['total_Gbps']:.3f} Gbit/s together", "-",
            f"{shares} of an equal share")


def beside_tcp_figures(case: Case, results: str = RESULTS) -> tuple:
    data = load(case, results)

    def cell(system):
        alone, beside = data[f"{system}_alone"], data[f"{system}_beside_tcp"]
        return (f"{beside['median_s']:.3f} s beside the flow ({alone['median_s']:.3f} s "
                f"alone), {beside['share']:.0%} of the link")
    mine, gloo = data["switchml_beside_tcp"], data["gloo_beside_tcp"]
    return (cell("switchml"), cell("gloo"),
            f"the flow keeps {mine['tcp_share']:.0%} beside switchml, {gloo['tcp_share']:.0%} "
            f"beside gloo ({data['tcp_alone']['throughput_Mbps']:.0f} Mbit/s alone)")


def switch_core_figures(case: Case, results: str = RESULTS) -> tuple:
    rows = load(case, results)["rows"]
    cells = [f"{r['gbit_per_core_s']:.1f} Gbit/s per core at {r['packet_bytes']} B"
             for r in rows if r["data_plane"] == "c"]
    return "; ".join(cells), "-", "contributions summed per second of the switch's core"


FIGURES = {"suite": suite_figures, "train": train_figures, "two_jobs": two_jobs_figures,
           "beside_tcp": beside_tcp_figures, "switch_core": switch_core_figures}


def figures(case: Case, results: str = RESULTS) -> tuple:
    return FIGURES[case.kind](case, results)


# ------------------------------------------------------------------ the docs' blocks
def cases_table(ids, results: str = RESULTS) -> str:
    lines = ["| case | set-up | switchml | gloo | result |", "|---|---|---|---|---|"]
    for case in (BY_ID[i] for i in ids if BY_ID[i].table):
        mine, gloo, result = figures(case, results)
        lines.append(f"| [`{case.id}`](#{case.id}) | {case.title} | {mine} | {gloo} | {result} |")
    return "\n".join(lines)


def headline_table(results: str = RESULTS) -> str:
    """README's table: the headline figure of a few cases."""
    ids = ["tb-n4-mtu9000", "tb-n4-mtu1500", "tb-n4-mtu9000-loss1", "tb-n4-mtu9000-sparse",
           "tb-n8-500mbit-mtu1500", "tb-n16-100mbit", "tb-n16-100mbit-servers4",
           "tb-n16-100mbit-racks2-os4", "lo-n4-100mib", "tb-h2x2-1gbit", "tb-h4x2-500mbit",
           "tb-h2x4-500mbit", "lo-h1x4-100mib", "train-testbed-digits-hidden2048",
           "train-testbed-h2x2-digits", "train-testbed-bag-of-words"]
    lines = ["| set-up (emulated cluster unless loopback) | switchml | result | "
             "command |", "|---|---|---|---|"]
    for case in (BY_ID[i] for i in ids):
        mine, _, result = figures(case, results)
        mine = mine.split(" (")[0]  # the median; the runs are in docs/performance.md
        lines.append(f"| {case.title} | {mine} | {result} | "
                     f"`python -m bench campaign {case.id}` |")
    return "\n".join(lines)


def latency_table(results: str = RESULTS) -> str:
    lines = ["| size | testbed: switchml | gloo | ratio | loopback: switchml | gloo | ratio |",
             "|---|---|---|---|---|---|---|"]
    tb, lo = load(BY_ID["lat-tb-n4-mtu9000"], results), load(BY_ID["lat-lo-n4"], results)
    for mib in LATENCY_MIB:
        size = float(mib)
        label = ("1 value" if size * 2**20 <= 4 else f"{size * 1024:g} KiB" if size < 1
                 else f"{size:g} MiB")
        cells = [label]
        for data in (tb, lo):
            got = {r["system"]: r["median_s"] for r in data["rows"] if r["size_mib"] == size}
            mine, gloo = got["switchml-dense"], got["gloo"]
            cells += [f"{mine * 1e3:.1f} ms", f"{gloo * 1e3:.1f} ms", f"{gloo / mine:.2f}x"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def local_latency_table(results: str = RESULTS) -> str:
    """Latency of 4 ranks on 2 hosts (the local stage) against gloo's 4 ranks there."""
    lines = ["| size | switchml | gloo | ratio |", "|---|---|---|---|"]
    data = load(BY_ID["lat-tb-h2x2"], results)
    for mib in LATENCY_MIB:
        size = float(mib)
        label = ("1 value" if size * 2**20 <= 4 else f"{size * 1024:g} KiB" if size < 1
                 else f"{size:g} MiB")
        got = {r["system"]: r["median_s"] for r in data["rows"] if r["size_mib"] == size}
        mine, gloo = got["switchml-dense"], got["gloo"]
        lines.append(f"| {label} | {mine * 1e3:.1f} ms | {gloo * 1e3:.1f} ms | "
                     f"{gloo / mine:.2f}x |")
    return "\n".join(lines)


def machine_text(results: str = RESULTS) -> str:
    with open(os.path.join(ROOT, results, "machine.json")) as f:
        m = json.load(f)
    return (f"**Machine**: {m['cores']} cores ({m['cpu']}, as `/proc/cpuinfo` names it), "
            f"{m['memory_gib']} GiB, {m['platform']}, Python {m['python']}, numpy "
            f"{m['numpy']}, torch {m['torch']} (gloo). Every host, switch and link of the "
            "emulated cluster shares those cores.")


def fast_text(results: str = RESULTS) -> str:
    """The fast-link cases' table, and the machine they ran on (their results')."""
    fast = [c for c in CASES if c.group == "fast"]
    with open(os.path.join(output(fast[0], os.path.join(ROOT, results)), "run1",
                           "results.json")) as f:
        m = json.load(f)["machine"]
    return (cases_table([c.id for c in fast], results) + "\n\n"
            f"**Machine**: {m['cpus']} cores ({m['cpu']}, as `/proc/cpuinfo` names it), "
            f"{m['platform']}, Python {m['python']}. The 4 hosts, the switch and every "
            "link share those cores.")


def commands_list(results: str = RESULTS) -> str:
    lines = []
    for case in CASES:
        if case.kind == "suite":
            shown = "switchml bench " + " ".join(
                a if re.fullmatch(r"[\w.:/=-]+", a) else repr(a) for a in case.args)
            runs = f"; the median of {case.runs} invocations" if case.runs > 1 else ""
            if case.check_first_only:
                runs += ", the first checking the sums"
            if case.cores:
                runs += f"; on {case.cores} cores or more"
            lines.append(f"- <a id=\"{case.id}\"></a>`{case.id}`: `{shown}`{runs}")
        else:
            shown = " ".join(a if re.fullmatch(r"[\w.:/=-]+", a) else repr(a)
                             for a in command(case, results)[1:])
            lines.append(f"- <a id=\"{case.id}\"></a>`{case.id}`: `python {shown}`")
    return "\n".join(lines)


BLOCKS = {
    "machine": machine_text,
    "headline": headline_table,
    "link": lambda results=RESULTS: cases_table(
        [c.id for c in CASES if c.kind == "suite" and not c.id.startswith("lat-")
         and c.group not in ("local", "fast")], results),
    "local": lambda results=RESULTS: cases_table(
        [c.id for c in CASES if c.kind == "suite" and not c.id.startswith("lat-")
         and c.group == "local"], results),
    "latency_local": local_latency_table,
    "latency": latency_table,
    "other": lambda results=RESULTS: cases_table(
        [c.id for c in CASES if c.kind != "suite"], results),
    "fast": fast_text,
    "commands": commands_list,
}
BLOCK = re.compile(r"(<!-- campaign:(\w+) -->\n)(.*?)(<!-- /campaign -->)", re.S)


def render(text: str, results: str = RESULTS) -> str:
    """``text`` with every generated block made again from ``results``."""
    return BLOCK.sub(lambda m: m.group(1) + BLOCKS[m.group(2)](results) + "\n" + m.group(4),
                     text)


def report(results: str = RESULTS) -> None:
    for doc in DOCUMENTS:
        path = os.path.join(ROOT, doc)
        with open(path) as f:
            text = f.read()
        new = render(text, results)
        if new != text:
            with open(path, "w") as f:
                f.write(new)
            print(f"campaign: rewrote {doc}'s figures", file=sys.stderr)
    plots(results)


def plots(results: str = RESULTS) -> list:
    """The docs' plots, as PNG files in ``results``; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for name, draw in PLOTS.items():
        fig, ax = plt.subplots(figsize=(6, 4.2))
        draw(ax, results)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small")
        fig.tight_layout()
        path = os.path.join(ROOT, results, name)
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written


def _speedups(ids, results):
    """(workers, speedup over gloo, case id) of suite cases."""
    points = []
    for cid in ids:
        r = row(BY_ID[cid], results)
        assert r is not None and r["speedup_over_gloo"], cid
        points.append((r["workers"], r["speedup_over_gloo"], cid))
    return points


def plot_speedup_vs_workers(ax, results):
    points = _speedups(("tb-n4-mtu9000", "tb-n8-500mbit-mtu1500", "tb-n16-100mbit"), results)
    worlds = [p[0] for p in points]
    ax.plot(worlds, [p[1] for p in points], "o-", label="switchml dense, 64 MiB")
    for n, s, cid in points:
        ax.annotate(cid, (n, s), textcoords="offset points", xytext=(4, -12), fontsize=7)
    ax.plot(worlds, [2 * (n - 1) / n for n in worlds], "k--", linewidth=1,
            label="2(n-1)/n: ratio of the link bounds")
    ax.set(xlabel="workers n", ylabel="gloo time / switchml time", xticks=worlds,
           title="speedup over gloo's ring allreduce")


def plot_speedup_vs_link(ax, results):
    ids = {100: "tb-n4-100mbit", 500: "tb-n4-500mbit", 1000: "tb-n4-mtu9000"}
    rates = sorted(ids)
    points = _speedups([ids[m] for m in rates], results)
    ax.plot(rates, [p[1] for p in points], "o-", label="switchml dense, 4 hosts, 64 MiB")
    ax.axhline(1.5, color="k", linestyle="--", linewidth=1,
               label="2(n-1)/n = 1.5: ratio of the link bounds")
    ax.set(xscale="log", xlabel="link rate (Mbit/s), MTU 9000", xticks=rates,
           xticklabels=[str(m) for m in rates], ylabel="gloo time / switchml time",
           ylim=(0, 2), title="speedup over gloo against the link rate")


def plot_speedup_vs_density(ax, results):
    case = BY_ID["tb-n4-mtu9000-densities"]
    rows = load(case, results)["rows"]
    gloo = next(r["median_s"] for r in rows if r["system"] == "gloo")
    dense = next(r["median_s"] for r in rows if r["system"] == "switchml-dense")
    sparse = sorted((r["density"], r["median_s"]) for r in rows
                    if r["system"] == "switchml-sparse")
    n = rows[0]["workers"]
    ax.plot([d for d, _ in sparse], [gloo / t for _, t in sparse], "o-",
            label="switchml sparse (OmniReduce)")
    ax.axhline(gloo / dense, color="tab:blue", linestyle=":", label="switchml dense")
    # the ring moves 2(n-1)/n of the tensor, the sparse path the union of the
    # ranks' blocks, 1 - (1-d)^n of it
    ax.plot([d for d, _ in sparse], [2 * (n - 1) / n / (1 - (1 - d) ** n) for d, _ in sparse],
            "k--", linewidth=1, label=f"2(n-1)/n / (1 - (1-d)^n), n={n}: the bounds' ratio")
    ax.set(xscale="log", yscale="log", xlabel="block density d (each rank's, at random)",
           ylabel="gloo time / switchml time",
           title="speedup over gloo against block density, 4 hosts, 64 MiB")
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    ax.yaxis.set_major_formatter(ScalarFormatter())
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_yticks([1, 2, 5, 10, 20, 50])


def plot_time_vs_ranks(ax, results):
    series = (("2 hosts, 1 Gbit/s, 64 MiB", "tab:blue", ("tb-h2x1-1gbit", "tb-h2x2-1gbit")),
              ("4 hosts, 500 Mbit/s, 32 MiB", "tab:green",
               ("tb-h4x1-500mbit", "tb-h4x2-500mbit")),
              ("2 hosts, 500 Mbit/s, 32 MiB", "tab:red", ("tb-h2x1-500mbit", "tb-h2x4-500mbit")))
    for label, color, ids in series:
        mine, ring = [], []
        for cid in ids:
            args = BY_ID[cid].args
            k = int(args[args.index("--ranks-per-host") + 1]) if "--ranks-per-host" in args \
                else 1
            mine.append((k, row(BY_ID[cid], results)["median_s"]))
            gloo = row(BY_ID[cid], results, "gloo")
            if gloo:
                ring.append((k, gloo["median_s"]))
        ax.plot(*zip(*mine), "o-", color=color, label=f"switchml, {label}")
        ax.plot(*zip(*ring), "x", color=color, markersize=9, label=f"gloo, {label}")
    ax.set(xlabel="ranks a host", ylabel="median time (s)", xticks=[1, 2, 4], ylim=(0, 1.1),
           title="allreduce time against ranks a host (the local stage)")


def plot_latency_vs_size(ax, results):
    for cid, style in (("lat-tb-n4-mtu9000", "-"), ("lat-lo-n4", ":")):
        data = load(BY_ID[cid], results)
        for system, color in (("switchml-dense", "tab:blue"), ("gloo", "tab:orange")):
            pts = sorted((r["size_mib"] * 2**20, r["median_s"] * 1e3) for r in data["rows"]
                         if r["system"] == system)
            ax.plot(*zip(*pts), marker="o", linestyle=style, color=color,
                    label=f"{system}, {cid}")
    ax.set(xscale="log", yscale="log", xlabel="tensor bytes", ylabel="median time (ms)",
           title="allreduce latency against size, 4 workers")


#: File name -> what draws it on an axis.
PLOTS = {"speedup_vs_workers.png": plot_speedup_vs_workers,
         "speedup_vs_link.png": plot_speedup_vs_link,
         "speedup_vs_density.png": plot_speedup_vs_density,
         "time_vs_ranks_per_host.png": plot_time_vs_ranks,
         "latency_vs_size.png": plot_latency_vs_size}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench campaign", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", metavar="NAME",
                        help=f"cases (ids) or groups ({', '.join(GROUPS)}); none: every case")
    parser.add_argument("--list", action="store_true", help="print the cases' commands only")
    parser.add_argument("--report", action="store_true",
                        help="only rewrite the docs' figures and the plots from the results")
    parser.add_argument("--results", default=RESULTS,
                        help=f"results folder, from the repository root (default {RESULTS})")
    parser.add_argument("--python", default=sys.executable, help="the Python that runs them")
    args = parser.parse_args(argv)
    cases = select(args.names)
    if args.list:
        for case in cases:
            print(f"{case.id} [{case.group}]: {' '.join(command(case, args.results))}")
        return 0
    if not args.report:
        status = run(cases, args.results, args.python)
        if status:
            return status
    report(args.results)
    return 0


if __name__ == "__main__":
    with signals_end_the_run():  # TERM or HUP: the bench it runs is asked to stop
        sys.exit(main())
