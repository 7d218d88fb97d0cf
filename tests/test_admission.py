"""Admission control: jobs that do not fit are refused naming the limit, or wait for
room; no job ever takes slots another job holds; slots come back when a job ends,
fails or times out.  First the controller alone (sans-IO), then a real switch."""

import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from conftest import run_ranks

import switchml
from switchml.switch import control
from switchml.switch.control import Controller
from switchml.switch.dataplane.pipeline import Pipeline


def join(ctl, conn, rank, world, job, wait=False, **extra):
    msg = {"op": "join", "version": 2, "job": job, "rank": rank, "world_size": world,
           "data_addr": ["10.0.0.1", 1000 + conn], "wait": wait, **extra}
    return ctl.handle_message(conn, msg)


def events(out):
    return {conn: msg for conn, msg in out}


def start_job(ctl, job, conns, wait=False):
    """Join ranks 0..n-1 of ``job`` on connections ``conns``; return the last replies."""
    for rank, conn in enumerate(conns):
        out = join(ctl, conn, rank, len(conns), job, wait)
    return events(out)


def slot_ranges(pipeline):
    return {job.name: (job.slot_base, job.slot_count) for job in pipeline.jobs.values()}


@pytest.fixture
def ctl():
    """A pool of 16 slots, 8 per job: two jobs fit."""
    return Controller(Pipeline(slots=16, packet_elements=64), data_port=9, slots_per_job=8)


@pytest.fixture
def full(ctl):
    """Jobs a (connections 1, 2) and b (3, 4) hold the whole pool."""
    assert start_job(ctl, "a", [1, 2])[1]["event"] == "ready"
    assert start_job(ctl, "b", [3, 4])[3]["event"] == "ready"
    assert ctl.pipeline.free_slots() == 0
    return ctl


# ---------------------------------------------------------------- sans-IO
def test_job_that_does_not_fit_is_refused_naming_the_slot_limit(full):
    before = slot_ranges(full.pipeline)
    out = start_job(full, "c", [5, 6])
    assert set(out) == {5, 6}
    for reply in out.values():
        assert reply["event"] == "error" and reply["limit"] == "slots"
        assert "window of 8 slots does not fit in the switch's pool of 16 slots" in reply["message"]
        assert "0 free; held by a 0..7, b 8..15" in reply["message"]
    assert slot_ranges(full.pipeline) == before == {"a": (0, 8), "b": (8, 8)}
    assert "c" not in full.jobs and full.refused["slots"] == 2
    # the refused ranks' connections are free to try again
    assert join(full, 5, 0, 2, "c")[0][1]["event"] == "joined"


def test_max_jobs_refusal_names_the_limit():
    ctl = Controller(Pipeline(slots=64, packet_elements=64), data_port=9, slots_per_job=4,
                     max_jobs=2)
    start_job(ctl, "a", [1])
    start_job(ctl, "b", [2])
    [reply] = start_job(ctl, "c", [3]).values()
    assert reply["event"] == "error" and reply["limit"] == "max_jobs"
    assert "at most 2 jobs at once (max_jobs), and runs a, b" in reply["message"]
    assert ctl.pipeline.free_slots() == 56


def test_waiting_job_gets_the_slots_of_a_job_that_ends(full):
    out = start_job(full, "c", [5, 6], wait=True)
    assert {m["event"] for m in out.values()} == {"waiting"}
    assert out[5]["limit"] == "slots" and "0 free" in out[5]["message"]
    assert full.admission()["waiting"] == [{"job": "c", "world_size": 2, "slots": 8}]
    assert slot_ranges(full.pipeline) == {"a": (0, 8), "b": (8, 8)}
    assert full.handle_message(1, {"op": "leave"}) == [(1, {"event": "left"})]
    out = events(full.handle_message(2, {"op": "leave"}))  # a ended: c starts
    assert out[2] == {"event": "left"}
    assert out[5]["event"] == out[6]["event"] == "ready" and out[5]["slot_base"] == 0
    assert slot_ranges(full.pipeline) == {"b": (8, 8), "c": (0, 8)}
    assert full.admission()["waiting"] == []


def test_waiting_job_gets_the_slots_of_a_job_that_fails(full):
    start_job(full, "c", [5, 6], wait=True)
    out = events(full.handle_disconnect(3))  # b fails
    assert out[4]["event"] == "failed" and out[4]["missing"] == [0]
    assert out[5]["event"] == "ready" and out[5]["slot_base"] == 8
    assert slot_ranges(full.pipeline) == {"a": (0, 8), "c": (8, 8)}


def test_waiting_job_gets_the_slots_of_a_job_that_timed_out(full):
    """A rank that gave up waiting for a silent one (its timeout) aborts the job."""
    start_job(full, "c", [5, 6], wait=True)
    out = events(full.handle_message(
        1, {"op": "abort", "reason": "no progress for 1s; ranks [1] did not contribute",
            "missing": [1]}))
    assert 1 not in out  # the rank that gave up knows already
    assert out[2] == {"event": "failed", "missing": [1],
                      "reason": "rank 0 of job 'a' gave up: no progress for 1s; ranks [1] "
                                "did not contribute"}
    assert out[5]["event"] == "ready" and out[5]["slot_base"] == 0
    assert full.pipeline.counters["jobs_failed"] == 1
    assert full.pipeline.ended_jobs["a"]["state"] == "failed"
    # both ranks of the failed job may leave or go away without effect
    assert full.handle_message(1, {"op": "leave"}) == [(1, {"event": "left"})]
    assert full.handle_disconnect(2) == []
    assert slot_ranges(full.pipeline) == {"b": (8, 8), "c": (0, 8)}


def test_a_job_waits_only_when_every_rank_asked_to(full):
    join(full, 5, 0, 2, "c", wait=True)
    out = events(join(full, 6, 1, 2, "c", wait=False))
    assert out[5]["event"] == out[6]["event"] == "error"
    assert full.admission()["waiting"] == []


def test_waiting_jobs_start_in_arrival_order_when_they_fit(full):
    start_job(full, "c", [5, 6], wait=True)
    start_job(full, "d", [7], wait=True)
    full.handle_message(3, {"op": "leave"})
    out = events(full.handle_message(4, {"op": "leave"}))  # b's 8 slots free: c first
    assert out[5]["event"] == "ready" and 7 not in out
    out = events(full.handle_disconnect(1))  # a fails: d gets its slots
    assert out[7]["event"] == "ready" and out[7]["slot_base"] == 0
    assert slot_ranges(full.pipeline) == {"c": (8, 8), "d": (0, 8)}


def test_a_waiting_rank_that_goes_away_puts_the_job_back_to_gathering(full):
    start_job(full, "c", [5, 6], wait=True)
    out = full.handle_disconnect(6)
    assert out == [(5, {"event": "joined", "job": "c", "present": [0]})]
    assert full.admission()["waiting"] == []
    assert full.admission()["gathering"] == [{"job": "c", "world_size": 2, "present": [0]}]
    full.handle_message(1, {"op": "leave"})
    assert full.handle_message(2, {"op": "leave"}) == [(2, {"event": "left"})]  # nobody starts
    assert full.pipeline.free_slots() == 8


def test_a_restarted_rank_is_refused_while_its_job_runs_then_the_job_re_forms(ctl):
    first = start_job(ctl, "j", [1, 2])[1]["session"]
    [(_, reply)] = join(ctl, 7, 1, 2, "j")  # rank 1 again, from a new connection
    assert reply["event"] == "error" and "already running" in reply["message"]
    assert "rank 1" in reply["message"] and ctl.refused["job_running"] == 1
    out = events(ctl.handle_disconnect(2))  # the old rank 1 is gone: the job fails
    assert out[1]["event"] == "failed" and out[1]["missing"] == [1]
    assert ctl.pipeline.free_slots() == 16
    assert join(ctl, 7, 1, 2, "j")[0][1] == {"event": "joined", "job": "j", "present": [1]}
    out = events(join(ctl, 8, 0, 2, "j"))  # rank 0 rejoins too: a new session
    assert out[7]["event"] == "ready" and out[7]["session"] not in (0, first)


def test_a_new_job_never_gets_a_recent_session(ctl, monkeypatch):
    first = start_job(ctl, "j", [1])[1]["session"]
    ctl.handle_message(1, {"op": "leave"})
    draws = iter([first, first, 12345, 777])  # then the rank's token
    monkeypatch.setattr(control.secrets, "randbits", lambda bits: next(draws))
    assert start_job(ctl, "k", [2])[2]["session"] == 12345


def test_world_size_beyond_the_bitmap_names_the_limit(ctl):
    [(_, reply)] = join(ctl, 1, 0, 33, "big")
    assert reply["limit"] == "max_workers"
    assert "exceeds the limit of 32 workers per job" in reply["message"]


# ---------------------------------------------------------------- real switch
def hold(address, job, stop: threading.Event, ready: threading.Event):
    with switchml.Worker(address, 0, 1, job=job, timeout=5):
        ready.set()
        stop.wait(30)


def test_worker_gets_a_limit_error_when_the_pool_is_full():
    with switchml.Switch(slots=32, slots_per_job=16, packet_elements=1024) as sw:
        stop = threading.Event()
        holders = []
        for name in ("a", "b"):
            ready = threading.Event()
            holders.append(threading.Thread(target=hold, args=(sw.address, name, stop, ready)))
            holders[-1].start()
            assert ready.wait(10)
        try:
            start = time.monotonic()
            with pytest.raises(switchml.LimitExceededError) as info:
                switchml.Worker(sw.address, 0, 1, job="c", timeout=5)
            assert time.monotonic() - start < 1.0
            assert info.value.limit == "slots"
            assert "pool of 32 slots (0 free; held by a 0..15, b 16..31)" in str(info.value)
        finally:
            stop.set()
            for t in holders:
                t.join()
        assert sw.stats()["free_slots"] == 32


def test_worker_gets_a_limit_error_beyond_max_jobs():
    with switchml.Switch(slots=64, slots_per_job=4, max_jobs=1, packet_elements=1024) as sw:
        with switchml.Worker(sw.address, 0, 1, job="a"):
            with pytest.raises(switchml.LimitExceededError, match=r"at most 1 jobs") as info:
                switchml.Worker(sw.address, 0, 1, job="b", timeout=5)
            assert info.value.limit == "max_jobs"
        with pytest.raises(switchml.LimitExceededError) as info:
            switchml.Worker(sw.address, 0, 40, job="c", timeout=5)
        assert info.value.limit == "max_workers"
        assert sw.stats()["admission"]["refused"] == {"max_jobs": 1, "max_workers": 1}


def test_waiting_worker_runs_once_a_job_ends():
    with switchml.Switch(slots=16, slots_per_job=16, packet_elements=1024) as sw:
        holder = switchml.Worker(sw.address, 0, 1, job="a")
        timer = threading.Timer(0.5, holder.close)
        timer.start()
        data = [np.arange(5000, dtype=np.int32) * (r + 1) for r in range(2)]

        def body(rank):
            start = time.monotonic()
            with switchml.Worker(sw.address, rank, 2, job="b", timeout=5,
                                 wait_for_slots=5) as w:
                waited = time.monotonic() - start
                return waited, w.allreduce(data[rank])

        for waited, out in run_ranks(2, body):
            assert 0.4 < waited < 3.0
            assert np.array_equal(out, data[0] + data[1])
        timer.join()
        assert sw.stats()["ended_jobs"]["b"]["slot_base"] == 0


def test_waiting_worker_gives_up_after_wait_for_slots():
    with switchml.Switch(slots=16, slots_per_job=16, packet_elements=1024) as sw:
        with switchml.Worker(sw.address, 0, 1, job="a"):
            start = time.monotonic()
            with pytest.raises(switchml.LimitExceededError, match="waited 0.5s") as info:
                switchml.Worker(sw.address, 0, 1, job="b", timeout=5, wait_for_slots=0.5)
            assert 0.5 <= time.monotonic() - start < 1.5
            assert info.value.limit == "slots"
            time.sleep(0.1)
            admission = sw.stats()["admission"]
            assert admission["waiting"] == [] and admission["gathering"] == []
            assert sw.stats()["free_slots"] == 0  # job a still has its slots


def test_slots_come_back_when_a_job_times_out_while_a_rank_hangs():
    """Rank 1 is connected but hangs: rank 0 gives up after its timeout, the switch
    frees the slots at once (not when rank 1 leaves) and a waiting job gets them."""
    with switchml.Switch(slots=16, slots_per_job=16, packet_elements=1024) as sw:
        results = {}

        def rank0():
            with switchml.Worker(sw.address, 0, 2, job="a", timeout=1.0) as w:
                with pytest.raises(switchml.SwitchMLTimeoutError) as info:
                    w.allreduce(np.ones(10, np.float32))
                results["error"] = info.value

        t = threading.Thread(target=rank0)
        t.start()
        w1 = switchml.Worker(sw.address, 1, 2, job="a", timeout=5)  # never calls allreduce
        start = time.monotonic()
        with switchml.Worker(sw.address, 0, 1, job="next", timeout=5, wait_for_slots=5) as w:
            assert 0.5 < time.monotonic() - start < 3.0
            assert np.array_equal(w.allreduce(np.ones(7, np.int32)), np.ones(7))
        t.join()
        assert results["error"].missing_ranks == [1]
        assert sw.stats()["ended_jobs"]["a"]["state"] == "failed"
        with pytest.raises(switchml.SwitchMLTimeoutError, match="gave up"):
            w1.allreduce(np.ones(10, np.float32))  # the hung rank learns it too
        w1.close()


def test_switch_help_states_the_limits():
    result = subprocess.run([sys.executable, "-m", "switchml.cli", "switch", "--help"],
                            capture_output=True, text=True, timeout=30)
    text = " ".join(result.stdout.split())
    assert "at most 32 workers per job" in text
    assert "at most 16128 elements per packet" in text
    assert "--max-jobs" in text and "--metrics-port" in text


@pytest.mark.parametrize("elements", ["16384", "20000"])
def test_too_many_elements_per_packet_names_the_limit(elements):
    """Also a count that is no whole number of the default blocks (a packet of one
    block then): the limit named is the default blocks' (it said 0)."""
    result = subprocess.run([sys.executable, "-m", "switchml.cli", "switch", "--port", "0",
                             "--packet-elements", elements], capture_output=True, text=True,
                            timeout=30)
    assert result.returncode == 2
    assert f"packet_elements {elements} exceeds the limit of 16128 elements per packet " \
           "with 256-value blocks" in result.stderr
