"""How many contributions one switch core aggregates per second, Python data plane
against the C one, at the packet sizes of MTU 1500 and MTU 9000 frames.

    python bench/switch_core.py                          # both MTUs, both data planes
    python bench/switch_core.py --mtu 9000 --workers 4 --seconds 5 --json out.json
    python bench/switch_core.py --paths c --threads 1 2     # the C data plane's threads

A switch runs in this process (its serving thread); ``--senders`` processes play
the ``--workers`` ranks of one job: each rank has its own UDP socket, and its
contributions, built once, go out with ``sendmmsg`` (libc through ctypes), every
slot's message m from every rank before message m+1, so each one is aggregated,
as fast as the senders can. Results go back to the ranks' sockets, which are
read only at the end (the kernel drops them once their small buffers are full):
the switch pays for sending them, as it would for real workers, and the few each
socket holds are checked against the exact sums (a wrong one fails the bench).

Per switch core means per second of the switch's CPU time (``cpu_s`` in the
switch's stats: its serving thread's and its data threads', user and system,
recvmmsg and sendmmsg included), so the figures do not depend on how many other
processes share the machine; the wall clock rates are given too.  With
``--threads``, the C data plane runs that many data threads (the switch's
``threads``), and each row gives its rates against the same path's row of one
thread (of the first count given where 1 is not among them): ``wall_ratio``
(contributions a wall-clock second: what several cores buy, where the machine
has cores to spare for them and the senders) and ``core_ratio`` (a CPU second:
what threading costs each core).

Only contributions added to a sum count: not those the kernel dropped before
the switch read them (its buffer full), nor those the switch admitted and then
dropped as stale, mismatched or duplicate (with several senders, ranks'
messages interleave and some arrive after their slot moved on).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import multiprocessing
import multiprocessing.connection
import os
import platform
import socket
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from switchml import wire  # noqa: E402
from switchml.bench.common import at_least, within  # noqa: E402
from switchml.bench.launch import end_processes  # noqa: E402
from switchml.switch.server import Switch  # noqa: E402

#: IPv4 and UDP headers: what a frame holds beside the datagram.
IP_UDP_HEADERS = 28
SESSION = 0x5EED


def write_rows(path: str, args, rows: list) -> None:
    """A core bench's JSON: the machine, the arguments, the rows."""
    with open(path, "w") as f:
        json.dump({"machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                               "python": platform.python_version()},
                   "args": vars(args), "rows": rows}, f, indent=1)


def packet_elements_for(mtu: int, block: int) -> int:
    """The most values, in whole blocks, whose datagram fits one frame of ``mtu``."""
    room = mtu - IP_UDP_HEADERS - wire.HEADER_SIZE
    blocks = room // (wire.LANE_SIZE + wire.VALUE_SIZE * block)
    if blocks < 1:
        raise ValueError(f"a block of {block} values does not fit a frame of MTU {mtu}")
    return blocks * block


# ---------------------------------------------------------------- senders
class _Iovec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


class _Msghdr(ctypes.Structure):
    _fields_ = [("msg_name", ctypes.c_void_p), ("msg_namelen", ctypes.c_uint32),
                ("msg_iov", ctypes.POINTER(_Iovec)), ("msg_iovlen", ctypes.c_size_t),
                ("msg_control", ctypes.c_void_p), ("msg_controllen", ctypes.c_size_t),
                ("msg_flags", ctypes.c_int)]


class _Mmsghdr(ctypes.Structure):
    _fields_ = [("msg_hdr", _Msghdr), ("msg_len", ctypes.c_uint)]


def _sender(ranks, world, switch_addr, slots, packet_elements, block, conn):
    """One sender process: the sockets of ``ranks``; sends until told the deadline."""
    libc = ctypes.CDLL(None, use_errno=True)
    socks = []
    for _ in ranks:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # results: not read
        s.bind(("127.0.0.1", 0))
        s.connect(switch_addr)
        socks.append(s)
    conn.send([s.getsockname() for s in socks])
    lanes = packet_elements // block
    size = wire.packet_size(lanes, packet_elements)
    rounds = 2  # messages built ahead per slot; then their numbers move on
    packets = np.zeros((rounds, len(ranks), slots, size), np.uint8)
    for r in range(rounds):
        for i, rank in enumerate(ranks):
            for slot in range(slots):
                values = _values(r, rank, slot, packet_elements)
                packets[r, i, slot] = np.frombuffer(wire.encode(
                    wire.KIND_CONTRIBUTION, wire.DTYPE_INT32, slot, SESSION, r, 0, slot,
                    np.zeros(lanes, wire.LANE), values), np.uint8)
    msgs = packets[..., 12:16].view(np.uint32)
    base = packets.ctypes.data
    batches = []  # per round and rank: one sendmmsg of every slot's packet
    for r in range(rounds):
        for i in range(len(ranks)):
            iov = (_Iovec * slots)()
            vec = (_Mmsghdr * slots)()
            for slot in range(slots):
                iov[slot].iov_base = base + packets[r, i, slot].ctypes.data - base
                iov[slot].iov_len = size
                vec[slot].msg_hdr.msg_iov = ctypes.pointer(iov[slot])
                vec[slot].msg_hdr.msg_iovlen = 1
            batches.append((socks[i].fileno(), vec, iov))
    deadline = conn.recv()
    sent = 0
    while time.monotonic() < deadline:
        for fd, vec, _ in batches:
            done = 0
            while done < slots:
                n = libc.sendmmsg(fd, ctypes.byref(vec, done * ctypes.sizeof(_Mmsghdr)),
                                  slots - done, 0)
                if n < 0:
                    break
                done += n
            sent += done
        msgs += rounds  # the next messages of every slot
    conn.send((sent,) + _check_results(socks, world, slots, packet_elements))
    for s in socks:
        s.close()


def _values(r: int, rank: int, slot: int, packet_elements: int) -> np.ndarray:
    """Rank ``rank``'s values for ``slot`` in the messages of round ``r`` (any
    sender can rebuild every rank's, to check a result)."""
    return np.random.default_rng([r, rank, slot]).integers(
        -1000, 1000, packet_elements).astype(np.int32)


def results_left(socks) -> tuple[list, list]:
    """The datagrams left in the ranks' sockets once the last results are on their
    way (a few: the buffers are small and unread): [(datagram, header)] of those
    that decode, and what was wrong with the others."""
    time.sleep(0.05)  # the last results on their way
    results, wrong = [], []
    for s in socks:
        s.setblocking(False)
        while True:
            try:
                data = s.recv(65536)
            except BlockingIOError:
                break
            try:
                results.append((data, wire.decode_header(data)))
            except wire.MalformedPacket as exc:
                wrong.append(f"a malformed datagram ({exc})")
    return results, wrong


def _check_results(socks, world: int, slots: int, packet_elements: int) -> tuple:
    """(results read, what was wrong with them): the results left in the ranks'
    sockets against the exact sums (message m of a slot holds round m % 2's
    values)."""
    exact = {}
    results, wrong = results_left(socks)
    read = len(results) + len(wrong)
    for data, h in results:
        key = (h.msg % 2, h.slot)
        if h.kind != wire.KIND_RESULT or h.slot >= slots:
            wrong.append(f"kind {h.kind} slot {h.slot}")
            continue
        if key not in exact:
            exact[key] = np.sum([_values(key[0], rank, key[1], packet_elements)
                                 for rank in range(world)], axis=0).astype(np.int32)
        got = wire.values(data, h.lanes, h.count)
        if not np.array_equal(got, exact[key]):
            wrong.append(f"slot {h.slot} msg {h.msg}: not the sum")
    return read, wrong[:5]


# ---------------------------------------------------------------- one measurement
class WrongSums(RuntimeError):
    """A result the ranks' sockets held is not the sum of their contributions."""


def _recv(conn, proc, name: str, timeout: float | None = None):
    """What sender ``proc`` sends on ``conn``; RuntimeError naming it and its exit
    code once it died (a pipe whose other end the parent closed reads EOF then)."""
    ready = multiprocessing.connection.wait([conn, proc.sentinel], timeout)
    if conn in ready:
        try:
            return conn.recv()
        except EOFError:
            pass
    elif not ready:
        raise RuntimeError(f"{name} sent nothing in {timeout:g} s")
    proc.join(1)
    raise RuntimeError(f"{name} died (exit code {proc.exitcode})")


def measure(path: str, mtu: int, workers: int, senders: int, slots: int, block: int,
            seconds: float, warmup: float, threads: int = 1) -> dict:
    """One row: ``path`` is "python", "c" (with UDP GSO for the results) or "c-nogso";
    ``threads``: the C data plane's data threads."""
    fastpath = path != "python"
    packet_elements = packet_elements_for(mtu, block)
    lanes = packet_elements // block
    size = wire.packet_size(lanes, packet_elements)
    ctx = multiprocessing.get_context("spawn")
    sw = Switch(slots=slots, fastpath=fastpath, threads=threads)
    sw.udp_gso = path == "c"  # before start(): data threads take it when they start
    pipes, procs, names = [], [], []
    with sw:
        try:
            groups = [list(range(workers))[i::senders] for i in range(senders)]
            addrs = [None] * workers
            for ranks in groups:
                parent, child = ctx.Pipe()
                proc = ctx.Process(target=_sender, args=(ranks, workers, sw.address, slots,
                                                         packet_elements, block, child),
                                   daemon=True)
                proc.start()
                child.close()  # the sender's end is the sender's alone: EOF when it dies
                pipes.append(parent)
                procs.append(proc)
                names.append(f"sender {len(procs) - 1} (ranks {ranks}, pid {proc.pid})")
                for rank, addr in zip(ranks, _recv(parent, proc, names[-1], 60)):
                    addrs[rank] = tuple(addr)
            with sw._lock:
                sw.pipeline.install_job("bench", SESSION, addrs, 0, slots, packet_elements,
                                        block)
            start_at = time.monotonic() + 0.2
            for parent in pipes:
                parent.send(start_at + warmup + seconds)
            time.sleep(max(0.0, start_at + warmup - time.monotonic()))
            before, t0 = sw.stats(), time.monotonic()
            time.sleep(seconds)
            after, t1 = sw.stats(), time.monotonic()
            answers = [_recv(parent, proc, name, 30)
                       for parent, proc, name in zip(pipes, procs, names)]
            for proc in procs:
                proc.join(10)
        finally:  # (a failure, a dead sender, TERM or Ctrl-C) no sender outlives the row
            end_processes(procs, pipes)
    wall = t1 - t0
    cpu = after["cpu_s"] - before["cpu_s"]
    sent = sum(a[0] for a in answers)
    checked = sum(a[1] for a in answers)
    wrong = [w for a in answers for w in a[2]]
    # (none read is wrong only where the switch sent some: with several senders the
    # ranks' messages can drift apart so that no slot completes)
    if wrong or not checked and after["totals"].get("results_out", 0):
        raise WrongSums(f"wrong sums: {path}, MTU {mtu}: " + (
            "results that are not the sums: " + "; ".join(wrong) if wrong
            else "the ranks' sockets held no result"))

    def delta(key):
        return after["totals"].get(key, 0) - before["totals"].get(key, 0)
    # contributions added to a sum: admitted ones less those admitted only to be
    # dropped (stale, mismatched, duplicate) or answered from the shadow copy, which
    # several senders' interleaving (or the kernel's drops) can cause
    packets = delta("packets_in") - sum(delta(k) for k in (
        "dropped_stale", "dropped_mismatch", "duplicates", "retransmissions_answered"))
    return {
        "data_plane": path, "threads": threads, "mtu": mtu, "workers": workers,
        "senders": senders, "slots": slots, "packet_elements": packet_elements,
        "block_elements": block, "packet_bytes": size, "wall_s": wall, "switch_cpu_s": cpu,
        "switch_cpu_share": cpu / wall if wall else 0.0,
        "packets_in": delta("packets_in"), "contributions_added": packets,
        "results_completed": delta("results_completed"),
        "results_out": delta("results_out"), "sent_by_senders": sent,
        "results_checked": checked,
        "dropped": {k: delta(k) for k in after["totals"] if k.startswith("dropped_")
                    and delta(k)},
        "packets_per_core_s": packets / cpu if cpu else 0.0,
        "gbit_per_core_s": packets * size * 8 / cpu / 1e9 if cpu else 0.0,
        "packets_per_wall_s": packets / wall if wall else 0.0,
        "gbit_per_wall_s": packets * size * 8 / wall / 1e9 if wall else 0.0,
    }


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mtu", type=at_least(68), nargs="+", default=[1500, 9000])
    parser.add_argument("--paths", nargs="+", choices=["python", "c", "c-nogso"],
                        default=["python", "c", "c-nogso"])
    parser.add_argument("--threads", type=at_least(1), nargs="+", default=[1],
                        help="data threads of the C data plane (rows for each)")
    parser.add_argument("--workers", type=at_least(1), default=4, help="ranks of the job")
    parser.add_argument("--senders", type=at_least(1), default=1, help="sender processes")
    parser.add_argument("--slots", type=at_least(1), default=64, help="the job's window")
    parser.add_argument("--block", type=at_least(1), default=256, help="values per block")
    parser.add_argument("--seconds", type=within(0, above_low=True), default=3.0,
                        help="measured, per row")
    parser.add_argument("--warmup", type=within(0), default=0.5)
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    for mtu in args.mtu:
        try:
            packet_elements_for(mtu, args.block)
        except ValueError as e:
            parser.error(str(e))
    rows = []
    for mtu in args.mtu:
        for path in args.paths:
            mine = [measure(path, mtu, args.workers, min(args.senders, args.workers),
                            args.slots, args.block, args.seconds, args.warmup, threads)
                    for threads in (args.threads if path != "python" else [1])]
            # the reference: the row of one thread, else the first count given
            one = next((r for r in mine if r["threads"] == 1), mine[0])
            for row in mine:
                row["wall_ratio"] = (row["packets_per_wall_s"] / one["packets_per_wall_s"]
                                     if one["packets_per_wall_s"] else 0.0)
                row["core_ratio"] = (row["packets_per_core_s"] / one["packets_per_core_s"]
                                     if one["packets_per_core_s"] else 0.0)
                rows.append(row)
    print(f"{'plane':>7} {'thr':>3} {'MTU':>5} {'bytes':>6} {'pkts/core-s':>12} "
          f"{'Gbit/core-s':>12} {'pkts/s':>10} {'Gbit/s':>8} {'cpu':>5} {'wall x':>6} "
          f"{'core x':>6} {'drops':>8}")
    for r in rows:
        print(f"{r['data_plane']:>7} {r['threads']:>3} {r['mtu']:>5} {r['packet_bytes']:>6} "
              f"{r['packets_per_core_s']:>12,.0f} {r['gbit_per_core_s']:>12.2f} "
              f"{r['packets_per_wall_s']:>10,.0f} {r['gbit_per_wall_s']:>8.2f} "
              f"{r['switch_cpu_share']:>5.0%} {r['wall_ratio']:>6.2f} {r['core_ratio']:>6.2f} "
              f"{sum(r['dropped'].values()):>8}")
    if args.json:
        write_rows(args.json, args, rows)
    return rows


if __name__ == "__main__":
    from switchml.testbed.core import signals_end_the_run
    with signals_end_the_run():  # TERM or HUP: the senders go, as on Ctrl-C
        try:
            main()
        except RuntimeError as e:  # a sender died: say which, no traceback
            sys.exit(f"switch_core: {e}")
