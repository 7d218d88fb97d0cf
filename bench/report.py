"""Print a benchmark JSON as tables: Markdown for bench/allreduce.py's,
bench/train.py's and bench/ddp_resnet.py's, the ``python -m bench`` table for
results.json files of switchml/bench/suite.py.

    python bench/report.py allreduce-20260101-120000.json
    python bench/report.py switchml-bench-20260101-120000/results.json
    python bench/report.py bench/results/campaign/train-testbed-digits-hidden2048.json
"""

from __future__ import annotations

import json
import os
import sys


def markdown_table(header: list, rows: list) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def timing_table(data: dict) -> str:
    rows = []
    for r in data["runs"]:
        if r["system"] in ("switchml", "gloo"):
            speedup = r.get("switchml_speedup_over_gloo")
            rows.append([r["workers"], r["system"], f"{r['median_s']:.3f}", f"{r['min_s']:.3f}",
                         f"{r['max_s']:.3f}", f"{r['goodput_GBps_per_worker']:.3f}",
                         f"{speedup:.2f}x" if speedup else ""])
    return markdown_table(["n", "system", "median s", "min s", "max s", "GB/s per worker",
                           "switchml speedup over gloo"], rows)


def switch_table(data: dict) -> str:
    rows = [[r["workers"], f"{r['switch_packets_per_s']:.0f}",
             f"{r['switch_MBps_in_plus_out']:.0f}",
             f"{r['switch_cpu_s_per_packet'] * 1e6:.1f}",
             f"{r['worker_cpu_s_per_packet'] * 1e6:.1f}",
             r["switch_counters"].get("duplicates", 0)]
            for r in data["runs"] if r["system"] == "switchml"]
    return markdown_table(["n", "switch packets/s", "switch MB/s (in + out)",
                           "switch CPU µs/datagram", "worker CPU µs/datagram",
                           "duplicates seen by the switch"], rows)


def density_table(data: dict) -> str:
    rows = [[r["workers"], f"{r['density']:g}", f"{r['sparse']['median_s']:.3f}",
             f"{r['dense']['median_s']:.3f}", f"{r['sparse_speedup_over_dense']:.2f}x",
             f"{r['sparse']['bytes_sent_per_worker'] / 1e6:.1f}",
             f"{r['sparse']['bytes_received_per_worker'] / 1e6:.1f}",
             f"{r['sent_over_density_times_size']:.3f}"]
            for r in data["runs"] if r["system"] == "switchml-sparse-vs-dense"]
    return markdown_table(["n", "block density", "sparse median s", "dense median s",
                           "sparse speedup", "sent MB/worker", "received MB/worker",
                           "sent / (density × size)"], rows)


def main(path: str) -> None:
    with open(path) as f:
        data = json.load(f)
    known = isinstance(data, dict) and "command" in data and (
        "cluster" in data or "network" in data or "runs" in data and "elements" in data
        or data.get("runs") and "backend" in data["runs"][0])
    if not known:  # the core benches' and the probes' JSON: KeyError before
        sys.exit(f"report.py: {path} is not a JSON it reads (those of switchml bench, "
                 "bench/allreduce.py, bench/train.py and bench/ddp_resnet.py)")
    if "rows" in data:  # from `switchml bench` (switchml/bench/suite.py)
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
        from switchml.bench.suite import format_table

        print(f"`{data['command']}` on {data['cluster']}\n")
        print(format_table(data["rows"], data["cluster"].get("link_bps")))
        return
    if data.get("runs") and "backend" in data["runs"][0]:  # from bench/ddp_resnet.py
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from ddp_resnet import table as ddp_table

        print(f"`{data['command']}`\n")
        print(ddp_table(data["runs"]))
        return
    if "network" in data:  # from bench/train.py
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from train import table

        print(f"`{data['command']}` on {data['network']}\n")
        print(table(data["runs"]))
        return
    print(f"`{data['command']}` ({data['elements']} {data['dtype']} elements)\n")
    if any(r["system"] == "switchml-sparse-vs-dense" for r in data["runs"]):
        print(density_table(data) + "\n")
    if any(r["system"] in ("switchml", "gloo") for r in data["runs"]):
        print(timing_table(data) + "\n")
        print(switch_table(data))


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1].startswith("-"):
        sys.exit(__doc__)
    main(sys.argv[1])
