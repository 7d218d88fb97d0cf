"""Allreduce benchmark on loopback: n worker processes and a switch process.

    python bench/allreduce.py --workers 2 4 8 --mib 64 --repeats 5 [--gloo] [--profile]
    python bench/allreduce.py --workers 4 --mib 100 --repeats 5 --no-dense \
        --densities 1.0 0.5 0.2 0.1 0.05 0.01

For every worker count it reports, per allreduce, the median, min and max time
(the slowest rank of each iteration), goodput per worker (tensor bytes / time),
the switch's packets/s and MB/s (in + out) over the timed iterations, and CPU
seconds per packet of the switch and of a worker.  With ``--gloo`` it also runs
torch.distributed's gloo allreduce on the same tensors in the same invocation
(needs the torch extra).  ``--profile`` runs cProfile in the switch and in rank
0 and prints where the time goes per packet.  ``--densities`` runs OmniReduce's
micro-benchmark: block-sparse tensors with non-zero blocks placed at random per
rank, sparse and dense path on the same tensors, bytes sent and received per
worker.  Results go to JSON (``--out``).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import multiprocessing as mp
import os
import platform
import pstats
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import switchml  # noqa: E402
from switchml import config  # noqa: E402
from switchml.bench.common import make_block_sparse, summarize  # noqa: E402
from switchml.cli import fetch_stats  # noqa: E402


def _profile_text(prof) -> str:
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(14)
    return out.getvalue()


def _switch_main(options, address_q, stop_ev, profile, report_q):
    sw = switchml.Switch(**options)
    prof = cProfile.Profile() if profile else None
    if prof is not None:
        serve = sw._serve  # profile the switch's own loop thread
        sw._serve = lambda: prof.runcall(serve)
    sw.start()
    address_q.put(sw.address)
    stop_ev.wait()
    sw.stop()
    if prof is not None:
        report_q.put(("switch-profile", _profile_text(prof)))


def _worker_main(address, rank, world, elements, dtype, warmup, repeats, profile, report_q):
    rng = np.random.default_rng(rank)
    if dtype == "float32":
        data = rng.standard_normal(elements).astype(np.float32)
    else:
        data = rng.integers(-1000, 1000, elements, dtype=np.int32)
    out = np.empty_like(data)
    # each process a host of its own: the switch path is what is measured
    with switchml.Worker(address, rank, world, job=f"bench-{world}", timeout=60,
                         local_stage=False) as w:
        for _ in range(warmup):
            w.allreduce(data, out=out)
        prof = cProfile.Profile() if profile and rank == 0 else None
        if prof is not None:
            run = w._run  # profile the worker's I/O thread, where the work happens
            w._run = lambda *args: prof.runcall(run, *args)
        c0 = dict(w.counters)
        cpu0 = time.process_time()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            w.allreduce(data, out=out)
            times.append(time.perf_counter() - start)
        cpu = time.process_time() - cpu0
        c1 = w.counters
        sent = ((c1["results_in"] - c0["results_in"])
                + (c1["retransmissions"] - c0["retransmissions"]))
        received = c1["results_in"] - c0["results_in"]
        prof = _profile_text(prof) if prof is not None else None
        report_q.put(("worker", rank, times, cpu, sent, received, prof))


def _density_worker_main(address, rank, world, elements, densities, block, warmup, repeats,
                         report_q):
    with switchml.Worker(address, rank, world, job=f"bench-density-{world}", timeout=60,
                         local_stage=False) as w:
        for density in densities:
            data = make_block_sparse(rank, elements, density, block)
            out = np.empty_like(data)
            for sparse in (True, False):
                for _ in range(warmup):
                    w.allreduce(data, out=out, sparse=sparse)
                c0 = w.counters
                cpu0 = os.times()
                times = []
                for _ in range(repeats):
                    start = time.perf_counter()
                    w.allreduce(data, out=out, sparse=sparse)
                    times.append(time.perf_counter() - start)
                cpu1 = os.times()
                c1 = w.counters
                per_call = {
                    "bytes_sent_per_worker": c1["bytes_sent"] - c0["bytes_sent"],
                    "bytes_received_per_worker": c1["bytes_received"] - c0["bytes_received"],
                    # each block once: a retransmission resends the same datagram
                    "value_bytes_sent_per_worker":
                        (c1["sparse_blocks_sent"] - c0["sparse_blocks_sent"]) * block * 4,
                    "retransmissions_per_worker": c1["retransmissions"] - c0["retransmissions"],
                    # the whole process, I/O thread and all: user (numpy, Python), system (sockets)
                    "worker_cpu_user_s": cpu1.user - cpu0.user,
                    "worker_cpu_system_s": cpu1.system - cpu0.system,
                }
                report_q.put(("density", rank, density, sparse, times,
                              {k: v / repeats for k, v in per_call.items()}))


def _gloo_main(port, rank, world, elements, warmup, repeats, report_q):
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # gloo at its best: no intra-op threads fighting the ranks
    dist.init_process_group("gloo", rank=rank, world_size=world)
    rng = np.random.default_rng(rank)
    t = torch.from_numpy(rng.standard_normal(elements).astype(np.float32))
    for _ in range(warmup):
        dist.all_reduce(t.clone())
    times = []
    for _ in range(repeats):
        x = t.clone()
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(x)
        times.append(time.perf_counter() - start)
    report_q.put(("gloo", rank, times))
    dist.barrier()
    dist.destroy_process_group()


def run_switchml(ctx, world, elements, dtype, args):
    report_q, address_q, stop_ev = ctx.Queue(), ctx.Queue(), ctx.Event()
    options = dict(slots=args.slots, packet_elements=args.packet_elements,
                   slots_per_job=args.slots_per_job)
    switch_proc = ctx.Process(target=_switch_main,
                              args=(options, address_q, stop_ev, args.profile, report_q))
    switch_proc.start()
    address = address_q.get(timeout=60)
    procs = [ctx.Process(target=_worker_main,
                         args=(address, r, world, elements, dtype, args.warmup, args.repeats,
                               args.profile, report_q)) for r in range(world)]
    for p in procs:
        p.start()
    reports = []
    while len(reports) < world:
        item = report_q.get(timeout=600)
        if item[0] == "worker":
            reports.append(item)
    for p in procs:
        p.join()
    stats = fetch_stats(address)  # after every rank left: the job's counters are final
    stop_ev.set()
    switch_profile = None
    if args.profile:
        item = report_q.get(timeout=60)
        switch_profile = item[1]
    switch_proc.join()
    job = stats["ended_jobs"][f"bench-{world}"]["counters"]
    iterations = args.warmup + args.repeats
    packets = job.get("packets_in", 0) + job.get("results_out", 0)
    nbytes = elements * 4
    reports.sort(key=lambda r: r[1])
    result = summarize([r[2] for r in reports], nbytes)
    total_time = sum(max(r[2][i] for r in reports) for i in range(args.repeats))
    # The switch counters cover warm-up too; scale them to the timed iterations.
    timed_packets = packets * args.repeats / iterations
    payload = (wire_bytes := nbytes * world * 2) * args.repeats
    result.update({
        "switch_packets_per_s": timed_packets / total_time,
        "switch_MBps_in_plus_out": payload / total_time / 1e6,
        "switch_cpu_s_per_packet": stats["cpu_s"] / packets if packets else None,
        "worker_cpu_s_per_packet": reports[0][3] / max(1, reports[0][4] + reports[0][5]),
        "switch_counters": job,
        "payload_bytes_up_plus_down_per_worker": wire_bytes // world,
    })
    if args.profile:
        result["profile_switch"] = switch_profile
        result["profile_worker0"] = reports[0][6]
    return result


def run_densities(ctx, world, elements, args):
    """Sparse and dense on the same block-sparse tensors, per density (OmniReduce's method)."""
    report_q, address_q, stop_ev = ctx.Queue(), ctx.Queue(), ctx.Event()
    options = dict(slots=args.slots, packet_elements=args.packet_elements,
                   slots_per_job=args.slots_per_job)
    switch_proc = ctx.Process(target=_switch_main,
                              args=(options, address_q, stop_ev, False, report_q))
    switch_proc.start()
    address = address_q.get(timeout=60)
    block = fetch_stats(address)["block_elements"]
    procs = [ctx.Process(target=_density_worker_main,
                         args=(address, r, world, elements, args.densities, block, args.warmup,
                               args.repeats, report_q)) for r in range(world)]
    for p in procs:
        p.start()
    items = [report_q.get(timeout=1200) for _ in range(world * len(args.densities) * 2)]
    for p in procs:
        p.join()
    stop_ev.set()
    switch_proc.join()
    rows = []
    nbytes = elements * 4
    for density in args.densities:
        row = {"density": density, "workers": world, "block_elements": block}
        for sparse in (True, False):
            mine = sorted((i for i in items if i[2] == density and i[3] == sparse),
                          key=lambda i: i[1])
            key = "sparse" if sparse else "dense"
            row[key] = summarize([i[4] for i in mine], nbytes)
            for name in mine[0][5]:  # the ranks' mean of each per-call figure
                row[key][name] = float(np.mean([i[5][name] for i in mine]))
        row["sparse_speedup_over_dense"] = row["dense"]["median_s"] / row["sparse"]["median_s"]
        row["sent_over_density_times_size"] = row["sparse"]["bytes_sent_per_worker"] / max(
            1.0, density * nbytes)
        # The values alone: "density x size, plus headers" without the headers.
        row["values_sent_over_density_times_size"] = row["sparse"][
            "value_bytes_sent_per_worker"] / max(1.0, density * nbytes)
        # What must come down to every worker: the union of the ranks' blocks.
        row["union_fraction_expected"] = 1.0 - (1.0 - density) ** world
        rows.append(row)
    return rows


def _cpu_text(result) -> str:
    """A worker's CPU per call, user + system, in ms."""
    return f"{1e3 * result['worker_cpu_user_s']:.0f}+{1e3 * result['worker_cpu_system_s']:.0f}"


def run_gloo(ctx, world, elements, args):
    report_q = ctx.Queue()
    port = 29500 + (os.getpid() % 1000)
    procs = [ctx.Process(target=_gloo_main,
                         args=(port, r, world, elements, args.warmup, args.repeats, report_q))
             for r in range(world)]
    for p in procs:
        p.start()
    reports = sorted((report_q.get(timeout=600) for _ in range(world)), key=lambda r: r[1])
    for p in procs:
        p.join()
    return summarize([r[2] for r in reports], elements * 4)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--mib", type=float, default=64.0, help="tensor size in MiB")
    parser.add_argument("--dtype", choices=["float32", "int32"], default="float32")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--slots", type=int, default=config.DEFAULT_SLOTS)
    parser.add_argument("--packet-elements", type=int, default=config.DEFAULT_PACKET_ELEMENTS)
    parser.add_argument("--slots-per-job", type=int, default=config.DEFAULT_SLOTS_PER_JOB)
    parser.add_argument("--gloo", action="store_true", help="also run torch gloo allreduce")
    parser.add_argument("--densities", type=float, nargs="*", default=[],
                        help="also run sparse vs dense on block-sparse tensors of these "
                             "block densities (random blocks per rank)")
    parser.add_argument("--no-dense", action="store_true",
                        help="skip the plain dense runs (with --densities)")
    parser.add_argument("--profile", action="store_true", help="cProfile switch and rank 0")
    parser.add_argument("--out", default=None, help="JSON file (default ./allreduce-<time>.json)")
    args = parser.parse_args(argv)

    elements = int(args.mib * 2**20) // 4
    ctx = mp.get_context("spawn")
    arguments = sys.argv[1:] if argv is None else argv
    results = {"command": "python bench/allreduce.py " + " ".join(arguments),
               "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                           "python": platform.python_version()},
               "elements": elements, "dtype": args.dtype, "runs": []}
    if not args.no_dense:
        print(f"{'n':>3} {'system':>9} {'median s':>9} {'min s':>8} {'max s':>8} "
              f"{'GB/s/worker':>12} {'switch pkt/s':>13} {'switch MB/s':>12} "
              f"{'sw us/pkt':>10} {'wk us/pkt':>10}")
    for world in args.workers:
        if args.densities:
            print(f"{'n':>3} {'density':>8} {'sparse s':>9} {'dense s':>8} {'speedup':>8} "
                  f"{'sent MB':>8} {'recv MB':>8} {'sent/(d*S)':>10} {'values/(d*S)':>12} "
                  f"{'retx':>5} {'cpu u+s sparse':>15} {'cpu u+s dense':>14}")
            for row in run_densities(ctx, world, elements, args):
                results["runs"].append(dict(row, system="switchml-sparse-vs-dense"))
                sp = row["sparse"]
                print(f"{world:>3} {row['density']:>8.2f} {sp['median_s']:>9.3f} "
                      f"{row['dense']['median_s']:>8.3f} {row['sparse_speedup_over_dense']:>7.2f}x "
                      f"{sp['bytes_sent_per_worker'] / 1e6:>8.1f} "
                      f"{sp['bytes_received_per_worker'] / 1e6:>8.1f} "
                      f"{row['sent_over_density_times_size']:>10.3f} "
                      f"{row['values_sent_over_density_times_size']:>12.3f} "
                      f"{sp['retransmissions_per_worker']:>5.1f} "
                      f"{_cpu_text(sp):>15} {_cpu_text(row['dense']):>14}", flush=True)
        if args.no_dense:
            continue
        r = run_switchml(ctx, world, elements, args.dtype, args)
        r.update(workers=world, system="switchml")
        results["runs"].append(r)
        print(f"{world:>3} {'switchml':>9} {r['median_s']:>9.3f} {r['min_s']:>8.3f} "
              f"{r['max_s']:>8.3f} {r['goodput_GBps_per_worker']:>12.3f} "
              f"{r['switch_packets_per_s']:>13.0f} {r['switch_MBps_in_plus_out']:>12.0f} "
              f"{r['switch_cpu_s_per_packet'] * 1e6:>10.1f} "
              f"{r['worker_cpu_s_per_packet'] * 1e6:>10.1f}", flush=True)
        if args.gloo:
            g = run_gloo(ctx, world, elements, args)
            g.update(workers=world, system="gloo",
                     switchml_speedup_over_gloo=g["median_s"] / r["median_s"])
            results["runs"].append(g)
            print(f"{world:>3} {'gloo':>9} {g['median_s']:>9.3f} {g['min_s']:>8.3f} "
                  f"{g['max_s']:>8.3f} {g['goodput_GBps_per_worker']:>12.3f}   "
                  f"(switchml speedup {g['switchml_speedup_over_gloo']:.2f}x)", flush=True)
        if args.profile:
            print("--- switch profile (tottime) ---\n" + r["profile_switch"])
            print("--- worker rank 0 profile (tottime) ---\n" + (r["profile_worker0"] or ""))
    out = args.out or f"allreduce-{time.strftime('%Y%m%d-%H%M%S')}.json"
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump(results, f, indent=2)
    print(f"wrote {out}")
    return results


if __name__ == "__main__":
    main()
