"""Failures in the middle of a job, and what comes after: a worker killed inside an
allreduce, a switch killed under a running job and restarted on the same port, a
worker that restarts and rejoins, and packets of an old session arriving after a
restart.  Every failure must be an error naming what is missing, within the
(short) timeout, with the switch's state freed."""

import json
import multiprocessing as mp
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from conftest import run_ranks

import switchml
from switchml import wire
from switchml.cli import fetch_stats
from switchml.netutil import LineReader, encode_line

TIMEOUT = 2.0
K = 1024
CLI = [sys.executable, "-m", "switchml.cli"]


def inputs(rank, size=100_000):
    return (np.arange(size, dtype=np.int32) % 1000) * (rank + 1)


class DieAfterSends:
    """The victim's data socket: the process SIGKILLs itself at its n-th datagram."""

    def __init__(self, sock, n):
        self._sock, self._left = sock, n

    def sendto(self, data, address):
        self._left -= 1
        if self._left == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        return self._sock.sendto(data, address)

    def __getattr__(self, name):
        return getattr(self._sock, name)


def _victim(address, rank, world, job, started):
    """Join, finish one allreduce, then die inside the second one."""
    started.set()  # its interpreter is up (a spawn on a busy machine takes seconds)
    w = switchml.Worker(address, rank, world, job=job, timeout=10)
    w.allreduce(inputs(rank))
    w._udp = DieAfterSends(w._udp, 30)  # about a third of the second call's packets
    w.allreduce(inputs(rank))
    raise AssertionError("the victim should have died inside its second allreduce")


def test_worker_killed_inside_an_allreduce_is_named_and_its_slots_are_reused(switch):
    ctx = mp.get_context("spawn")
    started = ctx.Event()
    victim = ctx.Process(target=_victim, args=(switch.address, 2, 3, "kill", started),
                         daemon=True)
    victim.start()
    assert started.wait(60)  # the others join within TIMEOUT of the first
    died = {}
    watcher = threading.Thread(target=lambda: (victim.join(30), died.setdefault(
        "at", time.monotonic())))
    watcher.start()

    def body(rank):
        with switchml.Worker(switch.address, rank, 3, job="kill", timeout=TIMEOUT) as w:
            assert np.array_equal(w.allreduce(inputs(rank)), inputs(0) * 6)
            with pytest.raises(switchml.SwitchMLTimeoutError) as info:
                w.allreduce(inputs(rank))
            return info.value, time.monotonic()

    results = run_ranks(2, body)
    watcher.join()
    assert victim.exitcode == -signal.SIGKILL
    for error, when in results:
        assert error.missing_ranks == [2] and "rank 2 of job 'kill' disconnected" in str(error)
        assert when - died["at"] < 1.0  # seen when its connection dropped, not at the timeout
    stats = switch.stats()
    assert stats["free_slots"] == 64 and stats["ended_jobs"]["kill"]["state"] == "failed"
    # all the pool, the killed job's slots included, is there for the next job
    with switchml.Worker(switch.address, 0, 1, job="next", slots=64) as w:
        assert w.membership.slot_count == 64
        assert np.array_equal(w.allreduce(inputs(0)), inputs(0))


def _start_switch(port=0):
    proc = subprocess.Popen(CLI + ["switch", "--port", str(port), "--slots", "64",
                                   "--slots-per-job", "16", "--packet-elements", str(K),
                                   "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert "listening on" in line, line + proc.stderr.read()
    return proc, line.split("SWITCHML_SWITCH=")[1].strip()


def test_switch_killed_mid_job_then_a_new_job_on_a_restarted_switch_works():
    proc, address = _start_switch()
    port = int(address.rsplit(":", 1)[1])
    progress = threading.Barrier(3)
    results = []

    def body(rank):
        calls = 0
        with switchml.Worker(address, rank, 2, job="train", timeout=TIMEOUT) as w:
            try:
                while True:
                    out = w.allreduce(inputs(rank, 300_000))
                    assert np.array_equal(out, inputs(0, 300_000) * 3)
                    calls += 1
                    if calls == 2:
                        progress.wait(10)
            except switchml.SwitchMLError as exc:
                return exc, time.monotonic(), calls

    try:
        runner = threading.Thread(target=lambda: results.extend(run_ranks(2, body)))
        runner.start()
        progress.wait(30)  # both ranks are past two allreduces, in the middle of more
        proc.kill()
        proc.wait(10)
        killed_at = time.monotonic()
        runner.join(30)
        for error, when, calls in results:
            assert isinstance(error, switchml.SwitchUnreachableError), error
            assert f"switch at 127.0.0.1:{port}" in str(error)
            # it tried to rejoin for the timeout, then gave up with the error it had
            assert when - killed_at < TIMEOUT + 1.5
            assert calls >= 2
        # a new switch on the same port serves a new job
        proc, address = _start_switch(port)

        def again(rank):
            with switchml.Worker(address, rank, 2, job="train", timeout=TIMEOUT) as w:
                return w.allreduce(inputs(rank))

        for out in run_ranks(2, again):
            assert np.array_equal(out, inputs(0) * 3)
        assert fetch_stats(address)["ended_jobs"]["train"]["state"] == "ended"
    finally:
        proc.kill()
        proc.wait(10)


def raw_join(address, data_sock, job):
    """Join a one-rank job from ``data_sock`` over a bare control connection."""
    control = socket.create_connection(address, timeout=5)
    control.sendall(encode_line({"op": "join", "version": 2, "job": job, "rank": 0, "world_size": 1,
                                 "data_addr": list(data_sock.getsockname())}))
    reader = LineReader()
    while True:
        for msg in reader.feed(control.recv(4096)):
            if msg["event"] == "ready":
                return control, msg


def contribution(ready, token, value=1):
    lanes = np.zeros(K // 256, wire.LANE)
    return wire.encode(wire.KIND_CONTRIBUTION, wire.DTYPE_INT32, ready["slot_base"], token,
                       0, 0, 0, lanes, np.full(K, value, np.int32))


@pytest.mark.parametrize("how", ["restarted switch", "new job"])
def test_packets_of_an_old_session_are_dropped_and_counted(how):
    """The same data address, the same slots, the old session: dropped, counted,
    and the new session's packets are served."""
    data = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    data.bind(("127.0.0.1", 0))
    data.settimeout(2)
    sw = switchml.Switch(packet_elements=K, slots=16, slots_per_job=16).start()
    try:
        control, old = raw_join(sw.address, data, "j")
        data.sendto(contribution(old, old["token"]), sw.address)
        assert wire.decode_header(data.recv(65536)).session == old["session"]
        if how == "restarted switch":
            control.close()
            port = sw.address[1]
            sw.stop()
            sw = switchml.Switch(port=port, packet_elements=K, slots=16,
                                 slots_per_job=16).start()
        else:
            control.sendall(encode_line({"op": "leave"}))
            assert json.loads(control.recv(4096)) == {"event": "left"}
            control.close()
        control, new = raw_join(sw.address, data, "j")
        assert new["session"] != old["session"] and new["slot_base"] == old["slot_base"]
        for value in range(1, 6):  # late packets of the old job, from the same address
            data.sendto(contribution(old, old["token"], value), sw.address)
        data.sendto(contribution(new, new["token"], 7), sw.address)
        result = data.recv(65536)  # the only reply: to the new session's packet
        h = wire.decode_header(result)
        assert h.session == new["session"]
        assert wire.values(result, h.lanes, h.count).tolist() == [7] * K
        counters = sw.stats()["jobs"]["j"]["counters"]
        assert counters["dropped_bad_token"] == 5
        assert counters["packets_in"] == 1 and counters["results_completed"] == 1
        data.settimeout(0.2)
        with pytest.raises(socket.timeout):
            data.recv(65536)
        control.close()
    finally:
        sw.stop()
        data.close()


def _restartable_rank(address, job, results, die, started):
    """Rank 1: one allreduce, then die (SIGKILL, no goodbye) or report and leave."""
    started.set()  # its interpreter is up (a spawn on a busy machine takes seconds)
    w = switchml.Worker(address, 1, 2, job=job, timeout=10)
    out = w.allreduce(inputs(1))
    if die:
        os.kill(os.getpid(), signal.SIGKILL)
    results.put((w.membership.session, out.tolist()[:5]))
    w.close()


def test_a_worker_that_restarts_rejoins_and_the_job_re_forms(switch):
    """Rank 1 dies mid-job; rank 0 gets an error naming it; the restarted rank 1 and
    a fresh Worker of rank 0 form the job again under a new session."""
    ctx = mp.get_context("spawn")
    results, started = ctx.Queue(), ctx.Event()
    first = ctx.Process(target=_restartable_rank,
                        args=(switch.address, "rj", results, True, started), daemon=True)
    first.start()
    assert started.wait(60)  # rank 0 waits TIMEOUT for it to join
    with switchml.Worker(switch.address, 0, 2, job="rj", timeout=TIMEOUT) as w:
        old_session = w.membership.session
        w.allreduce(inputs(0))  # rank 1 dies right after this one
        with pytest.raises(switchml.SwitchMLTimeoutError) as info:
            w.allreduce(inputs(0))
        assert info.value.missing_ranks == [1]
    first.join(10)
    assert switch.stats()["free_slots"] == 64
    second = ctx.Process(target=_restartable_rank,
                         args=(switch.address, "rj", results, False, started), daemon=True)
    second.start()
    with switchml.Worker(switch.address, 0, 2, job="rj", timeout=10) as w:
        out = w.allreduce(inputs(0))
        new_session = w.membership.session
    assert np.array_equal(out, inputs(0) * 3)
    session, head = results.get(timeout=10)
    second.join(10)
    assert session == new_session != old_session and head == (inputs(0) * 3)[:5].tolist()
    assert switch.stats()["free_slots"] == 64


def test_a_second_incarnation_of_a_live_rank_is_refused_and_the_job_goes_on(switch):
    def body(rank):
        with switchml.Worker(switch.address, rank, 2, job="live", timeout=TIMEOUT) as w:
            if rank == 1:
                with pytest.raises(switchml.JoinRefusedError,
                                   match=r"job 'live' is already running and rank 1"):
                    switchml.Worker(switch.address, 1, 2, job="live", timeout=TIMEOUT)
            return w.allreduce(inputs(rank))

    for out in run_ranks(2, body):
        assert np.array_equal(out, inputs(0) * 3)
