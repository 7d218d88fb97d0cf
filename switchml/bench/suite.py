"""``switchml bench``: switchml dense, switchml sparse and gloo side by side.

    switchml bench --workers 2 4 --sizes 1 4 --densities 0.1 --repeats 3
    switchml bench --testbed --link 1gbit --mtu 9000 --workers 4 --sizes 64 --densities 0.1
    switchml bench --device cuda --workers 2 4 --ranks-per-host 4 --sizes 45

Installed with the ``bench`` extra (``pip install '.[bench,torch]'`` in a checkout; gloo
needs torch); the testbed needs root, ``ip`` and ``tc``.

For every worker count and tensor size, on the same float32 tensors (common.py):
switchml's dense path, switchml's sparse path at each block density (non-zero
blocks placed at random per rank) and torch gloo's ring allreduce.  Each system
does its warm-up, then timed repeats; a row reports the median, min and max of
the slowest rank's time, goodput (tensor bytes / median time), and bytes per
worker per allreduce: switchml from its worker counters (UDP payload), gloo from
the ring formula 2(n-1)/n*S, and on the testbed both measured on the host's veth
(frames, headers included).  With a link rate, the least time the links allow is
given too: S/B for switchml dense, 2(n-1)/n*S/B for the ring.

The dense systems stream every byte whatever the values are, so they run on the
dense tensor of each size; the sparse path runs on the block-sparse tensors.

By default switchml's ranks call ``switchml.Worker.allreduce`` on numpy arrays.
With ``--device cpu`` or ``--device cuda`` they call ``dist.all_reduce`` on the
"switchml" backend (``switchml.torch``) with torch tensors on that device, as a
torch job does, and gloo sums the same tensors on the same device; a CUDA call is
timed until its sum is back in the tensor (the device synchronized).  Rank r uses
the GPU (r mod --ranks-per-host) mod the GPUs: on a one-GPU host every rank
shares cuda:0.  Every row also gives the minor page faults a timed call took
(``faults_per_call``, the busiest rank's): fresh memory touched on the call's path.
Results: a table on stdout, results.json and PNG plots in --out.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import sys
import time

from ..config import DEFAULT_BLOCK_ELEMENTS
from ..testbed.core import OFFLOAD, add_host_queue_argument, signals_end_the_run
from .common import lower_bound_s, ring_bytes, summarize
from .launch import BenchError, Loopback, OnTestbed, Roles
from .roles import RECOVERY

#: dense16: switchml's dense path on the 16-bit wire; gloo-fp16: gloo's allreduce
#: of the tensor cast to float16 and back, as PyTorch's fp16_compress_hook does.
SYSTEMS = ("dense", "sparse", "gloo", "dense16", "gloo-fp16")
DEFAULT_SYSTEMS = ("dense", "sparse", "gloo")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workers", type=int, nargs="+", default=[4], metavar="N",
                   help="worker counts (default: 4)")
    p.add_argument("--sizes", type=float, nargs="+", default=[4.0, 16.0, 64.0], metavar="MIB",
                   help="tensor sizes in MiB of float32 (default: 4 16 64)")
    p.add_argument("--densities", type=float, nargs="*", default=[], metavar="D",
                   help="block densities for switchml's sparse path (default: none)")
    p.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(DEFAULT_SYSTEMS),
                   help="what to run (default: dense sparse gloo; sparse needs --densities; "
                        "dense16 is the 16-bit wire, gloo-fp16 gloo as fp16_compress_hook)")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None,
                   help="torch tensors on this device through torch.distributed: "
                        "switchml's \"switchml\" backend and gloo on the same tensors "
                        "(default: none, switchml.Worker on numpy arrays); "
                        "--systems dense gloo gloo-fp16 only")
    p.add_argument("--warmup", type=int, default=1,
                   help="untimed calls of each system first (default: 1)")
    p.add_argument("--repeats", type=int, default=5,
                   help="timed calls of each system; a row gives their median, min and max "
                        "(default: 5)")
    p.add_argument("--testbed", action="store_true",
                   help="run on an emulated cluster (root): one worker per host namespace, "
                        "the switch on the bridge")
    p.add_argument("--ranks-per-host", type=int, default=1, metavar="K",
                   help="ranks a host: ranks r of one host (r // K) share its link and "
                        "memory (a testbed namespace; on loopback, SWITCHML_LOCAL_GROUP) and "
                        "combine there first; bounds are per host link (default: 1)")
    p.add_argument("--link", default="1gbit", help="testbed link rate (default: 1gbit)")
    p.add_argument("--mtu", type=int, default=None, help="testbed MTU (default: 1500)")
    p.add_argument("--loss", type=float, default=0.0,
                   help="testbed UDP loss probability per link (default: 0)")
    p.add_argument("--queue", default="256kb",
                   help="testbed: bytes each link queues before dropping (default: 256kb)")
    add_host_queue_argument(p, "testbed: ")
    p.add_argument("--udp-offload", choices=["auto", "on", "off"], default="auto",
                   help="the veths' UDP segmentation offload: on (a GSO run crosses the "
                        "emulated wire as one packet), off (cut into frames at the first "
                        "link: per-datagram loss, and frame-by-frame work on this machine), "
                        "or auto: on without loss, off with it (default)")
    p.add_argument("--switches", type=int, default=0, metavar="K",
                   help="testbed: K switch servers, each in its own namespace behind a link "
                        "like a host's, one job over all of them (default 0: the switch on "
                        "the bridge, as a programmable switch)")
    p.add_argument("--striped", type=int, default=1, metavar="K",
                   help="K switch processes where the one switch would run (the bridge, or "
                        "loopback), one job striped over all of them (default 1)")
    p.add_argument("--racks", type=int, default=0, metavar="R",
                   help="testbed: R racks under a spine: each a bridge with its "
                        "hosts and a rack switch, joined to the spine's bridge by a shaped "
                        "uplink; the spine switch on the spine's bridge (default 0: none)")
    p.add_argument("--oversubscription", type=float, default=1.0, metavar="X",
                   help="with --racks: an uplink carries its rack's hosts' rate over X "
                        "(default 1)")
    p.add_argument("--flat", action="store_true",
                   help="with --racks: no rack switches, every worker sends to the spine "
                        "(the flat job through the spine, hierarchical aggregation's baseline)")
    p.add_argument("--prefix", default="smlbench", help="testbed name prefix (default: smlbench)")
    p.add_argument("--packet-elements", type=int, default=None,
                   help="switch: int32 values per packet (default: the switch's)")
    p.add_argument("--data-plane", choices=["python", "c", "xdp"], default=None,
                   help="switch: where datagrams are aggregated (default: the switch's, C "
                        "where built); xdp (root) attaches the XDP program to the interface "
                        "of the switch's address (sparse calls aggregate in the switch's "
                        "user space; its workers send datagrams apart, not in GSO runs)")
    p.add_argument("--slots-per-job", type=int, default=None,
                   help="switch: window of a job (default: the switch's)")
    p.add_argument("--seed", type=int, default=0, help="seed of the inputs")
    p.add_argument("--no-check", dest="check", action="store_false",
                   help="skip checking sums against the exact sum (saves time at large sizes)")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds without progress before giving up (default: 600)")
    p.add_argument("--out", default=None,
                   help="output folder (default: ./switchml-bench-<time>)")
    p.add_argument("--no-plots", dest="plots", action="store_false", help="skip the PNGs")


def _cases(args, mib) -> list:
    elements = int(mib * 2**20) // 4
    cases = []
    if "dense" in args.systems:
        cases.append({"elements": elements, "density": None, "sparse": False})
    if "dense16" in args.systems:
        cases.append({"elements": elements, "density": None, "sparse": False, "bits": 16})
    if "sparse" in args.systems:
        cases += [{"elements": elements, "density": d, "sparse": True} for d in args.densities]
    return cases


def run_switchml(cluster, world, cases, args, progress) -> tuple:
    """The cluster's switches (one, or its switch servers: one job over all of
    them), ``world`` worker processes, every case; rows and the switches' job
    counters (summed)."""
    options = {k: v for k, v in (("packet_elements", args.packet_elements),
                                 ("slots_per_job", args.slots_per_job),
                                 ("data_plane", getattr(args, "data_plane", None)))
               if v is not None}
    job = f"bench-{world}"
    per_host = args.ranks_per_host
    on_torch = args.device is not None
    with Roles(cluster, args.timeout) as roles:
        switches: list = []
        addresses: list = []
        binds = cluster.switch_binds
        if args.striped > 1:  # K processes in the one switch's place, ports of their own
            binds = [(where, host, 0) for where, host, _ in binds[:1]] * args.striped
        racks = cluster.rack_binds if getattr(args, "racks", 0) and not args.flat else []
        if on_torch and world <= per_host:
            # one host: the backend's local stage is the whole job, it starts no switch
            binds, racks = [], []
        for k, (where, host, port) in enumerate(binds + racks):
            name = "switch" if k == 0 else f"switch{k}"
            # a rack switch, under the spine (the first): its partial sums go up
            upstream = {"upstream": addresses[0]} if k >= len(binds) else {}
            # a switch server, behind a link like a host's, says so (its jobs'
            # windows are their ranks' shares of that link's)
            server = {"shared_link": True} if cluster.switch_servers and k < len(binds) else {}
            switches.append(roles.start(name, where, "switch",
                                        {"host": host, "port": port,
                                         "options": dict(options, **upstream, **server)},
                                        stdin=True))
            while True:  # its address (the others' lines wait in the queue)
                got, msg = roles.next()
                if got == name and "address" in msg:
                    addresses.append("{}:{}".format(*msg["address"]))
                    break
        address = ",".join(addresses[:len(binds)])
        uplinks = cluster.uplink_bytes()
        torch_spec: dict = {}
        if on_torch:
            addr, port = cluster.master()
            torch_spec = {"master_addr": addr, "master_port": port, "device": args.device,
                          "block": DEFAULT_BLOCK_ELEMENTS}
        for rank in range(world):
            host = rank // per_host
            rack = cluster.rack_of(host) if racks else None
            roles.start(rank, host, "switchml_torch" if on_torch else "switchml", {
                "switch": address if rack is None else addresses[len(binds) + rack],
                "rank": rank, "world": world, "job": job, "ranks_per_host": per_host,
                "ifname": cluster.ifname(host), "warmup": args.warmup, "repeats": args.repeats,
                "check": args.check, "seed": args.seed, "timeout": min(args.timeout, 120),
                "cases": [dict(c, id=i) for i, c in enumerate(cases)], **torch_spec})
        reports = _gather_reports(roles, world, progress)
        for switch in switches:
            switch.stdin.write("stop\n")
            switch.stdin.flush()
        counters: dict = {}
        pooled: dict = {}  # the switches' own counters: hand-overs, runs, drops of no job
        planes: set = set()  # what the switches said they aggregated with
        xdp_modes: set = set()  # how the XDP switches attached (stats' xdp_mode)
        switch_cpu = {"thread_s": 0.0, "program_s": 0.0}
        stopped = 0
        while stopped < len(switches):
            name, msg = roles.next()
            if isinstance(name, str) and name.startswith("switch") and msg["event"] == "stats":
                stopped += 1
                planes.add(msg["stats"].get("data_plane"))
                if msg["stats"].get("xdp_mode"):  # an XDP switch: driver or generic
                    xdp_modes.add(msg["stats"]["xdp_mode"])
                switch_cpu["thread_s"] += msg["stats"].get("cpu_s", 0.0)
                switch_cpu["program_s"] += sum(msg["stats"].get("program_time_s", {}).values())
                for key, value in msg["stats"]["ended_jobs"].get(job, {}).get(
                        "counters", {}).items():
                    counters[key] = (counters.get(key, 0) + value
                                     if isinstance(value, (int, float)) else value)
                for key, value in msg["stats"].get("counters", {}).items():
                    if isinstance(value, (int, float)):
                        pooled[key] = pooled.get(key, 0) + value
    uplinks = cluster.uplink_bytes(since=uplinks)
    rows = []
    for i, case in enumerate(cases):
        items = sorted(reports[i], key=lambda m: m["rank"])
        system = ("switchml-sparse" if case["sparse"] else "switchml-dense16"
                  if case.get("bits") == 16 else "switchml-dense")
        rows.append(_row(system, world, case, items, cluster, args,
                         sent=_mean(items, "bytes_sent"), received=_mean(items, "bytes_received"),
                         retransmissions=_mean(items, "retransmissions")))
        rows[-1]["switch_data_plane"] = ",".join(sorted(str(p) for p in planes)) or None
        if xdp_modes:
            rows[-1]["switch_xdp_mode"] = ",".join(sorted(xdp_modes))
        rows[-1]["switch_counters_in_run"] = pooled
    calls = len(cases) * (args.warmup + args.repeats)
    _note_uplinks(rows, uplinks, calls)
    _note_switch_cpu(rows, switch_cpu, calls)
    return rows, counters


def _note_switch_cpu(rows, switch_cpu: dict, calls: int) -> None:
    """The switches' CPU seconds per call, over the run's calls (all its cases
    together, their start and end included): their serving threads' (the C and
    Python data planes' whole work, the XDP switch's control plane) and their
    XDP programs' own time, counted by the kernel (in no process's CPU time)."""
    for row in rows:
        row["switch_thread_cpu_s_per_call"] = switch_cpu["thread_s"] / calls
        row["switch_program_s_per_call"] = switch_cpu["program_s"] / calls


def _note_uplinks(rows, uplinks, calls: int) -> None:
    """Bytes each rack's uplink carried up (to the spine) and down, per call, over
    the run's calls (all its cases together)."""
    if uplinks is None:
        return
    for row in rows:
        row["rack_uplink_bytes_per_call"] = [
            {"up": c["tx_bytes"] / calls, "down": c["rx_bytes"] / calls} for c in uplinks]


def _gather_reports(roles, world: int, progress) -> dict:
    """Every rank's report per case id, until all ``world`` ranks are done."""
    reports: dict = {}
    done = 0
    while done < world:
        _, msg = roles.next()
        if msg["event"] == "case":
            reports.setdefault(msg["id"], []).append(msg)
            if len(reports[msg["id"]]) == world:
                progress(1)
        elif msg["event"] == "done":
            done += 1
    return reports


def run_gloo(cluster, world, sizes, args, progress) -> list:
    """``world`` gloo ranks, the dense tensor of every size (and as float16 for gloo-fp16)."""
    addr, port = cluster.master()
    kinds = [k for k in ("gloo", "gloo-fp16") if k in args.systems]
    cases: list[dict] = [{"id": i, "elements": int(mib * 2**20) // 4, "density": None,
              "fp16": kind == "gloo-fp16"}
             for i, (kind, mib) in enumerate((k, m) for k in kinds for m in sizes)]
    uplinks = cluster.uplink_bytes()
    with Roles(cluster, args.timeout) as roles:
        for rank in range(world):
            host = rank // args.ranks_per_host
            roles.start(rank, host, "gloo", {
                "master_addr": addr, "master_port": port, "rank": rank, "world": world,
                "ifname": cluster.ifname(host), "warmup": args.warmup, "repeats": args.repeats,
                "check": args.check, "seed": args.seed, "block": DEFAULT_BLOCK_ELEMENTS,
                "ranks_per_host": args.ranks_per_host, "device": args.device or "cpu",
                "cases": cases})
        reports = _gather_reports(roles, world, progress)
    rows = []
    for case in cases:
        items = sorted(reports[case["id"]], key=lambda m: m["rank"])
        system = "gloo-fp16" if case["fp16"] else "gloo"
        ring = ring_bytes(world, case["elements"] * (2 if case["fp16"] else 4))
        rows.append(_row(system, world, dict(case, sparse=False), items, cluster, args,
                         sent=ring, received=ring, retransmissions=None))
    _note_uplinks(rows, cluster.uplink_bytes(since=uplinks),
                  len(cases) * (args.warmup + args.repeats))
    return rows


def _mean(items, key):
    values = [m[key] for m in items if m.get(key) is not None]
    return sum(values) / len(values) if values else None


def _row(system, world, case, items, cluster, args, *, sent, received, retransmissions) -> dict:
    nbytes = case["elements"] * 4
    per_host = args.ranks_per_host
    combined = system.startswith("switchml") and any(m.get("local_calls") for m in items)
    row = {"system": system, "workers": world, "size_bytes": nbytes,
           "size_mib": nbytes / 2**20, "density": case.get("density"),
           "hosts": -(-world // per_host), "ranks_per_host": per_host,
           "local_stage": combined if system.startswith("switchml") else None,
           # where the tensors were, and what summed them: switchml.Worker on numpy
           # arrays, or torch.distributed (gloo always) on torch tensors
           "device": args.device or "cpu",
           "api": ("torch.distributed" if args.device or not system.startswith("switchml")
                   else "switchml.Worker")}
    row.update(summarize([m["times"] for m in items], nbytes))
    row["goodput_Gbps_per_worker"] = nbytes * 8 / row["median_s"] / 1e9
    # a host's link: switchml's hosts send S each (the local stage), or k·S (without)
    bound = lower_bound_s(system, world, nbytes, cluster.link_bps, case.get("density"),
                          getattr(cluster, "switch_servers", 0),
                          **getattr(cluster, "rack_layout", lambda args: {})(args),
                          ranks_per_host=1 if combined else per_host)
    if row["hosts"] == 1 and getattr(cluster, "link_bps", None):
        bound = 0.0  # one host: nothing crosses a link
    row["bound_s"] = bound
    row["goodput_over_link_rate"] = (row["goodput_Gbps_per_worker"] * 1e9 / cluster.link_bps
                                     if cluster.link_bps else None)
    row["bytes_sent_per_worker"] = sent
    row["bytes_received_per_worker"] = received
    row["bytes_counted_by"] = "ring formula" if system == "gloo" else "worker counters"
    row["wire_tx_bytes_per_worker"] = _mean(items, "link_tx")
    row["wire_rx_bytes_per_worker"] = _mean(items, "link_rx")
    row["retransmissions_per_worker"] = retransmissions
    # a call's CPU seconds on a rank's threads, and seconds they were runnable but
    # waited for a core (mean over ranks; None off Linux)
    row["cpu_s_per_worker"] = _mean(items, "cpu_s")
    row["runqueue_wait_s_per_worker"] = _mean(items, "runqueue_wait_s")
    # minor page faults of a timed call, the busiest rank's: fresh memory on its path
    faults = [m["faults_per_call"] for m in items if m.get("faults_per_call") is not None]
    row["faults_per_call"] = max(faults) if faults else None
    recovery = [m["recovery"] for m in items if m.get("recovery")]
    row["recovery_per_worker"] = ({k: sum(r[k] for r in recovery) / len(recovery)
                                   for k in recovery[0]} if recovery else None)
    # each timed call's recovery, summed over the ranks (the counters that moved)
    windows = [m["windows"] for m in items if m.get("windows")]
    row["recovery_per_call"] = ([{k: v for k in RECOVERY
                                  if (v := sum(w[call].get(k, 0) for w in windows))}
                                 for call in range(min(map(len, windows)))]
                                if windows else None)
    row["checked"] = items[0].get("ok")
    row["ranks_bit_identical"] = len({m["digest"] for m in items}) == 1 and len(items) == world
    # the result's SHA-256 (rank 0's): runs of the same inputs compare bit for bit,
    # a lossy run against a loss-free one
    row["result_sha256"] = items[0]["digest"] if items else None
    return row


def _speedups(rows) -> None:
    """Over gloo for every system; the 16-bit wire also over gloo-fp16 (the same bytes)."""
    def times(system):
        return {(r["workers"], r["size_bytes"]): r["median_s"] for r in rows
                if r["system"] == system}
    gloo, fp16 = times("gloo"), times("gloo-fp16")
    for r in rows:
        g = gloo.get((r["workers"], r["size_bytes"]))
        if g and r["system"] != "gloo":
            r["speedup_over_gloo"] = g / r["median_s"]
        h = fp16.get((r["workers"], r["size_bytes"]))
        if h and r["system"] == "switchml-dense16":
            r["speedup_over_gloo_fp16"] = h / r["median_s"]


def format_table(rows, link_bps) -> str:
    head = ["n", "MiB", "device", "system", "density", "median s", "min s", "max s", "Gbit/s",
            "of link", "sent MB", "recv MB", "wire tx MB", "wire rx MB", "retx", "faults",
            "bound s", "vs gloo", "check"]
    lines = []
    for r in rows:
        def mb(v):
            return f"{v / 1e6:.2f}" if v is not None else "-"
        check = {True: "ok", False: "FAIL", None: "-"}[r["checked"]]
        if not r["ranks_bit_identical"]:
            check += "/ranks differ"
        per_host = r.get("ranks_per_host", 1)
        n = str(r["workers"]) if per_host == 1 else f"{r['workers']}={r['hosts']}x{per_host}"
        lines.append([n, f"{r['size_mib']:g}", r.get("device", "cpu"), r["system"],
                      "-" if r["density"] is None else f"{r['density']:g}",
                      f"{r['median_s']:.4f}", f"{r['min_s']:.4f}", f"{r['max_s']:.4f}",
                      f"{r['goodput_Gbps_per_worker']:.3f}",
                      f"{r['goodput_over_link_rate']:.0%}" if link_bps else "-",
                      mb(r["bytes_sent_per_worker"]), mb(r["bytes_received_per_worker"]),
                      mb(r["wire_tx_bytes_per_worker"]), mb(r["wire_rx_bytes_per_worker"]),
                      "-" if r["retransmissions_per_worker"] is None
                      else f"{r['retransmissions_per_worker']:.1f}",
                      "-" if r.get("faults_per_call") is None
                      else f"{r['faults_per_call']:.0f}",
                      f"{r['bound_s']:.4f}" if r["bound_s"] else "-",
                      f"{r['speedup_over_gloo']:.2f}x" if r.get("speedup_over_gloo") else "-",
                      check])
    widths = [max(len(h), *(len(line[i]) for line in lines)) if lines else len(h)
              for i, h in enumerate(head)]
    fmt = "  ".join("{:>%d}" % w for w in widths)
    return "\n".join([fmt.format(*head)] + [fmt.format(*line) for line in lines])


def _preflight(args) -> None:
    if {"gloo", "gloo-fp16"} & set(args.systems) and importlib.util.find_spec("torch") is None:
        raise SystemExit("bench: gloo needs torch (the 'torch' extra: pip install torch), "
                         "or leave it out with --systems dense sparse")
    if args.device is not None:
        _preflight_device(args)
    if "sparse" in args.systems and not args.densities and args.systems == ["sparse"]:
        raise SystemExit("bench: --systems sparse needs --densities")
    if args.striped < 1 or (args.striped > 1 and args.switches):
        raise SystemExit("switchml bench: --striped K takes K >= 1, and not with --switches")
    if args.switches and not args.testbed:
        raise SystemExit("switchml bench: --switches needs --testbed (switch servers)")
    if args.racks and (not args.testbed or args.switches or args.striped > 1):
        raise SystemExit("switchml bench: --racks needs --testbed, and goes with neither "
                         "--switches nor --striped")
    if args.flat and not args.racks:
        raise SystemExit("switchml bench: --flat goes with --racks")
    xdp = getattr(args, "data_plane", None) == "xdp"
    if xdp and args.racks:
        raise SystemExit("switchml bench: --data-plane xdp goes without --racks (a rack "
                         "switch runs the Python data plane)")
    if args.testbed and not 0.0 <= args.loss < 1.0:
        raise SystemExit("bench: --loss must be in [0, 1)")
    if xdp and args.testbed and args.loss:
        raise SystemExit("switchml bench: --loss goes without --data-plane xdp: the testbed "
                         "loses the workers' datagrams at the switch's input hook, which "
                         "the XDP program runs before (the uplinks would lose nothing)")
    if args.repeats < 1:
        raise SystemExit("switchml bench: --repeats takes 1 or more")


#: What runs on torch tensors (--device): the dense path and gloo.
DEVICE_SYSTEMS = ("dense", "gloo", "gloo-fp16")


def _preflight_device(args) -> None:
    """--device: torch is there, the device too, and only what runs on its tensors."""
    if importlib.util.find_spec("torch") is None:
        raise SystemExit(f"switchml bench: --device {args.device} needs torch "
                         "(the 'torch' extra: pip install torch)")
    # sparse (a default) runs only at --densities
    others = sorted(set(args.systems) - set(DEVICE_SYSTEMS) - ({"sparse"} - {
        "sparse" if args.densities else ""}))
    if others:
        raise SystemExit(f"switchml bench: --device runs --systems {' '.join(DEVICE_SYSTEMS)} "
                         f"(not {' '.join(others)}{' at --densities' if args.densities else ''})"
                         ": the sparse path and the 16-bit wire run on numpy arrays, without "
                         "--device")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise SystemExit(
                f"switchml bench: --device cuda: torch {torch.__version__} sees no CUDA "
                "device here (" + ("built without CUDA" if torch.version.cuda is None
                                   else f"CUDA {torch.version.cuda}, no device or driver")
                + "); run on a GPU machine, or --device cpu")


def _device_description(device: str | None) -> dict:
    """The torch and GPU a --device run used (nothing without --device)."""
    if device is None:
        return {}
    import torch

    found: dict = {"torch": torch.__version__, "torch_cuda": torch.version.cuda}
    if device == "cuda":
        found["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return found


def _cpu_model() -> str | None:
    """The CPU's name as /proc/cpuinfo gives it (None elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


class _Lines:
    """tqdm's place where it is not installed: a line on stderr per stage."""

    def __init__(self, total, **_):
        self.total, self.done = total, 0

    def update(self, n=1) -> None:
        self.done += n

    def set_postfix_str(self, text: str) -> None:
        print(f"bench: {self.done}/{self.total} cases done; {text}", file=sys.stderr, flush=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass


def _drops(cluster):
    """The testbed's drop counters, or on loopback the host's."""
    from . import drops

    if not isinstance(cluster, OnTestbed):
        return drops.host_snapshot()
    return drops.snapshot(cluster.tb)


def _note_drops(rows, before, cluster) -> None:
    """Where the datagrams of these rows' run were lost (all its cases together)."""
    from . import drops

    if isinstance(cluster, OnTestbed):
        key, lost = "testbed_drops_in_run", drops.delta(before, _drops(cluster))
    else:
        key, lost = "host_drops_in_run", drops.host_delta(before, _drops(cluster))
    for row in rows:
        row[key] = lost


def run(args, cluster) -> dict:
    try:
        from tqdm import tqdm
    except ImportError:  # the bench extra's progress bar; the run needs none
        tqdm = _Lines

    per_world = sum(len(_cases(args, mib)) for mib in args.sizes)
    glooish = [k for k in ("gloo", "gloo-fp16") if k in args.systems]
    per_world += len(args.sizes) * len(glooish)
    rows, counters = [], {}
    with tqdm(total=per_world * len(args.workers), unit="case", file=sys.stderr,
              desc="bench") as bar:
        for world in args.workers:
            cases = [c for mib in args.sizes for c in _cases(args, mib)]
            if cases:
                bar.set_postfix_str(f"n={world} switchml")
                before = _drops(cluster)
                got, counters[world] = run_switchml(cluster, world, cases, args, bar.update)
                _note_drops(got, before, cluster)
                rows += got
            if glooish:
                bar.set_postfix_str(f"n={world} gloo")
                before = _drops(cluster)
                got = run_gloo(cluster, world, args.sizes, args, bar.update)
                _note_drops(got, before, cluster)
                rows += got
    _speedups(rows)
    order = {"switchml-dense": 0, "switchml-dense16": 1, "switchml-sparse": 2, "gloo": 3,
             "gloo-fp16": 4}
    rows.sort(key=lambda r: (r["workers"], r["size_bytes"], order[r["system"]],
                             r["density"] or 0))
    return {"rows": rows, "switch_job_counters": counters}


def main(args, argv_text: str = "", prog: str = "switchml bench") -> int:
    _preflight(args)
    out = args.out or f"switchml-bench-{time.strftime('%Y%m%d-%H%M%S')}"
    os.makedirs(out, exist_ok=True)
    results: dict = {"command": f"{prog} {argv_text}".strip(),
               "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                           "cpu": _cpu_model(), "python": platform.python_version(),
                           **_device_description(args.device)},
               "settings": {k: v for k, v in vars(args).items() if k != "func"}}
    try:
        with signals_end_the_run():  # TERM or HUP: processes and testbed go, as on Ctrl-C
            if args.testbed:
                from ..testbed import Testbed, TestbedError

                try:
                    hosts = -(-max(args.workers) // args.ranks_per_host)
                    with Testbed(hosts, args.link, mtu=args.mtu, loss=args.loss,
                                 udp_offload=OFFLOAD[args.udp_offload], switches=args.switches,
                                 racks=args.racks, oversubscription=args.oversubscription,
                                 prefix=args.prefix, queue=args.queue,
                                 host_queue=args.host_queue,
                                 ranks_per_host=args.ranks_per_host) as tb:
                        cluster: OnTestbed | Loopback = OnTestbed(tb)
                        results["cluster"] = cluster.describe()
                        results.update(run(args, cluster))
                        results["loss_drops"] = tb.loss_drops() if args.loss else None
                except TestbedError as exc:
                    print(f"bench: {exc}", file=sys.stderr)
                    return 2
            else:
                cluster = Loopback()
                results["cluster"] = cluster.describe()
                results.update(run(args, cluster))
    except BenchError as exc:
        print(f"bench: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # processes and testbed are gone by now
        print("bench: interrupted", file=sys.stderr)
        return 130
    link_bps = results["cluster"].get("link_bps")
    print(format_table(results["rows"], link_bps))
    path = os.path.join(out, "results.json")
    with open(path, "w") as f:  # first: what was measured is kept whatever follows
        json.dump(results, f, indent=2)
    print(f"wrote {path}")
    if args.plots:
        from .plots import write_plots

        try:
            results["plots"] = write_plots(results["rows"], link_bps, out)
        except Exception as exc:  # a figure that cannot be drawn: the results stand
            print(f"bench: the plots could not be drawn: {exc!r}", file=sys.stderr)
        else:
            with open(path, "w") as f:
                json.dump(results, f, indent=2)
            print("".join(f"wrote {p}\n" for p in results["plots"]), end="")
    failed = [r for r in results["rows"] if r["checked"] is False or not r["ranks_bit_identical"]]
    if failed:
        print(f"bench: {len(failed)} result(s) FAILED their check", file=sys.stderr)
        return 1
    return 0


def cli(argv=None, prog: str = "switchml bench", description: str | None = None) -> int:
    """The command; ``description``: what ``--help`` prints above the flags (this
    module's docstring where None; the ``switchml`` command gives it plain)."""
    parser = argparse.ArgumentParser(prog=prog, description=description or __doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    argv = sys.argv[1:] if argv is None else argv
    return main(parser.parse_args(argv), " ".join(argv), prog)


if __name__ == "__main__":
    sys.exit(cli())
