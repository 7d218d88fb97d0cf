"""The C data plane's data threads (``threads``): socket steering by slot, sums and
counters equal to one thread's, jobs changing under traffic, CPU time, failures.

A switch of N threads binds N sockets to its port in one SO_REUSEPORT group,
steered by a classic BPF program to ``slot % N``; each thread owns those slots.
"""

from __future__ import annotations

import contextlib
import logging
import os
import resource
import socket
import struct
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from conftest import run_ranks
from test_fastpath import BLOCK, JOB_A, PACKET, SLOTS, Lockstep, run_jobs

import switchml
from switchml import wire
from switchml.config import SwitchConfiguration
from switchml.sim.network import Faults
from switchml.switch import sockets
from switchml.switch.dataplane import fastpipeline
from switchml.switch.dataplane.fastpipeline import FastPipeline
from switchml.switch.sockets import bind_group, bind_pair

pytestmark = pytest.mark.skipif(fastpipeline._fastpath is None,
                                reason="switchml.switch.dataplane._fastpath is not built")

K = 64  # packet_elements of the test switches
SESSION = 0x7EAD


def _received_slots(sock: socket.socket) -> list:
    """The slot of each datagram waiting on ``sock``; None for one too short for it."""
    slots = []
    while True:
        try:
            data = sock.recv(2048)
        except BlockingIOError:
            return slots
        slots.append(struct.unpack_from("<H", data, 6)[0] if len(data) >= 8 else None)


@pytest.mark.parametrize("threads", [2, 3])
def test_the_kernel_steers_each_slot_to_its_socket(threads):
    tcp, first = bind_pair("127.0.0.1", 0, reuse_port=True)
    group = bind_group(first, threads)
    tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        for slot in list(range(200)) + [65535, 4097]:
            header = bytearray(wire.HEADER_SIZE)
            struct.pack_into("<H", header, 6, slot)
            tx.sendto(header, first.getsockname())
        tx.sendto(b"SM", first.getsockname())  # too short for a slot: socket 0
        time.sleep(0.2)
        got = [_received_slots(s) for s in group]
        assert sum(map(len, got)) == 203
        assert got[0].count(None) == 1
        for index, slots in enumerate(got):
            assert slots and all(s % threads == index for s in slots if s is not None), \
                (index, slots[:20])
    finally:
        for s in (tcp, tx, *group):
            s.close()


def test_a_core_of_three_threads_is_the_reference():
    """The differential check of test_fastpath, against a core of three threads fed
    through receive() (each datagram to the thread its slot's steering picks): the
    same datagrams, counters (summed over the threads), mismatches and slot states."""
    lock = Lockstep(0.3, 7, slots=SLOTS, packet_elements=PACKET, block_elements=BLOCK)
    lock.fast = FastPipeline(slots=SLOTS, packet_elements=PACKET, block_elements=BLOCK,
                             threads=3)
    run_jobs(lock, 3, Faults(loss=0.05, duplicate=0.05),
             [("A", "int32", 300, False, 1.0), ("B", "float32", 200, True, 0.5),
              ("A", "float32", 100, True, 0.3)], check_sums=False)
    assert lock.deliveries > 0
    assert lock.fast.stats() == lock.ref.stats()
    lock.remove_job(JOB_A["session"], "failed")
    assert lock.fast.stats() == lock.ref.stats()


def _allreduces(threads: int, drop_rate: float, world: int = 3) -> tuple[list, dict]:
    sizes = [1, K * 40 + 3, K * 300]
    with switchml.Switch(packet_elements=K, slots=64, slots_per_job=16, threads=threads,
                         drop_rate=drop_rate, seed=1) as sw:
        def body(rank):
            rng = np.random.default_rng([rank, 5])
            with switchml.Worker(sw.address, rank, world, timeout=20) as w:
                # told at join whose results overtake whose (engine/stream.py)
                assert w.membership.data_threads == threads
                return [w.allreduce((rng.standard_normal(n) * 100).astype(np.float32))
                        for n in sizes] + [w.allreduce(rng.integers(-9, 9, 999, dtype=np.int32))]

        results = run_ranks(world, body)
        return results[0], sw.stats()


@pytest.mark.parametrize("threads,drop_rate", [(2, 0.0), (3, 0.0), (2, 0.05)])
def test_workers_get_the_sums_of_one_thread_bit_for_bit(threads, drop_rate):
    one, _ = _allreduces(1, drop_rate)
    several, stats = _allreduces(threads, drop_rate)
    assert [a.tobytes() for a in several] == [a.tobytes() for a in one]
    counters = stats["ended_jobs"]["default"]["counters"]
    assert counters["results_completed"] >= sum(-(-n // K) for n in (1, K * 40 + 3, K * 300))
    if drop_rate:
        assert counters.get("dropped_egress_simulated", 0) > 0
    # the workers' UDP GSO runs reach one socket whole on loopback: the other
    # threads' datagrams in them were handed over, none lost
    assert stats["totals"].get("handed_over", 0) > 0
    assert stats["totals"].get("dropped_not_handed_over", 0) == 0


def _members(count: int) -> list[socket.socket]:
    socks = []
    for _ in range(count):
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.bind(("127.0.0.1", 0))
        s.setblocking(False)
        socks.append(s)
    return socks


def _contribution(slot: int, msg: int, rank: int, seq: int = 0) -> bytes:
    values = np.arange(K, dtype=np.int32) * (rank + 1) + slot
    return wire.encode(wire.KIND_CONTRIBUTION, wire.DTYPE_INT32, slot, SESSION, msg, seq,
                       slot, np.zeros(1, wire.LANE), values)


def _wait_for(predicate, seconds=5.0):
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def _fixed_traffic(threads: int) -> tuple[dict, dict, list]:
    """The same datagrams, one a send, to a switch of ``threads``: its job's counters,
    the pipeline-wide ones, and every result the ranks got."""
    ranks, stranger = _members(2), _members(1)[0]
    with switchml.Switch(packet_elements=K, slots=32, threads=threads) as sw:
        with sw._lock:
            job = sw.pipeline.install_job("fixed", SESSION, [s.getsockname() for s in ranks],
                                          0, 16, K, K)
        sent = 0
        for msg in range(3):
            for slot in range(16):
                for rank, s in enumerate(ranks):
                    s.sendto(_contribution(slot, msg, rank), sw.address)
                    sent += 1
                ranks[0].sendto(_contribution(slot, msg, 0), sw.address)  # answered again
                sent += 1
            time.sleep(0.05)
        ranks[1].sendto(_contribution(3, 0, 1), sw.address)  # stale
        ranks[1].sendto(_contribution(4, 3, 1, seq=9), sw.address)
        ranks[0].sendto(_contribution(4, 3, 0, seq=8), sw.address)  # mismatch
        ranks[0].sendto(b"SM\x01", sw.address)  # truncated
        stranger.sendto(_contribution(5, 0, 0), sw.address)
        sent += 5

        def counted():
            totals = sw.stats()["totals"]
            return totals.get("packets_in", 0) + sum(
                v for k, v in totals.items() if k.startswith("dropped_")) >= sent
        _wait_for(counted)
        time.sleep(0.1)
        results = sorted(d for s in ranks for d in _drain(s))
        stats = sw.stats()
        job_counters, wide = stats["jobs"][job.name]["counters"], stats["totals"]
    for s in (*ranks, stranger):
        s.close()
    return job_counters, wide, results


def _drain(sock: socket.socket) -> list[bytes]:
    out = []
    while True:
        try:
            out.append(sock.recv(65536))
        except BlockingIOError:
            return out


def test_counters_summed_over_threads_are_one_threads():
    one = _fixed_traffic(1)
    for threads in (2, 3):
        several = _fixed_traffic(threads)
        assert several[0] == one[0]
        assert several[1] == one[1]
        assert several[2] == one[2]
    assert one[0]["results_completed"] == 48 and one[0]["dropped_mismatch"] == 1


def test_jobs_come_and_go_while_traffic_flows():
    """Install and remove jobs (the tables' write lock) while two threads serve a
    job's traffic and stats() takes their counters: no crash, no count lost."""
    ranks = _members(2)
    with switchml.Switch(packet_elements=K, slots=64, threads=2) as sw:
        with sw._lock:
            job = sw.pipeline.install_job("steady", SESSION, [s.getsockname() for s in ranks],
                                          0, 16, K, K)
        stop = threading.Event()
        sent = [0]

        def traffic():
            msg = 0
            while not stop.is_set():
                for slot in range(16):
                    for rank, s in enumerate(ranks):
                        s.sendto(_contribution(slot, msg, rank), sw.address)
                        sent[0] += 1
                msg += 1
                time.sleep(0.002)  # within the socket's buffer: nothing lost in the kernel

        sender = threading.Thread(target=traffic)
        sender.start()
        try:
            others = [("127.0.0.2", 40000 + i) for i in range(4)]
            i = 0
            while i < 300 or (sent[0] < 2000 and i < 100_000):
                i += 1
                time.sleep(0.0001)  # the GIL to the sender now and then: traffic flows
                with sw._lock:
                    sw.pipeline.install_job(f"churn{i}", 10**6 + i, others, 16 + i % 40, 8, K, K)
                if i % 10 == 0:
                    sw.stats()
                with sw._lock:
                    sw.pipeline.remove_job(10**6 + i)
        finally:
            stop.set()
            sender.join()
        _wait_for(lambda: sw.stats()["jobs"][job.name]["counters"].get("packets_in", 0)
                  >= sent[0])
        counters = sw.stats()["jobs"][job.name]["counters"]
        assert sent[0] >= 2000 and counters["packets_in"] == sent[0]
        assert counters["results_completed"] == sent[0] // 2
        assert sw.stats()["totals"].get("dropped_unknown_source", 0) == 0
    for s in ranks:
        s.close()


def test_a_job_removed_while_its_members_send_leaves_no_count_behind():
    """A job removed (its rank died) while its other ranks still stream: the data
    threads count its datagrams until it is out of the core, and those counts go
    to it, never to a slot base no job holds (a KeyError in every later stats(),
    leave or disconnect, which took the serving thread down)."""
    ranks = _members(2)
    with switchml.Switch(packet_elements=K, slots=64, threads=2) as sw:
        stop = threading.Event()
        contributions = [_contribution(slot, 0, 0) for slot in range(16)]

        def traffic():
            while not stop.is_set():
                for d in contributions:
                    for s in ranks:
                        with contextlib.suppress(BlockingIOError):
                            s.sendto(d, sw.address)

        sender = threading.Thread(target=traffic)
        sender.start()
        try:
            for i in range(2000):
                with sw._lock:
                    sw.pipeline.install_job(f"j{i}", 10**6 + i,
                                            [s.getsockname() for s in ranks], 0, 16, K, K,
                                            tokens=[SESSION, SESSION])
                time.sleep(0.001)
                with sw._lock:
                    sw.pipeline.remove_job(10**6 + i)
                sw.stats()  # raised KeyError here within a thousand rounds or so
        finally:
            stop.set()
            sender.join()
        totals = sw.stats()["totals"]
        assert totals["packets_in"] > 0 and totals.get("internal_errors", 0) == 0
    for s in ranks:
        s.close()


def test_a_datagram_too_long_for_a_row_is_its_jobs_drop_on_any_thread():
    """A member's UDP GSO run reaches the socket of its first datagram's slot whole:
    a datagram of it for another thread's slot that the job refuses (more values
    than its packets hold) is counted as the job's drop, as one thread counts it,
    not as a hand-over that failed."""
    def oversized(slot):
        return wire.encode(wire.KIND_CONTRIBUTION, wire.DTYPE_INT32, slot, SESSION, 0, 0, 0,
                           np.zeros(1, wire.LANE), np.ones(K + 25, np.int32))

    seen = []
    for threads in (1, 2):
        [member] = _members(1)
        with switchml.Switch(packet_elements=K, slots=32, threads=threads) as sw:
            with sw._lock:
                sw.pipeline.install_job("j", SESSION, [member.getsockname()], 0, 16, K, K)
            first, second = oversized(0), oversized(1)
            member.sendmsg([first + second], [(socket.SOL_UDP, sockets.UDP_SEGMENT,
                                               struct.pack("H", len(first)))], 0, sw.address)
            _wait_for(lambda: sum(sw.stats()["jobs"]["j"]["counters"].values()) >= 2)
            stats = sw.stats()
            seen.append((stats["jobs"]["j"]["counters"],
                         stats["counters"].get("dropped_not_handed_over", 0)))
        member.close()
    assert seen[0] == seen[1] == ({"dropped_too_many_values": 2}, 0)


@pytest.mark.parametrize("plane", ["c", "python"])
def test_an_empty_datagram_is_counted_by_either_loop(plane):
    with switchml.Switch(data_plane=plane, packet_elements=K, slots=8, threads=1) as sw, \
            socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as stranger:
        for _ in range(5):
            stranger.sendto(b"", sw.address)
        stranger.sendto(b"x", sw.address)
        _wait_for(lambda: sw.stats()["totals"].get("dropped_unknown_source", 0) >= 6)
        assert sw.stats()["totals"]["dropped_unknown_source"] == 6


SENDER = """
import socket, struct, sys, time
port, seconds = int(sys.argv[1]), float(sys.argv[2])
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
datagrams = [bytearray(40) for _ in range(64)]
for slot, d in enumerate(datagrams):
    struct.pack_into("<H", d, 6, slot)
end = time.monotonic() + seconds
while time.monotonic() < end:
    for d in datagrams:
        s.sendto(d, ("127.0.0.1", port))
"""


def test_cpu_s_counts_every_data_thread():
    """Strangers' datagrams keep both data threads busy while this process's other
    threads sleep: the switch's cpu_s is then nearly all of the process's CPU time."""
    with switchml.Switch(packet_elements=K, slots=64, threads=2) as sw:
        before, usage = sw.stats()["cpu_s"], resource.getrusage(resource.RUSAGE_SELF)
        subprocess.run([sys.executable, "-c", SENDER, str(sw.address[1]), "1.0"], check=True)
        time.sleep(0.3)  # cpu_s is read every 0.1 s
        after, usage2 = sw.stats()["cpu_s"], resource.getrusage(resource.RUSAGE_SELF)
        process = (usage2.ru_utime + usage2.ru_stime) - (usage.ru_utime + usage.ru_stime)
        assert sw.stats()["totals"]["dropped_unknown_source"] > 1000
    assert process > 0.05
    assert after - before >= 0.7 * process, (after - before, process)


def test_a_failed_data_thread_stops_the_switch_with_an_error():
    """The switch stops and closes its control connections; its worker, which cannot
    tell a stopped switch from one that restarts, tries to rejoin for its timeout
    (2 s here; a join it starts may wait that long again) and then raises: told,
    not left waiting."""
    timeout = 2
    sw = switchml.Switch(packet_elements=K, slots=64, threads=2).start()
    tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    worker = switchml.Worker(sw.address, 0, 1, timeout=timeout)
    try:
        assert worker.allreduce(np.ones(K * 4, np.int32)).tolist() == [1] * K * 4
        os.close(sw._data_sockets[1].detach())  # its thread's socket fails under it
        header = bytearray(wire.HEADER_SIZE)
        struct.pack_into("<H", header, 6, 1)
        tx.sendto(header, sw.address)  # wakes its poll
        _wait_for(lambda: sw.failure is not None, seconds=1.0)  # woken, not polled
        assert "data thread 1 failed: Bad file descriptor" in str(sw.failure)
        _wait_for(lambda: not sw._thread.is_alive(), seconds=1.0)  # stopped serving
        started = time.monotonic()
        with pytest.raises(switchml.SwitchMLError):  # told, not left waiting
            worker.allreduce(np.ones(K * 4, np.int32))
        # its listener still accepts: a rejoin may wait a join's timeout too
        assert time.monotonic() - started < 2 * timeout + 2
    finally:
        worker.close()
        tx.close()
        sw.stop()


def test_threads_are_the_c_data_planes_setting(monkeypatch):
    for other in ({"data_plane": "python"}, {"data_plane": "xdp"}, {"fastpath": False}):
        with pytest.raises(ValueError, match="threads=2 is a setting of the C data plane"):
            SwitchConfiguration(threads=2, **other)
    with pytest.raises(ValueError, match="threads must be 1 to 64"):
        SwitchConfiguration(threads=0)
    monkeypatch.setenv("SWITCHML_SWITCH_THREADS", "3")
    assert SwitchConfiguration.from_env().threads == 3
    from switchml import cli
    args = cli.build_parser().parse_args(["switch", "--threads", "2"])
    assert cli.switch_configuration(args, environ={}).threads == 2


def test_a_switch_takes_half_the_cores_unless_told(monkeypatch):
    """Unless told, the C data plane runs half the machine's cores (1 to 8);
    other data planes and rack switches one; a number given is kept."""
    from switchml.config import auto_switch_threads
    assert [auto_switch_threads(c) for c in (1, 2, 3, 4, 7, 8, 16, 64, 128)] == [
        1, 1, 1, 2, 3, 4, 8, 8, 8]
    assert SwitchConfiguration().threads is None
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    switch = switchml.Switch()
    assert switch.threads == 8 and switch.pipeline.threads == 8
    assert switchml.Switch(threads=2).threads == 2
    assert switchml.Switch(data_plane="python").threads == 1
    with switchml.Switch() as running:  # its eight sockets, and a job through them
        assert len(running._data_sockets) == 8
        rng = np.random.default_rng(5)
        arrays = [rng.integers(-1000, 1000, 40_000, dtype=np.int32) for _ in range(2)]
        outs: list = [None, None]

        def rank(r):
            with switchml.Worker(running.address, r, 2, job="auto", timeout=20) as w:
                outs[r] = w.allreduce(arrays[r])
        threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert outs[0].tobytes() == outs[1].tobytes() == (arrays[0] + arrays[1]).tobytes()


def test_a_switch_left_to_its_default_says_why_it_is_not_on_xdp(monkeypatch, caplog):
    """A default switch runs C and its log says why not XDP: the reason XDP cannot
    run here, or that it runs but is not the faster one; a switch given its data
    plane says nothing of it."""
    from switchml.switch.xdp import loader
    caplog.set_level(logging.INFO, logger="switchml")
    monkeypatch.setattr(loader, "unavailable", lambda: "no clang to build the XDP program")
    with switchml.Switch():
        pass
    lines = [r.getMessage() for r in caplog.records if "XDP data plane not used" in r.message]
    assert lines == ["XDP data plane not used: it cannot run here (no clang to build the XDP "
                     "program); C is the default"]
    caplog.clear()
    monkeypatch.setattr(loader, "unavailable", lambda: None)
    with switchml.Switch():
        pass
    assert any("XDP data plane not used: it runs here (--data-plane xdp)" in r.message
               for r in caplog.records)
    caplog.clear()
    with switchml.Switch(data_plane="c"):
        pass
    assert not any("XDP" in r.message for r in caplog.records)


def test_the_data_threads_a_switch_may_announce_are_those_it_may_run():
    from switchml import protocol
    from switchml.config import MAX_SWITCH_THREADS
    from switchml.worker.engine import compiled
    assert protocol.MAX_DATA_THREADS == MAX_SWITCH_THREADS
    assert compiled._fastengine is None or (
        compiled._fastengine.MAX_DATA_THREADS == protocol.MAX_DATA_THREADS)
