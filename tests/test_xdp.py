"""The XDP program (switch/xdp/pipeline.bpf.c) against the Python pipeline (the
reference model): the same datagrams in must give the same datagrams out (bytes,
destinations), the same counters and the same slot state (every set's
registers and the bytes of every row), bit for bit.

The program runs through BPF_PROG_TEST_RUN on whole Ethernet/IPv4/UDP frames,
which these tests build with their own code (``frame``), not the loader's; its
answer is read back from the frame it leaves and the XDP action it returns:
XDP_DROP where the Python pipeline sends nothing, XDP_TX with the addresses
swapped for an answer to the sender alone, XDP_PASS for a completed result
(which the switch's socket sends to every rank).

Traffic: hypothesis (derandomized) sequences of valid, duplicated, reordered,
stale and hostile datagrams, and real worker engines in the simulator with
loss, duplication and reordering, dense calls and sparse ones.  The program
does the dense path; a sparse contribution it passes up (XDP_PASS, the frame
as it came), and the switch's socket hands it to ``XdpPipeline.passed_up``,
which runs pipeline.py's sparse path on the set in the program's maps: these
tests do the same (``Both.deliver``), and then compare as for any datagram.

Several CPUs: two processes pinned to two CPUs feed the same slots at once
(``test_two_cpus_*``): with the program's bpf_spin_lock calls removed it loses
contributions (hundreds of 3000 results wrong or missing, each run tried), and
without the probe path's lock alone answers to probes come out torn (5 to 15
of some 15,000 a run); with them, none.  And a process on one CPU probes a
sparse set while user space writes it on another
(``test_probes_on_another_cpu_*``): with the row written before the registers
that make the set hold its new message, some 300 of 20,000 answers come out
torn; in ``_store_set``'s order, none.

Skips, saying why, without root, clang, libbpf or the kernel headers
(``make test`` installs them as root).
"""

from __future__ import annotations

import os
import random
import re
import socket
import struct
from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from switchml import wire
from switchml.sim.network import Faults
from switchml.switch.dataplane.pipeline import Pipeline
from switchml.switch.xdp import loader as xdp_loader
from switchml.switch.xdp import pipeline as xdp

REASON = xdp.unavailable()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"XDP: {REASON}")

SWITCH = ("10.255.0.1", 7300)
SWITCH_MAC, WORKER_MAC = bytes.fromhex("0a0000000001"), bytes.fromhex("0a0000000002")
SLOTS, PACKET, BLOCK = 8, 16, 4
JOB_A = dict(name="A", session=0xA11CE, slot_base=0, slots=4, packet=PACKET, block=BLOCK,
             addresses=[("10.0.0.1", 5000 + r) for r in range(3)], tokens=[0x1111, 0x2222, 0x3333])
JOB_B = dict(name="B", session=0xB0B, slot_base=4, slots=4, packet=8, block=2,
             addresses=[("10.0.0.2", 6000 + r) for r in range(2)], tokens=[0xB1, 0xB2])
STRANGERS = [("10.0.0.1", 4999), ("10.0.0.9", 5000), ("10.0.0.2", 5000)]
# counters the program keeps that pipeline.py has no twin of: frames the kernel
# would have dropped before the socket, what it passes up to user space, and
# the copies of results its fan-out sends (tests/test_xdp_serve.py)
XDP_ONLY = {"dropped_bad_ip_udp", "dropped_ip_options", "dropped_ip_fragment",
            "sparse_passed_up", "dropped_internal", "probes_passed_up", "gso_passed_up",
            "results_fanned_out", "results_fanout_failed", "result_runs_fanned_out"}
DIFF = settings(max_examples=30, derandomize=True, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# ---------------------------------------------------------------- frames
def checksum(header: bytes) -> int:
    total = sum(struct.unpack(f"!{len(header) // 2}H", header))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF


def frame(src, payload: bytes, dst=SWITCH, *, ip_options=b"", frag=0x4000, ttl=64,
          bad_checksum=False, udp_len=None) -> bytes:
    """An Ethernet/IPv4/UDP frame from a worker to the switch."""
    ihl = 5 + len(ip_options) // 4
    ip = bytearray(struct.pack("!BBHHHBBH4s4s", 0x40 | ihl, 0,
                               4 * ihl + 8 + len(payload), 0x1234, frag, ttl, socket.IPPROTO_UDP,
                               0, socket.inet_aton(src[0]), socket.inet_aton(dst[0])))
    ip += ip_options
    ip[10:12] = (checksum(bytes(ip)) ^ (1 if bad_checksum else 0)).to_bytes(2, "big")
    udp = struct.pack("!HHHH", src[1], dst[1], 8 + len(payload) if udp_len is None else udp_len,
                      0)
    return SWITCH_MAC + WORKER_MAC + b"\x08\x00" + bytes(ip) + udp + payload


def unpack(out: bytes):
    """(eth dst, eth src, ip src, ip dst, udp payload) of a frame the program left,
    checking its IP checksum and lengths."""
    ip = out[14:34]
    assert ip[0] == 0x45 and ip[9] == socket.IPPROTO_UDP
    assert checksum(ip) == 0, "bad IP header checksum"
    total = int.from_bytes(ip[2:4], "big")
    udp_len = int.from_bytes(out[38:40], "big")
    assert total == 20 + udp_len and len(out) >= 14 + total
    assert out[40:42] == b"\0\0"  # no UDP checksum: the payload was rewritten
    src = (socket.inet_ntoa(ip[12:16]), int.from_bytes(out[34:36], "big"))
    dst = (socket.inet_ntoa(ip[16:20]), int.from_bytes(out[36:38], "big"))
    return out[:6], out[6:12], src, dst, out[42:34 + total]


# ---------------------------------------------------------------- both pipelines
class Both:
    """The Python pipeline and the XDP program fed the same datagrams, compared
    after every one."""

    def __init__(self, slots=SLOTS, packet=PACKET, block=BLOCK, jobs=(JOB_A, JOB_B)):
        self.ref = Pipeline(slots, packet, block_elements=block)
        self.xdp = xdp.XdpPipeline(slots, packet, block_elements=block, port=SWITCH[1],
                                   switch_ip=SWITCH[0])
        self.jobs = {}
        for job in jobs:
            self.install(job)
        self.deliveries = 0
        self.sparse_passed_up = 0  # datagrams the program passed up to passed_up

    def install(self, job):
        for p in (self.ref, self.xdp):
            p.install_job(job["name"], job["session"], job["addresses"], job["slot_base"],
                          job["slots"], job["packet"], job["block"], tokens=job["tokens"])
        self.jobs[job["session"]] = job

    def close(self):
        self.xdp.close()

    def deliver(self, data: bytes, src, pad: int = 0) -> list:
        """``pad``: zero bytes after the IP packet (as Ethernet pads short frames)."""
        before = self.ref.totals()["results_completed"]
        want = [(bytes(d), a) for d, a in self.ref.receive_datagram(data, src)]
        completed = self.ref.totals()["results_completed"] - before
        sent = frame(src, data) + bytes(pad)
        action, out = self.xdp.run_frame(sent)
        if action == xdp.XDP_PASS and out == sent and data[3] == wire.KIND_CONTRIBUTION and \
                data[5] & wire.MODE_SPARSE:  # passed up, as it came: the socket's path
            got = self.xdp.passed_up(data, src)
            assert [(bytes(d), a) for d, a in got] == want
            self.sparse_passed_up += 1
        elif not want:
            assert action == xdp.XDP_DROP, (xdp.ACTIONS.get(action), want)
        elif completed:  # the result, to every rank: handed to the switch's socket
            job = self.ref._members[src][0]
            assert [a for _, a in want] == job.members
            assert action == xdp.XDP_PASS
            eth_dst, eth_src, ip_src, ip_dst, payload = unpack(out)
            assert (eth_dst, eth_src, ip_src, ip_dst) == (SWITCH_MAC, WORKER_MAC, src, SWITCH)
            assert payload == want[0][0]
        else:  # to the sender alone, back out of the port
            assert len(want) == 1 and want[0][1] == src
            assert action == xdp.XDP_TX
            eth_dst, eth_src, ip_src, ip_dst, payload = unpack(out)
            assert (eth_dst, eth_src, ip_src, ip_dst) == (WORKER_MAC, SWITCH_MAC, SWITCH, src)
            assert payload == want[0][0]
        self.check()
        self.deliveries += 1
        return want

    def receive_datagram(self, data, addr):  # as the simulator's pipeline
        return self.deliver(bytes(data), addr)

    def __getattr__(self, name):  # packet_elements, block_elements, slots, ... for the sim
        return getattr(self.ref, name)

    def check(self):
        assert without_zeros(self.xdp.counters) == without_zeros(self.ref.counters)
        for session, job in self.ref.jobs.items():
            got = without_zeros(self.xdp.jobs[session].counters)
            got.pop("sparse_passed_up", None)
            assert got == without_zeros(job.counters)
        # each sparse contribution the program passed up, counted once
        assert self.xdp.totals()["sparse_passed_up"] == self.sparse_passed_up
        assert [(j.name, m) for j, m in self.xdp.take_mismatches()] == \
            [(j.name, m) for j, m in self.ref.take_mismatches()]
        self.check_slots()

    def check_slots(self):
        """Every set's registers and row: pipeline.py's lists and _rows against the
        program's maps (the rows up to the room past the datagram where pipeline.py
        builds resends, which the program builds in the frame)."""
        ref = self.ref
        for v in (0, 1):
            for slot in range(ref.slots):
                got = self.xdp.set_registers(v, slot)
                seq, pkt_id, dtype, mode, count, call = ref._ids[v][slot]
                assert got == dict(valid=int(ref._valid[v][slot]), msg=ref._msg[v][slot],
                                   bitmap=ref._bitmap[v][slot], count=ref._count[v][slot],
                                   seq=seq, pkt_id=pkt_id, dtype=dtype, mode=mode,
                                   id_count=count, call=call), (v, slot)
                assert self.xdp.row(v, slot) == bytes(ref._rows[v, slot, : ref.datagram_size]), \
                    (v, slot)


def without_zeros(counter) -> dict:
    return {k: v for k, v in counter.items() if v}


@pytest.fixture
def both():
    b = Both()
    yield b
    b.close()


# ---------------------------------------------------------------- datagrams
def contribution(job, rank, *, slot=0, msg=0, seq=0, pkt_id=0, dtype=0, mode=0, count=None,
                 values=None, exps=None, call=0, kind=wire.KIND_CONTRIBUTION, token=None):
    lanes = job["packet"] // job["block"]
    count = job["packet"] if count is None else count
    table = np.zeros(lanes, wire.LANE)
    if exps is not None:
        table["exp"] = exps[:lanes]
    vals = np.zeros(count, np.int32) if values is None else np.asarray(values[:count], np.int32)
    return wire.encode(kind, dtype, job["slot_base"] + slot,
                       job["tokens"][rank] if token is None else token, msg, seq, pkt_id,
                       table, vals, mode=mode, call=call)


def sparse_contribution(job, rank, rng: random.Random, pos: list, *, slot=0, msg=0, seq=0,
                        pkt_id=0, dtype=0, mode=wire.MODE_SPARSE, values=None, exps=None,
                        call=0, **_) -> bytes:
    """A sparse contribution (OmniReduce's, as a worker's sparse engine sends it):
    the blocks it flags (a random few of the packet's lanes, maybe none), their
    values, and per lane the call's position ``pos`` and the rank's next one;
    now and then out of step with the others (another position in a lane), a
    block count that disagrees with the flags, or flag bits besides the block's."""
    lanes = job["packet"] // job["block"]
    table = np.zeros(lanes, wire.LANE)
    table["pos"] = pos
    if rng.random() < 0.05:
        table["pos"][rng.randrange(lanes)] ^= 1
    table["nxt"] = [p + rng.choice([0, 1, 1, 2, 7]) for p in pos]  # 0: the lane is done
    if exps is not None:
        table["exp"] = exps[:lanes]
    flagged = [lane for lane in range(lanes) if rng.random() < 0.5]
    table["flag"][flagged] = wire.FLAG_BLOCK
    if rng.random() < 0.1:
        table["flag"][rng.randrange(lanes)] |= 2
    count = len(flagged) * job["block"]
    if rng.random() < 0.05:
        count = rng.choice([max(0, count - job["block"]), count + 1])
    vals = np.asarray(values if values is not None else [0] * job["packet"], np.int32)
    vals = np.resize(vals, count)
    return wire.encode(wire.KIND_CONTRIBUTION, dtype, job["slot_base"] + slot,
                       job["tokens"][rank], msg, seq, pkt_id, table, vals, mode=mode, call=call)


I32 = st.integers(-2**31, 2**31 - 1)
I16 = st.integers(-2**15, 2**15 - 1)


def traffic(rng: random.Random, rounds: int, replay: float, hostile_rate: float,
            sparse: bool = False):
    """Datagrams and their sources: ``rounds`` aggregations (a job, a slot, a
    message; every rank's contribution with random values and exponents), their
    datagrams reordered, some replayed (duplicates, retransmissions of complete
    sets, stale messages), probed or queried, made hostile; messages mostly follow
    one another on a slot, sometimes jump ahead or go back; now and then a rank
    disagrees on the call.  With ``sparse``, half the calls are sparse (with or
    without MODE_SEED: ``sparse_contribution``), on the same slots as the dense
    ones, and a rank may disagree on the sparseness."""
    msgs: dict = {}
    pending: list = []
    sent: list = []
    for _ in range(rounds):
        job = rng.choice([JOB_A, JOB_B])
        slot = rng.randrange(job["slots"])
        msg = msgs.get((job["name"], slot), rng.choice([0, 2**32 - 2]))
        msg = (msg + rng.choice([1, 1, 1, 1, 2, 2**31, -1, 0])) % 2**32
        msgs[job["name"], slot] = msg
        ids = dict(slot=slot, msg=msg, seq=rng.randrange(3), pkt_id=rng.randrange(3),
                   dtype=rng.randrange(3),
                   mode=rng.choice([0, 0, wire.MODE_MAX] + ([
                       wire.MODE_SPARSE, wire.MODE_SPARSE, wire.MODE_SPARSE | wire.MODE_SEED]
                       if sparse else [])),
                   count=rng.choice([job["packet"]] * 3 + [0, 1, job["packet"] - 1]),
                   call=rng.choice([0, 17, 2**31 + 17]))
        lanes = job["packet"] // job["block"]
        pos = [rng.randrange(2**31) for _ in range(lanes)]  # a sparse call's, per lane
        for rank in range(len(job["addresses"])):
            mine = dict(ids)
            if rng.random() < 0.05:  # this rank calls something else
                field = rng.choice(["seq", "pkt_id", "dtype", "call", "count", "mode"])
                other_mode = {0: wire.MODE_MAX, wire.MODE_MAX: 0, wire.MODE_SPARSE: 0,
                              wire.MODE_SPARSE | wire.MODE_SEED: wire.MODE_SPARSE}
                mine[field] = {"dtype": (ids["dtype"] + 1) % 3, "count": max(0, ids["count"] - 1),
                               "mode": other_mode[ids["mode"]]}.get(field, ids[field] + 1)
            values = [rng.choice([rng.randrange(-2**31, 2**31), -2**31, 2**31 - 1, 0, 1])
                      for _ in range(job["packet"])]
            exps = [rng.choice([rng.randrange(-2**15, 2**15), -2**15, 2**15 - 1])
                    for _ in range(lanes)]
            make = sparse_contribution if mine["mode"] & wire.MODE_SPARSE else contribution
            extra = (rng, pos) if make is sparse_contribution else ()
            pending.append((make(job, rank, *extra, values=values, exps=exps, **mine),
                            job["addresses"][rank]))
        while len(pending) > rng.randrange(4):  # the rest stays, to be reordered with later
            data, src = pending.pop(rng.randrange(len(pending)))
            yield data, src
            sent.append((data, src))
            while rng.random() < replay:
                again, by = rng.choice(sent[-12:])
                roll = rng.random()
                if roll < 0.4:
                    yield again, by
                elif roll < 0.8:
                    yield wire.probe_of(again, rng.choice([wire.KIND_PROBE, wire.KIND_QUERY])), by
                else:  # another message of the slot (stale, newer, the other set)
                    msg = (int.from_bytes(again[12:16], "little") +
                           rng.choice([-2, -1, 1, 2])) % 2**32
                    yield wire.probe_of(again[:12] + msg.to_bytes(4, "little") + again[16:],
                                        rng.choice([wire.KIND_PROBE, wire.KIND_QUERY])), by
            while rng.random() < hostile_rate:
                yield hostile(rng, *rng.choice(sent[-12:]), sparse=sparse)
    rng.shuffle(pending)
    yield from pending


def hostile(rng: random.Random, data: bytes, src, sparse: bool = False):
    """``data`` (valid, from member ``src``) made hostile in one of the ways the
    pipeline counts; in a sparse mode only with ``sparse`` (kept apart: the
    dense traffic's examples stay the program's alone)."""
    members = JOB_A["addresses"] + JOB_B["addresses"]
    way = rng.randrange(14)
    out = bytearray(data)
    if way == 0:
        out[0:2] = rng.choice([b"MS", b"\0\0", b"SN"])
    elif way == 1:
        out[2] = rng.choice([0, wire.VERSION - 1, wire.VERSION + 1, 255])
    elif way == 2:  # a kind no worker sends, or none at all
        out[3] = rng.choice([0, wire.KIND_RESULT, wire.KIND_RESEND, wire.KIND_DONE, 7, 255])
    elif way == 3:
        out[4] = rng.choice([3, 4, 255])
    elif way == 4:  # a mode that is none (never sparse: 1 or 3)
        out[5] = rng.choice([2, 5, 6, 8, 255])
    elif way == 5:  # truncated, padded
        out = out[: rng.randrange(len(out))] if rng.random() < 0.5 else \
            out + bytes(rng.randrange(1, 9))
    elif way == 6:
        return bytes(out), rng.choice(STRANGERS)
    elif way == 7:  # another member's token, another job's, none
        tokens = JOB_A["tokens"] + JOB_B["tokens"] + [JOB_A["session"], 0]
        out[8:12] = rng.choice(tokens).to_bytes(4, "little")
    elif way == 8:  # a slot of the other job, or past the pool
        out[6:8] = rng.choice([0, 3, 4, 7, 8, 0xFFFF]).to_bytes(2, "little")
    elif way == 9:  # well formed, with another lane count or more values
        lanes = rng.choice([int.from_bytes(data[26:28], "little"), rng.randrange(6)])
        count = rng.choice([0, 1, 4, 8, 9, 16, 17, 20, 64])
        body = bytes(rng.randrange(256) for _ in range(12 * lanes + 4 * count))
        out = out[:24] + count.to_bytes(2, "little") + lanes.to_bytes(2, "little") + \
            out[28:32] + body
    elif way == 10:  # the same bytes from another member (its token is not this one)
        return bytes(out), rng.choice(members)
    elif way == 11:  # a probe with a lane table or values
        out = bytearray(wire.probe_of(data, rng.choice([wire.KIND_PROBE, wire.KIND_QUERY])))
        out[24:28] = bytes([1, 0, 0, 0])
        out += bytes(4)
    elif way == 12:  # random bytes, sometimes with our magic
        out = bytearray(rng.randrange(256) for _ in range(rng.randrange(80)))
        if rng.random() < 0.5:
            out[0:4] = b"SM" + bytes([wire.VERSION, wire.KIND_CONTRIBUTION])
    else:  # bit flips in the header (the mode byte is kept off sparse)
        for _ in range(rng.randrange(1, 3)):
            bit = rng.randrange(8 * min(len(out), 32))
            out[bit // 8] ^= 1 << bit % 8
    if not sparse and len(out) > 5 and out[5] & wire.MODE_SPARSE and out[5] in wire.MODES:
        out[5] = 0
    return bytes(out), src


# ---------------------------------------------------------------- tests
def test_counter_names_are_the_pipelines():
    """The program's counters are pipeline.py's (as the C core names them), but
    for its own few."""
    core = (xdp.HERE.parent / "dataplane" / "fastpath_core.c").read_text()
    names = set(re.findall(r'"([a-z_]+)"',
                           re.search(r"FP_COUNTER_NAMES\[FP_NCOUNTERS\] = \{(.*?)\};", core,
                                     re.S).group(1)))
    assert set(xdp.COUNTER_NAMES) - XDP_ONLY <= names
    assert XDP_ONLY <= set(xdp.COUNTER_NAMES)
    assert len(set(xdp.COUNTER_NAMES)) == len(xdp.COUNTER_NAMES)


def test_the_verifier_takes_it_and_says_how_much_it_checked(both):
    assert re.search(r"processed \d+ insns", both.xdp.verifier_stats)


@DIFF
@given(seed=st.integers(0, 2**32 - 1), rounds=st.integers(1, 24),
       replay=st.sampled_from([0.0, 0.2, 0.5]), hostile_rate=st.sampled_from([0.0, 0.1, 0.4]))
def test_same_datagrams_counters_and_slots_for_any_traffic(seed, rounds, replay, hostile_rate):
    """Valid datagrams, reordered, replayed (duplicates, retransmissions, stale
    messages), probed, queried, disagreeing, and made hostile, to both; equal
    after every one."""
    both = Both()
    try:
        for data, src in traffic(random.Random(seed), rounds, replay, hostile_rate):
            both.deliver(data, src)
    finally:
        both.close()


# 20 examples, not 30: each loads the program (0.15 s); a max, exponent or add that is
# wrong fails within the first few
@settings(DIFF, max_examples=20)
@given(values=st.lists(st.lists(I32, min_size=16, max_size=16), min_size=3, max_size=3),
       exps=st.lists(st.lists(I16, min_size=4, max_size=4), min_size=3, max_size=3),
       mode=st.sampled_from([0, wire.MODE_MAX]), order=st.permutations([0, 1, 2]),
       msg=st.integers(0, 2**32 - 1))
def test_sums_and_maxima_wrap_and_exponents_max_as_the_reference(values, exps, mode, order, msg):
    """One complete set of job A, in any order: the result is the int32 sum with
    wrap-around (or the signed maximum) and per lane the largest exponent."""
    both = Both()
    try:
        for rank in order:
            want = both.deliver(contribution(JOB_A, rank, slot=1, msg=msg, mode=mode,
                                             values=values[rank], exps=exps[rank]),
                                JOB_A["addresses"][rank])
        result = want[0][0]
        got = wire.values(result, 4, 16)
        v = np.array(values, np.int64)
        expect = v.max(axis=0) if mode else (v.sum(axis=0) + 2**31) % 2**32 - 2**31
        assert got.tolist() == expect.tolist()
        assert wire.lane_table(result, 4)["exp"].tolist() == np.max(exps, axis=0).tolist()
    finally:
        both.close()


def test_frame_sized_packets_of_one_lane(monkeypatch):
    """MTU 1500's geometry (wire.frame_geometry: 352 values, one lane): the loops
    run to their full length and the result fills the frame."""
    packet, block = wire.frame_geometry(1500, 16128, 256)
    assert (packet, block) == (352, 352)
    job = dict(JOB_A, packet=packet, block=block, slots=2)
    both = Both(slots=2, packet=packet, block=block, jobs=[job])
    try:
        rng = np.random.default_rng(1)
        rows = rng.integers(-2**31, 2**31, (3, packet), dtype=np.int64).astype(np.int32)
        for msg in range(4):  # both sets, twice, with a retransmission and a probe each
            for rank in range(3):
                data = contribution(job, rank, slot=msg % 2, msg=msg, values=rows[rank] + msg,
                                    exps=[msg + rank])
                want = both.deliver(data, job["addresses"][rank])
            assert len(want) == 3 and len(want[0][0]) + 28 == 1480  # the IP packet
            assert len(both.deliver(data, job["addresses"][2])) == 1
            probe = wire.probe_of(data)
            assert len(both.deliver(probe, job["addresses"][2])) == 1
    finally:
        both.close()


@pytest.mark.parametrize("packet, block", [(2048, 256), (16128, 256)])
def test_packets_past_one_page(packet, block):
    """MTU 9000's geometry (8 lanes of 256 values: 8320-byte datagrams) and the
    switch's default (63 lanes: 65,300 bytes, the most one datagram holds):
    frames of several buffers (multi-buffer XDP), the rows and loops as long as
    the pipeline's packets.  Sums, maxima, a count short of the packet, a
    retransmission, and a probe in a frame padded to the result's length (which
    the program answers in place); unpadded, a frame has no room to grow to the
    result: the probe is passed up to user space, whose receive_datagram pads it."""
    assert (packet, block) in {wire.frame_geometry(9000, 16128, 256), (16128, 256)}
    job = dict(JOB_A, packet=packet, block=block, slots=2)
    both = Both(slots=2, packet=packet, block=block, jobs=[job])
    try:
        assert both.xdp.max_values >= packet
        rng = np.random.default_rng(2)
        lanes = packet // block
        pad = xdp.FRAME_HEADERS + both.ref.datagram_size
        for msg, mode, count in [(0, 0, packet), (1, wire.MODE_MAX, packet), (2, 0, packet - 3),
                                 (3, wire.MODE_MAX, packet - 9)]:
            rows = rng.integers(-2**31, 2**31, (3, packet), dtype=np.int64).astype(np.int32)
            exps = rng.integers(-2**15, 2**15, (3, lanes))
            for rank in range(3):
                data = contribution(job, rank, slot=msg % 2, msg=msg, mode=mode, count=count,
                                    values=rows[rank], exps=exps[rank])
                want = both.deliver(data, job["addresses"][rank])
            assert len(want) == 3 and len(want[0][0]) == wire.packet_size(lanes, count)
            v = rows[:, :count].astype(np.int64)
            expect = v.max(axis=0) if mode else (v.sum(axis=0) + 2**31) % 2**32 - 2**31
            assert wire.values(want[0][0], lanes, count).tolist() == expect.tolist()
            src = job["addresses"][2]  # the last contributor's
            assert both.deliver(data, src) == [(want[0][0], src)]  # a retransmission
            probe = wire.probe_of(data)
            assert both.deliver(probe, src, pad=pad) == [(want[0][0], src)]
        action, out = both.xdp.run_frame(frame(src, probe))
        assert (action, out) == (xdp.XDP_PASS, frame(src, probe))
        assert both.xdp.jobs[job["session"]].counters["probes_passed_up"] == 1
        assert both.xdp.passed_up(probe, src) == [(want[0][0], src)]
    finally:
        both.close()


def test_faulty_worker_traffic_through_both():
    """Real worker engines (dense, int32 and float32) in the simulator with loss,
    duplication and reordering: every datagram goes to both pipelines."""
    from test_fastpath import run_jobs  # the C core's traffic, dense calls only

    for seed, faults in [(1, Faults(loss=0.1, duplicate=0.1, jitter=2e-3)),
                         (2, Faults(loss=0.2, jitter=1e-4)), (3, Faults())]:
        both = Both(jobs=())
        try:
            calls = [("A", "int32", 300, False, 1.0), ("B", "float32", 70, False, 0.6),
                     ("A", "float32", 41, False, 0.2), ("B", "int32", 5, False, 1.0)]
            run_jobs(_SimAdapter(both), seed, faults, calls)
            assert both.deliveries > 0
        finally:
            both.close()


def test_faulty_worker_traffic_of_sparse_and_dense_calls_through_both():
    """Real worker engines alternating dense and sparse calls (OmniReduce's
    rounds, their exponent rounds MODE_MAX, MODE_SEED) in the simulator, with
    loss, duplication and reordering: the program and the sparse path it passes
    up against the Python pipeline, every datagram; the sums exact."""
    from test_fastpath import run_jobs

    for seed, faults in [(4, Faults(loss=0.1, duplicate=0.1, jitter=2e-3)),
                         (5, Faults(loss=0.2, jitter=1e-4)), (6, Faults())]:
        both = Both(jobs=())
        try:
            calls = [("A", "int32", 300, True, 0.3), ("A", "float32", 200, False, 1.0),
                     ("B", "float32", 70, True, 0.5), ("A", "float32", 130, True, 0.1),
                     ("B", "int32", 40, False, 1.0), ("B", "int32", 33, True, 0.0)]
            run_jobs(_SimAdapter(both), seed, faults, calls)
            assert both.sparse_passed_up > 0
            assert both.xdp.totals()["sparse_blocks_in"] > 0
        finally:
            both.close()


class _SimAdapter:
    """Both as the simulator's pipeline: its jobs come from the simulation (with
    the sessions as tokens, as a job without tokens has)."""

    def __init__(self, both: Both):
        self.both = both

    def __getattr__(self, name):
        return getattr(self.both.ref, name)

    def allocate(self, count):
        return self.both.ref.allocate(count)

    def install_job(self, name, session, members, slot_base, slot_count, packet_elements=None,
                    block_elements=None, tokens=None):
        job = self.both.ref.install_job(name, session, members, slot_base, slot_count,
                                        packet_elements, block_elements, tokens)
        self.both.xdp.install_job(name, session, members, slot_base, slot_count,
                                  packet_elements, block_elements, tokens)
        return job

    def remove_job(self, session, state="ended"):
        self.both.xdp.remove_job(session, state)
        return self.both.ref.remove_job(session, state)

    def receive_datagram(self, data, addr):
        return self.both.deliver(bytes(data), addr)


def test_other_traffic_passes_untouched(both):
    """What is not a UDP datagram to the switch's port is the host's: XDP_PASS, the
    frame as it came, nothing counted."""
    data = contribution(JOB_A, 0)
    src = JOB_A["addresses"][0]
    other_port = frame(src, data, dst=(SWITCH[0], SWITCH[1] + 1))
    tcp = bytearray(frame(src, data))
    tcp[23] = socket.IPPROTO_TCP
    ipv6 = bytearray(frame(src, data))
    ipv6[12:14] = b"\x86\xdd"
    later_fragment = frame(src, data, frag=0x0010)
    arp = SWITCH_MAC + WORKER_MAC + b"\x08\x06" + bytes(28)
    for f in (other_port, bytes(tcp), bytes(ipv6), later_fragment, arp):
        assert both.xdp.run_frame(f) == (xdp.XDP_PASS, f)
    assert without_zeros(both.xdp.totals()) == {}


def test_frames_the_kernel_would_drop_are_dropped_and_counted_apart(both):
    """Python's switch never sees a datagram the kernel drops (bad IP checksum,
    lengths that disagree); the program drops them, and the IP options and first
    fragments it does not parse, under counters of its own."""
    data = contribution(JOB_A, 0)
    src = JOB_A["addresses"][0]
    cases = {
        "dropped_bad_ip_udp": [frame(src, data, bad_checksum=True),
                               frame(src, data, udp_len=7),
                               frame(src, data, udp_len=8 + len(data) + 1),
                               frame(src, data)[:-4]],
        "dropped_ip_options": [frame(src, data, ip_options=b"\x01\x01\x01\x00")],
        "dropped_ip_fragment": [frame(src, data, frag=0x2000)],
    }
    for counter, frames in cases.items():
        for f in frames:
            assert both.xdp.run_frame(f)[0] == xdp.XDP_DROP
        assert both.xdp.counters[counter] == len(frames)
    assert without_zeros(both.ref.totals()) == {}
    both.check_slots()
    # a UDP length shorter than the IP packet's: the kernel trims the datagram to
    # it, here to a valid contribution
    assert both.xdp.run_frame(frame(src, data + bytes(8), udp_len=8 + len(data)))[0] == \
        xdp.XDP_DROP
    assert both.xdp.jobs[JOB_A["session"]].counters["packets_in"] == 1


@DIFF
@given(seed=st.integers(0, 2**32 - 1), rounds=st.integers(1, 24),
       replay=st.sampled_from([0.0, 0.2, 0.5]), hostile_rate=st.sampled_from([0.0, 0.1, 0.4]))
def test_sparse_and_dense_calls_same_datagrams_counters_and_slots(seed, rounds, replay,
                                                                  hostile_rate):
    """Sparse calls (OmniReduce's blocks, with or without MODE_SEED) among dense
    ones on the same slots, reordered, replayed, probed, disagreeing (on the
    sparseness too), out of step, made hostile: the program's dense path and
    the sparse path it passes up to user space (``passed_up``), against the
    Python pipeline alone; equal after every datagram, the slot state in the
    program's maps included (which the program answers the sparse sets'
    probes from)."""
    both = Both()
    try:
        for data, src in traffic(random.Random(seed), rounds, replay, hostile_rate, sparse=True):
            both.deliver(data, src)
    finally:
        both.close()


def test_sparse_traffic_goes_up_and_completes():
    """The traffic of the test above does what it is for: sparse contributions
    passed up, sparse sets completed, started over dense ones and dense ones
    over them, their probes answered by the program (seeds chosen here, not by
    hypothesis, so that this holds for each)."""
    totals: Counter = Counter()
    for seed in range(4):
        both = Both()
        try:
            for data, src in traffic(random.Random(seed), 40, 0.3, 0.1, sparse=True):
                both.deliver(data, src)
            assert both.sparse_passed_up > 0
            totals.update(both.ref.totals())
        finally:
            both.close()
    for counter in ("sparse_blocks_in", "sparse_blocks_out", "sparse_blocks_skipped",
                    "results_completed", "retransmissions_answered", "resends_asked",
                    "dropped_mismatch", "dropped_bad_block_count", "duplicates"):
        assert totals[counter] > 0, counter


def test_sparse_calls_aggregate_in_user_space_on_the_programs_sets(both, caplog):
    """A sparse call of job A (three ranks, blocks of their own) goes up, whole,
    to passed_up, which completes it on the set in the program's maps: the
    result holds the blocks any rank sent, summed and compacted; the program
    answers its probe itself (XDP_TX) from the maps; a retransmission of a
    sparse contribution goes up and gets the stored result; dense calls on the
    same slot before and after, in the program; the job's sparse path logged
    once."""
    import logging

    caplog.set_level(logging.INFO, "switchml.switch")
    rng = np.random.default_rng(5)
    lanes, block = JOB_A["packet"] // JOB_A["block"], JOB_A["block"]
    srcs = JOB_A["addresses"]
    for msg in range(4):  # sparse, dense, dense over the sparse set, sparse over the dense
        sparse = msg in (0, 3)
        full = rng.integers(-2**31, 2**31, (3, lanes, block), dtype=np.int64).astype(np.int32)
        present = [[0, 2], [2], []] if msg == 0 else [[1], [1, 3], [0, 1]]
        for rank in range(3):
            if sparse:
                table = np.zeros(lanes, wire.LANE)
                table["pos"], table["nxt"] = 10, 11
                table["flag"][present[rank]] = wire.FLAG_BLOCK
                data = wire.encode(wire.KIND_CONTRIBUTION, 0, 1, JOB_A["tokens"][rank], msg, 0,
                                   0, table, full[rank, present[rank]].ravel(),
                                   mode=wire.MODE_SPARSE)
            else:
                data = contribution(JOB_A, rank, slot=1, msg=msg, values=full[rank].ravel())
            want = both.deliver(data, srcs[rank])
        assert [a for _, a in want] == srcs
        if sparse:
            blocks = sorted({b for p in present for b in p})
            sums = np.zeros((lanes, block), np.int64)
            for rank in range(3):
                sums[present[rank]] += full[rank, present[rank]]
            expect = ((sums[blocks] + 2**31) % 2**32 - 2**31).ravel()
            assert wire.values(want[0][0], lanes, len(blocks) * block).tolist() == \
                expect.tolist()
            assert both.xdp.set_registers(msg & 1, 1)["id_count"] == len(blocks) * block
            # a retransmission goes up and gets the stored result
            assert both.deliver(data, srcs[2]) == [(want[0][0], srcs[2])]
        # the probe of the complete set: answered by the program, from its maps
        probe = wire.probe_of(data)
        action, out = both.xdp.run_frame(frame(srcs[2], probe))
        assert action == xdp.XDP_TX and unpack(out)[4] == want[0][0]
        both.ref.receive_datagram(probe, srcs[2])  # as both.deliver: the reference counts it
        both.check()
    counters = both.xdp.jobs[JOB_A["session"]].counters
    assert counters["sparse_passed_up"] == both.sparse_passed_up == 2 * 3 + 2
    assert counters["results_completed"] == 4
    said = [r for r in caplog.records if "sparse calls" in r.getMessage()]
    assert len(said) == 1 and "'A'" in said[0].getMessage()


def test_a_gso_run_is_passed_up_and_a_long_datagram_in_user_space_is_bad_length():
    """A UDP GSO super-packet (a same-host sender's run of datagrams, which XDP
    sees whole): the program passes it up for the kernel to cut
    (``gso_passed_up``), a result never; run again from user space, where the
    kernel has cut every run already, a datagram that long is ``bad_length``,
    as in the Python pipeline."""
    p = xdp.XdpPipeline(SLOTS, PACKET, block_elements=BLOCK)
    try:
        p.install_job("A", JOB_A["session"], JOB_A["addresses"], 0, 4, tokens=JOB_A["tokens"])
        src = JOB_A["addresses"][0]
        run = contribution(JOB_A, 0, slot=0) + contribution(JOB_A, 0, slot=1)
        action, _ = p._prog.test_run(frame(src, run), 4096)  # as it comes in
        p.sync_counters()
        job = p.jobs[JOB_A["session"]].counters
        assert action == xdp.XDP_PASS and job["gso_passed_up"] == 1
        assert p.run_frame(frame(src, run))[0] == xdp.XDP_DROP  # from user space
        p.sync_counters()
        assert job["gso_passed_up"] == 1 and job["dropped_bad_length"] == 1
        # a result a member sends, however long, is dropped (bad_length, as the
        # Python pipeline counts it): never passed up to be fanned out
        result = bytearray(run)
        result[3] = wire.KIND_RESULT
        assert p._prog.test_run(frame(src, bytes(result)), 4096)[0] == xdp.XDP_DROP
        # shorter than a header past what it says: bad_length in the kernel too
        assert p._prog.test_run(frame(src, contribution(JOB_A, 0) + bytes(31)), 4096)[0] == \
            xdp.XDP_DROP
        p.sync_counters()
        assert job["gso_passed_up"] == 1 and job["dropped_bad_length"] == 3
        assert job["packets_in"] == 0
    finally:
        p.close()


def test_jobs_come_and_go_and_keep_their_counters(both):
    """Removing a job forgets its members at once (their datagrams are a
    stranger's); a new job on the same slots and addresses starts clean."""
    src = JOB_B["addresses"][0]
    both.deliver(contribution(JOB_B, 0, slot=2, msg=1), src)
    for p in (both.ref, both.xdp):
        p.remove_job(JOB_B["session"])
    both.deliver(contribution(JOB_B, 0, slot=2, msg=1), src)
    assert both.xdp.ended_jobs == both.ref.ended_jobs
    assert both.xdp.ended_jobs["B"]["counters"]["packets_in"] == 1
    both.install(dict(JOB_B, session=0xB0B2, tokens=[7, 8]))
    job = both.jobs[0xB0B2]
    both.deliver(contribution(job, 0, slot=2, msg=1), src)
    both.deliver(contribution(job, 0, slot=2, msg=1, token=0xB1), src)  # the old token
    stats = both.xdp.stats()
    # the kernel's count of the programs' runs, which the reference has no twin of
    assert set(stats.pop("program_runs")) == set(stats.pop("program_time_s")) == \
        {"xdp_pipeline", "fan_out_results"}
    assert stats.pop("xdp_mode") is None  # attached nowhere: serve() says how
    assert stats.pop("xdp_results_in_runs") is False
    assert stats == both.ref.stats()


def test_the_programs_runs_and_time_are_counted_while_statistics_are_on():
    """``count_run_time``: the kernel counts each run of the program and its
    time while the fd is open, and no longer once it is closed."""
    p = xdp.XdpPipeline(SLOTS, PACKET, block_elements=BLOCK)
    try:
        p.install_job("A", JOB_A["session"], JOB_A["addresses"], 0, 4, tokens=JOB_A["tokens"])
        counting = xdp_loader.count_run_time()
        try:
            before = p.stats()
            for rank in range(3):
                p.receive_datagram(contribution(JOB_A, rank), JOB_A["addresses"][rank])
            during = p.stats()
        finally:
            os.close(counting)
        for rank in range(3):
            p.receive_datagram(contribution(JOB_A, rank, msg=1), JOB_A["addresses"][rank])
        after = p.stats()
    finally:
        p.close()
    runs = [s["program_runs"]["xdp_pipeline"] for s in (before, during, after)]
    times = [s["program_time_s"]["xdp_pipeline"] for s in (before, during, after)]
    assert runs[1] - runs[0] == 3 and times[1] > times[0]
    if xdp_loader.run_time_counted_always():  # another process, or the setting, has it on
        return
    assert runs[2] == runs[1] and times[2] == times[1]


def test_members_must_be_ipv4_and_packets_have_at_most_64_lanes():
    with pytest.raises(ValueError, match="at most 64 lanes"):
        xdp.XdpPipeline(4, 8192, block_elements=64)
    p = xdp.XdpPipeline(4, 512, block_elements=512)
    try:
        with pytest.raises(ValueError, match="IPv4"):
            p.install_job("x", 5, [("worker", 0)], 0, 1)
        with pytest.raises(ValueError, match="lanes"):  # 66 lanes of one value: rows hold it
            p.install_job("x", 5, [("10.0.0.1", 1)], 0, 1, 66, 1)
        assert p.jobs == {} and p.free_slots() == 4
    finally:
        p.close()


def test_results_to_every_rank_through_receive_datagram():
    """The loader's own frames (receive_datagram) agree with these tests' frames."""
    p = xdp.XdpPipeline(SLOTS, PACKET, block_elements=BLOCK)
    try:
        p.install_job("A", JOB_A["session"], JOB_A["addresses"], 0, 4, tokens=JOB_A["tokens"])
        out = []
        for rank in range(3):
            out = p.receive_datagram(contribution(JOB_A, rank, values=[rank + 1] * 16),
                                     JOB_A["addresses"][rank])
        assert [a for _, a in out] == JOB_A["addresses"]
        assert wire.values(out[0][0], 4, 16).tolist() == [6] * 16
        assert Counter(p.jobs[JOB_A["session"]].counters) == Counter(
            packets_in=3, results_completed=1, results_out=3)
    finally:
        p.close()


def test_a_result_completed_by_a_datagram_its_ip_packet_pads_has_its_own_lengths(both):
    """The kernel trims an IP packet longer than its UDP datagram to the datagram
    (udp_rcv), and so does the program; the result that datagram completes is
    sent with its own IP length, which the ranks' kernels check (with the
    contribution's, every rank dropped it as truncated)."""
    src = JOB_A["addresses"][2]
    for rank in range(2):
        both.deliver(contribution(JOB_A, rank), JOB_A["addresses"][rank])
    data = contribution(JOB_A, 2)
    [(want, _), *_] = both.ref.receive_datagram(data, src)
    action, out = both.xdp.run_frame(frame(src, data + bytes(40), udp_len=8 + len(data)))
    assert action == xdp.XDP_PASS
    _, _, ip_src, ip_dst, payload = unpack(out)  # lengths and checksum checked there
    assert (ip_src, ip_dst, payload) == (src, SWITCH, bytes(want))


def test_a_result_reaching_the_socket_is_sent_on_only_where_the_program_completed_it():
    """What the program passes up is one datagram to the switch's socket, or a run
    of them the kernel cuts there (UDP GSO, passed up on its first header's
    word): a result in it from a member's address was sent to every rank.  Only
    the program's own result is: the row of a set it completed, every byte."""
    p = xdp.XdpPipeline(SLOTS, PACKET, block_elements=BLOCK)
    try:
        p.install_job("A", JOB_A["session"], JOB_A["addresses"], 0, 4, tokens=JOB_A["tokens"])
        src = JOB_A["addresses"][0]
        for rank in range(3):
            action, out = p.run_frame(frame(JOB_A["addresses"][rank],
                                            contribution(JOB_A, rank, values=[rank + 1] * 16)))
        assert action == xdp.XDP_PASS
        result = unpack(out)[4]
        assert [a for _, a in p.passed_up(result, src)] == JOB_A["addresses"]
        forged = bytearray(result)
        forged[-4:] = (666).to_bytes(4, "little")
        of_a_set_not_complete = bytearray(result)
        of_a_set_not_complete[6:8] = (1).to_bytes(2, "little")  # slot 1
        for bad in (forged, of_a_set_not_complete, result[:-4]):
            assert p.passed_up(bytes(bad), src) == []
        counters = p.jobs[JOB_A["session"]].counters
        assert counters["dropped_unverified_result"] == 3 and counters["results_passed_up"] == 1
    finally:
        p.close()


def test_a_datagram_to_the_port_of_another_host_is_not_the_switchs():
    """Serving an interface, the program knows the switch's address: on a bridge's
    port or a router it sees datagrams between other hosts, to the same port,
    which pass untouched; those to the switch are its own."""
    p = xdp.XdpPipeline(SLOTS, PACKET, block_elements=BLOCK, port=SWITCH[1],
                        switch_ip=SWITCH[0])
    try:
        p.install_job("A", JOB_A["session"], JOB_A["addresses"], 0, 4, tokens=JOB_A["tokens"])
        p._configure(socket.if_nametoindex("lo"))  # as serve() configures it
        src, data = JOB_A["addresses"][0], contribution(JOB_A, 0)
        for other in (frame(src, data, dst=("10.255.0.2", SWITCH[1])),
                      frame(src, data + bytes(4), dst=("10.255.0.2", SWITCH[1]),
                            ip_options=b"\x01\x01\x01\x00")):
            assert p.run_frame(other) == (xdp.XDP_PASS, other)
        assert without_zeros(p.totals()) == {}
        assert p.run_frame(frame(src, data))[0] == xdp.XDP_DROP  # added: waits for the rest
        assert p.jobs[JOB_A["session"]].counters["packets_in"] == 1
    finally:
        p.close()


def lost_at_their_rates(p, rounds: int, datagram_of) -> Counter:
    """``rounds`` rounds of job A's ranks' ``datagram_of(rank, round)`` (ones)
    through ``p``, whose drop rates are 0.3 in and 0.5 out: every result the
    sum, every datagram in and copy out accounted for, each lost at about its
    rate; the job's counters."""
    copies = 0
    for n in range(rounds):  # each slot's messages in turn: a lost one's set is reset
        for rank in range(3):
            out = p.receive_datagram(datagram_of(rank, n), JOB_A["addresses"][rank])
            copies += len(out)
            assert all(wire.values(d, 4, 16).tolist() == [3] * 16 for d, _ in out)
    p.sync_counters()
    job = p.jobs[JOB_A["session"]].counters
    lost_in = p.counters["dropped_ingress_simulated"]
    assert lost_in + job["packets_in"] == 3 * rounds
    assert 0.2 * 3 * rounds < lost_in < 0.4 * 3 * rounds
    completed, lost_out = job["results_completed"], job["dropped_egress_simulated"]
    assert completed > rounds * 0.7**3 / 2
    assert copies == job["results_out"] == 3 * completed - lost_out
    assert completed < lost_out < 2 * completed  # half of 3 a result
    return job


def test_simulated_drops_lose_datagrams_in_and_copies_out_at_their_rates():
    """drop_rate and egress_drop_rate as the Python pipeline simulates them: a
    datagram in is lost before anything else counts it
    (``dropped_ingress_simulated``), each result copy and each answer to a probe
    out alone (``dropped_egress_simulated``, not in ``results_out``); every
    datagram and copy is accounted for, and the losses come at their rates."""
    p = xdp.XdpPipeline(SLOTS, PACKET, block_elements=BLOCK, drop_rate=0.3,
                        egress_drop_rate=0.5, seed=1)
    try:
        p.install_job("A", JOB_A["session"], JOB_A["addresses"], 0, 4, tokens=JOB_A["tokens"])
        rounds = 300
        job = lost_at_their_rates(p, rounds, lambda rank, n: contribution(
            JOB_A, rank, slot=n % 4, msg=n // 4, values=[1] * 16))
        # a probe of a set that completed is answered with its result, or lost
        msg = rounds // 4
        while p.slot_state(0, msg) != (True, 0b111):
            msg += 1
            for rank in range(3):
                p.receive_datagram(contribution(JOB_A, rank, slot=0, msg=msg),
                                   JOB_A["addresses"][rank])
        p.sync_counters()
        before = Counter(job)
        probe = wire.probe_of(contribution(JOB_A, 0, slot=0, msg=msg), wire.KIND_PROBE)
        answers = sum(len(p.receive_datagram(probe, JOB_A["addresses"][0])) for _ in range(200))
        p.sync_counters()
        asked = job["retransmissions_answered"] - before["retransmissions_answered"]
        assert asked == job["probes_in"] - before["probes_in"] > 100  # the rest lost coming in
        lost = job["dropped_egress_simulated"] - before["dropped_egress_simulated"]
        assert answers + lost == asked and 0.3 * asked < answers < 0.7 * asked
    finally:
        p.close()


def test_sparse_contributions_are_lost_coming_in_once_at_the_rate():
    """With simulated drops, a sparse contribution meets the ingress drop once:
    in the program, which passes up the rest; the reference's sparse path in
    user space does not draw it again (which would lose about half, 0.51, at a
    rate of 0.3).  The results it sends alone meet the egress drop there."""
    p = xdp.XdpPipeline(SLOTS, PACKET, block_elements=BLOCK, drop_rate=0.3,
                        egress_drop_rate=0.5, seed=2)
    try:
        p.install_job("A", JOB_A["session"], JOB_A["addresses"], 0, 4, tokens=JOB_A["tokens"])
        table = np.zeros(PACKET // BLOCK, wire.LANE)
        table["pos"], table["nxt"], table["flag"] = 0, 1, wire.FLAG_BLOCK
        job = lost_at_their_rates(p, 300, lambda rank, n: wire.encode(
            wire.KIND_CONTRIBUTION, 0, n % 4, JOB_A["tokens"][rank], n // 4, 0, 0, table,
            np.ones(PACKET, np.int32), mode=wire.MODE_SPARSE))
        assert job["sparse_passed_up"] == job["packets_in"]
    finally:
        p.close()


# ---------------------------------------------------------------- several CPUs
def _race_on(prog_fd: int, cpu: int, runs, rounds: int, barrier, conn, result_values: dict,
             values_at: int) -> None:
    """A child process on CPU ``cpu``: round after round, every one of ``runs``
    ((slot, frame, delta): its ranks' contributions and probes, slot by slot)
    through BPF_PROG_TEST_RUN, the round's message number plus delta patched in
    (a run whose message would be negative waits for a later round).  Sends back
    the results passed up (round, slot), how many of them were wrong, the
    answers to one rank (XDP_TX: stored results), how many of those were wrong,
    and any other action."""
    import ctypes
    import os

    try:
        os.sched_setaffinity(0, {cpu})
        lib = xdp_loader.libbpf()
        prepared = []
        for slot, data, delta in runs:
            data_in = ctypes.create_string_buffer(data, len(data))
            data_out = ctypes.create_string_buffer(8192)
            opts = xdp_loader.test_run_opts(data_in, data_out)
            prepared.append((slot, delta, data_in, data_out, opts, ctypes.byref(opts)))
        results, wrong, answered, wrong_answers, other = [], 0, 0, 0, Counter()
        for r in range(rounds):
            for _, delta, data_in, _, _, _ in prepared:  # the header's msg, before the start
                struct.pack_into("<I", data_in, 42 + 12, max(r + delta, 0))
            barrier.wait(timeout=30)  # both CPUs start the round together
            for slot, delta, _, data_out, opts, ref in prepared:
                if r + delta < 0:
                    continue
                opts.data_size_out = len(data_out)
                rc = lib.bpf_prog_test_run_opts(prog_fd, ref)
                if rc:
                    raise OSError(-rc, "BPF_PROG_TEST_RUN")
                out = data_out.raw[: opts.data_size_out]
                whole = out[42 + values_at:] == result_values[slot] and \
                    out[42 + 3] == wire.KIND_RESULT and \
                    int.from_bytes(out[42 + 12:42 + 16], "little") == r + delta
                if opts.retval == xdp.XDP_PASS:  # a completed result
                    results.append((r, slot))
                    wrong += not whole
                elif opts.retval == xdp.XDP_TX:  # a stored result, to the prober
                    answered += 1
                    wrong_answers += not whole
                elif opts.retval != xdp.XDP_DROP:
                    other[opts.retval] += 1
        conn.send((results, wrong, answered, wrong_answers, other))
    except BaseException as exc:  # the parent reports it
        conn.send(exc)


def _race(slots: int, rounds: int, probes: int, packet: int = 512, block: int = 128):
    """Two processes pinned to two CPUs, each 16 ranks of a 32-rank job, feed the
    same ``slots`` slots round after round (a message a round), slot by slot,
    starting each round together; with ``probes`` (a number), the second CPU
    starts each slot with that many probes of the message two rounds back (the
    same set, which the first CPU's first contribution of the round starts
    afresh at that moment).  Returns the pipeline's job counters, what the
    children saw, and the expected results."""
    import multiprocessing

    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs two CPUs")
    world, lanes = 32, packet // block
    job = dict(name="race", session=0x5ACE, slot_base=0, slots=slots, packet=packet,
               block=block, addresses=[(f"10.0.1.{1 + r % 2}", 7000 + r) for r in range(world)],
               tokens=[0x1000 + r for r in range(world)])
    p = xdp.XdpPipeline(slots, packet, block_elements=block, port=SWITCH[1],
                        switch_ip=SWITCH[0])
    try:
        p.install_job(job["name"], job["session"], job["addresses"], 0, slots, packet, block,
                      tokens=job["tokens"])
        rng = np.random.default_rng(27)
        values = rng.integers(-2**31, 2**31, (world, slots, packet), dtype=np.int64)
        exps = rng.integers(-2**15, 2**15, (world, slots, lanes))
        values_at = wire.HEADER_SIZE + wire.LANE_SIZE * lanes
        sums = ((values.sum(axis=0) + 2**31) % 2**32 - 2**31).astype("<i4")
        result_values = {s: sums[s].tobytes() for s in range(slots)}
        runs: dict = {}
        for half, cpu in enumerate(cpus[:2]):
            mine = runs[cpu] = []
            for s in range(slots):
                for rank in range(half * 16, half * 16 + 16):
                    data = contribution(job, rank, slot=s, values=values[rank, s],
                                        exps=exps[rank, s])
                    mine.append((s, frame(job["addresses"][rank], data), 0))
                if probes and half == 1:  # first, a burst of probes: CPU 0 starts the set then
                    burst = [(s, frame(job["addresses"][16 + i % 16], wire.probe_of(
                        contribution(job, 16 + i % 16, slot=s))), -2) for i in range(probes)]
                    at = len(mine) - 16
                    mine[at:at] = burst
        ctx = multiprocessing.get_context("fork")  # the children use the loaded program's fd
        barrier = ctx.Barrier(2)
        pipes, children = [], []
        for cpu, mine in runs.items():
            here, there = ctx.Pipe(duplex=False)
            child = ctx.Process(target=_race_on, args=(p._prog.prog_fd, cpu, mine, rounds,
                                                       barrier, there, result_values, values_at))
            child.start()
            pipes.append(here)
            children.append(child)
        answers = [pipe.recv() for pipe in pipes]
        for child in children:
            child.join(timeout=60)
        for answer in answers:
            if isinstance(answer, BaseException):
                raise answer
        p.sync_counters()  # the per-CPU counters, summed
        registers = {(v, s): (p.set_registers(v, s), p.row(v, s)) for v in (0, 1)
                     for s in range(slots)}
        return without_zeros(p.jobs[job["session"]].counters), answers, dict(
            world=world, packet=packet, values_at=values_at, result_values=result_values,
            exps=exps, registers=registers)
    finally:
        p.close()


def test_two_cpus_adding_to_the_same_slots_at_once_lose_nothing():
    """The program runs on every CPU that receives a frame, at once: the set's
    bpf_spin_lock makes a contribution's read-modify-write of the set and its row
    atomic.  Two processes, each pinned to its own CPU, feed 16 ranks each of a
    32-rank job into the same two slots, slot by slot, starting each round
    together: every contribution must be added exactly once (every round
    completes each slot once, with the exact wrap-around sums and the largest
    exponents; no duplicate, no stale, nothing lost).  Without the lock, two CPUs
    initialise or add to the same set at once and lose contributions (checked:
    it fails)."""
    slots, rounds = 2, 1500
    counters, answers, want = _race(slots, rounds, probes=0)
    world, packet, values_at = want["world"], want["packet"], want["values_at"]
    results = [r for got, *_ in answers for r in got]
    wrong = sum(a[1] for a in answers)
    missing = rounds * slots - len(set(results))
    twice = len(results) - len(set(results))
    assert (wrong, missing, twice) == (0, 0, 0), \
        f"of {rounds * slots} results, {wrong} wrong, {missing} missing, {twice} twice"
    assert [(a[2], a[4]) for a in answers] == [(0, Counter())] * 2  # nothing else out
    assert sorted(results) == [(r, s) for r in range(rounds) for s in range(slots)]
    assert counters == {"packets_in": rounds * slots * world,
                        "results_completed": rounds * slots,
                        "results_out": rounds * slots * world}
    for r in (rounds - 2, rounds - 1):  # the last two rounds' sets, one each
        for s in range(slots):
            regs, row = want["registers"][r & 1, s]
            assert regs["count"] == world and regs["bitmap"] == 2**world - 1
            assert row[values_at:values_at + 4 * packet] == want["result_values"][s]
            table = np.frombuffer(row[wire.HEADER_SIZE:values_at], wire.LANE)
            assert table["exp"].tolist() == want["exps"][:, s].max(axis=0).tolist()


def test_two_cpus_probing_a_set_another_starts_afresh_get_whole_results():
    """A probe of a complete set is answered with a copy of its row, taken under
    the set's lock: a CPU that starts the set's next message (overwriting the
    row) at the same time cannot tear it.  In the race above, on one slot, the
    second CPU begins each round with 8 probes of the message two rounds back
    while the first CPU starts the set afresh: every answer must be that
    message's whole result (or none: stale), and the adds stay exact.  Without
    the lock in the probe's path (the contributions' kept), 5 to 15 answers of
    11,000 to 20,000 were torn in each of 8 runs: it fails, by a margin thinner
    than the adds' test."""
    slots, rounds = 1, 4000
    # the largest rows a page holds: the longer the copies, the wider the window
    counters, answers, want = _race(slots, rounds, probes=8, packet=768)
    results = [r for got, *_ in answers for r in got]
    wrong_answers = sum(a[3] for a in answers)
    answered = sum(a[2] for a in answers)
    assert wrong_answers == 0, f"{wrong_answers} of {answered} answers to probes torn"
    assert answered > 0  # some probes found their set complete
    assert sum(a[1] for a in answers) == 0
    assert sorted(results) == [(r, s) for r in range(rounds) for s in range(slots)]
    assert counters["packets_in"] == rounds * slots * want["world"]
    assert counters["retransmissions_answered"] == answered



def _probe_while(prog_fd: int, cpu: int, probe: bytes, progress, done, expected: dict,
                 conn) -> None:
    """A child process on CPU ``cpu``: until ``done``, probes (``probe``, its
    message patched in) of the messages around ``progress`` (the one the parent
    aggregates: it and the two before) through BPF_PROG_TEST_RUN.  Sends back
    how many answers were stored results, how many of those were not the whole
    result of the message probed (``expected``), and any action but XDP_TX or
    XDP_DROP."""
    import ctypes

    try:
        os.sched_setaffinity(0, {cpu})
        lib = xdp_loader.libbpf()
        data_in = ctypes.create_string_buffer(probe, len(probe))
        data_out = ctypes.create_string_buffer(8192)
        opts = xdp_loader.test_run_opts(data_in, data_out)
        ref = ctypes.byref(opts)
        answers, wrong, other = 0, 0, Counter()
        while not done.is_set():
            now = progress.value
            for msg in range(max(0, now - 2), now + 1):
                struct.pack_into("<I", data_in, 42 + 12, msg)
                opts.data_size_out = len(data_out)
                rc = lib.bpf_prog_test_run_opts(prog_fd, ref)
                if rc:
                    raise OSError(-rc, "BPF_PROG_TEST_RUN")
                payload = data_out.raw[42: opts.data_size_out]
                if opts.retval == xdp.XDP_TX and payload[3] == wire.KIND_RESULT:
                    answers += 1
                    wrong += payload != expected[msg]
                elif opts.retval not in (xdp.XDP_TX, xdp.XDP_DROP):
                    other[opts.retval] += 1
        conn.send((answers, wrong, other))
    except BaseException as exc:  # the parent reports it
        conn.send(exc)


def test_probes_on_another_cpu_while_user_space_aggregates_sparse_sets_get_whole_results():
    """The program answers a sparse set's probes from its maps while user space
    writes that set (``_store_set``): a child on another CPU probes, without a
    pause, the message the parent aggregates by passed_up and the two before
    (the same set: each sparse message starts afresh over the one two back);
    every stored result it gets must be the whole result of the message it
    asked for, and the parent's results the Python pipeline's.  Writing the row
    before the registers that make the set hold the new message (a probe of the
    old message then reads a row half new) makes this fail."""
    import multiprocessing

    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs two CPUs")
    packet, block, messages = 768, 192, 1500
    job = dict(JOB_A, packet=packet, block=block, slots=1, addresses=JOB_A["addresses"][:2],
               tokens=JOB_A["tokens"][:2])
    ref = Pipeline(1, packet, block_elements=block)
    p = xdp.XdpPipeline(1, packet, block_elements=block, port=SWITCH[1], switch_ip=SWITCH[0])
    try:
        for pipeline in (ref, p):
            pipeline.install_job("A", job["session"], job["addresses"], 0, 1, packet, block,
                                 tokens=job["tokens"])
        rng = random.Random(8)
        calls, expected = [], {}
        for msg in range(messages):
            pos = [msg] * (packet // block)
            datagrams = [sparse_contribution(job, rank, rng, pos, msg=msg,
                                             values=[rng.randrange(-2**31, 2**31)
                                                     for _ in range(packet)])
                         for rank in range(2)]
            for rank, data in enumerate(datagrams):
                out = ref.receive_datagram(data, job["addresses"][rank])
            expected[msg] = bytes(out[0][0]) if out else None
            calls.append(datagrams)
        probe = frame(job["addresses"][1], wire.probe_of(calls[0][1]))
        ctx = multiprocessing.get_context("fork")
        progress, done = ctx.Value("l", 0), ctx.Event()
        here, there = ctx.Pipe(duplex=False)
        child = ctx.Process(target=_probe_while, args=(p._prog.prog_fd, cpus[1], probe,
                                                       progress, done, expected, there))
        os.sched_setaffinity(0, {cpus[0]})
        child.start()
        try:
            got = {}
            for msg, datagrams in enumerate(calls):
                progress.value = msg
                for rank, data in enumerate(datagrams):
                    out = p.passed_up(data, job["addresses"][rank])
                got[msg] = out[0][0] if out else None
        finally:
            done.set()
            answer = here.recv()
            child.join(timeout=60)
            os.sched_setaffinity(0, cpus)
        if isinstance(answer, BaseException):
            raise answer
        answers, wrong, other = answer
        assert got == expected
        assert (wrong, other) == (0, Counter()), f"{wrong} of {answers} answers torn"
        assert answers > 0
    finally:
        p.close()
