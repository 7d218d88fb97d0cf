"""Two levels over the control plane: a rack switch relays its workers' joins to the
spine (switch/racks/control.py, the spine's control.py), without sockets and then
with them: racks under a spine in this process, real workers, real failures.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time

import numpy as np
import pytest
from conftest import make_inputs, reference_sum, run_ranks
from test_racks import K, same_bits

import switchml
from switchml import Switch, protocol, wire
from switchml.netutil import encode_line
from switchml.switch.control import Controller
from switchml.switch.dataplane.pipeline import Pipeline
from switchml.switch.racks.control import CloseUplink, RackController, ToSpine
from switchml.switch.racks.pipeline import RackPipeline, Uplink
from switchml.worker.control import ControlClient


# ---------------------------------------------------------------- the control relay (sans-IO)
def uplink_addresses(rack: int):
    """A rack's address for each job toward the spine, one socket each as
    ``Uplinks.address_for`` opens: 10.0.1.<rack>, port 9000 + rack for its first
    job, 10 more for each next one."""
    ports: dict = {}
    return lambda job: (f"10.0.1.{rack}", ports.setdefault(job, 9000 + rack + 10 * len(ports)))


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
                                  uplink_address=uplink_addresses(r))
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
    return {"op": "join", "version": 2, "job": job, "rank": rank, "world_size": world,
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
                                spine_job.session, spine_job.slot_base, 1 - rack,
                                spine_job.tokens[1 - rack])
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
        assert failed["switch_lost"] is True  # the switch's failure: a torch job goes on


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def silent_spine_rack(clock):
    """A rack switch whose requests to the spine go nowhere (a hung spine)."""
    return RackController(RackPipeline(16, K), data_port=7400, spine=("10.0.0.1", 7300),
                          uplink_address=lambda job: ("10.0.1.0", 9000), clock=clock)


def test_a_spine_that_does_not_answer_a_relayed_join_fails_it_as_unreachable():
    """The spine answers a join at once: silent for SPINE_ANSWER_S, it is hung, and
    the rank hears so (as the switch's failure, naming the spine) before it would
    give up on its rack switch."""
    from switchml.config import SWITCH_ANSWER_S
    from switchml.switch.racks.control import SPINE_ANSWER_S
    assert SPINE_ANSWER_S < SWITCH_ANSWER_S
    clock = Clock()
    rack = silent_spine_rack(clock)
    [up] = rack.handle_message(("j", 0), join(0, 2))
    assert isinstance(up, ToSpine) and rack.next_deadline() == 100.0 + SPINE_ANSWER_S
    assert rack.expire(100.0 + SPINE_ANSWER_S - 0.01) == []
    [(conn, error), close] = rack.expire(100.0 + SPINE_ANSWER_S)
    assert conn == ("j", 0) and close == CloseUplink("j")
    assert error["reason"] == "unreachable"
    assert "the spine switch at 10.0.0.1:7300 did not answer within" in error["message"]
    assert rack.jobs == {} and rack.next_deadline() is None
    client = ControlClient("j", 0, 2, timeout=60.0)
    [failed] = client.receive_data(encode_line(error), 101.0)
    assert isinstance(failed.error, switchml.SwitchUnreachableError), failed.error


def test_a_spine_that_answers_owes_nothing_and_a_silent_one_fails_the_running_job():
    """A running job's status query relayed to a spine that says nothing: the job
    fails on the rack as the switch's (switch_lost), naming the spine.  The same
    query answered, nothing is left to expire."""
    relay = joined_cluster((0, 0, 1, 1))
    rack = relay.racks[0]
    clock = Clock()
    rack._clock = clock
    assert rack.next_deadline() is None  # every join was answered
    lanes = np.zeros(1, wire.LANE)
    ready = relay.told[("j", 0)][-1]
    slot = ready["slot_base"]
    for g in (0, 1):  # the message is complete at the rack: a query goes up
        rack.pipeline.receive_datagram(wire.encode(
            wire.KIND_CONTRIBUTION, wire.DTYPE_INT32, slot, relay.told[("j", g)][-1]["token"],
            0, 0, 1, lanes, np.ones(K, np.int32)), (f"10.0.2.{g}", 5000 + g))
    query = {"op": "status", "slots": [[slot, 0]]}
    relay.worker(0, ("j", 0), query)  # routed: the spine answers at once
    assert relay.told[("j", 0)][-1]["event"] == "status"
    assert rack.next_deadline() is None and rack.expire(1e9) == []
    [up] = rack.handle_message(("j", 0), query)  # this one is not routed: silence
    assert isinstance(up, ToSpine)
    assert rack.expire(100.0 + 6.9) == []
    out = rack.expire(100.0 + 7.0)
    failed = [event for conn, event in (i for i in out if isinstance(i, tuple))]
    assert len(failed) == 2 and all(f["switch_lost"] for f in failed)
    assert all("the spine switch at 10.0.0.1:7300 did not answer" in f["reason"]
               for f in failed)
    assert CloseUplink("j") in out and "j" not in rack.jobs


def test_every_worker_leaving_ends_the_job_at_the_racks_and_the_spine():
    relay = joined_cluster()
    for rank, rack in enumerate((0, 0, 1, 1)):
        relay.worker(rack, ("j", rank), {"op": "leave"})
        assert relay.told[("j", rank)][-1] == {"event": "left"}
    assert relay.spine.pipeline.counters["jobs_ended"] == 1
    assert all(rack.pipeline.counters["jobs_ended"] == 1 for rack in relay.racks)
    assert relay.spine.jobs == {} and relay.open_uplinks == set()


def test_a_racks_new_job_never_gets_a_recent_session(monkeypatch):
    """A rack switch's jobs, as the flat switch's: a session is never one of the
    last jobs' that ended there (it only avoided the running ones'), so an old
    job's late datagram is no new job's."""
    from switchml.switch import control
    relay = joined_cluster()
    [first] = relay.racks[0].pipeline.jobs
    for rank, rack in enumerate((0, 0, 1, 1)):
        relay.worker(rack, ("j", rank), {"op": "leave"})
    assert relay.racks[0].pipeline.jobs == {}
    # the spine's session and its token, then the rack's session, then its ranks' tokens
    draws = iter([5555, 6666, first, first, 12345, 777, 778])
    monkeypatch.setattr(control.secrets, "randbits", lambda bits: next(draws))
    for rank in (0, 1):
        relay.worker(0, ("k", rank), join(rank, 2, "k"))
    assert list(relay.racks[0].pipeline.jobs) == [12345]


def test_a_rank_gone_before_the_job_started_makes_its_rack_join_again():
    relay = Relay()
    relay.worker(0, ("j", 0), join(0))
    relay.worker(0, ("j", 1), join(1))
    relay.worker(1, ("j", 2), join(2))
    relay.worker_gone(0, ("j", 0))
    error = relay.told[("j", 1)][-1]
    assert error["event"] == "error" and "must join again" in error["message"]
    # the spine forgot rack 0's ranks: the job forms when they join again
    assert relay.spine.jobs["j", None].conns.keys() == {2}
    relay.worker(0, ("j", 10), join(0))
    relay.worker(0, ("j", 11), join(1))
    relay.worker(1, ("j", 3), join(3))
    assert all(relay.told[("j", c)][-1]["event"] == "ready" for c in (10, 11, 2, 3))


def test_rack_ready_and_rack_join_round_trip():
    ready = protocol.RackReady(5, 0, 4, 64, 64, 7300, 1, 2, (2, 3))
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


def after_the_end(switch, *jobs, seconds: float = 10.0) -> dict:
    """``switch``'s stats once every one of ``jobs`` ended there: a rank returns from
    its leave before its rack, and the rack's uplink before the spine, have heard it."""
    deadline = time.monotonic() + seconds
    while True:
        stats = switch.stats()
        if all(job in stats["ended_jobs"] for job in jobs) or time.monotonic() > deadline:
            return stats
        time.sleep(0.01)


def test_a_bug_on_a_spines_datagram_is_counted_and_the_rack_serves_on(monkeypatch):
    """The rack's socket toward the spine is drained as the switch's own: a datagram
    the pipeline fails on is counted (``internal_errors``) and logged, and the
    switch serves on; its sum comes again as the rack's ranks recover it."""
    original, failed = RackPipeline.receive_datagram, []

    def fails_once(self, data, addr):
        if addr in self._spines and not failed:
            failed.append(addr)
            raise RuntimeError("a bug")
        return original(self, data, addr)

    monkeypatch.setattr(RackPipeline, "receive_datagram", fails_once)
    inputs = make_inputs(2, 3000, np.float32, seed=7)
    stack, spine, racks = rack_switches(racks=1)
    with stack:
        def body(rank):
            with switchml.Worker(racks[0].address, rank, 2, job="bug", timeout=20) as w:
                return w.membership.packet_elements, w.allreduce(inputs[rank])

        results = run_ranks(2, body)
        assert failed and racks[0].stats()["counters"]["internal_errors"] == 1
        assert racks[0]._thread.is_alive()
    same_bits([out for _, out in results], reference_sum(inputs, results[0][0]))


@pytest.mark.parametrize("guarded", [False, True])
def test_two_levels_over_sockets_give_the_flat_sums(guarded, monkeypatch):
    """(guarded: a job secret, and a spine with an admission token, both of which
    the racks relay the proofs of.)"""
    placement = [0, 1, 0, 1]
    if guarded:
        monkeypatch.setenv("SWITCHML_SWITCH_TOKEN", "fabric token")
    stack, spine, racks = rack_switches()
    with stack:
        assert not racks[0].fastpath and racks[0].stats()["admission"]["upstream"]
        calls = [make_inputs(4, size, dtype, seed=size)
                 for size, dtype in ((5000, np.float32), (1, np.float32), (3000, np.int32))]

        def body(rank):
            with switchml.Worker(racks[placement[rank]].address, rank, 4, job="two-level",
                                 timeout=20, secret="s3cret" if guarded else None) as w:
                return w.membership.packet_elements, [w.allreduce(c[rank]) for c in calls]

        results = run_ranks(4, body)
        packet = results[0][0]
        for inputs, *outs in zip(calls, *(r[1] for r in results)):
            same_bits(outs, reference_sum(inputs, packet))
        stats = after_the_end(spine, "two-level")
        spine_job = stats["ended_jobs"]["two-level"]
        assert spine_job["world_size"] == 2  # two racks, one member each
        assert stats["totals"].get("jobs_open", 0) == (0 if guarded else 1)
        for rack in racks:
            job = after_the_end(rack, "two-level")["ended_jobs"]["two-level"]
            assert job["counters"]["partials_up"] == job["counters"]["results_from_spine"] > 0


def test_a_spine_that_does_not_answer_stalls_nothing_else_on_the_rack(monkeypatch):
    """A rack switch opens a job's connection to its spine without blocking its
    thread: while the connect hangs (a spine whose accept queue is full drops the
    SYNs), the rack switch answers at once, and the job's ranks hear within the
    connect deadline that the spine could not be reached."""
    from switchml.switch.racks import uplinks
    monkeypatch.setattr(uplinks, "CONNECT_TIMEOUT", 2.0)
    with socket.socket() as silent, socket.socket() as filler:
        silent.bind(("127.0.0.1", 0))
        silent.listen(0)
        filler.connect(silent.getsockname())  # the one place in its accept queue
        with Switch(upstream="%s:%d" % silent.getsockname(), packet_elements=512,
                    slots=64) as rack:
            errors: list = []

            def body(rank):
                try:
                    switchml.Worker(rack.address, rank, 2, job="silent", timeout=20)
                except switchml.SwitchMLError as exc:
                    return exc, time.monotonic()
                return None, time.monotonic()

            start = time.monotonic()
            ranks = threading.Thread(target=lambda: errors.extend(run_ranks(2, body)))
            ranks.start()
            time.sleep(0.5)  # the ranks joined; the connect to the spine hangs
            asked = time.monotonic()
            rack.stats()
            answered = time.monotonic() - asked
            ranks.join(30)
        for error, at in errors:
            assert isinstance(error, switchml.SwitchUnreachableError), error
            assert "could not be reached" in str(error), error
            assert at - start < 2.0 + 1.5
        assert answered < 1.0, answered  # blocked, it waited for the connect (2 s)


def test_a_rack_switch_stopped_fails_the_job_on_the_other_rack_naming_it():
    stack, spine, racks = rack_switches()
    with stack:
        rack1 = "%s:%d" % racks[1].address
        first_done = threading.Barrier(5)
        killed = threading.Event()

        def body(rank):
            # (ranks 2 and 3 try to rejoin their rack switch for a second, not 10)
            with switchml.Worker(racks[rank // 2].address, rank, 4, job="dies",
                                 timeout=10, rejoin_within=1) as w:
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


def test_two_jobs_share_the_rack_switches_and_the_spine_over_sockets():
    stack, spine, racks = rack_switches()
    with stack:
        inputs = {job: make_inputs(4, 4000 + 1000 * i, np.float32, seed=i)
                  for i, job in enumerate(("first", "second"))}

        def body(index):
            job, rank = ("first", "second")[index // 4], index % 4
            with switchml.Worker(racks[rank % 2].address, rank, 4, job=job, timeout=20) as w:
                return job, w.membership.packet_elements, [w.allreduce(inputs[job][rank])
                                                        for _ in range(3)]

        results = run_ranks(8, body)
        for job, packet, outs in results:
            for out in outs:
                same_bits([out], reference_sum(inputs[job], packet))
        ended = after_the_end(spine, "first", "second")["ended_jobs"]
        assert ended["first"]["world_size"] == ended["second"]["world_size"] == 2
        for rack in racks:
            up = {job: after_the_end(rack, "first", "second")["ended_jobs"][job]["counters"]
                  ["partials_up"]
                  for job in ("first", "second")}
            assert all(count > 0 for count in up.values())


def test_a_status_query_at_a_rack_asks_the_spine_which_ranks_it_has():
    """A stalled worker names who did not contribute: for a message complete at its
    rack, the spine answers with the ranks behind the racks it heard from."""
    relay = joined_cluster((0, 0, 1, 1, 2, 2))
    lanes = np.zeros(1, wire.LANE)
    slots = {}
    for r, ranks in ((0, (0, 1)), (2, (4, 5))):  # racks 0 and 2 complete slot 1's message 0
        ready = relay.told[("j", ranks[0])][-1]
        slots[r] = ready["slot_base"] + 1
        for g in ranks:
            token = relay.told[("j", g)][-1]["token"]
            up = relay.racks[r].pipeline.receive_datagram(wire.encode(
                wire.KIND_CONTRIBUTION, wire.DTYPE_INT32, slots[r], token, 0, 0, 1,
                lanes, np.ones(K, np.int32)), (f"10.0.2.{g}", 5000 + g))
        [(partial, uplink)] = up
        assert relay.spine.pipeline.receive_datagram(bytes(partial), uplink.source) == []
    relay.worker(0, ("j", 0), {"op": "status", "slots": [[slots[0], 0], [slots[0] - 1, 0]]})
    reply = relay.told[("j", 0)][-1]
    # slot 1: ranks 0, 1, 4 and 5 (racks 0 and 2 at the spine); slot 0: nothing yet
    assert reply == {"event": "status", "slots": [[slots[0], 0, True, 0b110011],
                                                  [slots[0] - 1, 0, False, 0]]}
    # what the worker then says: ranks 2 and 3 did not contribute
    client = ControlClient("j", 0, 6, timeout=5.0)
    error = client.stall_error(protocol.decode_event(reply), 5.0)
    assert sorted(error.missing_ranks) == [2, 3]


def calls_while_a_switch_hangs(racks, hung_switch, ranks_waited, job, timeout) -> list:
    """Two ranks a rack, each rack's switch in ``racks``: one call, then
    ``hung_switch`` stops serving with its connections open (its lock held: a hung
    process) and every rank calls again; (error or None, seconds) per rank.  The
    switch hangs until ``ranks_waited`` have their outcome (not a fixed time)."""
    world = 2 * len(racks)
    first_done, hung = threading.Barrier(world + 1), threading.Event()
    ended = threading.Barrier(len(ranks_waited) + 1)

    def body(rank):
        with switchml.Worker(racks[rank // 2].address, rank, world, job=job,
                             timeout=timeout) as w:
            w.allreduce(np.ones(3000, np.float32))
            first_done.wait(20)
            hung.wait(20)
            started = time.monotonic()
            try:
                w.allreduce(np.ones(3000, np.float32))
            except switchml.SwitchMLError as exc:
                return exc, time.monotonic() - started
            finally:
                if rank in ranks_waited:
                    ended.wait(30)
            return None, 0.0

    def hang():
        first_done.wait(20)
        with hung_switch._lock:  # its serving thread waits here: it hangs
            hung.set()
            ended.wait(30)

    hanger = threading.Thread(target=hang)
    hanger.start()
    results = run_ranks(world, body, timeout=60)
    hanger.join()
    return results


def test_a_hung_rack_switch_is_named_by_the_other_racks_ranks_within_the_timeout():
    """A hung rack switch: the ranks of the other racks see no progress for their
    timeout, ask their rack, which asks the spine, and name the hung rack's ranks."""
    stack, spine, racks = rack_switches(racks=3)
    with stack:
        results = calls_while_a_switch_hangs(racks, racks[1], (0, 1, 4, 5), "hangs", 2)
        for rank in (0, 1, 4, 5):  # not all the others: the spine heard from rack 2
            error, took = results[rank]
            assert isinstance(error, switchml.SwitchMLTimeoutError), error
            assert sorted(error.missing_ranks) == [2, 3], error
            assert took < 2 + 3, took


def test_a_hung_spine_is_named_by_every_rank_as_the_switchs_failure(monkeypatch):
    """A hung spine: each rank's call, without a result, asks its rack switch,
    which asks the spine; the spine silent for SPINE_ANSWER_S, every rank raises
    SwitchUnreachableError naming the spine, not its own rack switch, long before
    its timeout.  (The checks shortened: asked after 0.3 s, the spine 1 s to
    answer, the rack 3.)"""
    from switchml import config
    from switchml.switch.racks import control as rack_control
    from switchml.worker import driver
    monkeypatch.setattr(driver, "SWITCH_SILENCE_S", 0.3)
    monkeypatch.setattr(config, "SWITCH_ANSWER_S", 3.0)
    monkeypatch.setattr(rack_control, "SPINE_ANSWER_S", 1.0)
    stack, spine, racks = rack_switches()
    with stack:
        where = "%s:%d" % spine.address
        for error, took in calls_while_a_switch_hangs(racks, spine, (0, 1, 2, 3),
                                                       "spine-hangs", 60):
            assert isinstance(error, switchml.SwitchUnreachableError), error
            assert f"the spine switch at {where} did not answer" in str(error), error
            assert took < 10, took  # 0.3 s + 1 s on a busy machine; not the 60 s


def test_a_worker_joined_to_the_spine_directly_is_a_member_beside_the_racks():
    relay = Relay(racks=1)
    relay.worker(0, ("j", 1), join(1, world=3))
    relay.worker(0, ("j", 2), join(2, world=3))
    out = relay.spine.handle_message("direct", join(0, world=3))
    direct = [(c, event) for c, event in out if c == "direct"]
    relay.spine_replies([(c, event) for c, event in out if c != "direct"])
    spine_job = next(iter(relay.spine.pipeline.jobs.values()))
    assert spine_job.members == [("10.0.2.0", 5000), ("10.0.1.0", 9000)]  # rank 0 first
    assert [event["event"] for _, event in direct] == ["ready"]
    assert "member" not in direct[0][1]
    assert [relay.told[("j", g)][-1]["event"] for g in (1, 2)] == ["ready", "ready"]
    assert relay.racks[0].pipeline.uplinks[relay.told[("j", 1)][-1]["session"]].member == 1


def test_a_rack_whose_ranks_are_not_those_the_spine_started_with_fails_the_job():
    relay = Relay()
    for rank, rack in enumerate((0, 0, 1)):
        relay.worker(rack, ("j", rank), join(rank))
    rack = relay.racks[1]
    out = rack.handle_upstream("j", protocol.RackReady(5, 0, 4, K, K, 7300, 1, 2, (2, 3)))
    failed = [event for item in out if isinstance(item, tuple) for event in item[1:]]
    assert failed[0]["event"] == "failed"
    assert "ranks [2, 3] behind this rack switch, which has ranks [2]" in failed[0]["reason"]
    assert any(isinstance(item, ToSpine) and isinstance(item.request, protocol.Abort)
               for item in out)
    assert rack.pipeline.jobs == {}


def test_the_exchange_of_host_records_spans_the_racks():
    """Ranks join through their rack switches; who shares a host is learnt across
    every rack (the rack relays each rank's gather to the spine)."""
    from switchml.worker.local.hosts import HostRecord
    from switchml.worker.rendezvous import exchange_through_switch

    placement = [0, 1, 0, 1]
    stack, spine, racks = rack_switches()
    with stack:
        def body(rank):
            record = HostRecord(f"host{rank // 2}", "m", 1000 + rank, 1024)
            return exchange_through_switch(racks[placement[rank]].address, "who", rank, 4,
                                           10.0, record)

        results = run_ranks(4, body)
        assert len({r.nonce for r in results}) == 1
        assert [rec.pid for rec in results[3].records] == [1000, 1001, 1002, 1003]
        # a rank of a rack that gives up leaves the spine's gathering: the rest are
        # named as missing, not held
        with pytest.raises(switchml.SwitchMLTimeoutError) as info:
            exchange_through_switch(racks[0].address, "short", 0, 2, 0.5)
        assert info.value.missing_ranks == [1]


class Clients:
    """Workers' sans-IO control clients of job "j" (4 ranks) talking to ``relay``'s
    racks: ``start`` one, ``pump`` until nothing moves."""

    def __init__(self, relay: Relay):
        self.relay = relay
        self.clients: dict = {}
        self.heard: dict = {}

    def start(self, rack, conn, rank, secret, host) -> ControlClient:
        client = ControlClient("j", rank, 4, timeout=10, secret=secret)
        self.clients[conn] = (rack, client)
        client.join((f"10.0.2.{host}", 5000 + host), 0.0)
        return client

    def pump(self) -> None:
        relay, moved = self.relay, True
        while moved:
            moved = False
            for conn, (rack, client) in self.clients.items():
                for event in relay.told.get(conn, [])[self.heard.get(conn, 0):]:
                    client.receive_data(encode_line(event), 1.0)
                self.heard[conn] = len(relay.told.get(conn, []))
                for line in client.data_to_send().splitlines():
                    relay.worker(rack, conn, json.loads(line))
                    moved = True

    def __getitem__(self, conn) -> ControlClient:
        return self.clients[conn][1]


def test_an_authenticated_job_forms_through_racks_and_a_squatter_stays_apart():
    """The spine's challenges come down to the rank they name and the proofs go
    up; a process with the name but not the secret, first at a rack, is another
    job at the rack and at the spine, and the real ranks form theirs."""
    relay = Relay(racks=2)
    clients = Clients(relay)
    clients.start(0, "squatter", 0, None, 50)
    clients.pump()
    for rank, rack in enumerate((0, 0, 1, 1)):
        clients.start(rack, rank, rank, "the job's secret", rank)
        clients.pump()
    readies = [clients[r].ready for r in range(4)]
    assert None not in readies and len({r.token for r in readies}) == 4
    squatter = clients["squatter"]
    assert squatter.ready is None and squatter.error is None
    [spine_job] = relay.spine.pipeline.jobs.values()
    # the squatter's job came first at rack 0: the real one has the rack's next socket
    assert spine_job.members == [("10.0.1.0", 9010), ("10.0.1.1", 9001)]
    assert all(("10.0.2.50", 5050) not in job.members
               for rack in relay.racks for job in rack.pipeline.jobs.values())


def test_a_rank_whose_proof_fails_at_the_spine_is_refused_alone():
    """A process with the job's key (it travels in clear in each join) but not its
    secret joins a rank at a rack: the spine refuses its proof, that rank alone
    hears it, as at a switch of one level, and the real ranks form their job
    (the refusal, on the connection the rack's ranks share, took the rack's
    whole job down)."""
    relay = Relay(racks=2)
    clients = Clients(relay)
    for rank, rack in ((0, 0), (1, 0), (2, 1)):
        clients.start(rack, rank, rank, "the job's secret", rank)
        clients.pump()
    key = clients[0].key
    relay.worker(0, "squatter", protocol.Join("j", 3, 4, ("10.0.2.50", 5050), key=key).to_dict())
    assert relay.told["squatter"][-1]["event"] == "challenge"
    relay.worker(0, "squatter", protocol.Prove(3, "00" * (protocol.SIGNATURE_HEX // 2)).to_dict())
    refused = relay.told["squatter"][-1]
    assert refused["event"] == "error" and refused["reason"] == "authentication"
    clients.pump()
    assert all(clients[r].error is None for r in range(3))
    clients.start(1, 3, 3, "the job's secret", 3)  # the real rank 3
    clients.pump()
    readies = [clients[r].ready for r in range(4)]
    assert None not in readies and len({r.token for r in readies}) == 4


def test_a_proof_from_a_running_rank_is_answered_at_the_rack_and_nothing_is_left_installed():
    """The spine challenges ranks only while their job forms: a proof from a
    running job's rank is refused at the rack.  A refusal the spine sends on a
    running job's connection ends the job at the rack, its slots freed (before,
    the job stayed installed: a few such connections took every slot)."""
    relay = joined_cluster((0, 0, 1, 1))
    rack = relay.racks[0]
    free = rack.pipeline.free_slots()
    relay.worker(0, ("j", 0), protocol.Prove(0).to_dict())
    assert relay.told[("j", 0)][-1]["event"] == "error"
    assert rack.pipeline.free_slots() == free and len(rack.pipeline.jobs) == 1
    relay.route(0, rack.handle_upstream("j", protocol.Error("refused").to_dict()))
    assert [relay.told[("j", r)][-1]["event"] for r in (0, 1)] == ["failed", "failed"]
    assert rack.pipeline.jobs == {} and rack.jobs == {}


def test_ranks_of_one_rack_at_different_calls_fail_every_rank_as_a_mismatch():
    """Ranks behind one rack disagree on a call: every rank of the job hears a
    mismatch (CallMismatchError), those of the other racks too, as from a switch
    of one level (they heard that a rank gave up, a timeout)."""
    relay = joined_cluster((0, 0, 1, 1))
    pipeline = relay.racks[0].pipeline
    for rank in (0, 1):
        ready = relay.told[("j", rank)][-1]
        lanes = np.zeros(pipeline.jobs[ready["session"]].lanes, wire.LANE)
        pipeline.receive_datagram(wire.encode(
            wire.KIND_CONTRIBUTION, wire.DTYPE_FLOAT32, ready["slot_base"], ready["token"], 1,
            rank, 0, lanes, np.zeros(K, np.int32)), (f"10.0.2.{rank}", 5000 + rank))
    relay.route(0, relay.racks[0].handle_mismatches())
    failed = [relay.told[("j", r)][-1] for r in range(4)]
    assert all(f["event"] == "failed" and f.get("mismatch") for f in failed), failed
    assert "different calls" in failed[3]["reason"]


def test_a_rack_refuses_a_data_address_that_a_rank_of_another_job_holds():
    relay = Relay(racks=1)
    relay.worker(0, "a", join(0, 2, job="A"))
    relay.worker(0, "b", join(0, 2, job="B"))  # the same worker address, another job
    [error] = relay.told["b"]
    assert error["event"] == "error" and "a rank of another job" in error["message"]
    relay.worker_gone(0, "a")
    relay.worker(0, "b2", join(0, 2, job="B"))  # free again once A's rank went
    assert relay.told["b2"][-1]["event"] == "joined"


def test_relay_names_are_one_jobs_whatever_the_names():
    """A rack's connections to the spine are named by job, key and (a gather's)
    rank: a job named as another's key would be would share its connection."""
    from switchml.switch.racks.control import relay_name

    names = [relay_name("a", "ff"), relay_name("a#key:ff", None), relay_name("a", None),
             relay_name('["a", "ff"]', None), relay_name("a", "ff", 0),
             relay_name("a#gather0", "ff"), relay_name("a", None, 0)]
    assert len(set(names)) == len(names)
    assert relay_name("j", None) == "j"  # a job without a key: its name, as logged
