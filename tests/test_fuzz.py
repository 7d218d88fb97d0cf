"""Property tests (hypothesis) of the packet decoder and the switch pipeline under
hostile input: random, truncated, oversized and bit-flipped packets, wrong session,
wrong job, slot out of range, wrong element or lane count, unknown source.

The pipeline must never raise, must count every bad packet exactly once under the
reason it was dropped for, and two concurrent valid jobs must still get exact sums
(numpy's wrapping int32 sum) and exponent maxima, whatever is mixed into their
traffic.  Examples are derandomized: CI sees the same cases every run.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from switchml import wire
from switchml.switch.dataplane import fastpipeline
from switchml.switch.dataplane.pipeline import Pipeline

#: Both data planes: the Python reference and the C core (where it is built).
PIPELINES = [Pipeline] + ([fastpipeline.FastPipeline] if fastpipeline._fastpath else [])

K, BLK = 8, 4  # packet_elements, block_elements: two lanes
LANES = K // BLK
SLOTS = 8
SA, SB = 0x5EED_000A, 0x5EED_000B
JOBS = {  # name: (session, member addresses, slots)
    "A": (SA, [("10.0.0.1", 1000 + r) for r in range(3)], range(0, 4)),
    "B": (SB, [("10.0.0.2", 2000 + r) for r in range(2)], range(4, 8)),
}
# strangers: a member's host with another port, another host with a member's port
STRANGERS = [("10.0.0.1", 999), ("10.0.0.3", 2000)]
FUZZ = settings(max_examples=60, derandomize=True, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

u32 = st.integers(0, 2**32 - 1)
MEMBERS = [(name, addr) for name, (_, addrs, _) in JOBS.items() for addr in addrs]


def build(slot, session, msg, values, *, dtype=wire.DTYPE_INT32, exps=(0, 0), seq=0, pkt_id=0,
          lanes=LANES, kind=wire.KIND_CONTRIBUTION, mode=0, flags=0) -> bytes:
    table = np.zeros(lanes, wire.LANE)
    table["exp"][: len(exps[:lanes])] = exps[:lanes]
    table["flag"] = flags
    return wire.encode(kind, dtype, slot, session, msg, seq, pkt_id, table,
                       np.asarray(values, np.int32), mode=mode)


def new_pipeline(cls=Pipeline):
    p = cls(slots=SLOTS, packet_elements=K, block_elements=BLK)
    jobs = {name: p.install_job(name, session, addrs, slots.start, len(slots))
            for name, (session, addrs, slots) in JOBS.items()}
    return p, jobs


def drops(counter) -> Counter:
    return Counter({k: v for k, v in counter.items() if k.startswith("dropped_")})


# ---------------------------------------------------------------- bad packets
@st.composite
def well_formed(draw, job):
    """A well-formed contribution of ``job`` on one of its slots (only ever sent
    corrupted, or from an address that is not a member)."""
    session, _, slots = JOBS[job]
    count = draw(st.integers(0, K))
    return build(draw(st.sampled_from(slots)), session, draw(u32),
                 draw(st.lists(st.integers(-2**31, 2**31 - 1), min_size=count, max_size=count)),
                 dtype=draw(st.sampled_from([wire.DTYPE_INT32, wire.DTYPE_FLOAT32])),
                 seq=draw(u32), pkt_id=draw(u32))


# (byte offset, bits whose flip always invalidates the packet, reason)
FLIPS = ([(0, range(8), "bad_magic"), (1, range(8), "bad_magic"), (2, range(8), "bad_version"),
          (3, range(3, 8), "bad_kind"),  # not bits 0 to 2: kinds 1 to 6 are all valid
          (4, range(2, 8), "bad_dtype"), (5, range(3, 8), "bad_mode")]
         + [(b, range(8), "bad_length") for b in (24, 25, 26, 27)])  # count, lanes


@st.composite
def bad_packet(draw):
    """(datagram, source address, where it is counted: "switch" or a job, counter)."""
    case = draw(st.sampled_from([
        "stranger_random", "stranger_well_formed", "random", "truncated", "oversized",
        "bit_flip", "wrong_session", "other_jobs_session", "other_jobs_slot",
        "slot_out_of_range", "too_many_values", "bad_lanes", "bad_block_count", "result",
        "probe_with_values"]))
    job, addr = draw(st.sampled_from(MEMBERS))
    other = "B" if job == "A" else "A"
    session, _, slots = JOBS[job]
    template = draw(well_formed(job))
    slot = draw(st.sampled_from(slots))
    values = [1] * draw(st.integers(0, K))
    if case == "stranger_random":
        return draw(st.binary(max_size=120)), draw(st.sampled_from(STRANGERS)), "switch", \
            "dropped_unknown_source"
    if case == "stranger_well_formed":
        return template, draw(st.sampled_from(STRANGERS)), "switch", "dropped_unknown_source"
    if case == "random":
        data = draw(st.binary(max_size=120).filter(lambda b: b[:2] != b"SM"))
        return data, addr, job, "dropped_truncated" if len(data) < 32 else "dropped_bad_magic"
    if case == "truncated":
        n = draw(st.integers(0, len(template) - 1))
        return template[:n], addr, job, "dropped_truncated" if n < 32 else "dropped_bad_length"
    if case == "oversized":
        return template + draw(st.binary(min_size=1, max_size=64)), addr, job, \
            "dropped_bad_length"
    if case == "bit_flip":
        offset, bits, reason = draw(st.sampled_from(FLIPS))
        flipped = bytearray(template)
        flipped[offset] ^= 1 << draw(st.sampled_from(bits))
        return bytes(flipped), addr, job, "dropped_" + reason
    if case == "wrong_session":
        wrong = draw(u32.filter(lambda s: s != session))
        return build(slot, wrong, 0, values), addr, job, "dropped_bad_token"
    if case == "other_jobs_session":  # posing as the other job, on its slots
        other_session, _, other_slots = JOBS[other]
        return build(draw(st.sampled_from(other_slots)), other_session, 0, values), addr, job, \
            "dropped_bad_token"
    if case == "other_jobs_slot":  # its own session, the other job's slots
        return build(draw(st.sampled_from(JOBS[other][2])), session, 0, values), addr, job, \
            "dropped_slot_out_of_range"
    if case == "slot_out_of_range":
        return build(draw(st.integers(SLOTS, 0xFFFF)), session, 0, values), addr, job, \
            "dropped_slot_out_of_range"
    if case == "too_many_values":
        count = draw(st.sampled_from([K + 1, K + BLK, 16366]) | st.integers(K + 1, 4 * K))
        return build(slot, session, 0, np.ones(count)), addr, job, "dropped_too_many_values"
    if case == "bad_lanes":
        lanes = draw(st.integers(0, 6).filter(lambda n: n != LANES))
        return build(slot, session, 0, values, lanes=lanes), addr, job, "dropped_bad_lanes"
    if case == "bad_block_count":
        flags = draw(st.lists(st.integers(0, 3), min_size=LANES, max_size=LANES))
        blocks = sum(f & wire.FLAG_BLOCK for f in flags)
        count = draw(st.integers(0, K).filter(lambda c: c != blocks * BLK))
        return build(slot, session, 0, [1] * count, mode=wire.MODE_SPARSE, flags=flags), addr, \
            job, "dropped_bad_block_count"
    if case == "probe_with_values":  # a probe or query is the header alone
        kind = draw(st.sampled_from([wire.KIND_PROBE, wire.KIND_QUERY]))
        return build(slot, session, 0, values, kind=kind), addr, job, "dropped_bad_probe"
    # what only a switch sends
    kind = draw(st.sampled_from([wire.KIND_RESULT, wire.KIND_RESEND, wire.KIND_DONE]))
    return build(slot, session, 0, values, kind=kind), addr, job, "dropped_bad_kind"


# ---------------------------------------------------------------- valid traffic
def valid_schedule(seed: int, messages_per_slot: int):
    """Contributions of both jobs: per slot, messages one after another (ranks in a
    random order); slots and jobs interleaved at random.  Returns the deliveries
    [(datagram, address, key)] and the expected result per key: (job, slot, msg)."""
    rng = np.random.default_rng(seed)
    queues, expected = [], {}
    for name, (session, addrs, slots) in JOBS.items():
        for slot in slots:
            queue = []
            for msg in range(messages_per_slot):
                count = int(rng.integers(0, K + 1))
                dtype = int(rng.integers(0, 2))
                values = rng.integers(-2**31, 2**31, (len(addrs), count), dtype=np.int64)
                values = values.astype(np.int32)
                exps = rng.integers(-200, 200, (len(addrs), LANES)).astype(np.int16)
                total = np.zeros(count, np.int32)
                for row in values:
                    np.add(total, row, out=total)  # wraps modulo 2**32, as the switch
                key = (name, slot, msg)
                expected[key] = (total.tolist(), exps.max(axis=0).tolist(), dtype)
                for rank in rng.permutation(len(addrs)):
                    queue.append((build(slot, session, msg, values[rank], dtype=dtype,
                                        exps=tuple(exps[rank]), seq=msg, pkt_id=slot),
                                  addrs[rank], key))
            queues.append(queue)
    deliveries = []
    while any(queues):
        live = [q for q in queues if q]
        deliveries.append(live[int(rng.integers(len(live)))].pop(0))
    return deliveries, expected


def check_result(replies, key, expected):
    name, slot, msg = key
    session, addrs, _ = JOBS[name]
    assert sorted(a for _, a in replies) == sorted(addrs)
    datagram = bytes(replies[0][0])
    h = wire.decode_header(datagram)
    total, exps, dtype = expected[key]
    assert (h.kind, h.session, h.slot, h.msg, h.dtype) == (wire.KIND_RESULT, session, slot,
                                                          msg, dtype)
    assert wire.values(datagram, h.lanes, h.count).tolist() == total
    assert wire.lane_table(datagram, h.lanes)["exp"].tolist() == exps


@pytest.mark.parametrize("cls", PIPELINES)
@settings(FUZZ, max_examples=80)
@given(seed=st.integers(0, 2**32 - 1), messages=st.integers(1, 3),
       bad=st.lists(bad_packet(), min_size=10, max_size=40), data=st.data())
def test_pipeline_counts_every_bad_packet_and_both_jobs_stay_exact(cls, seed, messages, bad,
                                                                   data):
    p, jobs = new_pipeline(cls)
    deliveries, expected = valid_schedule(seed, messages)
    positions = sorted(data.draw(st.lists(st.integers(0, len(deliveries)), min_size=len(bad),
                                          max_size=len(bad))))
    stream = list(deliveries)
    for pos, packet in sorted(zip(positions, bad), key=lambda x: -x[0]):
        stream.insert(pos, packet)
    completed = []
    for item in stream:
        if len(item) == 3:  # a valid contribution
            datagram, addr, key = item
            replies = p.receive_datagram(datagram, addr)
            if replies:
                check_result(replies, key, expected)
                completed.append(key)
        else:
            datagram, addr, _, _ = item
            assert p.receive_datagram(datagram, addr) == []
    assert sorted(completed) == sorted(expected)
    want = {"switch": Counter(), "A": Counter(), "B": Counter()}
    for _, _, scope, reason in bad:
        want[scope][reason] += 1
    assert drops(p.counters) == want["switch"]
    for name, job in jobs.items():
        assert drops(job.counters) == want[name], name
        assert job.counters["packets_in"] == len(JOBS[name][1]) * len(JOBS[name][2]) * messages
        assert job.counters["results_completed"] == len(JOBS[name][2]) * messages
        assert job.counters["duplicates"] == job.counters["retransmissions_answered"] == 0
    assert p.free_slots() == 0


PRE_ADMISSION = {"dropped_stale", "dropped_mismatch"}  # these come after admission


@pytest.mark.parametrize("cls", PIPELINES)
@FUZZ
@given(seed=st.integers(0, 2**32 - 1),
       flips=st.lists(st.tuples(st.integers(0, 1), st.integers(0, 10**6),
                                st.lists(st.integers(0, 10**6), min_size=1, max_size=3)),
                      max_size=24))
def test_arbitrary_bit_flips_from_one_job_never_touch_the_other(cls, seed, flips):
    """Flips anywhere in job B's packets may yield packets B itself cannot tell from
    real ones (no checksum: UDP's is the network's), but they never reach job A,
    every packet is either admitted or dropped and counted, and nothing raises."""
    p, jobs = new_pipeline(cls)
    deliveries, expected = valid_schedule(seed, 2)
    a_traffic = [d for d in deliveries if d[2][0] == "A"]
    b_traffic = [d for d in deliveries if d[2][0] == "B"]
    for i, (datagram, addr, key) in enumerate(a_traffic):
        replies = p.receive_datagram(datagram, addr)
        if replies:
            check_result(replies, key, expected)
        if i < len(flips):  # interleave a corrupted copy of some B packet
            which, packet, bits = flips[i]
            corrupted = bytearray(b_traffic[packet % len(b_traffic)][0])
            for bit in bits:
                bit %= 8 * len(corrupted)
                corrupted[bit // 8] ^= 1 << (bit % 8)
            before = Counter(jobs["B"].counters)
            p.receive_datagram(bytes(corrupted), JOBS["B"][1][which])
            delta = Counter(jobs["B"].counters)
            delta.subtract(before)
            admitted = delta["packets_in"]
            dropped_first = sum(v for k, v in delta.items()
                                if k.startswith("dropped_") and k not in PRE_ADMISSION)
            assert admitted + dropped_first == 1, delta
    assert jobs["A"].counters["results_completed"] == len(JOBS["A"][2]) * 2
    assert not drops(jobs["A"].counters) and not drops(p.counters)


# ---------------------------------------------------------------- the decoder
@st.composite
def valid_datagram(draw):
    lanes = draw(st.integers(0, 4))
    count = draw(st.integers(0, 16))
    table = np.zeros(lanes, wire.LANE)
    table["pos"] = draw(st.lists(u32, min_size=lanes, max_size=lanes))
    return wire.encode(draw(st.sampled_from([wire.KIND_CONTRIBUTION, wire.KIND_RESULT])),
                       draw(st.sampled_from([wire.DTYPE_INT32, wire.DTYPE_FLOAT32])),
                       draw(st.integers(0, 0xFFFF)), draw(u32), draw(u32), draw(u32), draw(u32),
                       table, np.ones(count, np.int32),
                       mode=draw(st.sampled_from([0, wire.MODE_SPARSE,
                                                  wire.MODE_SPARSE | wire.MODE_SEED])))


def reason_of(data):
    try:
        wire.decode_header(data)
    except wire.MalformedPacket as exc:
        return exc.reason
    return None


@FUZZ
@given(datagram=valid_datagram(), cut=st.integers(0, 1000))
def test_decoder_refuses_every_truncation(datagram, cut):
    assert reason_of(datagram) is None
    n = cut % len(datagram)
    assert reason_of(datagram[:n]) == ("truncated" if n < 32 else "bad_length")


@FUZZ
@given(datagram=valid_datagram(), extra=st.binary(min_size=1, max_size=64),
       padding=st.integers(0, 70000))
def test_decoder_refuses_every_oversized_datagram(datagram, extra, padding):
    assert reason_of(datagram + extra + bytes(padding)) == "bad_length"


@FUZZ
@given(datagram=valid_datagram(), flip=st.sampled_from(FLIPS), bit=st.integers(0, 7))
def test_decoder_refuses_bit_flips_in_checked_fields_with_the_right_reason(datagram, flip,
                                                                           bit):
    offset, bits, reason = flip
    flipped = bytearray(datagram)
    flipped[offset] ^= 1 << list(bits)[bit % len(bits)]
    assert reason_of(bytes(flipped)) == reason


@FUZZ
@given(datagram=valid_datagram(), position=st.integers(0, 10**6))
def test_decoder_never_raises_anything_else_on_a_bit_flip_anywhere(datagram, position):
    flipped = bytearray(datagram)
    position %= 8 * len(flipped)
    flipped[position // 8] ^= 1 << (position % 8)
    header = None
    try:
        header = wire.decode_header(bytes(flipped))
    except wire.MalformedPacket:
        pass
    if header is not None:  # still well-formed: its length agrees with its counts
        assert len(flipped) == wire.packet_size(header.lanes, header.count)
