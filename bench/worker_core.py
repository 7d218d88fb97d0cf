"""Worker CPU and time of an allreduce: the Python engine against the C engine.

A switch in its own process, ``--workers`` worker processes on loopback; each
runs ``--warmup`` then ``--repeats`` allreduces of ``--mib`` MiB of float32 (or
int32), once with ``SWITCHML_PURE_PYTHON=1`` and once on the C engine.  Per
engine it reports the slowest rank's median time per call and a worker's CPU
(user + sys, of the whole worker process: the I/O thread is where the work is)
per MiB summed: each worker's median per call, the mean over the workers, over
the MiB of a call; it checks each rank's last result against the exact sum
(failing on a wrong one) and writes everything as JSON.  With ``--density`` the calls are
sparse (OmniReduce) on block-sparse tensors of that block density.  With
``--threads N`` each rank sends with N I/O threads (``Worker(threads=N)``; the
switch's data threads: ``--switch-threads``); goodput is each rank's, in MiB/s
and Gbit/s of allreduced data.

    python bench/worker_core.py --mib 64 --workers 2 --packet-elements 2048
    python bench/worker_core.py --mib 64 --workers 4 --density 0.1
    python bench/worker_core.py --engines c --workers 2 --threads 4 --switch-threads 8

Loopback on a shared host: the switch and the workers compete for the same
cores, so times say more about CPU than about a network.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import multiprocessing.connection
import os
import platform
import resource
import statistics
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from switchml.bench.common import at_least, make_tensor, within  # noqa: E402

ENGINES = ("python", "c")


def make_input(rank, elements, dtype, density=None):
    """Rank ``rank``'s tensor: normal float32 (block-sparse at ``density``), or int32
    integers from it."""
    values = make_tensor(rank, elements, density)
    return values if dtype == "float32" else (values * 1000).astype(np.int32)


def _switch_main(options, conn, stop_ev):
    """The switch's process: its address (or why it did not start) on ``conn``, then
    serves until ``stop_ev`` or until the bench that started it is gone."""
    import switchml
    parent = os.getppid()
    try:
        sw = switchml.Switch(**options)
        sw.start()
    except Exception as e:  # the bench names it instead of waiting for an address
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    with sw:
        conn.send(("address", sw.address))
        while not stop_ev.wait(1):
            if os.getppid() != parent:  # the bench was killed: the switch does not outlive it
                break


def check_sum(out, rank_inputs, packet_elements):
    """Whether ``out`` is the sum of every rank's input: exact for int32, within
    ``switchml.quant.error_bound`` for float32; and the largest error."""
    exact = np.sum(np.array(rank_inputs, np.float64 if out.dtype == np.float32 else np.int64),
                   axis=0)
    if out.dtype != np.float32:
        exact = exact.astype(out.dtype)  # int32's wrap-around, as the switch's
        wrong = out != exact
        return not wrong.any(), int(np.abs(out.astype(np.int64) - exact).max(initial=0))
    from switchml.quant import error_bound
    err = np.abs(out.astype(np.float64) - exact)
    return bool(np.all(err <= error_bound(rank_inputs, packet_elements))), float(
        err.max(initial=0.0))


def _worker_main(engine, address, rank, world, elements, dtype, density, warmup, repeats, job,
                 threads, conn):
    os.environ["SWITCHML_PURE_PYTHON"] = "1" if engine == "python" else "0"
    import switchml
    from switchml.worker.engine import compiled
    data = make_input(rank, elements, dtype, density)
    out = np.empty_like(data)
    sparse = density is not None
    # each process a host of its own: the engine and the switch path are measured
    with switchml.Worker(address, rank, world, job=job, timeout=60, local_stage=False,
                         threads=threads) as w:
        for _ in range(warmup):
            w.allreduce(data, out, sparse=sparse)
        times, cpu, system = [], [], []
        for _ in range(repeats):
            c0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            w.allreduce(data, out, sparse=sparse)
            t1, c1 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
            times.append(t1 - t0)
            cpu.append((c1.ru_utime - c0.ru_utime) + (c1.ru_stime - c0.ru_stime))
            system.append(c1.ru_stime - c0.ru_stime)
        counters, cwnd = w.counters, w.membership.window.cwnd
        packet_elements = w.membership.packet_elements
    # the last call's result against the exact sum of every rank's input (known: each
    # rank's is rebuilt from its seed), after the timing
    inputs = [data if r == rank else make_input(r, elements, dtype, density)
              for r in range(world)]
    ok, max_error = check_sum(out, inputs, packet_elements)
    conn.send({"rank": rank, "times": times, "cpu": cpu, "system": system,
               "counters": counters, "compiled": compiled.enabled(), "cwnd": cwnd,
               "ok": ok, "max_error": max_error})


class BenchFailed(RuntimeError):
    """A process of the bench died or a sum was wrong: the message says which."""


def wait_for(conns: dict, procs: dict, watch=(), timeout=None) -> dict:
    """What each named process sends on its pipe, as they send it; BenchFailed naming
    the first of ``procs`` or ``watch`` (name: process, not expected to send) that
    exits without having sent (or at all, for ``watch``) and its exit code."""
    got, pending = {}, dict(conns)
    deadline = None if timeout is None else time.monotonic() + timeout
    while pending:
        sentinels = {procs[n].sentinel: n for n in pending}
        sentinels.update({p.sentinel: n for n, p in watch})
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready = mp.connection.wait(list(pending.values()) + list(sentinels), left)
        if not ready:
            raise BenchFailed(f"nothing from {', '.join(pending)} in {timeout:g} s")
        for name, conn in list(pending.items()):
            if conn in ready or conn.poll():
                try:
                    got[name] = conn.recv()
                    del pending[name]
                except EOFError:
                    pass  # died: its sentinel says so
        watched = dict(watch)
        for sentinel in ready:
            name = sentinels.get(sentinel)
            if name in pending or name in watched:
                proc = watched.get(name) or procs[name]
                proc.join(1)
                raise BenchFailed(f"{name} (pid {proc.pid}) exited with code {proc.exitcode}"
                                  " before the workers reported")
    return got


def run_engine(ctx, engine, address, args, elements, switch):
    procs, conns = {}, {}
    try:
        for r in range(args.workers):
            parent, child = ctx.Pipe(duplex=False)
            name = f"{engine} worker {r}"
            procs[name] = ctx.Process(
                target=_worker_main,
                args=(engine, address, r, args.workers, elements, args.dtype, args.density,
                      args.warmup, args.repeats, f"bench-{engine}", args.threads, child))
            procs[name].start()
            child.close()  # the worker's end is the worker's alone: EOF once it dies
            conns[name] = parent
        reports = sorted(wait_for(conns, procs, [("the switch", switch)]).values(),
                         key=lambda r: r["rank"])
        for p in procs.values():
            p.join(30)
    finally:  # (a failure, TERM or Ctrl-C) no worker outlives the bench
        for p in procs.values():
            if p.is_alive():
                p.terminate()
            p.join(5)
        for conn in conns.values():
            conn.close()
    mib = elements * 4 / 2**20
    per_call = np.max([r["times"] for r in reports], axis=0)  # the slowest rank finishes it
    cpu = [statistics.median(r["cpu"]) for r in reports]
    system = [statistics.median(r["system"]) for r in reports]
    return {
        "engine": engine,
        "compiled": reports[0]["compiled"],
        "median_s": float(statistics.median(per_call)),
        "min_s": float(per_call.min()),
        "goodput_MiBps_per_worker": mib / float(statistics.median(per_call)),
        "goodput_Gbps_per_worker": mib * 2**20 * 8 / 1e9 / float(statistics.median(per_call)),
        "cpu_s_per_call_per_worker": cpu,
        "cpu_ms_per_MiB_per_worker": float(statistics.mean(cpu)) / mib * 1e3,
        "sys_ms_per_MiB_per_worker": float(statistics.mean(system)) / mib * 1e3,
        "retransmissions": [r["counters"]["retransmissions"] for r in reports],
        "spurious_retransmissions": [r["counters"]["spurious_retransmissions"] for r in reports],
        "cwnd": [r["cwnd"] for r in reports],
        "sums_ok": [r["ok"] for r in reports],
        "max_error": [r["max_error"] for r in reports],
    }


def engine_only(engine, elements, dtype, packet_elements, slots, repeats, density=None):
    """Seconds of CPU per call of the sans-IO engine alone, against a world-1 echo.

    For a job of one worker the switch returns each contribution as its result
    (its own values and exponent): turning the kind byte into "result" is the
    switch, so this times the engine's per-packet work without sockets or switch.
    Sparse too: one worker's least next position is its own.
    """
    from switchml import wire
    from switchml.worker.engine.dense import Membership
    data = make_input(0, elements, dtype, density)
    out = np.empty_like(data)
    membership = Membership(session=1, rank=0, world_size=1, slot_base=0, slot_count=slots,
                            packet_elements=packet_elements,
                            block_elements=block_of(packet_elements))
    cpu = []
    for _ in range(repeats):
        c0 = time.process_time()
        op = membership.allreduce(data, out, 0.0, sparse=density is not None,
                                  compiled=engine == "c")
        pending = op.datagrams_to_send()
        while pending:
            for d in pending:
                result = bytearray(d)
                result[3] = wire.KIND_RESULT
                op.receive_datagram(result, 0.0)
            pending = op.datagrams_to_send()
        assert op.done
        cpu.append(time.process_time() - c0)
    return float(statistics.median(cpu))


def block_of(packet_elements):
    """The switch's block: 256 values where they divide the packet (the sparse unit)."""
    return 256 if packet_elements % 256 == 0 else packet_elements


def engine_list(text: str) -> list:
    """An argparse ``type``: engines of ENGINES, comma-separated (a typo ran the C
    engine under the typo's name)."""
    names = [n for n in text.split(",") if n]
    unknown = [n for n in names if n not in ENGINES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"{text}: give engines of {', '.join(ENGINES)}, comma-separated")
    return names


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=within(0, above_low=True), default=64.0,
                        help="MiB per allreduce (default 64)")
    parser.add_argument("--workers", type=at_least(1), default=2)
    parser.add_argument("--packet-elements", type=at_least(1), default=2048,
                        help="values per packet (2048: 8 KiB, a frame at MTU 9000)")
    parser.add_argument("--slots", type=at_least(1), default=32, help="the job's window")
    parser.add_argument("--dtype", choices=["float32", "int32"], default="float32")
    parser.add_argument("--warmup", type=at_least(0), default=1)
    parser.add_argument("--repeats", type=at_least(1), default=5)
    parser.add_argument("--engines", type=engine_list, default=",".join(ENGINES),
                        help=f"comma-separated, of {', '.join(ENGINES)}")
    parser.add_argument("--threads", type=at_least(1), default=1,
                        help="I/O threads a rank sends with (default 1)")
    parser.add_argument("--switch-threads", type=at_least(1), default=None,
                        help="the switch's data threads (default: its own, a quarter of "
                             "the cores)")
    parser.add_argument("--density", type=within(0, 1, above_low=True), default=None,
                        help="sparse calls on block-sparse tensors of this block density")
    parser.add_argument("--json", default=os.path.join(ROOT, "bench", "results",
                                                       "worker-core.json"))
    args = parser.parse_args(argv)
    from switchml.worker.engine import compiled
    if compiled._fastengine is None:
        parser.error("the C engine is not built: python setup.py build_ext --inplace")
    elements = int(args.mib * 2**20 / 4)
    if elements < 1:
        parser.error(f"--mib {args.mib:g}: less than one value")
    engines = args.engines
    ctx = mp.get_context("spawn")
    stop_ev = ctx.Event()
    parent, child = ctx.Pipe(duplex=False)
    options = {"packet_elements": args.packet_elements,
               "block_elements": block_of(args.packet_elements), "slots_per_job": args.slots,
               "threads": args.switch_threads}
    switch = ctx.Process(target=_switch_main, args=(options, child, stop_ev), daemon=True)
    results = []
    try:
        switch.start()
        child.close()
        what, address = wait_for({"the switch": parent}, {"the switch": switch},
                                 timeout=60)["the switch"]
        if what == "error":
            raise BenchFailed(f"the switch did not start: {address}")
        for engine in engines:
            results.append(run_engine(ctx, engine, address, args, elements, switch))
    finally:  # (a failure, TERM or Ctrl-C too) the switch does not outlive the bench
        stop_ev.set()
        if switch.pid is not None:
            switch.join(10)
            if switch.is_alive():
                switch.terminate()
                switch.join(5)
        parent.close()
    kind = "dense" if args.density is None else f"sparse (density {args.density:g})"
    print(f"{kind} allreduce of {args.mib:g} MiB {args.dtype}, {args.workers} workers of "
          f"{args.threads} thread(s), {args.packet_elements} values a packet, loopback "
          f"({os.cpu_count()} cores)")
    print(f"{'engine':8} {'median s':>9} {'MiB/s':>8} {'Gbit/s':>7} {'CPU ms/MiB':>11} "
          f"{'of it sys':>10} {'retrans':>8}")
    for r in results:
        print(f"{r['engine']:8} {r['median_s']:9.3f} {r['goodput_MiBps_per_worker']:8.1f} "
              f"{r['goodput_Gbps_per_worker']:7.2f} "
              f"{r['cpu_ms_per_MiB_per_worker']:11.2f} {r['sys_ms_per_MiB_per_worker']:10.2f} "
              f"{sum(r['retransmissions']):8d}")
    record = {"argv": sys.argv[1:], "mib": args.mib, "workers": args.workers,
              "packet_elements": args.packet_elements, "slots": args.slots,
              "threads": args.threads, "switch_threads": args.switch_threads,
              "dtype": args.dtype, "density": args.density, "host": platform.node(),
              "cpus": os.cpu_count(),
              "results": results}
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    mib = elements * 4 / 2**20
    print("the engine alone (sans-IO, a world-1 echo for the switch), CPU ms/MiB:")
    for engine in engines:
        seconds = engine_only(engine, elements, args.dtype, args.packet_elements, args.slots,
                              max(1, args.repeats), args.density)
        record.setdefault("engine_only_cpu_ms_per_MiB", {})[engine] = seconds / mib * 1e3
        print(f"{engine:8} {seconds / mib * 1e3:11.3f}")
    with open(args.json, "w") as f:
        json.dump(record, f, indent=1)
    print(f"wrote {args.json}")
    wrong = [f"{r['engine']} rank {rank} (largest error {err:g})" for r in results
             for rank, (ok, err) in enumerate(zip(r["sums_ok"], r["max_error"])) if not ok]
    if wrong:
        raise BenchFailed("wrong sums: " + "; ".join(wrong))
    return record


if __name__ == "__main__":
    from switchml.testbed.core import signals_end_the_run
    with signals_end_the_run():  # TERM or HUP: the switch and workers go, as on Ctrl-C
        try:
            main()
        except BenchFailed as e:
            sys.exit(f"worker_core: {e}")
