"""The worker's half of the control protocol, sans-IO: no socket, no clock.

Bytes go from ``ControlClient``s to the switch's ``Controller`` and back through
the JSON line framing only, so these tests are the whole conversation of a
join, a refusal, a failure and a leave, and every bad line a switch could send.
"""

import json
from dataclasses import replace

import pytest

import switchml
from switchml.config import SWITCH_ANSWER_S, SWITCH_SILENCE_S
from switchml.netutil import LineReader, encode_line
from switchml.protocol import PROTOCOL_VERSION, Joined, Left, Ready, StatusReply, Waiting
from switchml.switch.control import Controller
from switchml.switch.dataplane.pipeline import Pipeline
from switchml.worker.control import CLOSED, RUNNING, ControlClient, JobFailed


def client(rank=0, world=2, **options):
    options.setdefault("timeout", 10.0)
    return ControlClient("j", rank, world, where="switch at sw:7300", **options)


def joining(rank=0, world=2, now=0.0, slots=None, **options):
    c = client(rank, world, **options)
    c.join(("10.0.0.1", 5000 + rank), now, slots=slots, mtu=1500)
    return c


def to_switch(c: ControlClient, ctl: Controller, conn) -> list:
    """What the client sent, through the controller: its (connection, reply) pairs."""
    out = []
    for msg in LineReader().feed(c.data_to_send()):
        out += ctl.handle_message(conn, msg)
    return out


def replies_to(out: list, conn) -> bytes:
    return b"".join(encode_line(msg) for c, msg in out if c == conn)


@pytest.fixture
def ctl():
    return Controller(Pipeline(slots=16, packet_elements=64), data_port=7300, slots_per_job=4)


def test_the_join_line_carries_the_version_and_the_path():
    c = joining(rank=1, world=3, slots=8, wait_for_slots=2.0)
    [line] = c.data_to_send().splitlines()
    assert json.loads(line) == {
        "op": "join", "version": PROTOCOL_VERSION, "job": "j", "rank": 1, "world_size": 3,
        "data_addr": ["10.0.0.1", 5001], "slots": 8, "rcvbuf": 0, "mtu": 1500, "wait": True}
    assert c.data_to_send() == b""  # taken once
    assert c.get_timer() == 10.0


def test_two_ranks_join_and_get_the_same_ready(ctl):
    a, b = joining(0), joining(1)
    [(_, joined)] = to_switch(a, ctl, "a")
    assert a.receive_data(encode_line(joined), 1.0) == [Joined("j", (0,))]
    out = to_switch(b, ctl, "b")
    [ready_a] = a.receive_data(replies_to(out, "a"), 2.0)
    [ready_b] = b.receive_data(replies_to(out, "b"), 2.0)
    assert isinstance(ready_a, Ready) and ready_a is a.ready and ready_b is b.ready
    # the same job; each rank its own data-plane token
    assert replace(ready_a, token=0) == replace(ready_b, token=0)
    assert 0 != ready_a.token != ready_b.token != 0
    assert ready_a.slot_count == 4 and ready_a.data_port == 7300 and ready_a.session != 0
    assert a.state == b.state == RUNNING and a.get_timer() is None


def test_lines_split_across_reads_and_several_in_one(ctl):
    a, b = joining(0), joining(1)
    to_switch(a, ctl, "a")
    data = replies_to(to_switch(b, ctl, "b"), "a") + encode_line({"event": "left"})
    events = []
    for i in range(len(data)):  # one byte a read
        events += a.receive_data(data[i:i + 1], 3.0)
    assert [type(e) for e in events] == [Ready, Left]
    both = encode_line({"event": "joined", "job": "j", "present": [0]}) * 2
    assert client().receive_data(both, 0.0) == [Joined("j", (0,))] * 2


def test_ranks_missing_at_the_join_deadline_are_named():
    c = joining(0, world=3, now=100.0)
    c.receive_data(encode_line({"event": "joined", "job": "j", "present": [0, 2]}), 101.0)
    assert c.handle_timer(109.0) == []  # not yet
    [failed] = c.handle_timer(110.0)
    assert isinstance(failed.error, switchml.SwitchMLTimeoutError)
    assert failed.error.missing_ranks == [1] and "did not join within 10s" in str(failed.error)
    assert c.state == CLOSED and c.get_timer() is None and c.error is failed.error


@pytest.mark.parametrize("heard", [b"", b"\x00\x01 not a line of ours", b"HTTP/1.1 400"])
def test_an_address_that_never_answers_the_join_is_the_switchs_fault(heard):
    """Something listens there and says nothing of the protocol: the switch is
    named unreachable (a torch job goes to gloo), not some rank late to join."""
    c = joining(0, world=3, now=100.0)
    assert c.receive_data(heard, 101.0) == []
    [failed] = c.handle_timer(110.0)
    assert isinstance(failed.error, switchml.SwitchUnreachableError)
    assert "switch at sw:7300 did not answer the join within 10s" in str(failed.error)


def test_a_switch_that_does_not_answer_fails_the_join_long_before_a_long_timeout():
    """A switch answers a join at once (who is there so far): one that says nothing
    for SWITCH_ANSWER_S is stopped or hung, however long the job would wait for its
    ranks (a torch group's timeout is 30 minutes); one that answered, and answers a
    status query after each SWITCH_SILENCE_S without a word, waits that long."""
    silent = joining(0, world=3, now=100.0, timeout=1800.0)
    assert silent.get_timer() == 100.0 + SWITCH_ANSWER_S
    assert silent.handle_timer(100.0 + SWITCH_ANSWER_S - 0.01) == []
    [failed] = silent.handle_timer(100.0 + SWITCH_ANSWER_S)
    assert isinstance(failed.error, switchml.SwitchUnreachableError)
    assert f"did not answer the join within {SWITCH_ANSWER_S:g}s" in str(failed.error)
    assert silent.unanswered
    answered = joining(0, world=3, now=100.0, timeout=1800.0)
    answered.receive_data(encode_line({"event": "joined", "job": "j", "present": [0]}), 101.0)
    answered.data_to_send()  # (the join)
    now, asked = 101.0, 0
    while (timer := answered.get_timer()) < 1900.0:
        assert timer == now + SWITCH_SILENCE_S
        assert answered.handle_timer(timer) == []
        assert json.loads(answered.data_to_send()) == {"op": "status", "slots": []}
        now, asked = timer + 0.5, asked + 1
        answered.receive_data(encode_line({"event": "status", "slots": []}), now)
    assert asked > 300 and answered.handle_timer(1899.0) == []
    [late] = answered.handle_timer(1900.0)
    assert isinstance(late.error, switchml.SwitchMLTimeoutError)
    assert late.error.missing_ranks == [1, 2]


def test_a_switch_that_answered_the_join_and_then_hangs_is_named_not_the_ranks_awaited():
    """A switch stopped (or hung) after it answered the join: the rank asks whether
    it is there after SWITCH_SILENCE_S without a word, and names it unreachable
    SWITCH_ANSWER_S later, not the ranks it awaited after the whole timeout."""
    c = joining(0, world=3, now=100.0, timeout=1800.0)
    c.receive_data(encode_line({"event": "joined", "job": "j", "present": [0]}), 101.0)
    c.data_to_send()
    assert c.handle_timer(101.0 + SWITCH_SILENCE_S) == []
    assert json.loads(c.data_to_send()) == {"op": "status", "slots": []}
    assert c.get_timer() == 101.0 + SWITCH_SILENCE_S + SWITCH_ANSWER_S
    assert c.handle_timer(101.0 + SWITCH_SILENCE_S + SWITCH_ANSWER_S - 0.01) == []
    [failed] = c.handle_timer(101.0 + SWITCH_SILENCE_S + SWITCH_ANSWER_S)
    assert isinstance(failed.error, switchml.SwitchUnreachableError)
    assert "answered the join, then did not answer a status query within 10s" in str(
        failed.error) and "ranks [1, 2] were awaited" in str(failed.error)


def test_a_job_waiting_for_room_fails_after_wait_for_slots_naming_the_limit():
    c = joining(0, wait_for_slots=3.0)
    waiting = {"event": "waiting", "job": "j", "limit": "slots", "message": "no room"}
    [event] = c.receive_data(encode_line(waiting), 1.0)
    assert event == Waiting("j", "slots", "no room") and c.get_timer() == 4.0
    c.receive_data(encode_line(waiting), 2.0)  # again: the first one's deadline holds
    [failed] = c.handle_timer(4.0)
    assert isinstance(failed.error, switchml.LimitExceededError)
    assert failed.error.limit == "slots" and "waited 3s" in str(failed.error)


def test_back_to_gathering_restores_the_join_deadline():
    c = joining(0, wait_for_slots=30.0)
    c.receive_data(encode_line({"event": "waiting", "job": "j", "limit": "slots",
                                "message": "x"}), 1.0)
    c.receive_data(encode_line({"event": "joined", "job": "j", "present": [0]}), 2.0)
    assert c.get_timer() == 2.0 + SWITCH_SILENCE_S  # (whether the switch is still there)
    c.handle_timer(2.0 + SWITCH_SILENCE_S)
    c.receive_data(encode_line({"event": "status", "slots": []}), 7.5)
    assert c.get_timer() == 10.0  # the join's deadline, not wait_for_slots'


@pytest.mark.parametrize("reply, error", [
    ({"event": "error", "message": "world_size 40 exceeds", "limit": "max_workers"},
     switchml.LimitExceededError),
    ({"event": "error", "message": "rank 0 of job 'j' has already joined"},
     switchml.JoinRefusedError),
])
def test_a_refused_join_raises_its_reason(reply, error):
    [failed] = joining().receive_data(encode_line(reply), 0.5)
    assert type(failed.error) is error and reply["message"] in str(failed.error)
    assert getattr(failed.error, "limit", None) == reply.get("limit")


def test_another_protocol_version_is_refused_naming_both(ctl):
    newer = joining(version=PROTOCOL_VERSION + 1)
    out = to_switch(newer, ctl, "n")
    [(_, reply)] = out
    assert reply["event"] == "error" and reply["version"] == PROTOCOL_VERSION
    assert f"version {PROTOCOL_VERSION + 1}" in reply["message"]
    assert f"version {PROTOCOL_VERSION}" in reply["message"]
    assert ctl.refused["version"] == 1 and ctl.jobs == {}
    [failed] = newer.receive_data(replies_to(out, "n"), 1.0)
    error = failed.error
    assert isinstance(error, switchml.ProtocolVersionError)
    assert isinstance(error, switchml.JoinRefusedError)  # what callers already catch
    assert (error.switch_version, error.worker_version) == (PROTOCOL_VERSION,
                                                           PROTOCOL_VERSION + 1)
    assert (f"speaks control protocol version {PROTOCOL_VERSION} and this worker version "
            f"{PROTOCOL_VERSION + 1}") in str(error)


def running(ctl):
    a, b = joining(0), joining(1)
    to_switch(a, ctl, "a")
    out = to_switch(b, ctl, "b")
    a.receive_data(replies_to(out, "a"), 1.0)
    b.receive_data(replies_to(out, "b"), 1.0)
    return a, b


def test_a_rank_that_gives_up_fails_the_job_for_the_other_naming_the_missing(ctl):
    a, b = running(ctl)
    a.abort(switchml.SwitchMLTimeoutError("no progress", missing_ranks=[1]))
    out = to_switch(a, ctl, "a")
    [failed] = b.receive_data(replies_to(out, "b"), 5.0)
    assert isinstance(failed, JobFailed)
    assert isinstance(failed.error, switchml.SwitchMLTimeoutError)
    assert failed.error.missing_ranks == [1] and "rank 0 of job 'j' gave up" in str(failed.error)
    assert ctl.pipeline.free_slots() == 16
    # the connection is done: nothing more is read
    assert b.receive_data(encode_line({"event": "left"}), 6.0) == [] and b.state == CLOSED


def test_ranks_that_disagree_on_a_call_get_a_mismatch():
    c = client()
    c.receive_data(encode_line({"event": "ready", "session": 5, "slot_base": 0,
                                "slot_count": 4, "packet_elements": 64,
                                "block_elements": 64, "data_port": 1}), 0.0)
    failed = {"event": "failed", "missing": [], "reason": "ranks disagree", "mismatch": True}
    [event] = c.receive_data(encode_line(failed), 1.0)
    assert type(event.error) is switchml.CallMismatchError
    assert "job 'j' failed: ranks disagree" in str(event.error)


def test_leave_and_status_round_trip(ctl):
    a, b = running(ctl)
    a.query_status([(0, 0), (1, 0)])
    [status] = a.receive_data(replies_to(to_switch(a, ctl, "a"), "a"), 2.0)
    assert isinstance(status, StatusReply) and [row[:2] for row in status.slots] == [
        (0, 0), (1, 0)]
    error = a.stall_error(StatusReply(((0, 0, True, 0b01),)), 30.0)
    assert error.missing_ranks == [1] and "no progress for 30s" in str(error)
    assert a.stall_error(StatusReply(), 30.0).missing_ranks == [0, 1]  # cannot tell: all
    a.leave()
    assert a.receive_data(replies_to(to_switch(a, ctl, "a"), "a"), 3.0) == [Left()]


@pytest.mark.parametrize("line", [
    b"not json\n",
    b"[1, 2]\n",
    b'{"no": "event"}\n',
    b'{"event": "ready", "session": 1}\n',                      # fields missing
    b'{"event": "joined", "job": "j", "present": "0"}\n',       # mistyped
    b'{"event": "status", "slots": [[1, 2]]}\n',
])
def test_a_malformed_line_is_a_named_error(line):
    c = joining()
    [failed] = c.receive_data(line, 1.0)
    assert isinstance(failed.error, switchml.SwitchUnreachableError)
    assert "switch at sw:7300 sent a malformed control message" in str(failed.error)
    assert c.state == CLOSED


def test_an_unknown_event_is_news_of_a_newer_switch_and_ignored():
    c = joining()
    assert c.receive_data(b'{"event": "hello-from-the-future", "x": 1}\n', 1.0) == []
    assert c.state != CLOSED


@pytest.mark.parametrize("ready, exc, words", [
    (False, None, "closed the connection while joining"),
    (False, OSError("reset"), "lost the switch at sw:7300 while joining: reset"),
    (True, None, "closed the control connection (switch stopped or crashed?)"),
    (True, TimeoutError("timed out"), "control connection to the switch at sw:7300 failed"),
])
def test_a_lost_connection_names_the_switch(ctl, ready, exc, words):
    c = running(ctl)[0] if ready else joining()
    [failed] = c.connection_lost(exc)
    assert isinstance(failed.error, switchml.SwitchUnreachableError)
    assert words in str(failed.error)
    assert c.connection_lost() == []  # once
