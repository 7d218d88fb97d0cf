"""Dead, missing and silent ranks, and a dead switch: errors that name them, never hangs."""

import contextlib
import multiprocessing as mp
import os
import signal
import socket
import threading
import time

import numpy as np
import pytest
from conftest import job_whose_rank_1_vanishes, run_ranks

import switchml
from switchml.switch.process import SwitchProcess

TIMEOUT = 2.0


def _join_and_sleep(address, rank, world, started, ready):
    started.set()  # its interpreter is up (a spawn on a busy machine takes seconds)
    w = switchml.Worker(address, rank, world, timeout=10)
    ready.set()
    time.sleep(60)
    w.close()


def test_killed_worker_is_named_and_slots_are_freed(switch):
    ctx = mp.get_context("spawn")
    started, ready = ctx.Event(), ctx.Event()
    victim = ctx.Process(target=_join_and_sleep, args=(switch.address, 2, 3, started, ready),
                         daemon=True)
    victim.start()
    try:
        def body(rank):
            # the others join within TIMEOUT of the first: not before the victim can
            assert started.wait(60)
            with switchml.Worker(switch.address, rank, 3, timeout=TIMEOUT) as w:
                assert ready.wait(30)
                os.kill(victim.pid, signal.SIGKILL)
                start = time.monotonic()
                with pytest.raises(switchml.SwitchMLTimeoutError) as info:
                    w.allreduce(np.ones(100_000, np.float32))
                return info.value, time.monotonic() - start

        for error, elapsed in run_ranks(2, body):
            assert error.missing_ranks == [2]
            assert "rank 2" in str(error)
            assert elapsed < TIMEOUT + 1.0
    finally:
        victim.kill()
    deadline = time.monotonic() + 5
    while switch.stats()["free_slots"] != 64 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert switch.stats()["free_slots"] == 64
    assert switch.stats()["counters"]["jobs_failed"] == 1


def test_silent_worker_is_named_after_the_timeout(switch):
    """Rank 1 joins but never calls allreduce: ranks 0 and 2 time out naming it."""
    failed = threading.Semaphore(0)

    def body(rank):
        with switchml.Worker(switch.address, rank, 3, timeout=TIMEOUT) as w:
            if rank == 1:
                assert failed.acquire(timeout=30) and failed.acquire(timeout=30)
                return None
            start = time.monotonic()
            try:
                with pytest.raises(switchml.SwitchMLTimeoutError) as info:
                    w.allreduce(np.ones(50_000, np.int32))
            finally:
                failed.release()
            return info.value, time.monotonic() - start

    results = run_ranks(3, body)
    for rank in (0, 2):
        error, elapsed = results[rank]
        assert error.missing_ranks == [1], error
        assert "[1]" in str(error)
        assert TIMEOUT - 0.1 <= elapsed < TIMEOUT + 1.0


def test_rank_that_never_joins_is_named(switch):
    start = time.monotonic()
    with pytest.raises(switchml.SwitchMLTimeoutError) as info:
        switchml.Worker(switch.address, 0, 3, timeout=1.0)
    assert info.value.missing_ranks == [1, 2]
    assert time.monotonic() - start < 2.0
    time.sleep(0.2)
    assert switch.stats()["free_slots"] == 64
    assert switch.controller.jobs == {}


def test_unreachable_switch_is_a_clear_error():
    with switchml.Switch() as sw:
        address = sw.address
    with pytest.raises(switchml.SwitchUnreachableError, match=f"{address[1]}"):
        switchml.Worker(address, 0, 1, timeout=1.0)


def test_switch_stopping_mid_job_fails_the_workers():
    sw = switchml.Switch().start()

    def body(rank):
        with switchml.Worker(sw.address, rank, 2, timeout=TIMEOUT) as w:
            w.allreduce(np.ones(10, np.float32))
            if rank == 0:
                sw.stop()
            time.sleep(0.2)
            start = time.monotonic()
            with pytest.raises(switchml.SwitchMLError) as info:
                w.allreduce(np.ones(100_000, np.float32))
            return info.value, time.monotonic() - start

    for error, elapsed in run_ranks(2, body):
        assert isinstance(error, switchml.SwitchUnreachableError)
        assert "switch" in str(error)
        assert elapsed < TIMEOUT + 1.0


@pytest.fixture
def quick_switch_checks(monkeypatch):
    """The switch asked after 0.3 s without a result, 1 s to answer (not 5 and 10)."""
    from switchml import config
    from switchml.worker import control, driver
    monkeypatch.setattr(driver, "SWITCH_SILENCE_S", 0.3)
    monkeypatch.setattr(control, "SWITCH_SILENCE_S", 0.3)
    monkeypatch.setattr(config, "SWITCH_ANSWER_S", 1.0)
    return config


def test_a_switch_that_hangs_while_a_rank_awaits_the_others_at_join_is_named(
        quick_switch_checks):
    """The switch answered rank 0's join, then stopped (SIGSTOP) while rank 0 waits
    for rank 1: rank 0 asks it whether it is there and, unanswered, raises
    SwitchUnreachableError naming it within 0.3 s + 1 s, not a SwitchMLTimeoutError
    blaming rank 1 after the 60 s timeout."""
    with SwitchProcess() as sw:
        stopper = threading.Timer(0.5, os.kill, (sw._proc.pid, signal.SIGSTOP))
        stopper.start()
        start = time.monotonic()
        try:
            with pytest.raises(switchml.SwitchUnreachableError,
                               match="answered the join, then did not answer") as info:
                switchml.Worker(sw.address, 0, 2, timeout=60.0)
        finally:
            stopper.join()
            os.kill(sw._proc.pid, signal.SIGCONT)
        assert "%s:%d" % sw.address in str(info.value)
        assert time.monotonic() - start < 10.0


def test_a_rank_late_to_join_is_waited_for_while_the_switch_answers(quick_switch_checks):
    """Rank 1 joins 3 s after rank 0, past the 0.3 s + 1 s a hung switch would get:
    the switch answers rank 0's queries meanwhile, and the job starts and sums."""
    with SwitchProcess() as sw:
        def body(rank):
            if rank == 1:
                time.sleep(3.0)
            with switchml.Worker(sw.address, rank, 2, timeout=60.0) as w:
                return w.allreduce(np.full(10, rank + 1.0, np.float32))

        for out in run_ranks(2, body):
            assert (out == 3.0).all()


def test_a_hung_switch_fails_the_call_as_the_switchs_long_before_the_timeout(
        quick_switch_checks):
    """A stopped switch (SIGSTOP: its connections stay open, the kernel still takes
    datagrams) under a job with a long timeout: each rank's call asks it whether it
    is there and, unanswered, raises SwitchUnreachableError naming it, not a
    SwitchMLTimeoutError blaming ranks after 60 s."""
    with SwitchProcess() as sw:
        ready = threading.Barrier(2)

        def body(rank):
            with switchml.Worker(sw.address, rank, 2, timeout=60.0) as w:
                w.allreduce(np.ones(10, np.float32))
                ready.wait(10)
                if rank == 0:
                    os.kill(sw._proc.pid, signal.SIGSTOP)
                ready.wait(10)
                start = time.monotonic()
                try:
                    with pytest.raises(switchml.SwitchMLError) as info:
                        w.allreduce(np.ones(100_000, np.float32))
                finally:
                    ready.wait(30)
                    if rank == 0:
                        os.kill(sw._proc.pid, signal.SIGCONT)
                return info.value, time.monotonic() - start

        for error, elapsed in run_ranks(2, body):
            assert isinstance(error, switchml.SwitchUnreachableError), error
            assert "%s:%d" % sw.address in str(error) and "status query" in str(error)
            assert elapsed < 10.0  # 0.3 s + 1 s, on a busy machine; not the 60 s


def test_a_rank_that_is_late_is_waited_for_while_the_switch_answers(quick_switch_checks):
    """The same checks while a rank computes for 3 s before its call, longer than
    the 0.3 s + 1.5 s a switch that did not answer would get: the switch answers
    each query, and the call waits and sums as always.  (A switch process of its
    own: one in the test's interpreter may be held up by the ranks' threads.)"""
    quick_switch_checks.SWITCH_ANSWER_S = 1.5
    with SwitchProcess() as sw:
        def body(rank):
            with switchml.Worker(sw.address, rank, 2, timeout=60.0) as w:
                if rank == 1:
                    time.sleep(3.0)
                return w.allreduce(np.full(1000, rank + 1.0, np.float32))

        for out in run_ranks(2, body):
            assert (out == 3.0).all()


def test_an_abort_while_the_stall_waits_for_its_diagnosis_is_honoured_at_once():
    """Rank 0's call stalls (rank 1 never calls) while the switch is stopped: the
    diagnosis waits up to SWITCH_ANSWER_S for the switch's answer, and an abort()
    from another thread meanwhile ends the call with the abort's error at once, not
    with the diagnosis's 10 s later."""
    with SwitchProcess() as sw:
        joined, ended = threading.Barrier(2), threading.Event()

        def body(rank):
            with switchml.Worker(sw.address, rank, 2, timeout=1.0) as w:
                joined.wait(10)
                if rank == 1:
                    ended.wait(30)
                    return None
                reason = switchml.SwitchMLError("given up by the caller")
                stopper = threading.Timer(0.5, os.kill, (sw._proc.pid, signal.SIGSTOP))
                aborter = threading.Timer(2.0, w.abort, (reason,))
                try:
                    stopper.start(), aborter.start()
                    with pytest.raises(switchml.SwitchMLError) as info:
                        w.allreduce(np.ones(1000, np.float32))
                    return info.value, time.monotonic()
                finally:
                    stopper.join(), aborter.join()
                    os.kill(sw._proc.pid, signal.SIGCONT)
                    ended.set()

        start = time.monotonic()
        (error, at), _ = run_ranks(2, body)
        assert str(error) == "given up by the caller", error
        assert at - start < 6.0  # 2 s, on a busy machine; not 1 s + 10 s


def test_a_stall_after_a_rank_left_names_the_silent_rank_not_the_caller(switch):
    """Rank 0 leaves after a call, rank 2 stays and never calls, rank 1 calls and
    stalls: the switch's answer names ranks 0 and 2 (its bitmaps are of the members
    as the job started; with rank 0's connection gone it read them as a rack's
    and named rank 1, the caller, and not rank 2)."""
    ended = threading.Event()

    def body(rank):
        with switchml.Worker(switch.address, rank, 3, timeout=1.0) as w:
            w.allreduce(np.ones(4, np.float32))
            if rank == 0:
                return None
            if rank == 2:
                ended.wait(30)
                return None
            time.sleep(0.3)
            try:
                with pytest.raises(switchml.SwitchMLTimeoutError) as info:
                    w.allreduce(np.ones(4, np.float32))
            finally:
                ended.set()
            return info.value

    _, error, _ = run_ranks(3, body)
    assert error.missing_ranks == [0, 2], error


def test_a_switch_slow_to_answer_the_diagnosis_still_names_the_missing_rank():
    """Rank 1 never calls; rank 0's call stalls for its 1 s timeout and asks the
    switch who is missing while the switch is stopped, answering 3 s later: as
    slow as that, the switch is alive (it has SWITCH_ANSWER_S, as for the checks
    during a call), so the error names rank 1, not the switch."""
    with SwitchProcess() as sw:
        joined, ended = threading.Barrier(2), threading.Event()

        def body(rank):
            with switchml.Worker(sw.address, rank, 2, timeout=1.0) as w:
                joined.wait(10)
                if rank == 1:
                    ended.wait(30)
                    return None
                try:
                    stopper = threading.Timer(0.7, os.kill, (sw._proc.pid, signal.SIGSTOP))
                    resumer = threading.Timer(3.7, os.kill, (sw._proc.pid, signal.SIGCONT))
                    stopper.start(), resumer.start()
                    with pytest.raises(switchml.SwitchMLError) as info:
                        w.allreduce(np.ones(1000, np.float32))
                    return info.value
                finally:
                    stopper.join(), resumer.join()
                    os.kill(sw._proc.pid, signal.SIGCONT)
                    ended.set()

        error, _ = run_ranks(2, body)
        assert isinstance(error, switchml.SwitchMLTimeoutError), error
        assert error.missing_ranks == [1], error


def test_an_address_that_never_answers_fails_the_join_once_within_the_answer_bound(
        monkeypatch):
    """Something accepts at the switch's address and says nothing (or a hung switch):
    the join fails as the switch's after SWITCH_ANSWER_S, not the job's 60 s
    timeout, and is not sent again on a second connection (that retry is for a
    connection closed unheard)."""
    from switchml import config
    monkeypatch.setattr(config, "SWITCH_ANSWER_S", 0.5)
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        start = time.monotonic()
        with pytest.raises(switchml.SwitchUnreachableError, match="did not answer the join"):
            switchml.Worker(listener.getsockname(), 0, 2, timeout=60.0)
        assert time.monotonic() - start < 30
        listener.settimeout(0.2)
        accepted = []
        with contextlib.suppress(TimeoutError):
            while True:
                accepted.append(listener.accept()[0])
        for conn in accepted:
            conn.close()
        assert len(accepted) == 1


def test_join_refused_for_inconsistent_world_size(switch):
    def body(rank):
        if rank == 1:
            time.sleep(0.3)
            with pytest.raises(switchml.JoinRefusedError, match="world_size"):
                switchml.Worker(switch.address, 1, 3, timeout=2)
            return None
        with pytest.raises(switchml.SwitchMLTimeoutError):
            switchml.Worker(switch.address, 0, 2, timeout=1.0)

    run_ranks(2, body)


def test_too_many_workers_is_refused(switch):
    with pytest.raises(switchml.JoinRefusedError, match="32"):
        switchml.Worker(switch.address, 0, 33, timeout=2)


def test_a_rank_leaving_right_after_ready_is_named_at_once(switch):
    """The switch's "failed" may reach a rank in the same read as its "ready": the
    worker must keep it, not wait out the timeout and blame everyone."""
    for attempt in range(12):  # the race is timing-dependent: try it several times
        start = time.monotonic()
        errors = job_whose_rank_1_vanishes(switch.address, f"brief-{attempt}", timeout=5)
        assert errors and errors[0].missing_ranks == [1], errors
        assert time.monotonic() - start < 3  # from the switch's news, not the 5 s timeout


@pytest.mark.parametrize("threads", [1, 2])
def test_a_call_whose_ready_raises_fails_the_job_not_the_sums(switch, threads):
    """Rank 0's call cannot begin (its ``ready`` raises, as a device's failed copy):
    the job fails on every rank naming rank 0, and no rank's next call is summed
    with another's previous one (a wrong sum, silently)."""
    def boom():
        raise RuntimeError("the device's copy failed")

    def body(rank):
        with switchml.Worker(switch.address, rank, 2, timeout=3.0, threads=threads) as w:
            outcomes = []
            calls = [(np.full(8, 100, np.int32), boom if rank == 0 else None),
                     (np.full(8, 1000 * (rank + 1), np.int32), None)]
            for values, ready in calls:
                try:
                    outcomes.append(w.allreduce_async(values, ready=ready).wait(20)[0])
                except Exception as exc:  # noqa: BLE001 - the outcome
                    outcomes.append(exc)
            return outcomes

    zero, one = run_ranks(2, body)
    assert isinstance(zero[0], RuntimeError), zero
    for outcome in zero[1:] + one:
        assert isinstance(outcome, switchml.SwitchMLError), (zero, one)
        assert "rank 0's call failed there" in str(outcome), outcome


def test_a_name_that_does_not_resolve_is_the_switchs_error_at_a_join_and_a_rejoin(
        switch, monkeypatch):
    """A switch named by a host name that does not resolve: SwitchUnreachableError
    at the join; and where the name stops resolving while the ranks rejoin a
    restarted switch (a pod's DNS record), the rejoin tries again until its bound,
    then the calls raise that error, the worker's thread alive (not a hang)."""
    with pytest.raises(switchml.SwitchUnreachableError, match="cannot reach the switch"):
        switchml.Worker("nonexistent-host.invalid:7300", 0, 1, timeout=2.0)
    real_connect = socket.socket.connect
    unresolved = threading.Event()

    def connect(sock, address):
        if unresolved.is_set() and sock.type == socket.SOCK_DGRAM:
            raise socket.gaierror(-2, "Name or service not known")
        return real_connect(sock, address)

    monkeypatch.setattr(socket.socket, "connect", connect)
    sw = switchml.Switch().start()
    workers = run_ranks(2, lambda r: switchml.Worker(f"localhost:{sw.address[1]}", r, 2,
                                                     timeout=2.0))
    try:
        run_ranks(2, lambda r: workers[r].allreduce(np.ones(4, np.float32)))
        unresolved.set()
        sw.stop()

        def call(rank):
            with pytest.raises(switchml.SwitchUnreachableError, match="within 2s"):
                workers[rank].allreduce_async(np.ones(4, np.float32)).wait(20)
            return workers[rank]._thread.is_alive()

        assert run_ranks(2, call) == [True, True]
    finally:
        for w in workers:
            w.close()


def test_a_call_queued_as_the_worker_closes_is_refused_or_served(switch, monkeypatch):
    """A call that is being queued while the worker closes (another thread): it
    is served before the end or refused, never left waiting behind the end."""
    w = switchml.Worker(switch.address, 0, 1, timeout=3.0)
    put = w._queue.put

    def slow_put(item, *args, **kwargs):  # the queueing thread held up a moment
        if item is not None:
            time.sleep(0.3)
        return put(item, *args, **kwargs)

    monkeypatch.setattr(w._queue, "put", slow_put)
    outcome: list = []

    def queue_one():
        try:
            outcome.append(w.allreduce_async(np.ones(4, np.float32)).wait(10))
        except Exception as exc:  # noqa: BLE001 - the outcome
            outcome.append(exc)

    caller = threading.Thread(target=queue_one)
    caller.start()
    time.sleep(0.1)
    w.close()
    caller.join(15)
    assert outcome and not isinstance(outcome[0], TimeoutError), outcome
    if isinstance(outcome[0], Exception):
        assert "closed" in str(outcome[0])
    else:
        assert (outcome[0] == 1.0).all()
