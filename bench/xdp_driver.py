"""What the switch's XDP program costs a core per contribution in a driver's
receive loop, where frames come one after another as from a NIC.

    sudo python bench/xdp_driver.py                      # MTU 1500 and 9000
    sudo python bench/xdp_driver.py --mtu 1500 --seconds 3 --json out.json
    python bench/xdp_driver.py --median run1.json run2.json run3.json   # Markdown

Two network namespaces joined by a veth pair.  The program
(switch/xdp/pipeline.bpf.c, loaded by ``XdpPipeline``) is attached to the
switch's end in driver (native) mode, so it runs in veth's NAPI poll over
batches of up to 64 frames, as a NIC's driver runs it, and not one system call
a frame as in ``bench/xdp_core.py`` (whose ``BPF_PROG_TEST_RUN`` starts each
run cold).  A sender in the other namespace sends one job's contributions
(``--workers`` ranks, ``--slots`` slots; xdp_core.py's packets: whole blocks of
``--block`` values, as many as one frame of the MTU holds) as UDP GSO runs,
which the sending veth cuts into frames (its UDP segmentation offload off).
Every slot's message from every rank in turn: each contribution is added, and
the last of a slot completes it.  The program is served as a switch serves it
(``XdpPipeline.serve(..., driver=True)``): it learns the ranks' Ethernet
addresses, and the fan-out program sends each result to every rank (whose
sockets do not read them).

The program's own time is the kernel's count of it (``run_time_ns`` and
``run_cnt`` of the program's info, which the kernel keeps while run-time
statistics are on: ``xdp_loader.count_run_time`` turns them on for the
measurement alone).  Gbit/s a
program core is the contributions' datagram bytes added per second of it; the
rate at which the sender, on this machine's cores, offers frames is given
beside it (``offered``; ``dropped_at_the_veth``: frames the veth's ring could
not hold, which the program never saw; ``dropped_at_the_sender``: datagrams the
sender's stack refused), and bounds the wall-clock rate here,
not the program's.

Needs root (CAP_BPF, CAP_NET_ADMIN, namespaces), clang and libbpf, as
``switchml switch --data-plane xdp``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from collections import Counter

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from bench.switch_core import packet_elements_for, results_left, write_rows  # noqa: E402
from bench.xdp_core import add_arguments, check_frames, median_cells, read_runs  # noqa: E402
from switchml import wire  # noqa: E402
from switchml.bench.launch import ask_to_stop  # noqa: E402
from switchml.switch.xdp import loader as xdp_loader  # noqa: E402
from switchml.switch.xdp import pipeline as xdp  # noqa: E402

SESSION = 0x5EED
PREFIX = "smlxdpd"
SWITCH_IP, SENDER_IP = "10.98.0.254", "10.98.0.1"
SENDER_PORT = 5000
UDP_SEGMENT = 103  # linux/udp.h


def contributions(rank: int, slots: int, packet_elements: int, block: int, slot_base: int,
                  token: int) -> bytearray:
    """Rank ``rank``'s contributions to ``slots`` slots from ``slot_base``, message
    0, back to back; ``token``: the rank's (the bench gives each job's ranks its
    session)."""
    lanes = packet_elements // block
    rng = np.random.default_rng(rank)
    return bytearray(b"".join(
        wire.encode(wire.KIND_CONTRIBUTION, wire.DTYPE_INT32, slot, token, 0, 0, slot,
                    np.zeros(lanes, wire.LANE),
                    rng.integers(-1000, 1000, packet_elements).astype(np.int32))
        for slot in range(slot_base, slot_base + slots)))


def sender_ip(index: int) -> str:
    """The address of sender ``index`` (the ranks of job ``index``)."""
    return f"10.98.0.{1 + index}"


def send(index: int, port: int, workers: int, slots: int, packet_elements: int, block: int,
         seconds: float) -> None:
    """Sender ``index``, in its namespace, on the CPU it was started on: passes over
    the slots of job ``index``, every rank's message to each, the message number
    one more each pass; prints the datagrams sent, the seconds it sent them in (its
    own: not its interpreter's start), and the results its ranks' sockets hold
    then, checked against the exact sums (every message of a slot has the same
    values, so every result of a slot the same sum)."""
    size = wire.packet_size(packet_elements // block, packet_elements)
    per_send = max(1, min(64, 65000 // size))  # a GSO run's datagrams
    socks, bodies = [], []
    for rank in range(workers):
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8 << 20)
        s.bind((sender_ip(index), SENDER_PORT + rank))
        s.connect((SWITCH_IP, port))
        socks.append(s)
        bodies.append(contributions(rank, slots, packet_elements, block, index * slots,
                                    SESSION + index))
    msg_fields = [np.frombuffer(b, np.uint8).reshape(slots, size)[:, 12:16] for b in bodies]
    segment = [(socket.SOL_UDP, UDP_SEGMENT, size.to_bytes(2, sys.byteorder))]
    sent = msg = refused = 0
    start = time.monotonic()
    end = start + seconds
    while time.monotonic() < end:
        for s, body, field in zip(socks, bodies, msg_fields):
            field[:] = np.frombuffer(np.uint32(msg).tobytes(), np.uint8)  # header.msg
            for first in range(0, slots, per_send):
                n = min(per_send, slots - first)
                run = bytes(body[first * size:(first + n) * size])
                while True:
                    try:
                        s.sendmsg([run], segment)
                        break
                    except OSError:  # the socket's buffer or the veth's queue: wait
                        refused += 1  # (a run refused part-way: its first datagrams twice)
                        time.sleep(0.0001)
                sent += n
        msg += 1
    sending_s = time.monotonic() - start
    lanes = packet_elements // block
    exact = np.sum([[wire.values(bytes(b[i * size:(i + 1) * size]), lanes, packet_elements)
                     for i in range(slots)] for b in bodies], axis=0, dtype=np.int64)
    exact = exact.astype(np.int32)
    results, wrong = results_left(socks)
    checked = len(results) + len(wrong)
    for data, h in results:
        j = h.slot - index * slots
        if h.kind != wire.KIND_RESULT or not 0 <= j < slots or not np.array_equal(
                wire.values(data, h.lanes, h.count), exact[j]):
            wrong.append(f"slot {h.slot} msg {h.msg} (kind {h.kind})")
    print(json.dumps({"sent": sent, "passes": msg, "refused": refused, "seconds": sending_s,
                      "results_checked": checked, "results_wrong": wrong[:5],
                      "results_wrong_count": len(wrong)}), flush=True)


class WrongSums(RuntimeError):
    """The results the ranks read are not the sums of their contributions."""


def inside(mtu: int, dev: str, cpus: list, workers: int, slots: int, block: int,
           seconds: float) -> dict:
    """In the switch's namespace: load and attach the program, run a sender on each
    of ``cpus`` (each its own job, on slots of its own), count."""
    packet_elements = packet_elements_for(mtu, block)
    size = wire.packet_size(packet_elements // block, packet_elements)
    row = {"mtu": mtu, "cpus": len(cpus), "workers": workers, "slots": slots,
           "packet_elements": packet_elements, "block_elements": block, "packet_bytes": size}
    p = xdp.XdpPipeline(slots * len(cpus), packet_elements, block_elements=block,
                        switch_ip=SWITCH_IP)
    sink = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)  # results passed up (none, or few)
    try:
        sink.bind((SWITCH_IP, p.port))
        sessions = [SESSION + i for i in range(len(cpus))]
        for i, session in enumerate(sessions):
            addresses = [(sender_ip(i), SENDER_PORT + r) for r in range(workers)]
            p.install_job(f"bench{i}", session, addresses, i * slots, slots, packet_elements,
                          block)
        # served as a switch serves, in driver mode: the ranks' Ethernet addresses
        # learnt, each result sent to every rank by the fan-out program
        if p.serve((SWITCH_IP, p.port), driver=True) != socket.if_nametoindex(dev):
            raise RuntimeError(f"{SWITCH_IP} is not on {dev}")
        prog_fd = p._prog.prog_fd
        stats_fd = xdp_loader.count_run_time()
        try:
            p.sync_counters()
            before = Counter()
            for session in sessions:
                before.update(p.jobs[session].counters)
            ns0, runs0 = xdp_loader.run_time(prog_fd)
            t0 = time.monotonic()
            senders = []
            for i, cpu in enumerate(cpus):
                senders.append(subprocess.Popen(
                    ["ip", "netns", "exec", f"{PREFIX}-w", "taskset", "-c", str(cpu),
                     sys.executable, __file__, "--send", str(i), str(p.port), str(workers),
                     str(slots), str(packet_elements), str(block), str(seconds)],
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
            answers = [sender.communicate(timeout=seconds + 60) for sender in senders]
            wall = time.monotonic() - t0
            ns1, runs1 = xdp_loader.run_time(prog_fd)
        finally:  # (a failure, TERM or Ctrl-C) no sender goes on
            for sender in senders if "senders" in locals() else []:
                if sender.poll() is None:
                    sender.terminate()
                    sender.wait()
            os.close(stats_fd)
        for sender, (_, err) in zip(senders, answers):
            if sender.returncode:
                raise RuntimeError(f"a sender failed: {err[-2000:]}")
        # the contributions each CPU admitted: where the program ran
        per_cpu = [sum(n) for n in zip(*(p.counted_by_cpu(p.jobs[session], "packets_in")
                                         for session in sessions))]
        p.sync_counters()
        c: Counter = Counter()
        for session in sessions:
            c.update(p.jobs[session].counters)
        c.subtract(before)
    finally:
        sink.close()
        p.close()
    added = c["packets_in"] - sum(c[k] for k in (
        "dropped_stale", "dropped_mismatch", "duplicates", "retransmissions_answered"))
    ns, runs = ns1 - ns0, runs1 - runs0
    bits = added * size * 8
    sent = [json.loads(out) for out, _ in answers]
    wrong = [w for a in sent for w in a["results_wrong"]]
    if wrong or not sum(a["results_checked"] for a in sent):
        raise WrongSums(f"MTU {mtu}, {len(cpus)} CPU(s): "
                        + (f"{sum(a['results_wrong_count'] for a in sent)} of the results the "
                           f"ranks read are not the sums ({', '.join(wrong)})" if wrong
                           else "the ranks read no result"))
    return dict(row, runs=runs, contributions_added=added,
                admitted_per_cpu=per_cpu, results_completed=c["results_completed"],
                dropped={k: v for k, v in c.items() if k.startswith("dropped_") and v},
                program_s=ns / 1e9, wall_s=wall,
                program_ns_per_frame=ns / runs if runs else 0.0,
                gbit_per_program_core_s=bits / ns if ns else 0.0,
                # each sender's datagrams over its own sending time (the wall time
                # included the senders' interpreters starting)
                offered_gbit_s=sum(a["sent"] / a["seconds"] for a in sent) * size * 8 / 1e9,
                results_checked=sum(a["results_checked"] for a in sent),
                sends_refused=sum(a["refused"] for a in sent))


def measure(mtu: int, cpus: int, workers: int, slots: int, block: int,
            seconds: float) -> dict:
    """One row: two namespaces and a veth pair with a queue for each of ``cpus``
    CPUs, each CPU's sender on its own (XPS), the measurement inside, then none."""
    from switchml.testbed import netns

    mine = sorted(os.sched_getaffinity(0))[:cpus]
    if len(mine) < cpus:
        raise SystemExit(f"--cpus {cpus}: this process may use {len(mine)} CPU(s)")
    sw, snd = f"{PREFIX}-s", f"{PREFIX}-w"
    for ns in (sw, snd):
        netns.delete_namespace(ns)  # a crashed run's
    try:
        for ns in (sw, snd):
            netns.sh(["ip", "netns", "add", ns])
            netns.sh(["ip", "-n", ns, "link", "set", "lo", "up"])
        queues = ["numtxqueues", str(cpus), "numrxqueues", str(cpus)]
        netns.sh(["ip", "-n", sw, "link", "add", "xs", *queues, "type", "veth", "peer",
                  "name", "xw", *queues, "netns", snd])
        for ns, dev, ips in ((sw, "xs", [SWITCH_IP]),
                             (snd, "xw", [sender_ip(i) for i in range(cpus)])):
            netns.sh(["ip", "-n", ns, "link", "set", dev, "mtu", str(mtu)])
            for ip in ips:
                netns.sh(["ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", dev])
            netns.sh(["ip", "-n", ns, "link", "set", dev, "up"])
        netns.set_offloads(snd, ["xw"], {"tx-udp-segmentation": False})
        # each CPU sends on a transmit queue of its own, which veth hands to the
        # same receive queue at the switch's end: one NAPI, so one program run at a
        # time, per CPU
        for queue, cpu in enumerate(mine if cpus > 1 else []):
            netns.sh(["ip", "netns", "exec", snd, "sh", "-c",
                      f"echo {1 << cpu:x} > /sys/class/net/xw/queues/tx-{queue}/xps_cpus"])
        proc = subprocess.Popen(
            ["ip", "netns", "exec", sw, sys.executable, __file__, "--inside", str(mtu), "xs",
             ",".join(map(str, mine)), str(workers), str(slots), str(block), str(seconds)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            out, err = proc.communicate(timeout=seconds + 120)
        finally:  # (TERM, Ctrl-C, a timeout) it detaches its programs and ends its senders
            if proc.poll() is None:
                ask_to_stop(proc, 15)
        if proc.returncode:
            last = err.strip().splitlines()[-1:] or [f"exit code {proc.returncode}"]
            if last[0].startswith("xdp_driver: wrong sums"):
                raise WrongSums(last[0].split(": ", 2)[-1])
            raise RuntimeError(f"the measurement in {sw} failed: {err[-2000:]}")
        row = json.loads(out.strip().splitlines()[-1])
        # frames the veth dropped before the program saw them (its ring full), and
        # datagrams the senders' own stack dropped (a send the kernel answered with
        # ENOBUFS, which a socket without IP_RECVERR counts and does not report)
        row["dropped_at_the_veth"] = (netns.link_counters(snd, "xw")["tx_dropped"]
                                      + netns.link_counters(sw, "xs")["rx_dropped"])
        row["dropped_at_the_sender"] = netns.udp_counters(snd)["SndbufErrors"]
        return row
    finally:
        for ns in (sw, snd):
            netns.delete_namespace(ns)


def median_table(paths: list) -> str:
    """A Markdown table of several invocations' rows: each figure the median of
    theirs, the invocations' figures beside it."""
    runs = read_runs(paths)
    columns = [("program_ns_per_frame", "ns a frame", "{:.0f}"),
               ("gbit_per_program_core_s", "Gbit/s a program core", "{:.1f}"),
               ("program_vs_1_cpu", "program x 1 CPU", "{:.2f}x"),
               ("offered_gbit_s", "Gbit/s offered", "{:.2f}")]
    header = ["MTU", "datagram B", "CPUs"] + [c[1] for c in columns]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in runs[0]:
        cells = [str(row["mtu"]), str(row["packet_bytes"]), str(row["cpus"])]
        lines.append("| " + " | ".join(cells + median_cells(runs, row, columns)) + " |")
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--send"]:
        index, port, workers, slots, packet_elements, block = map(int, argv[1:7])
        send(index, port, workers, slots, packet_elements, block, float(argv[7]))
        return []
    if argv[:1] == ["--inside"]:
        mtu, dev, cpus = int(argv[1]), argv[2], [int(c) for c in argv[3].split(",")]
        workers, slots, block = map(int, argv[4:7])
        try:
            print(json.dumps(inside(mtu, dev, cpus, workers, slots, block, float(argv[7]))))
        except WrongSums as e:
            sys.exit(f"xdp_driver: wrong sums: {e}")
        return []
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser, "CPUs running the program at once, each on slots of its own "
                          "(each count a row)")
    args = parser.parse_args(argv)
    check_frames(parser, args)
    if args.median:
        print(median_table(args.median))
        return []
    reason = xdp.unavailable()
    if reason:
        raise SystemExit(f"the XDP program cannot run here: {reason}")
    rows = [measure(mtu, cpus, args.workers, args.slots, args.block, args.seconds)
            for mtu in args.mtu for cpus in args.cpus]
    one = {r["mtu"]: r for r in rows if r["cpus"] == 1}
    for r in rows:
        if r["cpus"] > 1 and r["mtu"] in one:  # its per-core rate, times its CPUs, over one's
            r["program_vs_1_cpu"] = r["cpus"] * r["gbit_per_program_core_s"] / \
                one[r["mtu"]]["gbit_per_program_core_s"]
    print(f"{'MTU':>5} {'bytes':>6} {'cpus':>4} {'ns/frame':>9} {'Gbit/prog-core-s':>16} "
          f"{'x 1 cpu':>7} {'Gbit/s offered':>14} {'added':>10}")
    for r in rows:
        ratio = f"{r['program_vs_1_cpu']:.2f}x" if "program_vs_1_cpu" in r else "-"
        print(f"{r['mtu']:>5} {r['packet_bytes']:>6} {r['cpus']:>4} "
              f"{r['program_ns_per_frame']:>9.0f} {r['gbit_per_program_core_s']:>16.2f} "
              f"{ratio:>7} {r['offered_gbit_s']:>14.2f} {r['contributions_added']:>10}")
    if args.json:
        write_rows(args.json, args, rows)
    return rows


if __name__ == "__main__":
    from switchml.testbed.core import signals_end_the_run
    with signals_end_the_run():  # TERM or HUP: namespaces, programs, senders go, as on Ctrl-C
        try:
            main()
        except WrongSums as e:
            sys.exit(f"xdp_driver: wrong sums: {e}")
