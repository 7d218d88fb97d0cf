"""Where a profiled DDP step's time went on the GPU: a Chrome trace of torch's
profiler (``bench/ddp_resnet.py --profile-dir``) summed up.

    python bench/trace_summary.py profiles/profile-switchml-4.json profiles/profile-gloo-4.json

For each trace: the window from the first to the last GPU activity; each GPU
stream's busy time (the union of what ran on it), its kernels and its copies
by kind (device to host, host to device, ...) with their bytes; how much of
the copies' time ran while a kernel of the same process ran (overlap); the
time no activity of this process ran on the GPU (idle: with ranks that share
one GPU, the others' turns, and any wait for a copy); and the CPU's annotated
spans (DDP's forward, the optimizer's step, the collectives that torch names).
Writes nothing; ``--json`` prints the same as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def union_length(intervals: list) -> float:
    """The length of the union of (start, end) intervals."""
    total, reach = 0.0, None
    for start, end in sorted(intervals):
        if reach is None or start > reach:
            total += end - start
            reach = end
        elif end > reach:
            total += end - reach
            reach = end
    return total


def overlap_length(intervals: list, others: list) -> float:
    """The length of ``intervals``' union that lies inside ``others``' union."""
    return (union_length(intervals) + union_length(others)
            - union_length(list(intervals) + list(others)))


def copy_kind(name: str) -> str:
    """"DtoH", "HtoD", "DtoD" (or the event's name) of a memcpy event's name."""
    for kind in ("DtoH", "HtoD", "DtoD", "HtoH", "PtoP"):
        if kind in name:
            return kind
    return name


def summarize(trace: dict) -> dict:
    """The figures of one trace (microseconds, as the trace's own units)."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    gpu = [e for e in events if e.get("cat") in GPU_CATEGORIES]
    streams: dict = defaultdict(lambda: {"busy_us": 0.0, "kernels": 0, "copies": {}})
    spans: dict = defaultdict(list)
    for e in gpu:
        stream = e.get("args", {}).get("stream", e.get("tid"))
        spans[stream].append((e["ts"], e["ts"] + e["dur"]))
        s = streams[stream]
        if e["cat"] == "kernel":
            s["kernels"] += 1
        else:
            kind = copy_kind(e["name"])
            c = s["copies"].setdefault(kind, {"count": 0, "us": 0.0, "bytes": 0})
            c["count"] += 1
            c["us"] += e["dur"]
            c["bytes"] += int(e.get("args", {}).get("bytes", 0))
    for stream, intervals in spans.items():
        streams[stream]["busy_us"] = union_length(intervals)
    kernels = [(e["ts"], e["ts"] + e["dur"]) for e in gpu if e["cat"] == "kernel"]
    copies = [(e["ts"], e["ts"] + e["dur"]) for e in gpu if e["cat"] == "gpu_memcpy"]
    window = (max(e["ts"] + e["dur"] for e in gpu) - min(e["ts"] for e in gpu)) if gpu else 0.0
    busy = union_length([i for v in spans.values() for i in v])
    annotated: dict = defaultdict(lambda: {"count": 0, "us": 0.0})
    for e in events:
        if e.get("cat") == "user_annotation":
            annotated[e["name"]]["count"] += 1
            annotated[e["name"]]["us"] += e["dur"]
    return {"window_us": window, "gpu_busy_us": busy, "gpu_idle_us": window - busy,
            "kernel_us": union_length(kernels), "copy_us": union_length(copies),
            "copy_beside_kernels_us": overlap_length(copies, kernels),
            "streams": {str(k): v for k, v in sorted(streams.items(), key=lambda kv: str(kv[0]))},
            "annotated": dict(sorted(annotated.items(), key=lambda kv: -kv[1]["us"]))}


def text(name: str, s: dict) -> str:
    ms = 1e-3
    lines = [f"{name}: GPU window {s['window_us'] * ms:.1f} ms, busy {s['gpu_busy_us'] * ms:.1f}, "
             f"idle {s['gpu_idle_us'] * ms:.1f}; kernels {s['kernel_us'] * ms:.1f} ms, copies "
             f"{s['copy_us'] * ms:.1f} ms ({s['copy_beside_kernels_us'] * ms:.1f} beside kernels)"]
    for stream, v in s["streams"].items():
        copies = ", ".join(f"{k} {c['count']} x, {c['us'] * ms:.2f} ms, "
                           f"{c['bytes'] / 2**20:.1f} MiB" for k, c in v["copies"].items())
        lines.append(f"  stream {stream}: busy {v['busy_us'] * ms:.1f} ms, {v['kernels']} kernels"
                     + (f"; {copies}" if copies else ""))
    for label, a in list(s["annotated"].items())[:8]:
        lines.append(f"  cpu {label}: {a['count']} x, {a['us'] * ms:.1f} ms")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("traces", nargs="+", help="Chrome traces of torch's profiler")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    args = p.parse_args(argv)
    found = {}
    for path in args.traces:
        with open(path) as f:
            found[path] = summarize(json.load(f))
    if args.json:
        print(json.dumps(found, indent=2))
    else:
        print("\n".join(text(path, s) for path, s in found.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
