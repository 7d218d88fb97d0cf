"""The C switch core against the Python pipeline (the reference model): the same
datagrams in must give the same datagrams out (bytes, destinations, order) and the
same counters, bit for bit.

Traffic comes from real worker engines (``Membership``, dense and sparse, int32 and
float32) in the simulator with loss, duplication and reordering, through a
``Lockstep`` pipeline that hands every datagram to both and compares; hostile
datagrams derived from that traffic (truncated, bit-flipped, wrong fields, other
jobs' sessions and slots, strangers, replays, random bytes) are mixed in.
"""

from __future__ import annotations

import random
import socket
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from switchml import wire
from switchml.sim.network import Faults, Simulation, StalledSimulation
from switchml.switch import sockets
from switchml.switch.dataplane import fastpipeline
from switchml.switch.dataplane.fastpipeline import FastPipeline
from switchml.switch.dataplane.pipeline import Pipeline

pytestmark = pytest.mark.skipif(fastpipeline._fastpath is None,
                                reason="switchml.switch.dataplane._fastpath is not built")

SLOTS = 8
PACKET, BLOCK = 16, 4  # the pipeline's rows; job B uses smaller packets
JOB_A = dict(name="A", session=0xA11CE, slot_base=0, slots=4, packet=PACKET, block=BLOCK,
             addresses=[("10.0.0.1", 5000 + r) for r in range(3)])
JOB_B = dict(name="B", session=0xB0B, slot_base=4, slots=4, packet=8, block=2,
             addresses=[("10.0.0.2", 6000 + r) for r in range(2)])
STRANGERS = [("10.0.0.1", 4999), ("10.0.0.9", 5000), ("worker", 0)]
DIFF = settings(max_examples=60, derandomize=True, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


class Lockstep:
    """A pipeline for the simulator that is the reference and the C core at once:
    every datagram goes to both, their replies and counters must be identical, and
    between two valid datagrams hostile ones are delivered to both as well."""

    def __init__(self, hostile_rate=0.0, seed=0, **kw):
        self.ref = Pipeline(**kw)
        self.fast = FastPipeline(**kw)
        self.rng = random.Random(seed)
        self.hostile_rate = hostile_rate
        self.seen: list[tuple[bytes, tuple]] = []  # valid traffic so far, for replays
        self.deliveries = 0

    def __getattr__(self, name):  # packet_elements, block_elements, slots, ...
        return getattr(self.ref, name)

    def allocate(self, count):
        base = self.ref.allocate(count)
        assert self.fast.allocate(count) == base
        return base

    def install_job(self, *args, **kw):
        job = self.ref.install_job(*args, **kw)
        self.fast.install_job(*args, **kw)
        return job

    def remove_job(self, *args, **kw):
        ref = self.ref.remove_job(*args, **kw)
        fast = self.fast.remove_job(*args, **kw)
        assert (ref is None) == (fast is None)
        self.check_counters()
        return ref

    def receive_datagram(self, data, addr):
        data = bytes(data)
        while self.hostile_rate and self.rng.random() < self.hostile_rate:
            bad, src = hostile(self.rng, data, addr, self.seen)
            assert self.deliver(bad, src) == [] or src in self.ref._members
        self.seen.append((data, addr))
        return self.deliver(data, addr)

    def deliver(self, data, addr):
        want = [(bytes(d), a) for d, a in self.ref.receive_datagram(data, addr)]
        got = [(bytes(d), a) for d, a in self.fast.receive_datagram(data, addr)]
        assert got == want
        self.check_counters()
        assert [(j.name, m) for j, m in self.fast.take_mismatches()] == \
            [(j.name, m) for j, m in self.ref.take_mismatches()]
        if len(data) >= 8:
            slot = int.from_bytes(data[6:8], "little") % self.ref.slots
            for msg in range(2):
                assert self.fast.slot_state(slot, msg) == self.ref.slot_state(slot, msg)
        self.deliveries += 1
        return want

    def check_counters(self):
        assert dict(self.fast.counters) == dict(self.ref.counters)
        assert {s: dict(j.counters) for s, j in self.fast.jobs.items()} == \
            {s: dict(j.counters) for s, j in self.ref.jobs.items()}


def hostile(rng: random.Random, data: bytes, addr, seen):
    """A hostile datagram derived from ``data`` (a valid one from ``addr``) and where it
    comes from: a member of either job or a stranger."""
    kind = rng.randrange(15)
    members = JOB_A["addresses"] + JOB_B["addresses"]
    src = addr
    if kind == 0:  # random bytes, sometimes with our magic
        out = bytes(rng.randrange(256) for _ in range(rng.randrange(80)))
        if rng.random() < 0.5:
            out = b"SM" + bytes([wire.VERSION, wire.KIND_CONTRIBUTION]) + out[4:]
    elif kind == 1:  # truncated or padded
        out = data[: rng.randrange(len(data))] if rng.random() < 0.5 else \
            data + bytes(rng.randrange(1, 9))
    elif kind == 2:  # bit flips anywhere
        flipped = bytearray(data)
        for _ in range(rng.randrange(1, 4)):
            bit = rng.randrange(8 * len(flipped))
            flipped[bit // 8] ^= 1 << bit % 8
        out = bytes(flipped)
    elif kind == 3:  # one header field set to something else
        offset, size = rng.choice([(2, 1), (3, 1), (4, 1), (5, 1), (6, 2), (8, 4), (12, 4),
                                   (16, 4), (20, 4), (24, 2), (26, 2)])
        value = rng.choice([0, 1, 2, 3, 4, 255, 2**(8 * size) - 1, rng.randrange(2**(8 * size))])
        out = data[:offset] + value.to_bytes(size, "little") + data[offset + size:]
    elif kind == 4:  # the same bytes from a stranger or from another member
        out, src = data, rng.choice(STRANGERS + members)
    elif kind == 5:  # a replay of older traffic (stale, duplicate, retransmission)
        out, src = rng.choice(seen) if seen else (data, addr)
    elif kind == 6:  # a replay from another member of the job, or another job
        out, src = (rng.choice(seen)[0] if seen else data), rng.choice(members)
    elif kind == 7:  # a newer message on the slot, with other values
        msg = (int.from_bytes(data[12:16], "little") + rng.choice([1, 2, 3, 2**31])) % 2**32
        out = data[:12] + msg.to_bytes(4, "little") + data[16:]
    elif kind == 8:  # a lane record changed (positions, next, exponent, flags)
        flipped = bytearray(data)
        lanes = int.from_bytes(data[26:28], "little")
        if lanes and len(data) >= 32 + 12 * lanes:
            at = 32 + 12 * rng.randrange(lanes) + rng.choice([0, 4, 8, 10])
            flipped[at] = rng.randrange(256)
        out = bytes(flipped)
    elif kind == 9:  # a result posing as a contribution
        out = data[:3] + bytes([wire.KIND_RESULT]) + data[4:]
    elif kind == 10:  # another mode: sparse on a dense packet, max on a sum, ...
        out = data[:5] + bytes([rng.choice(wire.MODES)]) + data[6:]
    elif kind == 11:  # well formed, with another lane count or more values
        lanes, count = rng.randrange(6), rng.choice([0, 1, 4, 8, 16, 17, 20, 64])
        body = bytes(rng.randrange(256) for _ in range(12 * lanes + 4 * count))
        out = data[:24] + count.to_bytes(2, "little") + lanes.to_bytes(2, "little") + \
            data[28:32] + body
    elif kind == 12:  # a probe of it, for its message or another (stale, newer), from
        # its sender or another member, sometimes with a lane table and values
        msg = (int.from_bytes(data[12:16], "little") + rng.choice([0, 0, 1, 2, 2**31 + 1]))
        out = wire.probe_of(data[:12] + (msg % 2**32).to_bytes(4, "little") + data[16:],
                            rng.choice([wire.KIND_PROBE, wire.KIND_QUERY]))
        if rng.random() < 0.2:
            out = out[:24] + bytes([1, 0, 0, 0]) + out[28:] + bytes(4)
        src = addr if rng.random() < 0.7 else rng.choice(members)
    elif kind == 13:  # a resend or a done, which only a switch sends
        out = wire.answer_of(data, rng.choice([wire.KIND_RESEND, wire.KIND_DONE]))
    else:  # empty
        out = b""
    return out, src


def run_jobs(lock: Lockstep, seed: int, faults: Faults, calls, check_sums=True):
    """Run allreduces of both jobs in the simulator through ``lock``; check the sums."""
    rng = np.random.default_rng(seed)
    sims = {}
    for i, job in enumerate((JOB_A, JOB_B)):
        sims[job["name"]] = Simulation(
            len(job["addresses"]), slots=job["slots"], pipeline=lock, faults=faults,
            seed=seed + i, session=job["session"], slot_base=job["slot_base"],
            packet_elements=job["packet"], block_elements=job["block"],
            addresses=job["addresses"])
    for name, dtype, size, sparse, density in calls:
        sim = sims[name]
        world = len(sim.memberships)
        arrays = []
        for _ in range(world):
            if dtype == "int32":
                a = rng.integers(-2**31, 2**31, size, dtype=np.int64).astype(np.int32)
            else:
                a = rng.normal(0, 10, size).astype(np.float32)
            block = sim.job.block_elements
            zero = rng.random(-(-size // block)) > density
            for b in np.nonzero(zero)[0]:
                a[b * block: (b + 1) * block] = 0
            arrays.append(a)
        try:
            outs = sim.allreduce(arrays, sparse=sparse)
        except StalledSimulation:
            if check_sums:
                raise
            continue  # the hostile traffic made a worker give up; the job goes on
        if not check_sums:
            continue
        for o in outs[1:]:
            assert o.tobytes() == outs[0].tobytes()
        if dtype == "int32":
            total = np.zeros(size, np.int32)
            for a in arrays:
                np.add(total, a, out=total)
            assert outs[0].tolist() == total.tolist()
    return sims


def new_lockstep(hostile_rate=0.0, seed=0):
    return Lockstep(hostile_rate, seed, slots=SLOTS, packet_elements=PACKET,
                    block_elements=BLOCK)


CALL = st.tuples(st.sampled_from(["A", "B"]), st.sampled_from(["int32", "float32"]),
                 st.integers(1, 400), st.booleans(), st.sampled_from([0.0, 0.2, 0.6, 1.0]))
FAULTS = st.builds(Faults, loss=st.sampled_from([0.0, 0.05, 0.2]),
                   duplicate=st.sampled_from([0.0, 0.1]),
                   jitter=st.sampled_from([0.0, 1e-4, 2e-3]))


@DIFF
@given(seed=st.integers(0, 2**32 - 1), faults=FAULTS,
       calls=st.lists(CALL, min_size=1, max_size=4))
def test_same_datagrams_and_counters_for_faulty_traffic(seed, faults, calls):
    lock = new_lockstep()
    run_jobs(lock, seed, faults, calls)
    assert lock.deliveries > 0
    assert lock.fast.stats() == lock.ref.stats()


@DIFF
@given(seed=st.integers(0, 2**32 - 1), faults=FAULTS,
       rate=st.sampled_from([0.1, 0.5, 1.5]), calls=st.lists(CALL, min_size=1, max_size=3))
def test_same_datagrams_and_counters_with_hostile_traffic_mixed_in(seed, faults, rate, calls):
    """Hostile datagrams from members may corrupt their own job's sums (no checksum:
    UDP's is the network's), so only the agreement of both pipelines is checked."""
    lock = Lockstep(rate / (1 + rate), seed, slots=SLOTS, packet_elements=PACKET,
                    block_elements=BLOCK)
    run_jobs(lock, seed, faults, calls, check_sums=False)
    assert lock.fast.stats() == lock.ref.stats()
    for session in (JOB_A["session"], JOB_B["session"]):
        lock.remove_job(session, "failed")
    assert lock.fast.stats() == lock.ref.stats()


@DIFF
@given(data=st.lists(st.tuples(st.binary(max_size=200), st.integers(0, 4)), max_size=60))
def test_same_drops_for_random_bytes(data):
    lock = new_lockstep()
    for job in (JOB_A, JOB_B):
        lock.install_job(job["name"], job["session"], job["addresses"], job["slot_base"],
                         job["slots"], job["packet"], job["block"])
    sources = JOB_A["addresses"] + JOB_B["addresses"][:1] + STRANGERS[:1]
    for payload, who in data:
        lock.deliver(payload, sources[who])
        lock.deliver(b"SM" + bytes([wire.VERSION, 1]) + payload[4:], sources[who])
    assert lock.fast.stats() == lock.ref.stats()


def test_jobs_come_and_go_on_the_same_slots_and_addresses():
    lock = new_lockstep()
    for round_ in range(6):
        run_jobs(lock, round_, Faults(loss=0.05), [("A", "int32", 100, round_ % 2, 0.5),
                                                    ("B", "float32", 60, True, 0.3)])
        lock.remove_job(JOB_A["session"])
        lock.remove_job(JOB_B["session"], "failed")
        assert lock.fast.stats() == lock.ref.stats()
        assert lock.fast.free_slots() == SLOTS
        # the old members are strangers now
        lock.deliver(b"\x00" * 40, JOB_A["addresses"][0])
    assert lock.fast.totals() == lock.ref.totals()


def test_the_differential_check_can_fail():
    """A C core that differs from the reference is caught: here, one whose job has
    another packet size than the reference's."""
    lock = new_lockstep()
    lock.ref.install_job("A", 1, JOB_A["addresses"], 0, 2, 8, 4)
    lock.fast.install_job("A", 1, JOB_A["addresses"], 0, 2, 16, 4)
    packet = wire.encode(wire.KIND_CONTRIBUTION, 0, 0, 1, 0, 0, 0, np.zeros(2, wire.LANE),
                         np.ones(8, np.int32))
    with pytest.raises(AssertionError):
        lock.deliver(packet, JOB_A["addresses"][0])


# ---------------------------------------------------------------- simulated drops
def test_simulated_drops_are_counted_and_repaired():
    p = FastPipeline(slots=4, packet_elements=16, block_elements=4, drop_rate=0.2, seed=5)
    sim = Simulation(3, slots=4, pipeline=p, seed=1, addresses=JOB_A["addresses"])
    rng = np.random.default_rng(0)
    arrays = [rng.integers(-1000, 1000, 300).astype(np.int32) for _ in range(3)]
    for sparse in (False, True):
        outs = sim.allreduce(arrays, sparse=sparse)
        assert all(o.tolist() == sum(arrays).tolist() for o in outs)
    totals = p.totals()
    assert totals["dropped_ingress_simulated"] > 0 and totals["dropped_egress_simulated"] > 0
    assert totals["retransmissions_answered"] > 0


# ---------------------------------------------------------------- the socket loop
def _udp(host="127.0.0.1"):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind((host, 0))
    s.settimeout(5)
    return s


def _a_job_on_both(slots):
    """A switch socket, three worker sockets, and one job of them installed on the C
    pipeline and on the reference: (switch, workers, addresses, fast, ref)."""
    switch = _udp()
    switch.setblocking(False)
    workers = [_udp() for _ in range(3)]
    addrs = [w.getsockname() for w in workers]
    fast = FastPipeline(slots=slots, packet_elements=16, block_elements=4)
    ref = Pipeline(slots=slots, packet_elements=16, block_elements=4)
    for p in (fast, ref):
        p.install_job("j", 7, addrs, 0, slots)
    return switch, workers, addrs, fast, ref


@pytest.mark.parametrize("gso", [True, False])
def test_drain_gives_the_reference_replies_over_real_sockets(gso):
    switch, workers, addrs, fast, ref = _a_job_on_both(4)
    rng = np.random.default_rng(2)
    sent, expected = [], {a: [] for a in addrs}
    for msg in range(3):
        for slot in range(4):
            for r in rng.permutation(3):
                data = wire.encode(wire.KIND_CONTRIBUTION, 0, slot, 7, msg, 0, slot,
                                   np.zeros(4, wire.LANE),
                                   rng.integers(-9, 9, 16).astype(np.int32))
                sent.append((data, r))
                sent.append((data, r))  # a duplicate, or a retransmission answered
    sent.append((b"garbage", 0))
    for data, r in sent:
        for d, a in ref.receive_datagram(data, addrs[r]):
            expected[a].append(bytes(d))
    for data, r in sent:  # all queued before the switch looks: one batch
        workers[r].sendto(data, switch.getsockname())
    received, replies = 0, 0
    while received < len(sent):
        got, out = fast.drain(switch.fileno(), 1000, gso)
        received, replies = received + got, replies + out
    assert replies == sum(len(v) for v in expected.values())
    assert not fast.gso_refused  # Linux takes UDP GSO since 4.18
    for w, a in zip(workers, addrs):
        assert [w.recv(65536) for _ in expected[a]] == expected[a]
    assert fast.stats()["totals"] == ref.stats()["totals"]
    for s in workers + [switch]:
        s.close()


def test_drain_cuts_runs_received_whole_into_the_reference_datagrams():
    """With UDP_GRO on the switch's socket, a worker's UDP GSO run over loopback
    arrives as one receive; the loop must run each of its datagrams through the
    pipeline, in order, the last one shorter, as the reference does one by one."""
    switch, workers, addrs, fast, ref = _a_job_on_both(8)
    switch.setsockopt(socket.SOL_UDP, sockets.UDP_GRO, 1)
    rng = np.random.default_rng(3)

    def contribution(msg, slot, count=16):
        return wire.encode(wire.KIND_CONTRIBUTION, 0, slot, 7, msg, 0, slot,
                           np.zeros(4, wire.LANE), rng.integers(-9, 9, count).astype(np.int32))
    runs = []  # (datagrams, rank): each rank's slots of a message in one run
    for msg in range(2):
        for r in rng.permutation(3):
            runs.append(([contribution(msg, slot) for slot in range(8)], r))
    runs.append(([contribution(2, 0), contribution(2, 1, count=5)], 0))  # a shorter last one
    runs.append(([b""], 1))  # an empty datagram is one too: dropped, and counted
    expected = {a: [] for a in addrs}
    for datagrams, r in runs:
        for data in datagrams:
            for d, a in ref.receive_datagram(data, addrs[r]):
                expected[a].append(bytes(d))
    for datagrams, r in runs:
        if len(datagrams) == 1:
            workers[r].sendto(datagrams[0], switch.getsockname())
            continue
        workers[r].sendmsg([b"".join(datagrams)],
                           [(socket.SOL_UDP, sockets.UDP_SEGMENT,
                             len(datagrams[0]).to_bytes(2, sys.byteorder))], 0,
                           switch.getsockname())
    received = 0
    while received < len(runs):
        received += fast.drain(switch.fileno(), 1000)[0]
    for w, a in zip(workers, addrs):
        assert [w.recv(65536) for _ in expected[a]] == expected[a]
    totals = fast.stats()["totals"]
    assert totals.pop("runs_received") == len(runs) - 1
    assert totals == ref.stats()["totals"]
    for s in workers + [switch]:
        s.close()


def test_drain_sends_a_result_before_its_row_changes():
    """A member that sends message m+2 right after m's result, in the same batch, must
    not change the result still waiting to be sent (the row is flushed first)."""
    switch = _udp()
    switch.setblocking(False)
    workers = [_udp() for _ in range(2)]
    addrs = [w.getsockname() for w in workers]
    fast = FastPipeline(slots=1, packet_elements=4, block_elements=4)
    fast.install_job("j", 7, addrs, 0, 1)

    def packet(msg, value):
        return wire.encode(wire.KIND_CONTRIBUTION, 0, 0, 7, msg, 0, 0, np.zeros(1, wire.LANE),
                           np.full(4, value, np.int32))
    for data, r in ((packet(0, 1), 0), (packet(0, 2), 1), (packet(2, 100), 0)):
        workers[r].sendto(data, switch.getsockname())
    received = 0
    while received < 3:
        received += fast.drain(switch.fileno(), 64)[0]
    for w in workers:
        h = wire.decode_header(reply := w.recv(65536))
        assert wire.values(reply, h.lanes, h.count).tolist() == [3] * 4
    for s in workers + [switch]:
        s.close()


# ---------------------------------------------------------------- the switch
def test_switch_runs_its_data_plane_in_c_and_counts_it():
    from conftest import run_ranks

    import switchml
    from switchml import netutil
    world, size = 3, 5000
    rng = np.random.default_rng(4)
    arrays = [rng.integers(-1000, 1000, size).astype(np.int32) for _ in range(world)]
    for a in arrays:
        a[1024:4096] = 0
    with switchml.Switch(packet_elements=1024, slots=16, slots_per_job=4,
                         fastpath=True) as sw:
        assert isinstance(sw.pipeline, FastPipeline)
        assert sw._udp.getsockopt(socket.IPPROTO_IP, netutil.IP_MTU_DISCOVER) == \
            netutil.IP_PMTUDISC_DO

        def rank(r):
            with switchml.Worker(sw.address, r, world, job="c") as w:
                return [w.allreduce(arrays[r]), w.allreduce(arrays[r], sparse=True)]
        for dense, sparse in run_ranks(world, rank):
            assert dense.tolist() == sparse.tolist() == sum(arrays).tolist()
        stats = sw.stats()
    assert stats["data_plane"] == "c"
    counters = stats["ended_jobs"]["c"]["counters"]
    assert counters["packets_in"] >= world * 5 and counters["results_completed"] >= 5
    assert counters["sparse_blocks_in"] > 0 and counters["sparse_blocks_skipped"] > 0
    assert stats["totals"]["results_out"] == counters["results_out"]


def test_pure_python_switch_on_request(monkeypatch):
    import switchml
    monkeypatch.setenv("SWITCHML_PURE_PYTHON", "1")
    with switchml.Switch(slots=4) as sw:
        assert not sw.fastpath and type(sw.pipeline) is Pipeline
        assert sw.stats()["data_plane"] == "python"
    monkeypatch.delenv("SWITCHML_PURE_PYTHON")
    with switchml.Switch(slots=4) as sw:
        assert sw.fastpath and type(sw.pipeline) is FastPipeline
