"""Print a benchmark JSON (from bench/allreduce.py) as Markdown tables.

    python bench/report.py bench/results/allreduce-64mib.json
"""

from __future__ import annotations

import json
import sys


def timing_table(data: dict) -> str:
    rows = ["| n | system | median s | min s | max s | GB/s per worker | switchml speedup over gloo |",
            "|---|---|---|---|---|---|---|"]
    for r in data["runs"]:
        if r["system"] not in ("switchml", "gloo"):
            continue
        speedup = r.get("switchml_speedup_over_gloo")
        rows.append(f"| {r['workers']} | {r['system']} | {r['median_s']:.3f} | {r['min_s']:.3f} | "
                    f"{r['max_s']:.3f} | {r['goodput_GBps_per_worker']:.3f} | "
                    f"{f'{speedup:.2f}x' if speedup else ''} |")
    return "\n".join(rows)


def switch_table(data: dict) -> str:
    rows = ["| n | switch packets/s | switch MB/s (in + out) | switch CPU µs/datagram | "
            "worker CPU µs/datagram | duplicates seen by the switch |",
            "|---|---|---|---|---|---|"]
    for r in data["runs"]:
        if r["system"] != "switchml":
            continue
        rows.append(f"| {r['workers']} | {r['switch_packets_per_s']:.0f} | "
                    f"{r['switch_MBps_in_plus_out']:.0f} | "
                    f"{r['switch_cpu_s_per_packet'] * 1e6:.1f} | "
                    f"{r['worker_cpu_s_per_packet'] * 1e6:.1f} | "
                    f"{r['switch_counters'].get('duplicates', 0)} |")
    return "\n".join(rows)


def density_table(data: dict) -> str:
    rows = ["| n | block density | sparse median s | dense median s | sparse speedup | "
            "sent MB/worker | received MB/worker | sent / (density × size) |",
            "|---|---|---|---|---|---|---|---|"]
    for r in data["runs"]:
        if r["system"] != "switchml-sparse-vs-dense":
            continue
        sp = r["sparse"]
        rows.append(f"| {r['workers']} | {r['density']:g} | {sp['median_s']:.3f} | "
                    f"{r['dense']['median_s']:.3f} | {r['sparse_speedup_over_dense']:.2f}x | "
                    f"{sp['bytes_sent_per_worker'] / 1e6:.1f} | "
                    f"{sp['bytes_received_per_worker'] / 1e6:.1f} | "
                    f"{r['sent_over_density_times_size']:.3f} |")
    return "\n".join(rows)


def main(path: str) -> None:
    with open(path) as f:
        data = json.load(f)
    print(f"`{data['command']}` ({data['elements']} {data['dtype']} elements)\n")
    if any(r["system"] == "switchml-sparse-vs-dense" for r in data["runs"]):
        print(density_table(data) + "\n")
    if any(r["system"] in ("switchml", "gloo") for r in data["runs"]):
        print(timing_table(data) + "\n")
        print(switch_table(data))


if __name__ == "__main__":
    main(sys.argv[1])
