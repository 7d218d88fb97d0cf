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


def main(path: str) -> None:
    with open(path) as f:
        data = json.load(f)
    print(f"`{data['command']}` ({data['elements']} {data['dtype']} elements)\n")
    print(timing_table(data) + "\n")
    print(switch_table(data))


if __name__ == "__main__":
    main(sys.argv[1])
