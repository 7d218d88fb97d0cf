"""Dead, missing and silent ranks, and a dead switch: errors that name them, never hangs."""

import multiprocessing as mp
import os
import signal
import threading
import time

import numpy as np
import pytest
from conftest import job_whose_rank_1_vanishes, run_ranks

import switchml

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
