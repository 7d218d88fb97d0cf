"""Two jobs of different sizes and worker counts on one real switch while another
process sprays garbage at its port, and members send well-formed packets with wrong
sessions and slots: both jobs bit-exact, the switch alive, every garbage datagram
that reached the switch's socket counted."""

import multiprocessing as mp
import queue
import socket
import threading
import time

import numpy as np
from conftest import reference_sum, run_ranks

import switchml
from switchml import wire

K = 1024
JOBS = {"small": (2, [(np.float32, 50_000), (np.int32, 20_000)], 3),
        "big": (3, [(np.float32, 300_000), (np.int32, 100_001)], 2)}


def _spray(address, sessions: mp.Queue, stop, report: mp.Queue):
    """Random bytes, well-formed contributions with random sessions and slots, and,
    once the jobs run, their real sessions and slots (from this stranger's address),
    in bursts until told to stop; report how many datagrams were sent."""
    rng = np.random.default_rng(11)
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    lanes = np.zeros(K // 256, wire.LANE)
    real = []  # (session, slot_base, slot_count) of the running jobs
    sent = 0
    report.put("started")
    while not stop.is_set():
        try:
            real = sessions.get_nowait()
        except queue.Empty:
            pass
        for _ in range(100):
            kind = sent % 4
            if kind == 0:
                datagram = rng.bytes(int(rng.integers(0, 1500)))
            elif kind == 1 or not real:
                datagram = wire.encode(wire.KIND_CONTRIBUTION, int(rng.integers(0, 2)),
                                       int(rng.integers(0, 70)), int(rng.integers(1, 2**32)),
                                       0, 0, 0, lanes, rng.integers(-9, 9, K, dtype=np.int32))
            elif kind == 2:
                session, base, count = real[int(rng.integers(len(real)))]
                datagram = wire.encode(wire.KIND_CONTRIBUTION, wire.DTYPE_INT32,
                                       base + int(rng.integers(count)), session,
                                       int(rng.integers(0, 8)), 0, 0, lanes,
                                       np.full(K, 1000, np.int32))
            else:
                datagram = wire.encode(wire.KIND_RESULT, wire.DTYPE_FLOAT32, 0, 1, 0, 0, 0,
                                       lanes, np.full(K, 7, np.int32))[: int(rng.integers(0, 80))]
            sock.sendto(datagram, address)
            sent += 1
        time.sleep(0.01)
    report.put(sent)


def kernel_drops(port: int) -> int:
    """Datagrams the kernel dropped at the switch's UDP socket (its buffer was full)."""
    with open("/proc/net/udp") as f:
        for line in f.readlines()[1:]:
            fields = line.split()
            if int(fields[1].split(":")[1], 16) == port:
                return int(fields[-1])
    return 0


def inputs(job, rank, iteration):
    world, cases, _ = JOBS[job]
    rng = np.random.default_rng([list(JOBS).index(job), rank, iteration])
    out = []
    for dtype, size in cases:
        if dtype == np.int32:
            out.append(rng.integers(-(2**30), 2**30, size, dtype=np.int32))
        else:
            out.append((rng.standard_normal(size) * 10.0 ** rng.integers(-3, 4)).astype(dtype))
    return out


def test_two_jobs_stay_exact_while_garbage_is_sprayed_at_the_switch():
    ctx = mp.get_context("spawn")
    sessions, report, stop = ctx.Queue(), ctx.Queue(), ctx.Event()
    with switchml.Switch(packet_elements=K, slots=64, slots_per_job=16) as sw:
        sprayer = ctx.Process(target=_spray, args=(sw.address, sessions, stop, report),
                              daemon=True)
        sprayer.start()
        assert report.get(timeout=30) == "started"
        members = {}  # job -> list of Workers, as they join
        ready = {name: [] for name in JOBS}
        # the workers stay joined (their sockets open) until the forged datagrams
        # below went out through one of them: a small job may be done by then
        forged_sent = threading.Event()

        def run(job):
            world, cases, iterations = JOBS[job]

            def body(rank):
                with switchml.Worker(sw.address, rank, world, job=job, timeout=20) as w:
                    members.setdefault(job, []).append(w)
                    ready[job].append(w.membership)
                    sums = [[w.allreduce(x) for x in inputs(job, rank, it)]
                            for it in range(iterations)]
                    forged_sent.wait(60)
                    return sums
            return run_ranks(world, body)

        outcome = {}
        threads = [threading.Thread(target=lambda j=j: outcome.setdefault(j, run(j)))
                   for j in JOBS]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while sum(len(v) for v in ready.values()) < 5:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        real = [(s.session, s.slot_base, s.slot_count) for s in
                (ready["small"][0], ready["big"][0])]
        sessions.put(real)
        unknown_at_start = sw.stats()["totals"].get("dropped_unknown_source", 0)
        # members of one job posing as the other, or off their own slots
        (s_small, b_small, _), (s_big, b_big, _) = real
        lanes = np.zeros(K // 256, wire.LANE)
        forged = {"small": (wire.encode(wire.KIND_CONTRIBUTION, wire.DTYPE_INT32, b_big, s_big,
                                        0, 0, 0, lanes, np.ones(K, np.int32)),
                            "dropped_bad_token"),
                  "big": (wire.encode(wire.KIND_CONTRIBUTION, wire.DTYPE_INT32, b_small,
                                      members["big"][0].membership.token,
                                      0, 0, 0, lanes, np.ones(K, np.int32)),
                          "dropped_slot_out_of_range")}
        for job, (datagram, _) in forged.items():
            for _ in range(40):
                members[job][0]._udp.sendto(datagram, sw.address)

        def counted(job, reason):
            return sw.stats()["jobs"].get(job, {}).get("counters", {}).get(reason, 0)
        # the jobs leave once the switch has read them (read after a member left,
        # a forged datagram is a stranger's: unknown_source)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(
                counted(job, reason) < 40 for job, (_, reason) in forged.items()):
            time.sleep(0.01)
        forged_sent.set()
        for t in threads:
            t.join(120)
            assert not t.is_alive(), "a job hung"
        unknown_at_end = sw.stats()["totals"].get("dropped_unknown_source", 0)
        stop.set()
        sprayed = report.get(timeout=30)
        sprayer.join(10)
        time.sleep(0.3)  # let the switch drain what is still queued
        assert sw._thread.is_alive()
        lost = kernel_drops(sw.address[1])

        for job, results in outcome.items():
            world, cases, iterations = JOBS[job]
            for it in range(iterations):
                for c, (dtype, _) in enumerate(cases):
                    got = [results[rank][it][c] for rank in range(world)]
                    for g in got[1:]:
                        assert g.tobytes() == got[0].tobytes(), "ranks disagree"
                    want = reference_sum([inputs(job, r, it)[c] for r in range(world)], K)
                    assert got[0].tobytes() == want.tobytes(), (job, it, dtype)

        stats = sw.stats()
        unknown = stats["totals"].get("dropped_unknown_source", 0)
        assert sprayed - lost <= unknown <= sprayed
        for job, (_, reason) in forged.items():
            counted = stats["ended_jobs"][job]["counters"].get(reason, 0)
            assert 40 - lost <= counted <= 40
        assert stats["free_slots"] == 64
        assert unknown_at_end > unknown_at_start  # garbage arrived while the jobs ran
