"""Two levels of aggregation: rack switches under a spine (switch/rack.py, sim_racks.py).

The rack's pipeline is driven by hand first (what goes up, what comes down, what
a retransmission makes it do), then whole calls run through R racks and a spine
in the simulator, with seeded loss, duplication and reordering on every link,
and must give bit for bit what one flat switch gives the same inputs.
"""

from __future__ import annotations

import contextlib
import threading
import time

import numpy as np
import pytest
from conftest import reference_sum, run_ranks

import switchml
from switchml import Switch, protocol, wire
from switchml.sim import Faults, Simulation
from switchml.sim_racks import SPINE, Fabric, RackedJob, RackFailure, run_together
from switchml.switch.control import Controller
from switchml.switch.pipeline import Pipeline
from switchml.switch.rack import RackPipeline, Uplink
from switchml.switch.rack_control import CloseUplink, RackController, ToSpine

K = 16       # packet_elements
SLOTS = 4    # a job's window
LOSSY = Faults(loss=0.05, duplicate=0.05, jitter=0.002)
HARSH = Faults(loss=0.15, duplicate=0.1, jitter=0.01)  # jitter past the RTO: reordering


def make_inputs(world, size, dtype, seed):
    """Random values, a different magnitude per chunk and some all-zero chunks."""
    rng = np.random.default_rng(seed)
    if dtype == np.int32:
        return [rng.integers(-2**31, 2**31, size, dtype=np.int64).astype(np.int32)
                for _ in range(world)]
    arrays = []
    for _ in range(world):
        a = rng.standard_normal(size).astype(np.float32)
        for c in range(-(-size // K)):
            kind = rng.integers(0, 6)
            sl = slice(c * K, (c + 1) * K)
            if kind == 0:
                a[sl] = 0
            else:
                a[sl] *= np.float32(2.0 ** int(rng.integers(-60, 60)))
        arrays.append(a)
    return arrays


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
        assert "the spine has no partial sum" in str(why)


def test_the_spine_is_an_ordinary_switch_whose_members_are_the_racks():
    fab = fabric(2)
    job = RackedJob(fab, [1, 0, 1, 0], slots=SLOTS)
    # racks in the order of their lowest rank: rack 1 holds rank 0, so it is member 0
    assert job.racks == [1, 0]
    assert job.spine_job.members == [("uplink", 1, 0x5EED), ("uplink", 0, 0x5EED)]
    assert fab.racks[1].uplinks[0x5EED].member == 0
    assert fab.racks[1].stats()["jobs"][job.name]["uplink"]["spine"] == list(SPINE)


# ---------------------------------------------------------------- the control relay (sans-IO)
class Relay:
    """A spine ``Controller`` and rack ``RackController``s wired by hand: what the
    servers do with sockets, here with lists.  ``told[conn]``: the events each
    worker connection got, in order."""

    def __init__(self, racks=2, slots=16):
        self.spine = Controller(Pipeline(slots, K), data_port=7300, slots_per_job=4)
        self.racks = []
        for r in range(racks):
            rack = RackController(RackPipeline(slots, K), data_port=7400 + r,
                                  spine=("10.0.0.1", 7300),
                                  uplink_address=lambda job, r=r: (f"10.0.1.{r}", 9000 + r))
            self.racks.append(rack)
        self.told: dict = {}
        self.open_uplinks: set = set()  # (rack, job) connections to the spine

    def worker(self, rack, conn, msg):
        self.route(rack, self.racks[rack].handle_message(conn, msg))

    def worker_gone(self, rack, conn):
        self.route(rack, self.racks[rack].handle_disconnect(conn))

    def rack_gone(self, rack, job):
        """Rack ``rack``'s switch dies: the spine sees its connection drop."""
        self.open_uplinks.discard((rack, job))
        self.spine_replies(self.spine.handle_disconnect((rack, job)))

    def route(self, rack, out):
        for item in out:
            if isinstance(item, ToSpine):
                self.open_uplinks.add((rack, item.job))
                self.spine_replies(self.spine.handle_message((rack, item.job),
                                                             item.request.to_dict()))
            elif isinstance(item, CloseUplink):
                if (rack, item.job) in self.open_uplinks:
                    self.open_uplinks.discard((rack, item.job))
                    self.spine_replies(self.spine.handle_disconnect((rack, item.job)))
            else:
                conn, event = item
                self.told.setdefault(conn, []).append(event)

    def spine_replies(self, out):
        for (rack, job), event in out:
            if (rack, job) in self.open_uplinks:
                self.route(rack, self.racks[rack].handle_upstream(job, event))


def join(rank, world=4, job="j", mtu=None):
    return {"op": "join", "job": job, "rank": rank, "world_size": world,
            "data_addr": [f"10.0.2.{rank}", 5000 + rank], "mtu": mtu}


def joined_cluster(placement=(0, 0, 1, 1), job="j"):
    relay = Relay(racks=max(placement) + 1)
    for rank, rack in enumerate(placement):
        relay.worker(rack, (job, rank), join(rank, len(placement), job))
    return relay


def test_racks_join_the_spine_as_one_member_each_and_their_workers_get_ready():
    relay = joined_cluster((1, 0, 1, 0))
    spine_job = next(iter(relay.spine.pipeline.jobs.values()))
    # rack 1 holds rank 0: it is the spine's member 0
    assert spine_job.members == [("10.0.1.1", 9001), ("10.0.1.0", 9000)]
    assert spine_job.world_size == 2
    for rank, rack in enumerate((1, 0, 1, 0)):
        events = relay.told[("j", rank)]
        assert [e["event"] for e in events][-1] == "ready"
        ready = events[-1]
        local = relay.racks[rack].pipeline.jobs[ready["session"]]
        assert ready["data_port"] == 7400 + rack and ready["slot_count"] == 4
        assert local.members == [("10.0.2.%d" % g, 5000 + g) for g in (rack ^ 1, (rack ^ 1) + 2)]
        uplink = relay.racks[rack].pipeline.uplinks[ready["session"]]
        assert uplink == Uplink(("10.0.0.1", 7300), (f"10.0.1.{rack}", 9000 + rack),
                                spine_job.session, spine_job.slot_base, 1 - rack)
    # the ranks joined before the world was complete heard who was present, from the spine
    assert relay.told[("j", 0)][0] == {"event": "joined", "job": "j", "present": [0]}


def test_a_rack_switch_that_dies_fails_the_job_on_the_other_racks_naming_it():
    relay = joined_cluster()
    relay.rack_gone(1, "j")
    for rank in (0, 1):
        failed = relay.told[("j", rank)][-1]
        assert failed["event"] == "failed"
        assert failed["missing"] == [2, 3]
        assert "the rack switch at 10.0.1.1:7401 (ranks 2, 3)" in failed["reason"]
    assert relay.racks[0].pipeline.jobs == {} and relay.spine.pipeline.jobs == {}
    assert relay.open_uplinks == set()


def test_a_worker_that_gives_up_fails_the_job_on_every_rack():
    relay = joined_cluster()
    relay.worker(0, ("j", 1), {"op": "abort", "reason": "no progress", "missing": [3]})
    assert relay.told[("j", 0)][-1]["event"] == "failed"
    for rank in (2, 3):
        failed = relay.told[("j", rank)][-1]
        assert failed["event"] == "failed" and failed["missing"] == [3]
        assert "no progress" in failed["reason"]
    assert all(not rack.pipeline.jobs for rack in relay.racks)
    assert relay.spine.pipeline.jobs == {}


def test_a_worker_that_disconnects_is_named_on_every_rack():
    relay = joined_cluster()
    relay.worker_gone(1, ("j", 2))
    for rank in (0, 1, 3):
        failed = relay.told[("j", rank)][-1]
        assert failed["event"] == "failed" and failed["missing"] == [2], failed


def test_the_spine_lost_fails_the_rack_job_naming_the_spine():
    relay = joined_cluster()
    out = relay.racks[0].handle_uplink_closed("j", "closed the connection")
    relay.route(0, out)
    for rank in (0, 1):
        failed = relay.told[("j", rank)][-1]
        assert failed["event"] == "failed"
        assert "the spine switch at 10.0.0.1:7300 closed the connection" in failed["reason"]


def test_every_worker_leaving_ends_the_job_at_the_racks_and_the_spine():
    relay = joined_cluster()
    for rank, rack in enumerate((0, 0, 1, 1)):
        relay.worker(rack, ("j", rank), {"op": "leave"})
        assert relay.told[("j", rank)][-1] == {"event": "left"}
    assert relay.spine.pipeline.counters["jobs_ended"] == 1
    assert all(rack.pipeline.counters["jobs_ended"] == 1 for rack in relay.racks)
    assert relay.spine.jobs == {} and relay.open_uplinks == set()


def test_a_rank_gone_before_the_job_started_makes_its_rack_join_again():
    relay = Relay()
    relay.worker(0, ("j", 0), join(0))
    relay.worker(0, ("j", 1), join(1))
    relay.worker(1, ("j", 2), join(2))
    relay.worker_gone(0, ("j", 0))
    error = relay.told[("j", 1)][-1]
    assert error["event"] == "error" and "must join again" in error["message"]
    # the spine forgot rack 0's ranks: the job forms when they join again
    assert relay.spine.jobs["j"].conns.keys() == {2}
    relay.worker(0, ("j", 10), join(0))
    relay.worker(0, ("j", 11), join(1))
    relay.worker(1, ("j", 3), join(3))
    assert all(relay.told[("j", c)][-1]["event"] == "ready" for c in (10, 11, 2, 3))


def test_rack_ready_and_rack_join_round_trip():
    ready = protocol.RackReady(5, 0, 4, 64, 64, 7300, 1, 2)
    assert protocol.decode_event(ready.to_dict()) == ready
    rack_join = protocol.RackJoin("j", 3, 4, ("10.0.1.1", 9001), mtu=1500, rack="10.0.1.1:7301")
    assert protocol.decode_request(rack_join.to_dict()) == rack_join
    assert isinstance(protocol.decode_request(join(0)), protocol.Join)
    assert not isinstance(protocol.decode_request(join(0)), protocol.RackJoin)


# ---------------------------------------------------------------- real sockets
def rack_switches(racks=2, **settings):
    """A spine switch and ``racks`` rack switches under it, in this process."""
    stack = contextlib.ExitStack()
    geometry = {"packet_elements": 512, "slots": 64, **settings}
    spine = stack.enter_context(Switch(slots_per_job=8, **geometry))
    under = [stack.enter_context(Switch(upstream="%s:%d" % spine.address, **geometry))
             for _ in range(racks)]
    return stack, spine, under


def test_two_levels_over_sockets_give_the_flat_sums():
    placement = [0, 1, 0, 1]
    stack, spine, racks = rack_switches()
    with stack:
        assert not racks[0].fastpath and racks[0].stats()["admission"]["upstream"]
        calls = [make_inputs(4, size, dtype, seed=size)
                 for size, dtype in ((5000, np.float32), (1, np.float32), (3000, np.int32))]

        def body(rank):
            with switchml.Worker(racks[placement[rank]].address, rank, 4, job="two-level",
                                 timeout=20) as w:
                return w.session.packet_elements, [w.allreduce(c[rank]) for c in calls]

        results = run_ranks(4, body)
        packet = results[0][0]
        for inputs, *outs in zip(calls, *(r[1] for r in results)):
            same_bits(outs, reference_sum(inputs, packet))
        stats = spine.stats()
        spine_job = stats["ended_jobs"]["two-level"]
        assert spine_job["world_size"] == 2  # two racks, one member each
        for rack in racks:
            job = rack.stats()["ended_jobs"]["two-level"]
            assert job["counters"]["partials_up"] == job["counters"]["results_from_spine"] > 0


def test_a_rack_switch_stopped_fails_the_job_on_the_other_rack_naming_it():
    stack, spine, racks = rack_switches()
    with stack:
        rack1 = "%s:%d" % racks[1].address
        first_done = threading.Barrier(5)
        killed = threading.Event()

        def body(rank):
            with switchml.Worker(racks[rank // 2].address, rank, 4, job="dies",
                                 timeout=10) as w:
                w.allreduce(np.ones(2000, np.float32))
                first_done.wait(20)
                killed.wait(20)
                started = time.monotonic()
                with pytest.raises(switchml.SwitchMLError) as failure:
                    w.allreduce(np.ones(2000, np.float32))
                return str(failure.value), time.monotonic() - started

        def kill():
            first_done.wait(20)
            racks[1].stop()
            time.sleep(0.2)  # the spine hears of it, and rack 0 from the spine
            killed.set()

        killer = threading.Thread(target=kill)
        killer.start()
        results = run_ranks(4, body, timeout=40)
        killer.join()
        for rank in (0, 1):
            message, took = results[rank]
            assert f"the rack switch at {rack1} (ranks 2, 3)" in message, message
            assert took < 5
        for rank in (2, 3):
            assert rack1 in results[rank][0], results[rank][0]


def test_ranks_of_two_racks_that_disagree_raise_a_mismatch_naming_them():
    stack, spine, racks = rack_switches()
    with stack:
        def body(rank):
            with switchml.Worker(racks[rank // 2].address, rank, 4, job="odd",
                                 timeout=10) as w:
                with pytest.raises(switchml.CallMismatchError) as failure:
                    w.allreduce(np.ones(1000 if rank < 2 else 2000, np.float32))
                return str(failure.value)

        for message in run_ranks(4, body, timeout=30):
            assert "ranks 0, 1 asked for 1000 float32 values" in message or \
                "ranks 2, 3 asked for 2000 float32 values" in message, message
            assert "rank 2 for 2000" in message or "rank 0 for 1000" in message, message
