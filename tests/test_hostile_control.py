"""Hostile input on the control port: it is refused or dropped, and the switch lives on.

Each test ends with a real job through the same switch: a switch whose thread
died, or that is stuck sending to a client, cannot serve it.
"""

import json
import resource
import socket
import subprocess
import sys
import threading
import time

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import switchml
from switchml.netutil import unacknowledged
from switchml.protocol import Join
from switchml.switch import connections
from switchml.switch.control import Controller
from switchml.switch.dataplane.pipeline import Pipeline

CLI = [sys.executable, "-m", "switchml.cli"]


def job_still_works(address, job="after"):
    with switchml.Worker(address, 0, 1, job=job, timeout=2.0) as w:
        assert np.array_equal(w.allreduce(np.arange(3000, dtype=np.int32)), np.arange(3000))


def control_exchange(address, lines: bytes, replies: int = 1, timeout: float = 2.0) -> list:
    """Send raw bytes to the control port; return the first ``replies`` JSON replies."""
    with socket.create_connection(address, timeout=timeout) as conn:
        conn.sendall(lines)
        buf = b""
        while buf.count(b"\n") < replies:
            data = conn.recv(65536)
            if not data:
                break
            buf += data
    return [json.loads(line) for line in buf.splitlines()[:replies]]


def test_deeply_nested_json_does_not_kill_the_switch(switch):
    with socket.create_connection(switch.address) as conn:
        conn.sendall(b"[" * 200_000 + b"\n")
        conn.settimeout(2.0)
        assert conn.recv(100) == b""  # the switch hung up on it
    job_still_works(switch.address)
    assert switch.stats()["counters"]["control_bad_message"] == 1


def test_non_finite_and_mistyped_join_fields_are_refused(switch):
    base = '"op": "join", "version": 2, "job": "x", "rank": 0, "world_size": 1'
    bad = [
        '{%s, "data_addr": ["127.0.0.1", 5000], "slots": Infinity}' % base,
        '{%s, "data_addr": ["127.0.0.1", 5000], "slots": NaN}' % base,
        '{%s, "data_addr": ["127.0.0.1", 1e999]}' % base,
        '{%s, "data_addr": ["127.0.0.1", 70000]}' % base,
        '{%s, "data_addr": "127.0.0.1:5000"}' % base,
        # a name, which the switch would resolve on its serving thread (a resolver
        # that never answers would stall every job): refused, never looked up
        '{%s, "data_addr": ["localhost", 5000]}' % base,
        '{%s, "data_addr": ["127.0.0.1\\u0000", 5000]}' % base,
        '{%s, "data_addr": ["127.1", 5000]}' % base,
        '{"op": "join", "version": 2, "job": "x", "rank": 0.5, "world_size": 1, '
        '"data_addr": ["h", 1]}',
        '{"op": "join", "version": 2, "job": "x", "rank": 0, "world_size": true, '
        '"data_addr": ["h", 1]}',
        '{"op": "join", "version": 2, "job": "x", "rank": 0, "world_size": 1e300, '
        '"data_addr": ["h", 1]}',
    ]
    for line in bad:
        [reply] = control_exchange(switch.address, line.encode() + b"\n")
        assert reply["event"] == "error", (line, reply)
    assert switch.stats()["admission"]["refused"]["bad_request"] == len(bad)
    assert switch.controller.jobs == {}
    job_still_works(switch.address)


def test_malformed_status_query_of_a_joined_rank_is_answered_empty(switch):
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("127.0.0.1", 0))
    join = {"op": "join", "version": 2, "job": "j", "rank": 0, "world_size": 1,
            "data_addr": list(udp.getsockname())}
    queries = [5, {"a": 1}, "slots", [[0.5, 1]], [[1, 2, 3]], [[True, 0]], [[0, 2**40]]]
    lines = [json.dumps(join)] + [json.dumps({"op": "status", "slots": q}) for q in queries]
    replies = control_exchange(switch.address, "\n".join(lines).encode() + b"\n",
                               replies=1 + len(queries))
    assert replies[0]["event"] == "ready"
    assert replies[1:] == [{"event": "status", "slots": []}] * len(queries)
    udp.close()
    job_still_works(switch.address)


def never_reading_client(address) -> socket.socket:
    """A control connection whose replies are never read, with a small receive
    buffer set before it connects (so that its window is small from the start)."""
    hog = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    hog.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    hog.connect(address)
    return hog


def wait_for_the_slow_reader_hang_up(switch, seconds=30.0):
    """Until the switch has hung up on the one control connection as a slow reader;
    none may have been lost (reset, or timed out by TCP) instead."""
    deadline = time.monotonic() + seconds
    while not switch.stats()["counters"].get("control_slow_reader"):
        assert time.monotonic() < deadline, (
            "the switch never hung up on the client; its connections' replies, queued "
            "and in the kernel, not acknowledged: "
            f"{[(len(c.outbox), unacknowledged(c.sock)) for c in list(switch._conns.values())]}"
            f", counters: {switch.stats()['counters']}, "
            f"serving thread alive: {switch._thread.is_alive()}")
        time.sleep(0.05)
    counters = switch.stats()["counters"]
    assert "control_lost" not in counters, counters
    assert not switch._conns  # counted and closed in one step


def test_a_client_that_never_reads_cannot_stall_the_switch(switch, monkeypatch):
    """Stats requests whose replies are never read: once the kernel's buffers are
    full, a switch that waits to send them stops serving everyone.  It must queue
    them instead, hang up on the client when the replies it has not acknowledged
    pass their bound (lowered here to 64 KiB) and go on serving the others.

    The switch's end of the connection gets a kernel send buffer of a few KiB,
    which, with the client's small window, fills long before the bound: a switch
    that waited for the client would wait there, bound or no bound."""
    monkeypatch.setattr(connections, "MAX_CONTROL_BACKLOG", 1 << 16)
    hog = never_reading_client(switch.address)
    deadline = time.monotonic() + 10
    while not switch._conns:
        assert time.monotonic() < deadline, "the switch never accepted the connection"
        time.sleep(0.01)
    [switch_end] = list(switch._conns)
    switch_end.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)

    def flood():
        # 250k requests, some 90 MB of replies: far beyond any kernel buffer
        try:
            hog.sendall(b'{"op": "stats"}\n' * 250_000)
        except OSError:  # the switch hung up
            pass

    threading.Thread(target=flood, daemon=True).start()
    wait_for_the_slow_reader_hang_up(switch)
    # the others are served: a join and a call, each given 2 s without progress
    # (the worker's timeout) before it raises; no wall-clock bound beyond that,
    # which a loaded machine would break
    job_still_works(switch.address)
    hog.close()
    assert switch.stats()["counters"]["control_slow_reader"] == 1


def test_replies_held_by_the_kernel_count_toward_the_backlog_bound(switch, monkeypatch):
    """A thousand stats requests, some 400 KB of replies never read: past the bound
    (64 KiB here), but within what the kernel's send buffer takes (it grows to 4
    MiB by default).  The bound counts the replies the client has not acknowledged,
    the kernel's included, so the switch hangs up on it at once.  When it counted
    only its own queue, it waited with the replies in the kernel until TCP's user
    timeout (the keepalive, 20 s) ended the connection, uncounted: a flood stalled
    by loopback TCP backing off on a loaded machine did that to the test above."""
    monkeypatch.setattr(connections, "MAX_CONTROL_BACKLOG", 1 << 16)
    hog = never_reading_client(switch.address)
    hog.sendall(b'{"op": "stats"}\n' * 1000)  # 16 KB: the switch reads it all
    wait_for_the_slow_reader_hang_up(switch)
    job_still_works(switch.address)
    hog.close()
    assert switch.stats()["counters"]["control_slow_reader"] == 1


def _low_fd_limit():
    resource.setrlimit(resource.RLIMIT_NOFILE, (120, 120))


def test_more_connections_than_file_descriptors_do_not_kill_the_switch():
    """Members are never closed for room (the lobby's caps bound only connections
    that have not joined), so enough of them (each a rank of a job of its own
    that never gathers its second rank) exhaust the descriptors: the switch
    pauses accepting, and serves again once they go."""
    proc = subprocess.Popen(CLI + ["switch", "--port", "0", "--slots", "8", "--max-jobs", "1",
                                   "--max-unjoined", "8", "--packet-elements", "512",
                                   "--log-level", "error"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_low_fd_limit)
    try:
        line = proc.stdout.readline()
        assert "listening on" in line, line + proc.stderr.read()
        address = line.split("SWITCHML_SWITCH=")[1].strip()
        host, port = address.rsplit(":", 1)
        flood = []
        for i in range(150):
            conn = socket.create_connection((host, int(port)))
            conn.sendall(Join(f"squat{i}", 0, 2, ("127.0.0.1", 1000 + i)).encode())
            flood.append(conn)
        time.sleep(0.5)  # the switch runs out of descriptors accepting them
        for conn in flood:
            conn.close()
        time.sleep(0.3)
        job_still_works(address)
        assert proc.poll() is None
        stats = json.loads(subprocess.run(CLI + ["stats", "--switch", address, "--json"],
                                          capture_output=True, text=True, check=True).stdout)
        assert stats["counters"].get("control_accept_errors", 0) > 0, stats["counters"]
    finally:
        proc.terminate()
        proc.wait(timeout=10)


# ---------------------------------------------------------------- the controller, fuzzed
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                 max_size=3),
    max_leaves=8)
fields = {
    "op": st.sampled_from(["join", "leave", "abort", "status", "stats", "bogus"]) | json_values,
    "job": st.sampled_from(["a", "b"]) | json_values,
    "rank": st.integers(-1, 3) | json_values,
    "world_size": st.integers(0, 4) | json_values,
    "data_addr": st.tuples(st.sampled_from(["10.0.0.1", "10.0.0.2"]),
                           st.integers(0, 4)).map(list)
    | json_values,
    "slots": st.integers(0, 12) | st.none() | json_values,
    "wait": st.booleans() | json_values,
    "missing": st.lists(st.integers(-1, 5), max_size=3) | json_values,
}
messages = st.fixed_dictionaries({}, optional=fields) | json_values
actions = st.lists(st.tuples(st.integers(0, 5), st.booleans(), messages), max_size=30)


@settings(max_examples=100, derandomize=True, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(actions=actions)
def test_controller_never_raises_and_never_leaks_slots(actions):
    pipeline = Pipeline(slots=8, packet_elements=64)
    ctl = Controller(pipeline, data_port=9, slots_per_job=3, max_jobs=2)
    for conn, disconnect, msg in actions:
        out = ctl.handle_disconnect(conn) if disconnect else ctl.handle_message(conn, msg)
        for _, reply in out:
            json.dumps(reply, allow_nan=False)  # every reply can go over the wire
        running = [job for job in ctl.jobs.values() if job.session]
        assert len(running) <= 2
        held = sum(pipeline.jobs[job.session].slot_count for job in running)
        assert pipeline.free_slots() == 8 - held
        assert set(pipeline.jobs) == {job.session for job in running}
        for c, (name, rank) in ctl._conn_job.items():
            assert ctl.jobs[name].conns[rank] == c
        # every data address belongs to one job at most, and the index says which
        assert ctl._address_job == {addr: ident for ident, job in ctl.jobs.items()
                                    for addr in job.addrs.values()}


# ---------------------------------------------------------------- one address, one job
def join(conn, job, rank, world, port, wait=False, ctl=None):
    msg = {"op": "join", "version": 2, "job": job, "rank": rank, "world_size": world,
           "data_addr": ["10.0.0.1", port], "wait": wait}
    return ctl.handle_message(conn, msg)


def test_a_data_address_another_job_holds_is_refused_and_the_waiting_queue_lives_on():
    """The data plane tells members apart by address: a job that claims one a
    running job holds, and waits for room, would make the switch install it
    twice when room came (a ValueError that took the serving thread down)."""
    ctl = Controller(Pipeline(slots=8, packet_elements=64), data_port=9, slots_per_job=4,
                     max_jobs=2)
    assert join("a", "A", 0, 1, 5000, ctl=ctl)[0][1]["event"] == "ready"
    assert join("c", "C", 0, 1, 5001, ctl=ctl)[0][1]["event"] == "ready"
    [(_, reply)] = join("b", "B", 0, 1, 5000, wait=True, ctl=ctl)
    assert reply["event"] == "error" and "already used by a rank of another job" in \
        reply["message"]
    assert join("d", "D", 0, 1, 5002, wait=True, ctl=ctl)[0][1]["event"] == "waiting"
    started = ctl.handle_disconnect("c")  # room: the waiting job starts, nothing raises
    assert [(c, r["event"]) for c, r in started] == [("d", "ready")]
    # ranks of jobs still gathering hold their addresses too, until they go
    assert join("e0", "E", 0, 2, 6000, ctl=ctl)[0][1]["event"] == "joined"
    assert join("f0", "F", 0, 2, 6000, ctl=ctl)[0][1]["event"] == "error"
    assert join("e1", "E", 1, 2, 6000, ctl=ctl)[0][1]["event"] == "error"  # its own job's
    ctl.handle_disconnect("e0")
    assert join("f0", "F", 0, 2, 6000, ctl=ctl)[0][1]["event"] == "joined"
    assert ctl.pipeline.counters["internal_errors"] == 0


def test_a_bug_on_a_disconnect_is_counted_and_the_switch_serves_on(switch, monkeypatch):
    def broken(self, conn):
        raise RuntimeError("a bug")

    monkeypatch.setattr(Controller, "handle_disconnect", broken)
    control_exchange(switch.address, b'{"op": "stats"}\n')  # closed after the reply
    deadline = time.monotonic() + 5
    while switch.stats()["counters"].get("internal_errors", 0) == 0:
        assert time.monotonic() < deadline, "the disconnect never reached the controller"
        time.sleep(0.01)
    monkeypatch.undo()
    job_still_works(switch.address)


def test_a_serving_thread_that_fails_stops_the_switch_with_its_error(monkeypatch):
    def broken(self):
        raise RuntimeError("a bug in the loop")

    sw = switchml.Switch()
    monkeypatch.setattr(switchml.Switch, "_log_lobby", broken)
    sw.start()
    try:
        sw._thread.join(timeout=5)
        assert not sw._thread.is_alive()
        assert isinstance(sw.failure, switchml.SwitchMLError)
        assert "a bug in the loop" in str(sw.failure)
    finally:
        sw.stop()


def test_idle_gatherings_do_not_lock_jobs_out():
    """Gatherings of host records are members, as joins' ranks are: however many
    wait idle, a new job's ranks still gather (a cap on gatherings made four idle
    connections refuse every job of a switch with max_jobs=4)."""
    ctl = Controller(Pipeline(slots=8, packet_elements=64), data_port=9, max_jobs=1)
    gather = {"op": "gather", "version": 2, "world_size": 2, "value": "v"}
    for i in range(20):
        [(_, reply)] = ctl.handle_message(f"idle{i}", {**gather, "job": f"squat{i}", "rank": 0})
        assert reply["event"] == "joined"
    ctl.handle_message("r0", {**gather, "job": "real", "rank": 0})
    done = ctl.handle_message("r1", {**gather, "job": "real", "rank": 1})
    assert sorted((c, r["event"]) for c, r in done) == [("r0", "gathered"), ("r1", "gathered")]


def test_an_unknown_request_is_answered_and_counted_as_no_hang_up(switch):
    with socket.create_connection(switch.address, timeout=2.0) as conn:
        conn.sendall(b'{"op": "bogus"}\n')
        assert json.loads(conn.makefile().readline())["event"] == "error"
        conn.sendall(b'{"op": "stats"}\n')
        assert json.loads(conn.makefile().readline())["event"] == "stats"
        stats = switch.stats()
    assert stats["counters"]["control_unknown_request"] == 1
    assert stats["control"]["closed"]["bad_message"] == 0


def test_running_jobs_that_share_a_name_each_have_their_stats():
    pipeline = Pipeline(slots=8, packet_elements=64)
    pipeline.install_job("default", 1, [("10.0.0.1", 1)], 0, 2)
    pipeline.install_job("default", 2, [("10.0.0.1", 2)], 2, 2)
    pipeline.install_job("other", 3, [("10.0.0.1", 3)], 4, 2)
    assert sorted(pipeline.stats()["jobs"]) == ["default@00000001", "default@00000002", "other"]
