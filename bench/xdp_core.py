"""How many contributions the switch's XDP program aggregates per second of a
core, at the packet sizes of MTU 1500 and MTU 9000 frames, on one CPU and on
two: the XDP twin of ``bench/switch_core.py``.

    sudo python bench/xdp_core.py                        # both MTUs, 1 and 2 CPUs
    sudo python bench/xdp_core.py --mtu 1500 --cpus 1 --seconds 5 --json out.json
    python bench/xdp_core.py --median run1.json run2.json run3.json   # Markdown, medians

The program (switch/xdp/pipeline.bpf.c, loaded by ``XdpPipeline``) runs through
BPF_PROG_TEST_RUN, one call a frame, on Ethernet/IPv4/UDP contribution frames of
one job of ``--workers`` ranks: every slot's message from each rank in turn, so
that each contribution is added (the last one of a slot completes it: its
result is written over the frame and passed up, as when serving).  The frames
are built once; their message numbers move on by two after each pass over the
slots (a pass is each slot's two sets).  The packet geometry is switch_core.py's:
whole blocks of ``--block`` values, as many as fit the MTU's frame.

Two measures of a core:

- **program**: the nanoseconds the kernel reports for each run of the program
  (BPF_PROG_TEST_RUN's ``duration``: the program alone, between two reads of the
  clock), summed: what the data plane costs per frame, as a driver would run it;
- **harness**: the CPU time of the processes that call BPF_PROG_TEST_RUN (user
  and system: Python's loop, the system call, the copies of each frame into and
  out of the kernel), which bounds this bench's wall-clock rates, not a
  switch's.

Only contributions added to a sum count (the program's counters: admitted,
less stale, mismatched, duplicate and retransmissions), as payload bytes (the
UDP datagram, switch_core.py's ``packet_bytes``).

Two CPUs (``--cpus 2``): two processes, pinned to the first two CPUs this
process may use, run at once.  ``--share disjoint`` (the default): each owns
half of the slots and sends all ranks' contributions to them (a slot's
packets on one CPU, as a NIC's flow steering by slot would give); ``--share
same``: both feed the same slots, the first CPU half the ranks, the second the
other half, meeting after each pass so that neither runs a
message ahead: every set's lock is fought over.  The ratio ``2 CPUs / 1`` is of
contributions added per second of wall-clock time, and of the program's own
rate (its per-core rate on two CPUs, twice, over its rate on one).

Needs root (CAP_BPF), clang and libbpf, as ``switchml switch --data-plane xdp``.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import multiprocessing
import multiprocessing.connection
import os
import resource
import statistics
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from bench.switch_core import packet_elements_for, write_rows  # noqa: E402
from switchml import wire  # noqa: E402
from switchml.bench.common import at_least, within  # noqa: E402
from switchml.bench.launch import end_processes  # noqa: E402
from switchml.switch.xdp import loader as xdp_loader  # noqa: E402
from switchml.switch.xdp import pipeline as xdp  # noqa: E402

SESSION = 0x5EED
#: where a frame's header field ``msg`` starts (Ethernet, IPv4, UDP headers first)
MSG_AT = xdp.FRAME_HEADERS + 12


def _frames(pipeline, addresses, slots, ranks, packet_elements, block) -> np.ndarray:
    """The frames one process sends, in order: for each of two messages (the two
    sets), each of ``slots``, each of ``ranks``."""
    lanes = packet_elements // block
    rng = np.random.default_rng(1)
    out = []
    for msg in range(2):
        for slot in slots:
            for rank in ranks:
                values = rng.integers(-1000, 1000, packet_elements).astype(np.int32)
                data = wire.encode(wire.KIND_CONTRIBUTION, wire.DTYPE_INT32, slot, SESSION, msg,
                                   0, slot, np.zeros(lanes, wire.LANE), values)
                out.append(np.frombuffer(xdp.udp_frame(addresses[rank], pipeline.address, data),
                                         np.uint8))
    return np.stack(out)


class PassMeeting:
    """Two processes meeting after each pass: each publishes the passes it has
    made and waits until the other has made as many.  (multiprocessing's Barrier,
    reused a few thousand times a second, was seen to break in one process while
    the other passed.)  ``last``: the pass after which both end, set by the
    leader before it publishes that pass (a number, not a flag: the other may
    read it after the leader has gone on to the next pass); ``failed``: set by a
    process that gave up, so the other does not wait for it."""

    def __init__(self, ctx):
        self.passes = ctx.RawArray("q", [-1, -1])
        self.last = ctx.RawValue("q", -1)
        self.failed = ctx.RawValue("i", 0)

    def meet(self, me: int, passes: int, timeout: float = 30.0) -> None:
        self.passes[me] = passes
        limit = time.monotonic() + timeout
        while self.passes[1 - me] < passes:
            if self.failed.value:
                raise RuntimeError("the other process failed")
            if time.monotonic() > limit:
                raise TimeoutError(f"the other process made no pass {passes} in {timeout:g} s")
            os.sched_yield()


def _runner(prog_fd, cpu, me, frames, start, deadline, meeting, conn):
    """One process on CPU ``cpu``: passes over ``frames`` until ``deadline``
    (with a ``meeting``: every pass meeting the other process's, until the pass
    at whose end process 0, the leader, is past the deadline).  Sends back
    (passes, runs, program ns, CPU s, wall s, actions, the first pass's results:
    the frames the program passed up)."""
    try:
        os.sched_setaffinity(0, {cpu})
        lib = xdp_loader.libbpf()
        run = lib.bpf_prog_test_run_opts
        size = frames.shape[1]
        out = ctypes.create_string_buffer(2 * size + 4096)
        opts = []
        for i in range(len(frames)):
            o = xdp_loader.TestRunOpts(sz=ctypes.sizeof(xdp_loader.TestRunOpts),
                                 data_in=frames[i].ctypes.data,
                                 data_out=ctypes.cast(out, ctypes.c_void_p),
                                 data_size_in=size, data_size_out=len(out), repeat=1)
            opts.append(o)
        refs = [ctypes.byref(o) for o in opts]
        msgs = frames[:, MSG_AT:MSG_AT + 4].view(np.uint32)
        actions = [0] * 5
        results = []  # the first pass's, for the parent to check
        passes = runs = ns = 0
        where = "before the first pass"
        time.sleep(max(0.0, start - time.monotonic()))
        if meeting is not None:
            meeting.meet(me, 0)
        usage0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
        while True:
            for o, ref in zip(opts, refs):
                o.data_size_out = len(out)
                rc = run(prog_fd, ref)
                if rc:
                    raise OSError(-rc, "BPF_PROG_TEST_RUN")
                ns += o.duration
                actions[o.retval] += 1
                if not passes and o.retval == xdp.XDP_PASS:
                    results.append(out.raw[:o.data_size_out])
            runs += len(opts)
            passes += 1
            where = f"after pass {passes}, {time.monotonic() - t0:.3f} s in"
            msgs += 2  # the next message of every set
            if meeting is None:
                if time.monotonic() >= deadline:
                    break
            else:
                if me == 0 and time.monotonic() >= deadline:
                    meeting.last.value = passes  # before the pass is published
                meeting.meet(me, passes)
                if meeting.last.value == passes:
                    break
        t1, usage1 = time.monotonic(), resource.getrusage(resource.RUSAGE_SELF)
        cpu_s = (usage1.ru_utime - usage0.ru_utime) + (usage1.ru_stime - usage0.ru_stime)
        conn.send((passes, runs, ns, cpu_s, t1 - t0, actions, results))
    except BaseException as exc:  # the parent reports it, and where it came
        if meeting is not None:  # the other process must not wait its 30 s for this one
            meeting.failed.value = 1
        conn.send((exc, f"CPU {cpu}, {where}"))


_AFFINITY = set(os.sched_getaffinity(0))


def exact_sums(frames) -> dict:
    """(slot, msg): the int32 sum of the contributions among ``frames`` (every
    process's frames, as built: the values of their first pass)."""
    sums: dict = {}
    for frame in frames:
        _, _, payload = xdp.parse_udp_frame(bytes(frame))
        h = wire.decode_header(payload)
        values = wire.values(payload, h.lanes, h.count).astype(np.int64)
        key = (h.slot, h.msg)
        sums[key] = sums[key] + values if key in sums else values
    return {k: v.astype(np.int32) for k, v in sums.items()}


def check_results(results: list, sums: dict) -> list:
    """What is wrong with the result frames ``results`` of a first pass that
    completed every (slot, msg) of ``sums`` once: an empty list when each is there,
    once, with the exact sum."""
    wrong, seen = [], set()
    for frame in results:
        _, _, payload = xdp.parse_udp_frame(frame)
        try:
            h = wire.decode_header(payload)
        except wire.MalformedPacket as exc:
            wrong.append(f"a malformed result ({exc})")
            continue
        key = (h.slot, h.msg)
        if h.kind != wire.KIND_RESULT or key not in sums or key in seen:
            wrong.append(f"an unexpected frame (kind {h.kind}, slot {h.slot}, msg {h.msg})")
            continue
        seen.add(key)
        got = wire.values(payload, h.lanes, h.count)
        if got.shape != sums[key].shape or not np.array_equal(got, sums[key]):
            wrong.append(f"slot {h.slot} msg {h.msg}: not the sum")
    missing = sorted(set(sums) - seen)
    if missing:
        wrong.append(f"no result for {len(missing)} of {len(sums)} (slot, msg), "
                     f"first {missing[0]}")
    return wrong


def _duration(p, frame: bytes, repeat: int) -> int:
    """BPF_PROG_TEST_RUN's nanoseconds a run of ``frame``, ``repeat`` runs at once."""
    lib = xdp_loader.libbpf()
    data_in = ctypes.create_string_buffer(frame, len(frame))
    out = ctypes.create_string_buffer(len(frame) + 4096)
    opts = xdp_loader.test_run_opts(data_in, out)
    opts.repeat = repeat
    rc = lib.bpf_prog_test_run_opts(p._prog.prog_fd, ctypes.byref(opts))
    if rc:
        raise OSError(-rc, "BPF_PROG_TEST_RUN")
    return opts.duration


class WrongSums(RuntimeError):
    """The program's results are not the sums of the contributions."""


def _answer(pipe, child, cpu):
    """A runner's answer, or RuntimeError naming it and its exit code once it died."""
    multiprocessing.connection.wait([pipe, child.sentinel])
    try:
        return pipe.recv()
    except EOFError:
        child.join(1)
        raise RuntimeError(f"the runner on CPU {cpu} (pid {child.pid}) died "
                           f"(exit code {child.exitcode})") from None


def measure(mtu: int, cpus: int, share: str, workers: int, slots: int, block: int,
            seconds: float) -> dict:
    """One row: the program on ``cpus`` CPUs (1 or 2) for ``seconds``."""
    packet_elements = packet_elements_for(mtu, block)
    lanes = packet_elements // block
    size = wire.packet_size(lanes, packet_elements)
    mine = sorted(os.sched_getaffinity(0))[:cpus]
    if len(mine) < cpus:
        raise SystemExit(f"--cpus {cpus}: this process may use {len(mine)} CPU(s)")
    row = {"mtu": mtu, "cpus": cpus, "share": share if cpus > 1 else "-", "workers": workers,
           "slots": slots, "packet_elements": packet_elements, "block_elements": block,
           "packet_bytes": size, "frame_bytes": size + xdp.FRAME_HEADERS}
    try:
        p = xdp.XdpPipeline(slots, packet_elements, block_elements=block)
    except ValueError as exc:  # packets the program does not take
        return dict(row, refused=str(exc))
    try:
        addresses = [("10.0.0.1", 5000 + r) for r in range(workers)]
        p.install_job("bench", SESSION, addresses, 0, slots, packet_elements, block)
        if cpus == 1:
            plans = [(list(range(slots)), list(range(workers)))]
        elif share == "disjoint":
            plans = [(list(range(slots))[i::2], list(range(workers))) for i in range(2)]
        else:
            plans = [(list(range(slots)), list(range(workers))[i::2]) for i in range(2)]
        pipes, children = [], []
        ctx = multiprocessing.get_context("fork")  # the children use the loaded program's fd
        meeting = PassMeeting(ctx) if cpus > 1 and share == "same" else None
        start = time.monotonic() + 0.3
        every = [_frames(p, addresses, slots_of, ranks, packet_elements, block)
                 for slots_of, ranks in plans]
        sums = exact_sums(np.concatenate(every))
        try:
            for me, (cpu, frames) in enumerate(zip(mine, every)):
                here, there = ctx.Pipe(duplex=False)
                child = ctx.Process(target=_runner, args=(
                    p._prog.prog_fd, cpu, me, frames, start, start + seconds, meeting, there))
                child.start()
                there.close()  # the runner's alone: EOF once it dies
                pipes.append(here)
                children.append(child)
            answers = [_answer(pipe, child, cpu) for pipe, child, cpu
                       in zip(pipes, children, mine)]
            for child in children:
                child.join(timeout=30)
        finally:  # (a failure, TERM or Ctrl-C) no runner goes on spinning the program
            end_processes(children, pipes)
        failures = [a for a in answers if isinstance(a[0], BaseException)]
        if failures:  # the cause first, not the failed meeting it left the other process
            failures.sort(key=lambda f: "the other process failed" in str(f[0]))
            raise RuntimeError("; ".join(f"{where}: {exc!r}" for exc, where in failures)) \
                from failures[0][0]
        wrong = check_results([f for a in answers for f in a[6]], sums)
        if wrong:
            raise WrongSums(f"MTU {mtu}, {cpus} CPU(s) {share}: the first pass's results: "
                            + "; ".join(wrong[:5]) + (" ..." if len(wrong) > 5 else ""))
        p.sync_counters()
        c = p.jobs[SESSION].counters
        if cpus == 1:  # the per-call cost: a frame (stale by now: its set moved on), alone or
            # repeated
            os.sched_setaffinity(0, {mine[0]})
            last = bytes(every[-1][-1])
            alone = sorted(_duration(p, last, 1) for _ in range(2001))[1000]
            row["stale_ns_alone"] = alone
            row["stale_ns_repeated"] = _duration(p, last, 100_000)
            os.sched_setaffinity(0, set(range(os.cpu_count() or 1)) & _AFFINITY)
    finally:
        p.close()
    added = c["packets_in"] - sum(c[k] for k in (
        "dropped_stale", "dropped_mismatch", "duplicates", "retransmissions_answered"))
    runs = sum(a[1] for a in answers)
    prog_s = sum(a[2] for a in answers) / 1e9
    cpu_s = sum(a[3] for a in answers)
    wall = max(a[4] for a in answers)
    bits = added * size * 8
    return dict(
        row, runs=runs, contributions_added=added, results_completed=c["results_completed"],
        dropped={k: v for k, v in c.items() if k.startswith("dropped_") and v},
        program_s=prog_s, harness_cpu_s=cpu_s, wall_s=wall,
        program_ns_per_frame=prog_s * 1e9 / runs if runs else 0.0,
        gbit_per_program_core_s=bits / prog_s / 1e9 if prog_s else 0.0,
        gbit_per_harness_core_s=bits / cpu_s / 1e9 if cpu_s else 0.0,
        gbit_per_wall_s=bits / wall / 1e9 if wall else 0.0,
        contributions_per_wall_s=added / wall if wall else 0.0,
        results_checked=sum(len(a[6]) for a in answers),
        per_cpu=[dict(zip(("passes", "runs", "program_ns", "cpu_s", "wall_s"), a[:5]),
                      actions=dict(zip(xdp.ACTIONS.values(), a[5]))) for a in answers])


MEDIAN_COLUMNS = [("program_ns_per_frame", "ns a frame", "{:.0f}"),
                  ("gbit_per_program_core_s", "Gbit/s a program core", "{:.1f}"),
                  ("gbit_per_harness_core_s", "Gbit/s a harness core", "{:.2f}"),
                  ("gbit_per_wall_s", "Gbit/s wall", "{:.2f}"),
                  ("wall_vs_1_cpu", "wall x 1 CPU", "{:.2f}x"),
                  ("program_vs_1_cpu", "program x 1 CPU", "{:.2f}x"),
                  ("stale_ns_alone", "stale frame ns, alone", "{:.0f}"),
                  ("stale_ns_repeated", "stale frame ns, repeated", "{:.0f}")]


def read_runs(paths: list) -> list:
    """The rows of each invocation's JSON file."""
    runs = []
    for path in paths:
        with open(path) as f:
            runs.append(json.load(f)["rows"])
    return runs


def row_key(row: dict) -> tuple:
    """What makes a row the same case in every invocation: its MTU, CPUs and share."""
    return row["mtu"], row["cpus"], row.get("share", "-")


def median_cells(runs: list, row: dict, columns: list) -> list:
    """The cells of ``row``'s case (``row_key``: its row in each invocation, wherever
    it lies there) for ``columns`` (key, title, format): each the median of the
    invocations' figures (the mean of the middle two for an even count) in bold,
    theirs beside it; "-" where one lacks it."""
    same = [next((r for r in run if row_key(r) == row_key(row)), {}) for run in runs]
    cells = []
    for key, _, fmt in columns:
        values = [r.get(key) for r in same]
        if any(v is None for v in values):
            cells.append("-")
            continue
        mid = statistics.median(values)
        cells.append(f"**{fmt.format(mid)}** ({', '.join(fmt.format(v) for v in values)})")
    return cells


def median_table(paths: list) -> str:
    """A Markdown table of the rows of several invocations' JSON files: each
    figure the median of theirs, the invocations' figures beside it."""
    runs = read_runs(paths)
    header = ["MTU", "datagram B", "CPUs", "slots"] + [c[1] for c in MEDIAN_COLUMNS]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in runs[0]:
        cells = [str(row["mtu"]), str(row["packet_bytes"]),
                 f"{row['cpus']}" + (f" ({row['share']})" if row["cpus"] > 1 else ""),
                 str(row["slots"])]
        if "refused" in row:
            lines.append("| " + " | ".join(cells + ["refused"] + [""] * (len(header) - 5)) + " |")
            continue
        lines.append("| " + " | ".join(cells + median_cells(runs, row, MEDIAN_COLUMNS)) + " |")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser, cpus_help: str | None = None) -> None:
    """The arguments the XDP benches share (this one and xdp_driver.py)."""
    parser.add_argument("--mtu", type=at_least(68), nargs="+", default=[1500, 9000])
    parser.add_argument("--cpus", type=at_least(1), nargs="+", default=[1, 2], help=cpus_help)
    parser.add_argument("--workers", type=at_least(1), default=4, help="ranks of the job")
    parser.add_argument("--slots", type=at_least(1), default=64, help="the job's window")
    parser.add_argument("--block", type=at_least(1), default=256, help="values per block")
    parser.add_argument("--seconds", type=within(0, above_low=True), default=3.0,
                        help="measured, per row")
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--median", nargs="+", metavar="JSON",
                        help="print the medians of these invocations' files; nothing run")


def check_frames(parser: argparse.ArgumentParser, args) -> None:
    """A parser error for an MTU whose frame holds no block of ``--block`` values
    (it was a traceback in the first row that met it)."""
    for mtu in args.mtu:
        try:
            packet_elements_for(mtu, args.block)
        except ValueError as e:
            parser.error(str(e))


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser, "1 or 2: one process, or two running at once")
    parser.add_argument("--share", nargs="+", choices=["disjoint", "same"],
                        default=["disjoint", "same"], help="two CPUs: whose slots")
    args = parser.parse_args(argv)
    check_frames(parser, args)
    if not set(args.cpus) <= {1, 2}:
        parser.error("--cpus: 1 or 2 (bench/xdp_driver.py takes more)")
    if args.median:
        print(median_table(args.median))
        return []
    reason = xdp.unavailable()
    if reason:
        raise SystemExit(f"the XDP program cannot run here: {reason}")
    rows = []
    for mtu in args.mtu:
        for cpus in args.cpus:
            for share in (args.share if cpus > 1 else ["-"]):
                rows.append(measure(mtu, cpus, share, args.workers, args.slots, args.block,
                                    args.seconds))
    one = {r["mtu"]: r for r in rows if r["cpus"] == 1 and "refused" not in r}
    for r in rows:
        base = one.get(r["mtu"])
        if r["cpus"] > 1 and base and "refused" not in r:
            r["wall_vs_1_cpu"] = r["gbit_per_wall_s"] / base["gbit_per_wall_s"]
            r["program_vs_1_cpu"] = r["cpus"] * r["gbit_per_program_core_s"] / \
                base["gbit_per_program_core_s"]
    print(f"{'MTU':>5} {'bytes':>6} {'cpus':>4} {'share':>8} {'ns/frame':>9} "
          f"{'Gbit/prog-core-s':>16} {'Gbit/harness-core-s':>19} {'Gbit/s wall':>11} "
          f"{'x 1 cpu (wall, prog)':>20} {'stale ns (alone, rep.)':>22}")
    for r in rows:
        if "refused" in r:
            print(f"{r['mtu']:>5} {r['packet_bytes']:>6} {r['cpus']:>4} {r['share']:>8}  "
                  f"refused: {r['refused']}")
            continue
        ratio = f"{r['wall_vs_1_cpu']:.2f}x {r['program_vs_1_cpu']:.2f}x" \
            if "wall_vs_1_cpu" in r else "-"
        stale = f"{r['stale_ns_alone']} {r['stale_ns_repeated']}" if "stale_ns_alone" in r else "-"
        print(f"{r['mtu']:>5} {r['packet_bytes']:>6} {r['cpus']:>4} {r['share']:>8} "
              f"{r['program_ns_per_frame']:>9.0f} {r['gbit_per_program_core_s']:>16.2f} "
              f"{r['gbit_per_harness_core_s']:>19.2f} {r['gbit_per_wall_s']:>11.2f} "
              f"{ratio:>20} {stale:>22}")
    if args.json:
        write_rows(args.json, args, rows)
    return rows


if __name__ == "__main__":
    from switchml.testbed.core import signals_end_the_run
    with signals_end_the_run():  # TERM or HUP: the runners go, as on Ctrl-C
        try:
            main()
        except WrongSums as e:
            sys.exit(f"xdp_core: wrong sums: {e}")
