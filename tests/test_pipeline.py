"""The switch's data plane, driven directly with datagrams built by wire.encode."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from switchml import wire
from switchml.quant import EXP_NONFINITE, EXP_ZERO
from switchml.switch.dataplane import fastpipeline
from switchml.switch.dataplane import pipeline as pipeline_module
from switchml.switch.dataplane.pipeline import Pipeline, SlotPoolExhausted

#: Every test here runs on the Python reference and on the C core (where built).
DATA_PLANES = [pipeline_module.Pipeline] + (
    [fastpipeline.FastPipeline] if fastpipeline._fastpath is not None else [])


@pytest.fixture(autouse=True, params=DATA_PLANES, ids=lambda cls: cls.__name__)
def data_plane(request, monkeypatch):
    monkeypatch.setitem(globals(), "Pipeline", request.param)
    return request.param

K = 8  # packet_elements of the pipelines built here
BLK = 4  # block_elements: two lanes (two exponents) per packet
LANES = K // BLK
A = [("a", r) for r in range(4)]  # addresses of job A's ranks
B = [("b", r) for r in range(4)]  # addresses of job B's ranks
SA, SB = 0xA11CE, 0xB0B


def pipeline(slots, **kw):
    return Pipeline(slots=slots, packet_elements=K, block_elements=BLK, **kw)


def lanes_with(exps=None, lanes=LANES):
    """Dense lane records: only ``exp`` matters (one per lane, 0 by default)."""
    table = np.zeros(lanes, wire.LANE)
    if exps is not None:
        table["exp"] = exps
    return table


def contrib(slot, session, msg, values, *, seq=0, pkt_id=0, exps=None, lanes=LANES,
            dtype=wire.DTYPE_INT32, kind=wire.KIND_CONTRIBUTION, mode=0) -> bytes:
    return wire.encode(kind, dtype, slot, session, msg, seq, pkt_id, lanes_with(exps, lanes),
                       np.asarray(values, dtype=np.int32), mode=mode)


def sparse_contrib(slot, session, msg, flags, values, *, pos=0, nxt=1, seq=0, pkt_id=0,
                   lanes=LANES, mode=wire.MODE_SPARSE) -> bytes:
    """A sparse contribution: one block of values per flagged lane."""
    table = np.zeros(lanes, wire.LANE)
    table["pos"], table["nxt"], table["flag"] = pos, nxt, flags
    return wire.encode(wire.KIND_CONTRIBUTION, wire.DTYPE_INT32, slot, session, msg, seq,
                       pkt_id, table, np.asarray(values, dtype=np.int32), mode=mode)


def send(p, data, addr):
    """Deliver one datagram; copy the replies out of switch memory at once."""
    return [(bytes(d), a) for d, a in p.receive_datagram(data, addr)]


def decode(datagram):
    h = wire.decode_header(datagram)
    return h, wire.values(datagram, h.lanes, h.count).tolist()


def exps_of(datagram):
    h = wire.decode_header(datagram)
    return wire.lane_table(datagram, h.lanes)["exp"].tolist()


def two_jobs(world_a=2, world_b=2, slots=8):
    p = pipeline(slots)
    ja = p.install_job("A", SA, A[:world_a], 0, slots // 2)
    jb = p.install_job("B", SB, B[:world_b], slots // 2, slots - slots // 2)
    return p, ja, jb


def drop_keys(counter):
    return {k: v for k, v in counter.items() if k.startswith("dropped_")}


# ---------------------------------------------------------------- aggregation
def test_nth_contribution_sends_result_to_every_member():
    p = pipeline(4)
    job = p.install_job("j", SA, A[:3], 0, 4)
    assert send(p, contrib(2, SA, 0, [1, 2, 3], seq=7, pkt_id=5, exps=[-3, 5]), A[0]) == []
    assert send(p, contrib(2, SA, 0, [10, 20, 30], seq=7, pkt_id=5, exps=[4, -1]),
                A[2]) == []
    assert p.slot_state(2, 0) == (True, 0b101)
    out = send(p, contrib(2, SA, 0, [100, 200, 300], seq=7, pkt_id=5, exps=[1, 2]), A[1])
    assert [a for _, a in out] == A[:3]
    for datagram, _ in out:
        h, values = decode(datagram)
        assert h == wire.Header(wire.KIND_RESULT, wire.DTYPE_INT32, 0, 2, SA, 0, 7, 5, 3,
                                LANES)
        assert len(datagram) == wire.packet_size(LANES, 3)
        assert values == [111, 222, 333]
        assert exps_of(datagram) == [4, 5]  # the max per lane
    assert job.counters["results_completed"] == 1
    assert job.counters["results_out"] == 3
    assert job.counters["packets_in"] == 3
    assert p.slot_state(2, 0) == (True, 0b111)


def test_result_echoes_dtype_and_count_of_the_message():
    p = pipeline(2)
    p.install_job("j", SA, A[:2], 0, 2)
    send(p, contrib(1, SA, 4, [1] * K, seq=1, pkt_id=9, dtype=wire.DTYPE_FLOAT32,
                    exps=[EXP_ZERO, 2]), A[1])
    out = send(p, contrib(1, SA, 4, [2] * K, seq=1, pkt_id=9, dtype=wire.DTYPE_FLOAT32,
                          exps=[-7, EXP_ZERO]), A[0])
    assert len(out) == 2
    h, values = decode(out[0][0])
    assert (h.dtype, h.mode, h.count, h.lanes, h.msg, h.seq, h.pkt_id) == \
        (wire.DTYPE_FLOAT32, 0, K, LANES, 4, 1, 9)
    assert exps_of(out[0][0]) == [-7, 2]
    assert values == [3] * K
    # an empty message (exponent seed) completes with an empty result
    send(p, contrib(0, SA, 0, [], exps=[EXP_NONFINITE, EXP_ZERO]), A[0])
    out = send(p, contrib(0, SA, 0, [], exps=[3, 7]), A[1])
    h, values = decode(out[0][0])
    assert (h.count, h.lanes, values) == (0, LANES, [])
    assert exps_of(out[0][0]) == [EXP_NONFINITE, 7]


def test_world_of_one_completes_at_once():
    p = pipeline(1)
    p.install_job("solo", SA, A[:1], 0, 1)
    out = send(p, contrib(0, SA, 0, [5, -6]), A[0])
    assert len(out) == 1 and out[0][1] == A[0]
    assert decode(out[0][0])[1] == [5, -6]


def test_first_contribution_of_a_newer_message_overwrites():
    p = pipeline(2)
    p.install_job("j", SA, A[:2], 0, 2)
    send(p, contrib(0, SA, 0, [5, 5, 5, 5], exps=[20, 20]), A[0])
    out = send(p, contrib(0, SA, 0, [7, 7, 7, 7], exps=[20, 20]), A[1])
    assert decode(out[0][0])[1] == [12, 12, 12, 12]
    # msg 1 uses the other set; msg 2 reuses set 0 and must not add to 12
    send(p, contrib(0, SA, 1, [1, 1, 1, 1]), A[1])
    send(p, contrib(0, SA, 1, [1, 1, 1, 1]), A[0])
    assert send(p, contrib(0, SA, 2, [1, 2, 3], exps=[1, EXP_ZERO]), A[1]) == []
    assert p.slot_state(0, 2) == (True, 0b10)
    out = send(p, contrib(0, SA, 2, [10, 20, 30], exps=[-5, 2]), A[0])
    h, values = decode(out[0][0])
    assert (h.msg, h.count, values) == (2, 3, [11, 22, 33])
    # nor max its exponents with those of msg 0
    assert exps_of(out[0][0]) == [1, 2]


def test_new_job_on_reused_slots_starts_fresh():
    p = pipeline(2)
    p.install_job("old", SA, A[:2], 0, 2)
    send(p, contrib(0, SA, 0, [100, 100]), A[0])  # incomplete, left behind
    send(p, contrib(1, SA, 0, [1, 1]), A[0])
    send(p, contrib(1, SA, 0, [1, 1]), A[1])       # complete
    p.remove_job(SA)
    p.install_job("new", SB, B[:2], 0, 2)
    # same slot and message number as the old job: still a fresh aggregation
    assert send(p, contrib(0, SB, 0, [3, 4]), B[0]) == []
    out = send(p, contrib(0, SB, 0, [5, 6]), B[1])
    assert decode(out[0][0])[1] == [8, 10]
    assert send(p, contrib(1, SB, 0, [3, 4]), B[1]) == []  # not a "retransmission"
    out = send(p, contrib(1, SB, 0, [1, 1]), B[0])
    assert decode(out[0][0])[1] == [4, 5]


def test_duplicate_before_completion_is_never_added_twice():
    p = pipeline(2)
    job = p.install_job("j", SA, A[:3], 0, 2)
    send(p, contrib(1, SA, 0, [1, 2]), A[0])
    for _ in range(3):
        assert send(p, contrib(1, SA, 0, [1, 2]), A[0]) == []
    send(p, contrib(1, SA, 0, [10, 20]), A[1])
    assert send(p, contrib(1, SA, 0, [10, 20]), A[1]) == []
    assert job.counters["duplicates"] == 4
    assert p.slot_state(1, 0) == (True, 0b011)
    out = send(p, contrib(1, SA, 0, [100, 200]), A[2])
    assert len(out) == 3
    assert decode(out[0][0])[1] == [111, 222]


def test_duplicate_after_completion_answers_that_rank_only():
    p = pipeline(2)
    job = p.install_job("j", SA, A[:3], 0, 2)
    for r in range(3):
        out = send(p, contrib(0, SA, 6, [r + 1, 10 * (r + 1)], seq=3, pkt_id=2), A[r])
    first = out[0][0]
    for r in (1, 0, 2, 1):
        again = send(p, contrib(0, SA, 6, [r + 1, 10 * (r + 1)], seq=3, pkt_id=2), A[r])
        assert len(again) == 1
        assert again[0][1] == A[r]
        assert again[0][0] == first  # the stored result, unchanged
        assert decode(again[0][0])[1] == [6, 60]
    assert job.counters["retransmissions_answered"] == 4
    assert job.counters["results_completed"] == 1
    assert job.counters["results_out"] == 3 + 4


def test_stored_result_survives_use_of_the_other_set():
    p = pipeline(1)
    p.install_job("j", SA, A[:2], 0, 1)
    send(p, contrib(0, SA, 0, [1]), A[0])
    send(p, contrib(0, SA, 0, [2]), A[1])
    send(p, contrib(0, SA, 1, [40]), A[0])  # rank 0 moved on, set 1
    # rank 1 lost the result of msg 0 and retransmits it
    out = send(p, contrib(0, SA, 0, [2]), A[1])
    assert [(decode(d)[1], a) for d, a in out] == [([3], A[1])]
    out = send(p, contrib(0, SA, 1, [2]), A[1])
    assert [decode(d)[1] for d, _ in out] == [[42], [42]]


def test_mismatched_ids_for_the_same_message_are_dropped():
    p = pipeline(1)
    job = p.install_job("j", SA, A[:2], 0, 1)
    send(p, contrib(0, SA, 0, [1, 1], seq=1, pkt_id=0), A[0])
    for bad in (contrib(0, SA, 0, [1, 1], seq=2, pkt_id=0),
                contrib(0, SA, 0, [1, 1], seq=1, pkt_id=1),
                contrib(0, SA, 0, [1, 1, 1], seq=1, pkt_id=0),
                contrib(0, SA, 0, [1, 1], seq=1, pkt_id=0, dtype=wire.DTYPE_FLOAT32),
                # a sparse message where a dense one is aggregated
                sparse_contrib(0, SA, 0, [1, 0], [1] * BLK, seq=1, pkt_id=0)):
        assert send(p, bad, A[1]) == []
    assert job.counters["dropped_mismatch"] == 5
    assert p.slot_state(0, 0) == (True, 0b01)
    out = send(p, contrib(0, SA, 0, [2, 3], seq=1, pkt_id=0), A[1])
    assert decode(out[0][0])[1] == [3, 4]


def test_exponent_is_the_max_over_contributions():
    p = pipeline(1)
    p.install_job("j", SA, A[:4], 0, 1)
    # one exponent per lane (block), maxed lane by lane, independently
    exps = [[EXP_ZERO, 4], [-20, EXP_ZERO], [17, -3], [3, 5]]
    for r, e in enumerate(exps):
        out = send(p, contrib(0, SA, 0, [1], exps=e, dtype=wire.DTYPE_FLOAT32), A[r])
    assert all(exps_of(d) == [17, 5] for d, _ in out)
    exps = [[5, 1], [EXP_NONFINITE, 2], [EXP_ZERO, EXP_NONFINITE], [-1, -32767]]
    for r, e in enumerate(exps):
        out = send(p, contrib(0, SA, 1, [1] * K, exps=e, dtype=wire.DTYPE_FLOAT32), A[r])
    assert exps_of(out[0][0]) == [EXP_NONFINITE, EXP_NONFINITE]
    for r in range(4):
        out = send(p, contrib(0, SA, 2, [0], exps=[EXP_ZERO, EXP_ZERO if r else 0],
                              dtype=wire.DTYPE_FLOAT32), A[r])
    assert exps_of(out[0][0]) == [EXP_ZERO, 0]
    for r in range(4):
        out = send(p, contrib(0, SA, 3, [0], exps=[EXP_ZERO, EXP_ZERO],
                              dtype=wire.DTYPE_FLOAT32), A[r])
    assert exps_of(out[0][0]) == [EXP_ZERO, EXP_ZERO]


@settings(max_examples=40, derandomize=True, deadline=None)
@given(n=st.integers(1, 8), data=st.data())
def test_exponents_are_maxed_per_lane_in_any_order(n, data):
    p = Pipeline(slots=1, packet_elements=12, block_elements=3)  # four lanes
    members = [("w", r) for r in range(n)]
    p.install_job("j", SA, members, 0, 1)
    exps = [data.draw(st.lists(st.integers(-32768, 32767), min_size=4, max_size=4))
            for _ in range(n)]
    for r in data.draw(st.permutations(range(n))):
        out = send(p, contrib(0, SA, 0, [r] * 12, exps=exps[r], lanes=4,
                              dtype=wire.DTYPE_FLOAT32), members[r])
    expected = np.max(np.array(exps), axis=0).tolist()
    assert [exps_of(d) for d, _ in out] == [expected] * n
    assert decode(out[0][0])[1] == [n * (n - 1) // 2] * 12


# ---------------------------------------------------------------- stale
def test_stale_message_is_dropped_and_counted():
    p = pipeline(1)
    job = p.install_job("j", SA, A[:2], 0, 1)
    for m in (0, 1):
        send(p, contrib(0, SA, m, [1]), A[0])
        send(p, contrib(0, SA, m, [1]), A[1])
    send(p, contrib(0, SA, 2, [5]), A[0])
    # msg 0 maps to the same set as msg 2 but is older
    assert send(p, contrib(0, SA, 0, [1000]), A[1]) == []
    assert send(p, contrib(0, SA, 0, [1000]), A[0]) == []
    assert job.counters["dropped_stale"] == 2
    assert p.slot_state(0, 2) == (True, 0b01)
    out = send(p, contrib(0, SA, 2, [6]), A[1])
    assert decode(out[0][0])[1] == [11]


def test_message_numbers_wrap_around():
    p = pipeline(1)
    job = p.install_job("j", SA, A[:2], 0, 1)
    top = 0xFFFFFFFF
    for m, vals in ((top - 1, [1]), (top, [2]), (0, [3]), (1, [4]), (2, [5])):
        send(p, contrib(0, SA, m, vals), A[0])
        out = send(p, contrib(0, SA, m, [v * 10 for v in vals]), A[1])
        h, values = decode(out[0][0])
        assert (h.msg, values) == (m, [vals[0] * 11])
    # 0xFFFFFFFF is older than 1 (same set) and 0 is older than 2
    assert send(p, contrib(0, SA, top, [9]), A[0]) == []
    assert send(p, contrib(0, SA, 0, [9]), A[1]) == []
    assert job.counters["dropped_stale"] == 2
    # message 1 (older, set 1) is still answered from the shadow copy
    out = send(p, contrib(0, SA, 1, [4]), A[0])
    assert [(decode(d)[1], a) for d, a in out] == [([44], A[0])]


# ---------------------------------------------------------------- drops
def _assert_bad_packet_dropped(p, data, addr, where, key):
    before = dict(where)
    assert send(p, data, addr) == []
    after = dict(where)
    assert after.get(key, 0) == before.get(key, 0) + 1, (key, before, after)
    changed = {k for k in set(before) | set(after) if before.get(k) != after.get(k)}
    assert changed == {key}


def test_bad_packets_are_dropped_counted_and_leave_a_concurrent_job_alone():
    p, ja, jb = two_jobs(world_a=2, world_b=3, slots=8)
    slot = 5  # job B's
    send(p, contrib(slot, SB, 3, [1, 2, 3], seq=4, pkt_id=1), B[0])
    send(p, contrib(0, SA, 0, [1, 1, 1]), A[0])  # job A in progress too
    state_b, state_a = p.slot_state(slot, 3), p.slot_state(0, 0)
    good = contrib(slot, SB, 3, [10, 20, 30], seq=4, pkt_id=1)
    attacks = [
        # unknown source address, otherwise a perfect packet for job B
        (good, ("mallory", 1), p.counters, "dropped_unknown_source"),
        (good, B[3], p.counters, "dropped_unknown_source"),  # rank beyond job B's world
        # job A's member writing into job B's slot: wrong session from its address...
        (good, A[1], ja.counters, "dropped_bad_token"),
        # ...or with its own session: slot outside job A's range
        (contrib(slot, SA, 3, [10, 20, 30], seq=4, pkt_id=1), A[1], ja.counters,
         "dropped_slot_out_of_range"),
        # job B's member with a wrong session
        (contrib(slot, SB + 1, 3, [10, 20, 30], seq=4, pkt_id=1), B[1], jb.counters,
         "dropped_bad_token"),
        # job B's member on a slot outside B's range (job A's slot, and past the pool)
        (contrib(0, SB, 0, [5, 5, 5]), B[1], jb.counters, "dropped_slot_out_of_range"),
        (contrib(3, SB, 0, [5, 5, 5]), B[1], jb.counters, "dropped_slot_out_of_range"),
        (contrib(8, SB, 3, [5]), B[1], jb.counters, "dropped_slot_out_of_range"),
        (contrib(0xFFFF, SB, 3, [5]), B[1], jb.counters, "dropped_slot_out_of_range"),
        # more values than a slot holds
        (contrib(slot, SB, 3, list(range(K + 1)), seq=4, pkt_id=1), B[1], jb.counters,
         "dropped_too_many_values"),
        (contrib(slot, SB, 3, list(range(K + BLK)), seq=4, pkt_id=1), B[1], jb.counters,
         "dropped_too_many_values"),
        # a lane table of another pipeline's size
        (contrib(slot, SB, 3, [10, 20, 30], seq=4, pkt_id=1, lanes=LANES - 1), B[1],
         jb.counters, "dropped_bad_lanes"),
        (contrib(slot, SB, 3, [10, 20, 30], seq=4, pkt_id=1, lanes=LANES + 1), B[1],
         jb.counters, "dropped_bad_lanes"),
        (contrib(slot, SB, 3, [10, 20, 30], seq=4, pkt_id=1, lanes=0), B[1],
         jb.counters, "dropped_bad_lanes"),
        # sparse: values that are not one whole block per flagged lane
        (sparse_contrib(slot, SB, 3, [1, 0], [1] * (BLK - 1), seq=4, pkt_id=1), B[1],
         jb.counters, "dropped_bad_block_count"),
        (sparse_contrib(slot, SB, 3, [1, 1], [1] * BLK, seq=4, pkt_id=1), B[1],
         jb.counters, "dropped_bad_block_count"),
        (sparse_contrib(slot, SB, 3, [0, 0], [1] * BLK, seq=4, pkt_id=1), B[1],
         jb.counters, "dropped_bad_block_count"),
        (sparse_contrib(slot, SB, 3, [2, 0], [1] * BLK, seq=4, pkt_id=1), B[1],
         jb.counters, "dropped_bad_block_count"),  # flag bit 1 is not "block present"
        # a result pretending to be a contribution
        (contrib(slot, SB, 3, [10, 20, 30], seq=4, pkt_id=1, kind=wire.KIND_RESULT), B[1],
         jb.counters, "dropped_bad_kind"),
        # malformed bytes
        (good[:20], B[1], jb.counters, "dropped_truncated"),
        (b"", B[1], jb.counters, "dropped_truncated"),
        (b"\x00" * 2 + good[2:], B[1], jb.counters, "dropped_bad_magic"),
        (good[:2] + b"\x07" + good[3:], B[1], jb.counters, "dropped_bad_version"),
        (good[:3] + b"\x09" + good[4:], B[1], jb.counters, "dropped_bad_kind"),
        (good[:4] + b"\x05" + good[5:], B[1], jb.counters, "dropped_bad_dtype"),
        (good[:5] + b"\x05" + good[6:], B[1], jb.counters, "dropped_bad_mode"),
        (good[:5] + bytes([wire.MODE_SEED]) + good[6:], B[1], jb.counters,
         "dropped_bad_mode"),
        (good[:26] + (LANES + 1).to_bytes(2, "little") + good[28:], B[1], jb.counters,
         "dropped_bad_length"),
        (good[:-4], B[1], jb.counters, "dropped_bad_length"),
        (good + b"\x00\x00\x00\x01", B[1], jb.counters, "dropped_bad_length"),
        (good + b"\x01", B[1], jb.counters, "dropped_bad_length"),
    ]
    for data, addr, where, key in attacks:
        _assert_bad_packet_dropped(p, data, addr, where, key)
        assert p.slot_state(slot, 3) == state_b
        assert p.slot_state(0, 0) == state_a
    for key in ("dropped_unknown_source", "dropped_bad_token",
                "dropped_slot_out_of_range", "dropped_too_many_values", "dropped_bad_kind",
                "dropped_truncated", "dropped_bad_length", "dropped_bad_mode",
                "dropped_bad_lanes", "dropped_bad_block_count"):
        assert drop_keys(p.counters).get(key, 0) + drop_keys(ja.counters).get(key, 0) + \
            drop_keys(jb.counters).get(key, 0) > 0
    assert "packets_in" not in jb.counters or jb.counters["packets_in"] == 1
    # the valid job still sums exactly what its ranks sent, once
    assert send(p, good, B[1]) == []
    out = send(p, contrib(slot, SB, 3, [100, 200, 300], seq=4, pkt_id=1), B[2])
    assert [a for _, a in out] == B[:3]
    h, values = decode(out[0][0])
    assert (h.session, h.slot, h.msg, h.seq, h.pkt_id) == (SB, slot, 3, 4, 1)
    assert values == [111, 222, 333]
    out = send(p, contrib(0, SA, 0, [2, 2, 2]), A[1])
    assert [a for _, a in out] == A[:2]
    assert decode(out[0][0])[1] == [3, 3, 3]
    assert jb.counters["results_completed"] == 1 and ja.counters["results_completed"] == 1


def test_receive_datagram_never_raises_on_garbage():
    p, ja, jb = two_jobs()
    rng = np.random.default_rng(1)
    for i in range(300):
        n = int(rng.integers(0, 80))
        data = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        if i % 2 and n >= 2:
            data = b"SM" + data[2:]
        assert send(p, data, B[i % 2]) == []
    assert sum(drop_keys(jb.counters).values()) == 300
    assert not ja.counters
    # and the pipeline still aggregates afterwards
    send(p, contrib(4, SB, 0, [1]), B[0])
    out = send(p, contrib(4, SB, 0, [2]), B[1])
    assert decode(out[0][0])[1] == [3]


def test_contribution_of_exactly_packet_elements_is_accepted():
    p = pipeline(1)
    p.install_job("j", SA, A[:1], 0, 1)
    out = send(p, contrib(0, SA, 0, list(range(K))), A[0])
    assert decode(out[0][0])[1] == list(range(K))


# ---------------------------------------------------------------- int32 arithmetic
def test_int32_sums_wrap_around():
    p = pipeline(1)
    p.install_job("j", SA, A[:3], 0, 1)
    imax, imin = 2**31 - 1, -(2**31)
    send(p, contrib(0, SA, 0, [imax, imin, imax, -1, 0]), A[0])
    send(p, contrib(0, SA, 0, [1, -1, imax, imin, 0]), A[1])
    out = send(p, contrib(0, SA, 0, [0, 0, 2, 0, imin]), A[2])
    assert decode(out[0][0])[1] == [imin, imax, 0, imax, imin]


def test_a_max_contribution_keeps_the_signed_maximum_and_is_not_added():
    """MODE_MAX (sparse exponent rounds): the values are maxed as int32, a
    retransmission gets the stored result, and a rank adding where the others
    max is a mismatch, never mixed into the result."""
    p = pipeline(1)
    p.install_job("j", SA, A[:3], 0, 1)
    lo, hi = EXP_ZERO, EXP_NONFINITE
    send(p, contrib(0, SA, 0, [5, lo, -3, 0], mode=wire.MODE_MAX), A[0])
    send(p, contrib(0, SA, 0, [-7, -148, -3, hi], mode=wire.MODE_MAX), A[1])
    assert send(p, contrib(0, SA, 0, [1, 2, 3, 4]), A[2]) == []  # adds: a mismatch
    assert p.jobs[SA].counters["dropped_mismatch"] == 1
    out = send(p, contrib(0, SA, 0, [6, lo, -100, 1], mode=wire.MODE_MAX), A[2])
    assert len(out) == 3
    header, values = decode(out[0][0])
    assert header.mode == wire.MODE_MAX
    assert values == [6, -148, -3, hi]
    again = send(p, contrib(0, SA, 0, [6, lo, -100, 1], mode=wire.MODE_MAX), A[2])
    assert [addr for _, addr in again] == [A[2]] and decode(again[0][0])[1] == values


@settings(max_examples=60, derandomize=True, deadline=None)
@given(n=st.integers(1, 8), count=st.integers(0, K), data=st.data())
def test_int32_sums_match_numpy_wrapping_sum(n, count, data):
    p = pipeline(1)
    members = [("w", r) for r in range(n)]
    p.install_job("j", SA, members, 0, 1)
    arrays = [data.draw(hnp.arrays(np.int32, count)) for _ in range(n)]
    order = data.draw(st.permutations(range(n)))
    for i, r in enumerate(order):
        out = send(p, contrib(0, SA, 0, arrays[r]), members[r])
        assert (out == []) == (i < n - 1)
    expected = np.zeros(count, np.int32)
    for a in arrays:
        np.add(expected, a, out=expected)
    wide = np.sum([a.astype(np.int64) for a in arrays], axis=0) if count else np.zeros(0)
    assert expected.tolist() == [((int(v) + 2**31) % 2**32) - 2**31 for v in wide]
    for datagram, _ in out:
        assert decode(datagram)[1] == expected.tolist()


# ---------------------------------------------------------------- slot pool
def test_allocate_install_remove_frees_slots():
    p = pipeline(8)
    assert p.free_slots() == 8
    base = p.allocate(8)
    assert base == 0
    p.install_job("j", SA, A[:2], base, 8)
    assert p.free_slots() == 0
    with pytest.raises(SlotPoolExhausted):
        p.allocate(1)
    removed = p.remove_job(SA)
    assert removed is not None and removed.name == "j"
    assert p.free_slots() == 8
    assert p.remove_job(SA) is None
    assert p.allocate(8) == 0
    # the addresses are forgotten: their packets are now from unknown sources
    assert send(p, contrib(0, SA, 0, [1]), A[0]) == []
    assert p.counters["dropped_unknown_source"] == 1
    # and may join a new job
    p.install_job("again", SB, A[:2], 0, 8)


def test_allocate_first_fit_contiguous():
    p = pipeline(8)
    sessions = [11, 12, 13]
    ranges = []
    for s, count in zip(sessions, (3, 2, 3)):
        base = p.allocate(count)
        p.install_job(f"j{s}", s, [("x", s)], base, count)
        ranges.append(base)
    assert ranges == [0, 3, 5]
    with pytest.raises(SlotPoolExhausted):
        p.allocate(1)
    p.remove_job(12)
    assert p.free_slots() == 2
    with pytest.raises(SlotPoolExhausted):
        p.allocate(3)
    assert p.allocate(2) == 3
    p.remove_job(11)
    assert p.free_slots() == 5
    assert p.allocate(5) == 0  # slots 0..4 are contiguous again
    with pytest.raises(SlotPoolExhausted):
        p.allocate(6)
    with pytest.raises(SlotPoolExhausted):
        p.allocate(9)
    p.remove_job(13)
    assert p.free_slots() == 8


def test_install_job_rejects_taken_slots_sessions_and_addresses():
    p = pipeline(8)
    p.install_job("A", SA, A[:2], 0, 4)
    with pytest.raises(ValueError):
        p.install_job("X", SB, B[:2], 3, 2)  # slot 3 taken
    with pytest.raises(ValueError):
        p.install_job("X", SA, B[:2], 4, 2)  # session taken
    with pytest.raises(ValueError):
        p.install_job("X", SB, [A[1]], 4, 2)  # address taken
    with pytest.raises(ValueError):
        p.install_job("X", 0, B[:2], 4, 2)  # session 0 means free
    with pytest.raises(ValueError):
        p.install_job("X", SB, [], 4, 2)
    with pytest.raises(ValueError):
        p.install_job("X", SB, [("m", i) for i in range(33)], 4, 2)
    assert p.free_slots() == 4
    p.install_job("B", SB, [("m", i) for i in range(32)], 4, 4)
    assert p.free_slots() == 0


# ---------------------------------------------------------------- memory
def test_switch_memory_does_not_grow():
    p, ja, jb = two_jobs(world_a=3, world_b=2, slots=8)
    rows = p._rows
    nbytes = rows.nbytes
    shape = rows.shape
    sizes = {name: len(getattr(p, name)[0]) for name in
             ("_valid", "_msg", "_bitmap", "_count", "_blocks", "_ids")}
    lane_regs, values = jb.lane_regs, jb.values
    rng = np.random.default_rng(0)
    msgs = [0] * 8
    expected_out = 0
    for i in range(3000):
        slot = i % 8
        job, addrs, session = (ja, A[:3], SA) if slot < 4 else (jb, B[:2], SB)
        count = int(rng.integers(0, K + 1))
        arrays = rng.integers(-1000, 1000, (len(addrs), count), dtype=np.int32)
        for r, addr in enumerate(addrs):
            out = send(p, contrib(slot, session, msgs[slot], arrays[r], seq=i), addr)
            if r == 0:  # a duplicate on the way, before completion
                assert send(p, contrib(slot, session, msgs[slot], arrays[r], seq=i),
                            addr) == []
        assert decode(out[0][0])[1] == arrays.sum(axis=0).tolist()
        msgs[slot] += 1
        expected_out += len(addrs)
    assert p._rows is rows
    assert p._rows.nbytes == nbytes and p._rows.shape == shape
    assert nbytes == 2 * 8 * (wire.packet_size(LANES, K) + wire.HEADER_SIZE)  # and a resend
    # the lane registers and values are the result datagrams' own bytes
    assert jb.lane_regs is lane_regs and jb.values is values
    assert np.shares_memory(lane_regs, rows) and np.shares_memory(values, rows)
    for name, size in sizes.items():
        assert [len(x) for x in getattr(p, name)] == [size, size]
    assert len(p._owner) == 8
    assert ja.counters["results_out"] + jb.counters["results_out"] == expected_out


def test_constructor_limits():
    with pytest.raises(ValueError):
        Pipeline(slots=0)
    with pytest.raises(ValueError):
        Pipeline(slots=0x10000, packet_elements=K)
    with pytest.raises(ValueError):
        Pipeline(slots=1, packet_elements=0)
    with pytest.raises(ValueError):
        Pipeline(slots=1, packet_elements=K, block_elements=0)
    with pytest.raises(ValueError):
        Pipeline(slots=1, packet_elements=K, block_elements=3)  # not a multiple
    with pytest.raises(ValueError):
        Pipeline(slots=1, packet_elements=K, block_elements=2 * K)
    with pytest.raises(ValueError):  # 64 blocks of 256 do not fit in a datagram
        Pipeline(slots=1, packet_elements=16128 + 256, block_elements=256)
    with pytest.raises(ValueError):  # nor does one block of 16366 values
        Pipeline(slots=1, packet_elements=16366)
    p = Pipeline(slots=1, packet_elements=16128, block_elements=256)
    assert (p.lanes, p.block_elements) == (63, 256)
    assert p._rows.shape == (2, 1, wire.packet_size(63, 16128) + wire.HEADER_SIZE)
    assert p._rows.shape[2] <= wire.MAX_DATAGRAM
    # the defaults: the most 256-value blocks one datagram holds
    p = Pipeline(slots=2)
    assert (p.packet_elements, p.block_elements, p.lanes) == (16128, 256, 63)
    # a packet size that is not a multiple of 256 is one block
    p = Pipeline(slots=1, packet_elements=100)
    assert (p.block_elements, p.lanes) == (100, 1)
    p = Pipeline(slots=1, packet_elements=16365)
    assert (p.block_elements, p.lanes) == (16365, 1)
    p = Pipeline(slots=1, packet_elements=K, block_elements=1)
    assert p.lanes == K and p._rows.shape == (2, 1, wire.packet_size(K, K) + wire.HEADER_SIZE)


# ---------------------------------------------------------------- per-job packet sizes
def test_two_jobs_with_different_packet_sizes_share_a_pipeline():
    p = Pipeline(slots=4, packet_elements=12, block_elements=3)  # rows of 4 lanes, 12 values
    ja = p.install_job("A", SA, A[:2], 0, 2, packet_elements=4, block_elements=2)
    jb = p.install_job("B", SB, B[:3], 2, 2)  # the pipeline's own size
    assert (ja.packet_elements, ja.block_elements, ja.lanes) == (4, 2, 2)
    assert (jb.packet_elements, jb.block_elements, jb.lanes) == (12, 3, 4)
    assert p.stats()["jobs"]["A"]["packet_elements"] == 4
    assert p.stats()["jobs"]["A"]["block_elements"] == 2
    # dense: job A's packets have 2 lanes and at most 4 values
    send(p, contrib(1, SA, 0, [1, 2, 3, 4], exps=[5, -1], lanes=2), A[0])
    out = send(p, contrib(1, SA, 0, [10, 20, 30, 40], exps=[2, 3], lanes=2), A[1])
    assert [a for _, a in out] == A[:2]
    h, values = decode(out[0][0])
    assert (h.lanes, h.count, values) == (2, 4, [11, 22, 33, 44])
    assert len(out[0][0]) == wire.packet_size(2, 4)
    assert exps_of(out[0][0]) == [5, 3]
    for r in range(3):
        out = send(p, contrib(2, SB, 0, list(range(12)), exps=[r, 0, 0, -r], lanes=4), B[r])
    h, values = decode(out[0][0])
    assert (h.lanes, h.count, values) == (4, 12, [3 * i for i in range(12)])
    assert exps_of(out[0][0]) == [2, 0, 0, 0]
    # sparse, job A: blocks of 2 values, lane 1 present on one rank only
    send(p, sparse_contrib(0, SA, 0, [1, 1], [1, 2, 3, 4], pos=0, nxt=3, lanes=2), A[0])
    out = send(p, sparse_contrib(0, SA, 0, [0, 1], [5, 6], pos=0, nxt=1, lanes=2), A[1])
    h, values = decode(out[0][0])
    assert (h.lanes, h.count, values) == (2, 4, [1, 2, 8, 10])
    assert wire.lane_table(out[0][0], 2)["nxt"].tolist() == [1, 1]
    assert ja.counters["sparse_blocks_in"] == 3
    # a packet sized for the other job is dropped by reason, and changes nothing
    before = p.slot_state(3, 0)
    assert send(p, contrib(1, SA, 1, [1] * 4, lanes=4), A[0]) == []
    assert send(p, contrib(1, SA, 1, [1] * 12, lanes=2), A[0]) == []
    assert send(p, contrib(3, SB, 0, [1] * 4, lanes=2), B[0]) == []
    assert send(p, sparse_contrib(3, SB, 0, [1, 0, 0, 0], [1, 2], lanes=4), B[0]) == []
    assert drop_keys(ja.counters) == {"dropped_bad_lanes": 1, "dropped_too_many_values": 1}
    assert drop_keys(jb.counters) == {"dropped_bad_lanes": 1, "dropped_bad_block_count": 1}
    assert p.slot_state(3, 0) == before
    assert p.slot_state(1, 1) == (False, 0)


def test_install_job_refuses_packet_sizes_that_do_not_fit():
    p = Pipeline(slots=4, packet_elements=12, block_elements=3)
    for packet, block in ((0, 1), (4, 0), (5, 2), (-4, 2), (2, 4), (16, 4), (22, 22)):
        with pytest.raises(ValueError):
            p.install_job("X", SA, A[:2], 0, 2, packet_elements=packet, block_elements=block)
    # fewer lanes may carry more values, as long as the datagram fits the row: 32 + 48 + 48
    job = p.install_job("X", SA, A[:2], 0, 2, packet_elements=21, block_elements=21)
    assert job.lanes == 1 and wire.packet_size(1, 21) == p.datagram_size == 128
    with pytest.raises(ValueError, match="more than the switch's slots hold"):
        p.install_job("Y", SB, B[:2], 2, 2, packet_elements=22, block_elements=22)
    assert p.free_slots() == 2  # nothing was installed by the refusals


def test_simulation_runs_a_job_with_smaller_packets_than_the_pipeline():
    from switchml.sim.network import Simulation
    p = Pipeline(slots=8, packet_elements=64, block_elements=8)
    sim = Simulation(3, slots=4, pipeline=p, packet_elements=16, block_elements=4)
    assert (sim.job.packet_elements, sim.job.lanes) == (16, 4)
    assert all(s.packet_elements == 16 for s in sim.memberships)
    rng = np.random.default_rng(0)
    arrays = [rng.integers(-100, 100, 200).astype(np.int32) for _ in range(3)]
    for a in arrays:
        a[40:120] = 0  # whole zero blocks for the sparse path
    for sparse in (False, True):
        outs = sim.allreduce(arrays, sparse=sparse)
        assert all((o == sum(arrays)).all() for o in outs)
    assert sim.job.counters["packets_in"] > 0 and not drop_keys(sim.job.counters)


# ---------------------------------------------------------------- probes
def test_a_probe_is_answered_from_the_bitmap_and_never_changes_a_sum():
    """A retransmission as the header alone: nothing while the set waits for other
    ranks, the stored result when it is complete, a resend to a rank whose
    contribution the set lacks; never a value added."""
    p = pipeline(4)
    job = p.install_job("A", SA, A[:3], 0, 4)
    first = contrib(1, SA, 6, [1] * K, seq=2, pkt_id=9)
    assert send(p, first, A[0]) == []
    # rank 0 is in: its probe waits; rank 1 is not: its probe asks for a resend
    assert send(p, wire.probe_of(first), A[0]) == []
    ((resend, to),) = send(p, wire.probe_of(contrib(1, SA, 6, [2] * K, seq=2, pkt_id=9)), A[1])
    assert to == A[1]
    assert resend == wire.answer_of(wire.probe_of(first), wire.KIND_RESEND)
    h = wire.decode_header(resend)
    assert (h.kind, h.slot, h.msg, h.seq, h.pkt_id, h.count, h.lanes) == (
        wire.KIND_RESEND, 1, 6, 2, 9, 0, 0)
    # a probe for a message newer than the set holds, or on a slot never used: resend
    assert send(p, wire.probe_of(contrib(1, SA, 8, [0] * K)), A[2])[0][0][3] == wire.KIND_RESEND
    assert send(p, wire.probe_of(contrib(3, SA, 0, [0] * K)), A[2])[0][0][3] == wire.KIND_RESEND
    assert send(p, contrib(1, SA, 6, [2] * K, seq=2, pkt_id=9), A[1]) == []
    out = send(p, contrib(1, SA, 6, [3] * K, seq=2, pkt_id=9), A[2])
    assert [a for _, a in out] == A[:3] and decode(out[0][0])[1] == [6] * K
    # complete: a probe gets the stored result, to that rank alone
    ((again, to),) = send(p, wire.probe_of(first), A[2])
    assert (again, to) == (out[0][0], A[2])
    # an older message on the same set is stale
    assert send(p, wire.probe_of(contrib(1, SA, 4, [0] * K)), A[0]) == []
    assert decode(send(p, wire.probe_of(first), A[0])[0][0])[1] == [6] * K  # unchanged
    c = job.counters
    assert (c["probes_in"], c["probes_waiting"], c["resends_asked"]) == (7, 1, 3)
    assert (c["retransmissions_answered"], c["dropped_stale"], c["packets_in"]) == (2, 1, 3)


def test_a_query_of_a_complete_set_is_answered_done_not_with_the_result():
    """The timer's retransmission (a query): as a probe while the set waits or
    lacks the rank's contribution; once it is complete, a done (the result went
    out before it), and the contribution sent whole then gets the stored result."""
    p = pipeline(4)
    job = p.install_job("A", SA, A[:2], 0, 4)
    first = contrib(1, SA, 6, [1] * K, seq=2, pkt_id=9)
    query = wire.probe_of(first, wire.KIND_QUERY)
    assert send(p, first, A[0]) == []
    assert send(p, query, A[0]) == []  # waits for rank 1
    assert send(p, query, A[1])[0][0] == wire.answer_of(query, wire.KIND_RESEND)
    out = send(p, contrib(1, SA, 6, [2] * K, seq=2, pkt_id=9), A[1])
    assert decode(out[0][0])[1] == [3] * K
    ((done, to),) = send(p, query, A[1])
    assert (done, to) == (wire.answer_of(query, wire.KIND_DONE), A[1])
    h = wire.decode_header(done)
    assert (h.kind, h.slot, h.msg, h.seq, h.pkt_id, h.count, h.lanes) == (
        wire.KIND_DONE, 1, 6, 2, 9, 0, 0)
    ((again, to),) = send(p, first, A[0])
    assert (again, to) == (out[0][0], A[0])
    assert decode(again)[1] == [3] * K  # unchanged
    c = job.counters
    assert (c["probes_in"], c["probes_waiting"], c["resends_asked"], c["queries_done"]) == (
        3, 1, 1, 1)
    assert (c["retransmissions_answered"], c["packets_in"]) == (1, 3)


def test_a_probe_with_values_or_lanes_is_dropped():
    p = pipeline(2)
    job = p.install_job("A", SA, A[:2], 0, 2)
    probe = wire.probe_of(contrib(0, SA, 0, [1] * K))
    with_lanes = probe[:26] + (1).to_bytes(2, "little") + probe[28:] + bytes(12)
    with_values = probe[:24] + (1).to_bytes(2, "little") + probe[26:] + bytes(4)
    assert send(p, with_lanes, A[0]) == [] and send(p, with_values, A[0]) == []
    assert job.counters["dropped_bad_probe"] == 2 and job.counters["probes_in"] == 0
    # another job's session, a slot out of range: dropped as a contribution would be
    assert send(p, wire.probe_of(contrib(0, SB, 0, [1] * K)), A[0]) == []
    assert send(p, wire.probe_of(contrib(5, SA, 0, [1] * K)), A[0]) == []
    assert job.counters["dropped_bad_token"] == job.counters["dropped_slot_out_of_range"] == 1


def test_a_resend_posing_as_a_contribution_is_dropped():
    p = pipeline(2)
    job = p.install_job("A", SA, A[:2], 0, 2)
    resend = wire.answer_of(wire.probe_of(contrib(0, SA, 0, [1] * K)), wire.KIND_RESEND)
    assert send(p, resend, A[0]) == []
    assert job.counters["dropped_bad_kind"] == 1


@pytest.mark.parametrize("cls", [Pipeline, fastpipeline.FastPipeline])
def test_the_job_that_ended_last_is_kept_though_its_name_ended_before(cls):
    """Stats keep the last ended job of each name, ENDED_JOBS_KEPT in all, the oldest
    going first: a name that ended before kept its old place, and the job that had
    just ended under it was the first to go."""
    if cls is fastpipeline.FastPipeline and not fastpipeline.available():
        pytest.skip("the C data plane is not built")
    p = cls(slots=8, packet_elements=K)
    names = ["a"] + [f"j{i}" for i in range(pipeline_module.ENDED_JOBS_KEPT - 1)] + ["a", "new"]
    for session, name in enumerate(names, start=1):
        p.install_job(name, session, [("10.0.0.1", 1)], 0, 1)
        p.remove_job(session, "failed" if name == "a" else "ended")
    assert len(p.ended_jobs) == pipeline_module.ENDED_JOBS_KEPT
    assert "a" in p.ended_jobs and "j0" not in p.ended_jobs
