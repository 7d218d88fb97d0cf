"""The control plane, sans-IO: joins, refusals, leaves, failures, window sizing."""

import numpy as np
import pytest

from switchml import wire
from switchml.switch.control import Controller
from switchml.switch.dataplane.pipeline import Pipeline


def join(ctl, conn, rank, world, job="j", **extra):
    msg = {"op": "join", "version": 2, "job": job, "rank": rank, "world_size": world,
           "data_addr": ["10.0.0.1", 1000 + rank + 100 * conn], **extra}
    return ctl.handle_message(conn, msg)


@pytest.fixture
def ctl():
    return Controller(Pipeline(slots=16, packet_elements=64), data_port=9, slots_per_job=4)


def test_ready_only_when_every_rank_joined(ctl):
    out = join(ctl, 1, 0, 2)
    assert out == [(1, {"event": "joined", "job": "j", "present": [0]})]
    out = join(ctl, 2, 1, 2)
    assert sorted(c for c, _ in out) == [1, 2]
    ready = out[0][1]
    assert ready["event"] == "ready" and ready["slot_count"] == 4 and ready["data_port"] == 9
    assert ready["session"] != 0 and ctl.pipeline.free_slots() == 12


@pytest.mark.parametrize("msg, reason", [
    ({"op": "join", "version": 2, "job": "j", "rank": 0}, "needs"),
    ({"op": "join", "version": 2, "job": "j", "rank": 5, "world_size": 2,
      "data_addr": ["10.0.0.1", 1]}, "outside"),
    ({"op": "join", "version": 2, "job": "j", "rank": 0, "world_size": 40,
      "data_addr": ["10.0.0.1", 1]}, "32"),
    ({"op": "nonsense"}, "unknown"),
    ("not a dict", "unknown"),
])
def test_bad_joins_are_refused_with_a_reason(ctl, msg, reason):
    [(conn, reply)] = ctl.handle_message(7, msg)
    assert conn == 7 and reply["event"] == "error" and reason in reply["message"]
    assert ctl.pipeline.free_slots() == 16


def test_duplicate_rank_and_world_size_mismatch_are_refused(ctl):
    join(ctl, 1, 0, 3)
    [(_, reply)] = join(ctl, 2, 0, 3)
    assert "already joined" in reply["message"]
    [(_, reply)] = join(ctl, 3, 1, 4)
    assert "world_size 3" in reply["message"]


def test_disconnect_before_start_forgets_the_rank(ctl):
    join(ctl, 1, 0, 2)
    assert ctl.handle_disconnect(1) == []
    assert ctl.jobs == {}


def test_disconnect_of_a_running_rank_fails_the_job_and_frees_slots(ctl):
    join(ctl, 1, 0, 3)
    join(ctl, 2, 1, 3)
    join(ctl, 3, 2, 3)
    out = ctl.handle_disconnect(2)
    assert sorted(c for c, _ in out) == [1, 3]
    assert all(m == {"event": "failed", "missing": [1],
                     "reason": "rank 1 of job 'j' disconnected"} for _, m in out)
    assert ctl.pipeline.free_slots() == 16 and ctl.jobs == {}


def test_a_rank_that_gives_up_passes_its_culprits_on(ctl):
    """A shard job's rank gives up because a rank of its host died: the others hear
    that rank of the enclosing job named (``culprits``), not a rank of this one."""
    join(ctl, 1, 0, 2)
    join(ctl, 2, 1, 2)
    out = ctl.handle_message(1, {"op": "abort", "reason": "job 'local': rank 1 died",
                                 "missing": [], "culprits": [1]})
    assert out == [(2, {"event": "failed", "missing": [], "culprits": [1],
                        "reason": "rank 0 of job 'j' gave up: job 'local': rank 1 died"})]


def test_slots_freed_only_after_every_rank_left(ctl):
    join(ctl, 1, 0, 2)
    join(ctl, 2, 1, 2)
    ctl.handle_message(1, {"op": "leave"})
    assert ctl.pipeline.free_slots() == 12
    ctl.handle_message(2, {"op": "leave"})
    assert ctl.pipeline.free_slots() == 16
    assert ctl.handle_disconnect(1) == [] and ctl.handle_disconnect(2) == []
    assert "j" in ctl.pipeline.ended_jobs


def test_window_fits_the_smallest_receive_buffer():
    pipeline = Pipeline(slots=64, packet_elements=1024)
    size = wire.packet_size(pipeline.lanes, 1024)
    per_packet = size + size // 4 + 1024
    ctl = Controller(pipeline, data_port=9, slots_per_job=32, rcvbuf=100 * per_packet)
    join(ctl, 1, 0, 2, rcvbuf=50 * per_packet)
    [(_, ready), _] = join(ctl, 2, 1, 2, rcvbuf=7 * per_packet)
    assert ready["slot_count"] == 7  # the smaller worker buffer wins over 100 // 2
    ctl2 = Controller(Pipeline(slots=64, packet_elements=1024), data_port=9,
                      slots_per_job=32, rcvbuf=20 * per_packet)
    for rank in range(4):
        out = join(ctl2, rank + 1, rank, 4)
    assert out[0][1]["slot_count"] == 5  # 20 datagrams shared by 4 workers' bursts


@pytest.mark.parametrize("world, slots", [(1, 32), (4, 8), (5, 7), (16, 2), (32, 1)])
def test_a_switch_behind_a_shared_link_gives_a_job_its_ranks_share(world, slots):
    """A switch server (shared_link): every rank's packets queue at its one link, so
    a job gets its ranks' share of one link's window, ceil(32 / world) slots; the
    window one link carries goes along for a job split over several switches."""
    for shared, want in ((False, 32), (True, slots)):
        ctl = Controller(Pipeline(slots=64, packet_elements=64), data_port=9,
                         slots_per_job=32, shared_link=shared)
        for rank in range(world):
            out = join(ctl, rank + 1, rank, world)
        ready = out[0][1]
        assert ready["event"] == "ready" and ready["slot_count"] == want
        assert ready["link_window"] == 32
        assert ctl.pipeline.free_slots() == 64 - want


def test_status_reports_bitmaps_of_own_slots_only(ctl):
    join(ctl, 1, 0, 2)
    [(_, ready), _] = join(ctl, 2, 1, 2)
    base = ready["slot_base"]
    lanes = np.zeros(ctl.pipeline.lanes, wire.LANE)
    pkt = wire.encode(wire.KIND_CONTRIBUTION, wire.DTYPE_INT32, base, ready["token"], 5, 0, 0,
                      lanes, np.zeros(2, np.int32))
    ctl.pipeline.receive_datagram(pkt, ("10.0.0.1", 1100))  # rank 0, joined on conn 1
    [(_, reply)] = ctl.handle_message(1, {"op": "status", "slots": [[base, 5], [15, 0]]})
    assert reply == {"event": "status", "slots": [[base, 5, True, 0b01]]}


def test_a_jobs_packets_fit_the_smallest_frame_of_its_ranks():
    pipeline = Pipeline(slots=16, packet_elements=16128, block_elements=256)
    ctl = Controller(pipeline, data_port=9, slots_per_job=4)
    join(ctl, 1, 0, 3, mtu=9000)
    join(ctl, 2, 1, 3, mtu=65535)
    [(_, ready), *_] = join(ctl, 3, 2, 3, mtu=9000)
    assert (ready["packet_elements"], ready["block_elements"]) == (2048, 256)
    job = pipeline.jobs[ready["session"]]
    assert (job.packet_elements, job.block_elements) == (2048, 256)


def test_the_switchs_own_route_mtu_bounds_the_packets_too():
    pipeline = Pipeline(slots=16, packet_elements=16128, block_elements=256)
    ctl = Controller(pipeline, data_port=9, slots_per_job=4,
                     route_mtu=lambda addr: 1500 if addr[1] % 2 else 9000)
    join(ctl, 1, 0, 2, mtu=9000)
    [(_, ready), _] = join(ctl, 2, 1, 2, mtu=9000)
    assert (ready["packet_elements"], ready["block_elements"]) == (352, 352)


def test_workers_that_do_not_say_their_mtu_get_the_switchs_packets(ctl):
    join(ctl, 1, 0, 2)
    [(_, ready), _] = join(ctl, 2, 1, 2)
    assert ready["packet_elements"] == ctl.pipeline.packet_elements == 64


@pytest.mark.parametrize("mtu", [0, 67, "1500", 1.5, True])
def test_a_bad_mtu_is_refused(ctl, mtu):
    [(_, reply)] = join(ctl, 1, 0, 2, mtu=mtu)
    assert reply["event"] == "error" and "mtu" in reply["message"]
