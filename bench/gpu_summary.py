"""The table of a bench/gpu_check.sh run: every figure beside its aim.

    python bench/gpu_summary.py OUT [OUT ...]

Reads what the run wrote in OUT (stages.tsv, bench-cuda/ and bench-cpu/ from
bench/invocations.py, or for the CPU calls the ``cuda-modes`` stage's
bench-cpu-switchml/ where bench-cpu/ is missing; ddp.json from
bench/ddp_resnet.py), prints the stages, the
machine, and one table per measurement, and writes OUT/summary.json.  A bench
stage cut short still counts the invocations that finished (their results.json).
Several OUT folders (the stages of one check split over calls of the machine)
make one table: each measurement from the first folder that holds it, the
summary written in the first.

The aims (one host, K ranks, switchml against gloo in the same invocations):
- allreduce of a float32 tensor, CPU and CUDA tensors: at least 1.3x gloo at K=2,
  1.5x at K=4 and 8; a CUDA call at most 1.25x the CPU call of the same size;
- no fresh memory on a steady-state call: the minor page faults a call takes (the
  busiest rank's), "met" under 1% of the tensor's pages (what Python's own objects
  of a call may fault in);
- DDP ResNet-18: at least 1.2x gloo's samples/s, replicas identical.

With the ``cuda-modes`` and ``ddp-modes`` stages' results it also sets the CUDA
calls and DDP's samples/s of each ``SWITCHML_CUDA_COPIES`` side by side.
"""

from __future__ import annotations

import glob
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.invocations import summarize_runs  # noqa: E402

PAGE = 4096
#: Least switchml/gloo speed ratio at K ranks.
SPEEDUP_AIMS = {2: 1.3}
SPEEDUP_AIM_MORE = 1.5
CUDA_OVER_CPU_AIM = 1.25
DDP_AIM = 1.2
FRESH_PAGE_SHARE = 0.01


def speedup_aim(workers: int) -> float:
    return SPEEDUP_AIMS.get(workers, SPEEDUP_AIM_MORE)


def bench_rows(folder: str) -> tuple[list, int, dict | None]:
    """(invocations.py's summary rows, invocations counted, the first run's
    machine) of one bench stage; from the runs that finished where summary.json
    is missing (the stage cut short)."""
    runs, machine = [], None
    for path in sorted(glob.glob(os.path.join(folder, "run*", "results.json"))):
        with open(path) as f:
            data = json.load(f)
        runs.append(data["rows"])
        machine = machine or data.get("machine")
    summary = os.path.join(folder, "summary.json")
    if os.path.exists(summary):
        with open(summary) as f:
            return json.load(f)["rows"], len(runs), machine
    return (summarize_runs(runs) if runs else []), len(runs), machine


def runs_text(row: dict, scale: float = 1.0, digits: int = 3) -> str:
    """A row's median and each invocation's, times ``scale``: "m (r1, r2, r3)"."""
    return (f"{scale * row['median_s']:.{digits}f} ("
            + ", ".join(f"{scale * t:.{digits}f}" for t in row["run_medians_s"]) + ")")


def _verdict(met: bool | None) -> str:
    return {True: "met", False: "NOT met", None: "-"}[met]


def allreduce_table(rows_by_device: dict) -> tuple[list, list]:
    """Lines of the allreduce table, and its records (for summary.json)."""
    records = []
    lines = ["| device | K | MiB | switchml ms (runs) | gloo ms (runs) | vs gloo | aim | "
             "faults a call: switchml / gloo | fresh-page aim | CUDA / CPU | check |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    cpu = {(r["workers"], r["size_mib"]): r for r in rows_by_device.get("cpu", [])
           if r["system"] == "switchml-dense"}
    for device in ("cpu", "cuda"):
        rows = rows_by_device.get(device, [])
        gloo = {(r["workers"], r["size_mib"]): r for r in rows if r["system"] == "gloo"}
        for r in (r for r in rows if r["system"] == "switchml-dense"):
            k = (r["workers"], r["size_mib"])
            g = gloo.get(k)
            ratio = g["median_s"] / r["median_s"] if g else None
            aim = speedup_aim(r["workers"])
            pages = r["size_mib"] * 2**20 / PAGE
            faults = r.get("faults_per_call")
            fresh_met = None if faults is None else faults < FRESH_PAGE_SHARE * pages
            over_cpu = (r["median_s"] / cpu[k]["median_s"]
                        if device == "cuda" and k in cpu else None)
            checked = r["checked"] and r["ranks_bit_identical"] and (
                g is None or (g["checked"] and g["ranks_bit_identical"]))
            records.append({"device": device, "workers": r["workers"], "size_mib": r["size_mib"],
                            "switchml_s": r["median_s"], "switchml_runs_s": r["run_medians_s"],
                            "gloo_s": g["median_s"] if g else None,
                            "gloo_runs_s": g["run_medians_s"] if g else None,
                            "speedup_over_gloo": ratio, "speedup_aim": aim,
                            "speedup_met": None if ratio is None else ratio >= aim,
                            "faults_per_call": faults,
                            "gloo_faults_per_call": g.get("faults_per_call") if g else None,
                            "fresh_pages_met": fresh_met, "cuda_over_cpu": over_cpu,
                            "cuda_over_cpu_met": (None if over_cpu is None
                                                  else over_cpu <= CUDA_OVER_CPU_AIM),
                            "checked": checked})

            def ms(row):
                return runs_text(row, 1e3, 1)

            def count(v):
                return "-" if v is None else f"{v:.0f}"

            lines.append(
                f"| {device} | {r['workers']} | {r['size_mib']:g} | {ms(r)} | "
                f"{ms(g) if g else '-'} | "
                f"{'-' if ratio is None else format(ratio, '.2f') + 'x'} | "
                f">= {aim}x {_verdict(records[-1]['speedup_met'])} | "
                f"{count(faults)} / {count(records[-1]['gloo_faults_per_call'])} | "
                f"{_verdict(fresh_met)} | "
                + ("-" if over_cpu is None else
                   f"{over_cpu:.2f}x (<= {CUDA_OVER_CPU_AIM}x "
                   f"{_verdict(records[-1]['cuda_over_cpu_met'])})")
                + f" | {'ok' if checked else 'FAIL'} |")
    return lines, records


def modes_table(folders: list) -> tuple[list, list]:
    """CUDA calls by how they move (``SWITCHML_CUDA_COPIES``): the default's from
    bench-cuda/, the others' from bench-cuda-<mode>/ (the ``cuda-modes`` stage)."""
    found: dict = {}
    for mode, name in (("default", "bench-cuda"), ("pipelined", "bench-cuda-pipelined"),
                       ("direct, 8 MiB segments", "bench-cuda-segment8m"),
                       ("whole", "bench-cuda-whole"),
                       ("CPU tensors, 8 MiB segments", "bench-cpu-segment8m")):
        for folder in folders:
            rows, _, _ = bench_rows(os.path.join(folder, name))
            rows = [r for r in rows if r["system"] == "switchml-dense"]
            if rows:
                found[mode] = {r["workers"]: r for r in rows}
                break
    if len(found) < 2:
        return [], []
    modes = list(found)
    lines = ["| K | " + " | ".join(f"{m} ms (runs)" for m in modes) + " |",
             "|---|" + "---|" * len(modes)]
    records = []
    for k in sorted({k for rows in found.values() for k in rows}):
        cells = [runs_text(found[m][k], 1e3, 1) if k in found[m] else "-" for m in modes]
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
        records.append({"workers": k, **{m: found[m][k]["median_s"] for m in modes
                                         if k in found[m]}})
    return lines, records


def ddp_table(path: str) -> tuple[list, list]:
    if not os.path.exists(path):
        return [], []
    with open(path) as f:
        runs = json.load(f)["runs"]
    lines = ["| K | device | model | switchml samples/s | gloo samples/s | vs gloo | aim | "
             "step ms: switchml / gloo (compute) | step without communication ms | "
             "replicas identical | max weight diff |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    records = []
    gloo = {r["workers"]: r for r in runs if r["backend"] == "gloo"}
    for r in (r for r in runs if r["backend"] == "switchml"):
        g = gloo[r["workers"]]
        ratio = r["speedup_over_gloo"]
        identical = r["replicas_identical"] and g["replicas_identical"]
        records.append({"workers": r["workers"], "device": r["device"], "model": r["model"],
                        "switchml_samples_per_s": r["samples_per_s"],
                        "gloo_samples_per_s": g["samples_per_s"], "speedup_over_gloo": ratio,
                        "speedup_met": ratio >= DDP_AIM, "replicas_identical": identical,
                        "step_without_communication_ms": r.get("step_without_communication_ms"),
                        "max_weight_diff_vs_gloo": r["max_weight_diff_vs_gloo"]})
        lines.append(f"| {r['workers']} | {r['device']} | {r['model']} | "
                     f"{r['samples_per_s']:.1f} | {g['samples_per_s']:.1f} | {ratio:.2f}x | "
                     f">= {DDP_AIM}x {_verdict(ratio >= DDP_AIM)} | "
                     f"{r['step_ms']:.1f} / {g['step_ms']:.1f} ({g['compute_ms_per_step']:.1f}) | "
                     f"{_ms(r.get('step_without_communication_ms'))} | "
                     f"{'yes' if identical else 'NO'} | {r['max_weight_diff_vs_gloo']:.1e} |")
    return lines, records


def first_file(folders: list, name: str) -> str | None:
    """``name`` in the first of ``folders`` that holds it."""
    return next((os.path.join(f, name) for f in folders
                 if os.path.exists(os.path.join(f, name))), None)


def ddp_modes_table(folders: list, ddp: list) -> tuple[list, list]:
    """DDP's samples/s by ``SWITCHML_CUDA_COPIES`` (the ``ddp-modes`` stage's
    ddp-<mode>.json, switchml alone) beside the default's and gloo's (``ddp``)."""
    found: dict = {}
    for mode in ("whole", "pipelined"):
        path = first_file(folders, f"ddp-{mode}.json")
        if path:
            with open(path) as f:
                found[mode] = {r["workers"]: r for r in json.load(f)["runs"]}
    if not found:
        return [], []
    default = {r["workers"]: r for r in ddp}
    lines = ["| K | " + " | ".join(f"{m} samples/s (runs)" for m in found)
             + " | default | gloo |", "|---|" + "---|" * (len(found) + 2)]
    records = []
    for k in sorted({k for runs in found.values() for k in runs}):
        cells = [f"{found[m][k]['samples_per_s']:.1f} ("
                 + ", ".join(f"{x:.1f}" for x in found[m][k]["samples_per_s_all"]) + ")"
                 if k in found[m] else "-" for m in found]
        d = default.get(k)
        cells += [f"{d['switchml_samples_per_s']:.1f}" if d else "-",
                  f"{d['gloo_samples_per_s']:.1f}" if d else "-"]
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
        records.append({"workers": k, **{m: found[m][k]["samples_per_s"] for m in found
                                         if k in found[m]}})
    return lines, records


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def stages(path: str) -> list:
    if not os.path.exists(path):
        return []
    lines = ["| stage | exit | seconds | note |", "|---|---|---|---|"]
    with open(path) as f:
        for line in f:
            name, rc, took, note = (line.rstrip("\n").split("\t") + [""] * 4)[:4]
            lines.append(f"| {name} | {rc} | {took} | {note} |")
    return lines


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print("usage: python bench/gpu_summary.py OUT [OUT ...]", file=sys.stderr)
        return 2
    out = argv[0]
    rows_by_device, counted, machine = {}, {}, None
    for device in ("cuda", "cpu"):
        rows_by_device[device], counted[device] = [], 0
        names = [f"bench-{device}"] + (["bench-cpu-switchml"] if device == "cpu" else [])
        for folder in (os.path.join(f, name) for name in names for f in argv):
            rows, runs, found = bench_rows(folder)
            machine = machine or found
            if rows:
                rows_by_device[device], counted[device] = rows, runs
                break
    printed = []
    for folder in argv:
        printed += ([f"{folder}:"] if len(argv) > 1 else []) + stages(
            os.path.join(folder, "stages.tsv"))
    if machine:
        printed += ["", "machine: " + ", ".join(
            f"{k} {v}" for k, v in machine.items() if k in ("cpu", "cpus", "gpus", "torch",
                                                              "torch_cuda", "python"))]
    printed += ["", "allreduce, one host (invocations: "
                + ", ".join(f"{d} {n}" for d, n in counted.items()) + ")"]
    lines, allreduce = allreduce_table(rows_by_device)
    printed += lines if allreduce else ["(no bench results)"]
    lines, ddp = ddp_table(first_file(argv, "ddp.json") or os.path.join(out, "ddp.json"))
    printed += ["", "DDP ResNet-18, one host"] + (lines or ["(no DDP results)"])
    lines, ddp_modes = ddp_modes_table(argv, ddp)
    if lines:
        printed += ["", "DDP by SWITCHML_CUDA_COPIES (switchml alone)"] + lines
    lines, modes = modes_table(argv)
    if lines:
        printed += ["", "Calls by SWITCHML_CUDA_COPIES and segment (switchml alone)"] + lines
    print("\n".join(printed))
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump({"machine": machine, "invocations": counted, "allreduce": allreduce,
                   "ddp": ddp, "ddp_modes": ddp_modes, "cuda_modes": modes}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
