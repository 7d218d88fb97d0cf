"""The control messages: each one's JSON object, and read back the same."""

import json

import pytest

from switchml import protocol
from switchml.protocol import (
    Abort,
    Error,
    Failed,
    Join,
    Joined,
    Leave,
    Left,
    Ready,
    StatsQuery,
    StatsReply,
    StatusQuery,
    StatusReply,
    Waiting,
)

REQUESTS = [
    Join("j", 1, 4, ("10.0.0.2", 4000), slots=8, rcvbuf=1 << 20, mtu=9000, wait=True),
    Join("j", 0, 1, ("10.0.0.3", 1)),
    Leave(),
    Abort("no progress for 30s", (2, 3)),
    Abort("the switch at h:7300 closed the control connection", (), switch_lost=True),
    Abort("job 'local': rank 1 died", culprits=(1,)),
    StatusQuery(((0, 1), (5, 7))),
    StatsQuery(),
]
EVENTS = [
    Joined("j", (0, 2)),
    Ready(0xDEADBEEF, 32, 16, 16128, 256, 7300),
    Ready(0xDEADBEEF, 32, 2, 16128, 256, 7300, link_window=32),
    Ready(0xDEADBEEF, 32, 2, 16128, 256, 7300, token=5, gso=False),
    Ready(0xDEADBEEF, 32, 2, 16128, 256, 7300, threads=2, data_threads=8),
    Waiting("j", "slots", "its window does not fit"),
    Error("refused"),
    Error("job 'j' refused: ...", limit="max_jobs"),
    Error("protocol version 2 unsupported", version=1),
    Failed((1,), "rank 1 of job 'j' disconnected"),
    Failed((), "ranks disagree", mismatch=True),
    Failed((), "rank 2 of job 'j' gave up: the switch at h:7300 went away", switch_lost=True),
    Left(),
    protocol.OtherSecretWaiting("j"),
    protocol.OtherSecretSeen("j"),
    StatusReply(((3, 4, True, 0b101),)),
    StatsReply({"slots": 256}),
]


@pytest.mark.parametrize("message", REQUESTS, ids=lambda m: type(m).__name__)
def test_requests_read_back_as_sent(message):
    line = message.encode()
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert protocol.decode_request(json.loads(line)) == message


@pytest.mark.parametrize("message", EVENTS, ids=lambda m: type(m).__name__)
def test_events_read_back_as_sent(message):
    assert protocol.decode_event(json.loads(message.encode())) == message


def test_the_json_objects_are_those_of_docs_protocol_md():
    assert Failed((1,), "gone").to_dict() == {"event": "failed", "missing": [1], "reason": "gone"}
    assert Error("x").to_dict() == {"event": "error", "message": "x"}
    assert Left().to_dict() == {"event": "left"}
    assert Leave().to_dict() == {"op": "leave"}
    assert Join("j", 0, 1, ("h", 1)).to_dict()["version"] == protocol.PROTOCOL_VERSION


def test_ready_says_data_threads_only_where_the_switch_has_several():
    assert "data_threads" not in Ready(1, 0, 4, 16128, 256, 7300).to_dict()
    assert protocol.decode_event(Ready(1, 0, 4, 16128, 256, 7300).to_dict()).data_threads == 1
    for bad in (0, protocol.MAX_DATA_THREADS + 1, "8"):
        line = Ready(1, 0, 4, 16128, 256, 7300).to_dict() | {"data_threads": bad}
        with pytest.raises(protocol.MalformedMessage, match="data_threads"):
            protocol.decode_event(line)


@pytest.mark.parametrize("field, bad", [
    ("session", 0), ("session", 1 << 32), ("slot_base", -1), ("slot_base", 1 << 16),
    ("slot_count", 0), ("slot_count", -1), ("slot_count", (1 << 16) + 1),
    ("packet_elements", 0), ("packet_elements", 300), ("packet_elements", 2 ** 40),
    ("block_elements", 0), ("data_port", 0), ("data_port", 65536), ("token", -1),
    ("link_window", 0),
])
def test_a_ready_out_of_the_wires_ranges_is_malformed(field, bad):
    """Slots, packet geometry, port, session and token as the wire's header fields
    and a datagram hold them: a ready of 0 slots made every call return its output
    untouched, a packet of 0 values raised ZeroDivisionError in Worker()."""
    line = Ready(1, 0, 4, 16128, 256, 7300, token=5).to_dict() | {field: bad}
    with pytest.raises(protocol.MalformedMessage, match=field):
        protocol.decode_event(line)
    rack = line | {"event": "rack_ready", "member": 0, "members": 1, "ranks": [0]}
    if field != "link_window":
        with pytest.raises(protocol.MalformedMessage, match=field):
            protocol.decode_event(rack)


def test_ready_says_gso_only_when_the_switch_wants_datagrams_apart():
    assert "gso" not in Ready(1, 0, 4, 16128, 256, 7300).to_dict()
    assert Ready(1, 0, 4, 16128, 256, 7300, gso=False).to_dict()["gso"] is False
    line = Ready(1, 0, 4, 16128, 256, 7300).to_dict() | {"gso": "no"}
    with pytest.raises(protocol.MalformedMessage, match="gso"):
        protocol.decode_event(line)


def test_a_join_without_a_version_is_version_1_and_refused_naming_both():
    with pytest.raises(protocol.VersionMismatch, match="version 1 unsupported.*speaks version 2"):
        protocol.decode_request({"op": "join", "job": "j", "rank": 0, "world_size": 1,
                                 "data_addr": ["h", 1]})


@pytest.mark.parametrize("msg, error, words", [
    ({"op": "join", "version": 7, "job": "j"}, protocol.VersionMismatch, "version 7"),
    ({"op": "join", "version": 2, "job": "j"}, protocol.BadRequest, "needs"),
    ({"op": "join", "version": 2, "job": "j", "rank": -1, "world_size": 2, "data_addr": ["h", 1]},
     protocol.BadRequest, "rank -1 is outside"),
    ({"op": "teleport"}, protocol.UnknownMessage, "unknown control message 'teleport'"),
    ([], protocol.UnknownMessage, "unknown control message None"),
])
def test_bad_requests_name_what_is_wrong(msg, error, words):
    with pytest.raises(error, match=words):
        protocol.decode_request(msg)


def test_lenient_requests_keep_what_is_sound():
    abort = protocol.decode_request({"op": "abort", "missing": [1, "2", True, 3]})
    assert abort == Abort("no progress", (1, 3))
    query = protocol.decode_request({"op": "status", "slots": [[1, 2], [0.5, 1], [3, -1], 7]})
    assert query == StatusQuery(((1, 2),))
