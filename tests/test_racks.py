"""Two levels of aggregation: rack switches under a spine (switch/racks/pipeline.py, sim/racks.py).

The rack's pipeline is driven by hand first (what goes up, what comes down, what
a retransmission makes it do), then whole calls run through R racks and a spine
in the simulator, with seeded loss, duplication and reordering on every link,
and must give bit for bit what one flat switch gives the same inputs.  The control
relay and real sockets: test_racks_control.py; the emulated cluster:
test_racks_testbed.py.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import make_inputs, reference_sum

from switchml import wire
from switchml.sim.network import Faults, Simulation
from switchml.sim.racks import SPINE, Fabric, RackedJob, RackFailure, run_together
from switchml.switch.racks.pipeline import RackPipeline, Uplink

K = 16       # packet_elements
SLOTS = 4    # a job's window
LOSSY = Faults(loss=0.05, duplicate=0.05, jitter=0.002)
HARSH = Faults(loss=0.15, duplicate=0.1, jitter=0.01)  # jitter past the RTO: reordering


def same_bits(outs, expected):
    for out in outs:
        assert out.dtype == expected.dtype
        assert out.tobytes() == expected.tobytes()


def fabric(racks, faults=None, uplink_faults=None, seed=0, slots=32):
    return Fabric(racks, slots=slots, packet_elements=K, faults=faults,
                  uplink_faults=uplink_faults, seed=seed)


# ---------------------------------------------------------------- the rack's pipeline by hand
W = [("w", r) for r in range(3)]
SPINE_ADDR = ("spine", 9)
UP = Uplink(SPINE_ADDR, ("rack0", 1), session=0xBEEF, slot_base=10, member=0)
S = 0xA11CE


def contribution(slot, msg, values, *, exps=(0,), session=S, seq=3, pkt_id=1):
    lanes = np.zeros(1, wire.LANE)
    lanes["exp"] = exps
    return wire.encode(wire.KIND_CONTRIBUTION, wire.DTYPE_FLOAT32, slot, session, msg, seq,
                       pkt_id, lanes, np.asarray(values, np.int32))


def result(slot, msg, values, *, exps=(0,), session=0xBEEF, seq=3, pkt_id=1):
    lanes = np.zeros(1, wire.LANE)
    lanes["exp"] = exps
    return wire.encode(wire.KIND_RESULT, wire.DTYPE_FLOAT32, slot, session, msg, seq, pkt_id,
                       lanes, np.asarray(values, np.int32))


def send(p, data, addr):
    return [(bytes(d), a) for d, a in p.receive_datagram(data, addr)]


def rack_with_job(members=2):
    p = RackPipeline(slots=8, packet_elements=4, block_elements=4)
    job = p.install_job("j", S, W[:members], 2, 4, uplink=UP)
    return p, job


def test_a_set_complete_at_the_rack_goes_up_as_one_contribution_to_the_spine():
    p, job = rack_with_job()
    assert send(p, contribution(3, 5, [1, 2, 3, 4], exps=(-2,)), W[0]) == []
    out = send(p, contribution(3, 5, [10, 20, 30, 40], exps=(7,)), W[1])
    assert len(out) == 1 and out[0][1] == UP
    h = wire.decode_header(out[0][0])
    # the spine's session and slot (rack slot 3 is the job's slot 1: spine slot 11),
    # the same message and call
    assert h == wire.Header(wire.KIND_CONTRIBUTION, wire.DTYPE_FLOAT32, 0, 11, 0xBEEF, 5, 3,
                            1, 4, 1)
    assert wire.values(out[0][0], 1, 4).tolist() == [11, 22, 33, 44]
    assert wire.first_lane_exponent(out[0][0]) == 7
    assert job.counters["partials_up"] == 1 and job.counters["results_out"] == 0


def test_the_spines_result_becomes_the_sets_result_for_every_worker():
    p, job = rack_with_job()
    send(p, contribution(3, 5, [1, 2, 3, 4]), W[0])
    send(p, contribution(3, 5, [1, 2, 3, 4]), W[1])
    out = send(p, result(11, 5, [100, 200, 300, 400], exps=(9,)), SPINE_ADDR)
    assert [a for _, a in out] == W[:2]
    for datagram, _ in out:
        h = wire.decode_header(datagram)
        assert (h.kind, h.session, h.slot, h.msg, h.seq, h.pkt_id) == (
            wire.KIND_RESULT, S, 3, 5, 3, 1)  # the rack's own session and slot
        assert wire.values(datagram, 1, 4).tolist() == [100, 200, 300, 400]
        assert wire.first_lane_exponent(datagram) == 9
    # a second copy from the spine is not sent down again
    assert send(p, result(11, 5, [100, 200, 300, 400]), SPINE_ADDR) == []
    assert job.counters["upstream_duplicates"] == 1
    assert job.counters["results_from_spine"] == 1


def test_a_retransmission_resends_the_partial_until_the_spine_answers_then_that_worker_alone():
    p, job = rack_with_job()
    send(p, contribution(3, 5, [1, 2, 3, 4]), W[0])
    first = send(p, contribution(3, 5, [5, 6, 7, 8]), W[1])
    again = send(p, contribution(3, 5, [5, 6, 7, 8]), W[1])  # its result never came
    assert [a for _, a in again] == [UP] and again[0][0] == first[0][0]
    assert job.counters["upstream_resent"] == 1
    send(p, result(11, 5, [6, 8, 10, 12]), SPINE_ADDR)
    answer = send(p, contribution(3, 5, [1, 2, 3, 4]), W[0])
    assert [a for _, a in answer] == [W[0]]
    assert wire.decode_header(answer[0][0]).kind == wire.KIND_RESULT
    assert job.counters["retransmissions_answered"] == 1


def test_an_incomplete_set_neither_goes_up_nor_takes_the_spines_result():
    p, job = rack_with_job()
    send(p, contribution(3, 5, [1, 2, 3, 4]), W[0])
    assert send(p, contribution(3, 5, [1, 2, 3, 4]), W[0]) == []  # a duplicate
    assert send(p, result(11, 5, [1, 1, 1, 1]), SPINE_ADDR) == []
    assert job.counters["dropped_upstream_stale"] == 1
    assert job.counters["duplicates"] == 1


def test_the_spines_results_that_do_not_fit_a_set_are_dropped_and_counted():
    p, job = rack_with_job()
    send(p, contribution(3, 5, [1, 2, 3, 4]), W[0])
    send(p, contribution(3, 5, [1, 2, 3, 4]), W[1])
    assert send(p, result(11, 3, [1, 1, 1, 1]), SPINE_ADDR) == []        # an older message
    assert send(p, result(11, 5, [1, 1, 1, 1], seq=4), SPINE_ADDR) == []  # another call
    assert send(p, result(15, 5, [1, 1, 1, 1]), SPINE_ADDR) == []        # not the job's slot
    assert send(p, result(11, 5, [1, 1, 1, 1], session=7), SPINE_ADDR) == []
    assert send(p, b"junk", SPINE_ADDR) == []
    c = job.counters
    assert (c["dropped_upstream_stale"], c["dropped_upstream_mismatch"],
            c["dropped_upstream_foreign"]) == (1, 1, 1)
    assert p.counters["dropped_upstream_unknown_session"] == 1
    assert p.counters["dropped_upstream_truncated"] == 1
    assert c["results_out"] == 0


def test_a_newer_message_overwrites_a_set_that_holds_the_spines_result():
    """The shadow copies alternate as on a flat switch: message 7 takes set 1 afresh."""
    p, job = rack_with_job()
    for msg, value in ((5, 1), (7, 2)):
        send(p, contribution(3, msg, [value] * 4), W[0])
        up = send(p, contribution(3, msg, [value] * 4), W[1])
        assert wire.values(up[0][0], 1, 4).tolist() == [2 * value] * 4
        down = send(p, result(11, msg, [value * 10] * 4), SPINE_ADDR)
        assert len(down) == 2
    assert job.counters["results_from_spine"] == 2


def test_uplinks_are_one_per_job_and_removed_with_it():
    p, _ = rack_with_job()
    with pytest.raises(ValueError, match="already belongs"):
        p.install_job("k", S + 1, [("x", 0)], 6, 2,
                      uplink=Uplink(SPINE_ADDR, UP.source, 0xC0FFEE, 0))
    p.remove_job(S)
    assert send(p, result(11, 5, [1, 1, 1, 1]), SPINE_ADDR) == []
    assert p.counters["dropped_unknown_source"] == 1  # no job goes up to it any more
    assert p.stats()["jobs"] == {}


# ---------------------------------------------------------------- whole calls, two levels
PLACEMENTS = {
    "2x2": [0, 0, 1, 1],
    "interleaved 3x2": [0, 1, 2, 0, 1, 2],
    "uneven": [1, 1, 1, 0],
    "one rack": [0, 0, 0],
    "a rank a rack": [0, 1, 2, 3],
}


@pytest.mark.parametrize("placement", PLACEMENTS.values(), ids=PLACEMENTS.keys())
@pytest.mark.parametrize("dtype", [np.float32, np.int32])
@pytest.mark.parametrize("faults", [None, LOSSY, HARSH], ids=["clean", "lossy", "harsh"])
def test_two_levels_give_the_flat_switchs_bits(placement, dtype, faults):
    racks = max(placement) + 1
    job = RackedJob(fabric(racks, faults, seed=len(placement)), placement, slots=SLOTS)
    for call, size in enumerate([K * SLOTS * 3 + 5, 1, K, 0, K * 7 - 1]):
        arrays = make_inputs(len(placement), size, dtype, seed=call)
        expected = reference_sum(arrays, K)
        same_bits(job.allreduce(arrays), expected)


def test_loss_on_the_uplinks_alone_is_repaired_by_resending_partials():
    fab = fabric(2, uplink_faults=Faults(loss=0.3, duplicate=0.1, jitter=0.003), seed=4)
    job = RackedJob(fab, [0, 0, 0, 1, 1, 1], slots=SLOTS)
    for call in range(3):
        arrays = make_inputs(6, K * SLOTS * 4 + 3, np.float32, seed=10 + call)
        same_bits(job.allreduce(arrays), reference_sum(arrays, K))
    counters = [rack.jobs[0x5EED].counters for rack in fab.racks]
    assert all(c["upstream_resent"] > 0 for c in counters)
    assert all(c["dropped_egress_simulated"] == 0 for c in counters)


def test_each_rack_sends_one_partial_per_slot_message():
    """The point of two levels: the spine takes R contributions a message, not n."""
    fab = fabric(2)
    job = RackedJob(fab, [0, 0, 0, 1, 1, 1], slots=SLOTS)
    arrays = make_inputs(6, K * SLOTS * 5, np.int32, seed=1)
    same_bits(job.allreduce(arrays), reference_sum(arrays, K))
    messages = 5 * SLOTS
    spine = fab.spine.jobs[job.spine_job.session].counters
    assert spine["packets_in"] == 2 * messages
    assert spine["results_out"] == 2 * messages
    for rack in fab.racks:
        c = rack.jobs[0x5EED].counters
        assert c["packets_in"] == 3 * messages
        assert c["partials_up"] == c["results_from_spine"] == messages
        assert c["results_out"] == 3 * messages


def test_sparse_calls_fall_out_of_the_same_rules():
    """A rack's compacted partial is a valid sparse contribution: no special case."""
    placement = [0, 1, 0, 1, 2]
    world = len(placement)
    rng = np.random.default_rng(3)
    job = RackedJob(fabric(3, LOSSY, seed=5), placement, slots=SLOTS)
    for call in range(3):
        arrays = []
        for r in range(world):
            # blocks of K values (the packet: one lane), about a fifth of them non-zero
            a = (rng.standard_normal(K * SLOTS * 12) * 2.0 ** (r - 2)).astype(np.float32)
            keep = rng.random(a.size // K) < 0.2 + 0.1 * call
            arrays.append(a * np.repeat(keep, K).astype(np.float32))
        expected = flat_sparse(arrays)
        same_bits(job.allreduce(arrays, sparse=True), expected)
        same_bits(job.allreduce(arrays, sparse=False), expected)


def flat_sparse(arrays):
    out = Simulation(len(arrays), slots=SLOTS, packet_elements=K).allreduce(arrays, sparse=True)
    same_bits(out, reference_sum(arrays, K))  # sparse and dense agree on one switch
    return out[0]


def test_the_16_bit_wire_and_nonfinite_values_fall_out_too():
    placement = [0, 0, 1, 1, 1]
    job = RackedJob(fabric(2, LOSSY, seed=6), placement, slots=SLOTS)
    arrays = make_inputs(len(placement), K * SLOTS * 4 + 7, np.float32, seed=9)
    one_switch = Simulation(len(placement), slots=SLOTS, packet_elements=K)
    same_bits(job.allreduce(arrays, wire_bits=16), one_switch.allreduce(arrays, wire_bits=16)[0])
    arrays[1][5], arrays[4][3 * K + 1], arrays[2][3 * K + 1] = np.inf, np.nan, -np.inf
    same_bits(job.allreduce(arrays), reference_sum(arrays, K))


def test_two_jobs_share_the_racks_and_the_spine():
    fab = fabric(2, LOSSY, seed=7)
    a = RackedJob(fab, [0, 0, 1, 1], slots=SLOTS, session=0xA)
    b = RackedJob(fab, [1, 0, 1], slots=SLOTS, session=0xB)
    for call in range(3):
        inputs_a = make_inputs(4, K * SLOTS * 3 + 1, np.float32, seed=call)
        inputs_b = make_inputs(3, K * SLOTS * 2, np.int32, seed=100 + call)
        out_a, out_b = run_together([a, b], [inputs_a, inputs_b])
        same_bits(out_a, reference_sum(inputs_a, K))
        same_bits(out_b, reference_sum(inputs_b, K))
    assert {j.name for j in fab.spine.jobs.values()} == {"spine-10", "spine-11"}
    assert a.spine_job.slot_base != b.spine_job.slot_base


def test_a_dead_rack_fails_the_job_naming_it():
    fab = fabric(3, LOSSY, seed=8)
    job = RackedJob(fab, [0, 0, 1, 1, 2, 2], slots=SLOTS, progress_timeout=1.0)
    arrays = make_inputs(6, K * SLOTS * 20, np.float32, seed=2)
    same_bits(job.allreduce(arrays), reference_sum(arrays, K))
    job.begin(arrays)
    for _ in range(200):  # well into the call
        job.step()
    fab.kill(1)
    with pytest.raises(RackFailure) as failure:
        while not job.finished:
            job.step()
    assert failure.value.racks == [1]
    assert failure.value.ranks == [2, 3]
    assert "rack 1 at ('rack', 1)" in str(failure.value)
    # the ranks of the other racks find it at the spine: rack 1's partial is missing
    for g in (0, 1, 4, 5):
        why = job.why_stalled(g)
        assert isinstance(why, RackFailure), why
        assert (why.racks, why.ranks) == ([1], [2, 3])
        assert "rack 1 at ('rack', 1) (dead) with ranks [2, 3]" in str(why)
        assert "the spine has no partial sums from" in str(why)


def test_the_spine_is_an_ordinary_switch_whose_members_are_the_racks():
    fab = fabric(2)
    job = RackedJob(fab, [1, 0, 1, 0], slots=SLOTS)
    # racks in the order of their lowest rank: rack 1 holds rank 0, so it is member 0
    assert job.racks == [1, 0]
    assert job.spine_job.members == [("uplink", 1, 0x5EED), ("uplink", 0, 0x5EED)]
    assert fab.racks[1].uplinks[0x5EED].member == 0
    assert fab.racks[1].stats()["jobs"][job.name]["uplink"]["spine"] == list(SPINE)


def test_hostile_datagrams_from_the_spine_and_the_workers_are_dropped_never_raised():
    """Random headers (right magic and version, anything else random) and junk, from
    the spine's address and from the workers': counted drops, and nothing goes
    anywhere but to the job's workers or up its uplink."""
    rng = np.random.default_rng(11)
    p, job = rack_with_job()
    send(p, contribution(3, 5, [1, 2, 3, 4]), W[0])
    send(p, contribution(3, 5, [1, 2, 3, 4]), W[1])  # a set waiting for the spine
    for i in range(3000):
        lanes = np.zeros(int(rng.integers(0, 3)), wire.LANE)
        lanes["flag"] = rng.integers(0, 2, lanes.size)
        values = rng.integers(-9, 9, int(rng.integers(0, 6)), dtype=np.int32)
        kind = int(rng.choice([wire.KIND_RESULT, wire.KIND_CONTRIBUTION]))
        datagram = wire.encode(kind, int(rng.integers(0, 3)), int(rng.integers(0, 16)),
                               int(rng.choice([S, 0xBEEF, 7])), int(rng.integers(0, 8)),
                               int(rng.integers(0, 5)), int(rng.integers(0, 3)), lanes, values,
                               mode=int(rng.choice([0, wire.MODE_SPARSE])))
        if i % 7 == 0:
            datagram = datagram[: int(rng.integers(0, len(datagram)))]
        source = [SPINE_ADDR, W[0], W[1], ("stranger", 1)][i % 4]
        for _, to in send(p, datagram, source):
            assert to in W[:2] or to == UP
    totals = p.totals()
    assert sum(v for k, v in totals.items() if k.startswith("dropped_")) > 2000
