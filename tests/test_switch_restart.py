"""A switch that dies (SIGKILL) and comes back on its address within the workers'
timeout: the job rejoins it and the call in flight ends with the result an
undisturbed run gives, bit for bit, in place or not, with loss too.  One that
does not come back in time is the error it always was, and a rank that dies
while the others rejoin is named."""

import hashlib
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from conftest import run_ranks

import switchml
from switchml.cli import fetch_stats

CLI = [sys.executable, "-m", "switchml.cli"]
SIZE = 16 * 1024 * 1024  # float32 values: 64 MiB


def start_switch(port=0, drop_rate=0.0):
    proc = subprocess.Popen(CLI + ["switch", "--port", str(port), "--log-level", "warning",
                                   "--drop-rate", str(drop_rate)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert "listening on" in line, line + proc.stderr.read()
    return proc, line.split("SWITCHML_SWITCH=")[1].strip()


def data(rank, size=SIZE, infs=False):
    """Values of many magnitudes (every chunk its own exponent), some chunks zero;
    ``infs``: on rank 0 an inf every 50 000 values (chunks of a follow-up exchange)."""
    rng = np.random.default_rng(rank)
    exponents = rng.integers(-40, 40, size // 1024 + 1)
    scale = np.ldexp(np.float32(1), exponents).astype(np.float32).repeat(1024)[:size]
    a = rng.standard_normal(size, dtype=np.float32) * scale
    a[5 * 1024:7 * 1024] = 0
    if infs and rank == 0:
        a[::50_000] = np.inf
    return a


def digest(array):
    return hashlib.sha256(array.tobytes()).hexdigest()


def _rank(address, rank, world, in_place, infs, started, results):
    """One big call cut by the switch's restart, then the same call undisturbed."""
    with switchml.Worker(address, rank, world, job="restart", timeout=8.0,
                         local_stage=False) as w:
        w.allreduce(np.ones(16, np.float32))
        a = data(rank, infs=infs)
        same = a.copy()  # the undisturbed call's input (made once: 1 s of CPU a rank)
        started.put(rank)
        out = w.allreduce(a, out=a if in_place else None)
        cut = digest(out)
        counters = w.counters
        again = w.allreduce(same)
        results.put((rank, cut, digest(again), counters["rejoins"],
                     counters["calls_resumed"]))


@pytest.mark.parametrize("in_place,drop_rate,infs", [
    (True, 0.0, False), (False, 0.0, False), (True, 0.01, False),
    # chunks with an inf left for their follow-up exchange, the call's output its
    # input: the chunks summed again must leave them as they were (they came back
    # as the re-sum's unwritten buffer: zeros where the infs' sums belong)
    (True, 0.0, True)], ids=["in-place", "apart", "in-place-with-loss", "in-place-with-infs"])
def test_a_call_cut_by_a_switch_restart_ends_bit_identical(in_place, drop_rate, infs):
    proc, address = start_switch(drop_rate=drop_rate)
    port = int(address.rsplit(":", 1)[1])
    ctx = mp.get_context("spawn")
    started, results = ctx.Queue(), ctx.Queue()
    ranks = [ctx.Process(target=_rank, args=(address, r, 3, in_place, infs, started, results),
                         daemon=True) for r in range(3)]
    try:
        for p in ranks:
            p.start()
        for _ in ranks:
            started.get(timeout=60)
        time.sleep(0.02)  # into the call
        proc.kill()
        proc.wait(10)
        time.sleep(0.3)
        proc, _ = start_switch(port, drop_rate)
        got = sorted(results.get(timeout=60) for _ in ranks)
        for p in ranks:
            p.join(10)
            assert p.exitcode == 0
        for rank, cut, undisturbed, rejoins, _ in got:
            assert cut == undisturbed, rank
            assert rejoins == 1
        assert len({cut for _, cut, *_ in got}) == 1
        assert any(resumed for *_, resumed in got)  # the kill fell inside the call
        assert fetch_stats(address)["counters"]["jobs_rejoined"] == 1
    finally:
        proc.kill()
        proc.wait(10)
        for p in ranks:
            p.kill()


def calls_until_an_error(address, rank: int, world: int, job: str, timeout: float,
                         progress: threading.Barrier, report):
    """A rank calling until an error: after its second call it meets ``progress``;
    returns (the error, ``report(worker)``)."""
    with switchml.Worker(address, rank, world, job=job, timeout=timeout,
                         local_stage=False) as w:
        calls = 0
        try:
            while True:
                w.allreduce(np.ones(100_000, np.float32))
                calls += 1
                if calls == 2:
                    progress.wait(30)
        except switchml.SwitchMLError as exc:
            return exc, report(w)


def test_a_switch_back_later_than_the_timeout_is_the_error_it_was():
    proc, address = start_switch()
    port = int(address.rsplit(":", 1)[1])
    timeout = 1.5
    progress = threading.Barrier(3)

    def body(rank):
        return calls_until_an_error(address, rank, 2, "late", timeout, progress,
                                    lambda w: time.monotonic())

    results: list = []
    runner = threading.Thread(target=lambda: results.extend(run_ranks(2, body)))
    try:
        runner.start()
        progress.wait(30)
        proc.kill()
        proc.wait(10)
        killed_at = time.monotonic()
        runner.join(30)
        for error, when in results:
            assert isinstance(error, switchml.SwitchUnreachableError), error
            assert f"switch at 127.0.0.1:{port}" in str(error)
            assert timeout - 0.2 <= when - killed_at < timeout + 1.5
    finally:
        runner.join(30)


def _doomed_rank(address, started):
    with switchml.Worker(address, 2, 3, job="doomed", timeout=3.0, local_stage=False) as w:
        w.allreduce(np.ones(100_000, np.float32))
        started.put(2)
        while True:
            w.allreduce(np.ones(100_000, np.float32))


def test_a_rank_killed_while_the_others_rejoin_is_named():
    proc, address = start_switch()
    port = int(address.rsplit(":", 1)[1])
    ctx = mp.get_context("spawn")
    started = ctx.Queue()
    doomed = ctx.Process(target=_doomed_rank, args=(address, started), daemon=True)
    doomed.start()
    progress = threading.Barrier(3)

    def body(rank):
        return calls_until_an_error(address, rank, 3, "doomed", 3.0, progress,
                                    lambda w: w.counters["rejoins"])

    results: list = []
    runner = threading.Thread(target=lambda: results.extend(run_ranks(2, body)))
    try:
        runner.start()
        started.get(timeout=60)
        progress.wait(30)
        proc.kill()
        proc.wait(10)
        os.kill(doomed.pid, signal.SIGKILL)
        proc, _ = start_switch(port)
        runner.join(30)
        assert len(results) == 2
        for error, rejoins in results:
            assert isinstance(error, switchml.SwitchMLTimeoutError), error
            assert 2 in error.missing_ranks
            assert rejoins == 0  # the job never formed again without it
        # the first to give up names rank 2 alone (the other may then name it too,
        # having seen the first leave the new job as it waited)
        assert [2] in [error.missing_ranks for error, _ in results]
    finally:
        runner.join(30)
        proc.kill()
        proc.wait(10)
        doomed.kill()


def _rank_of_two_switches(address, rank, started, results):
    with switchml.Worker(address, rank, 3, job="two", timeout=12.0, local_stage=False) as w:
        w.allreduce(np.ones(16, np.float32))
        started.put(rank)
        while True:
            try:
                w.allreduce(np.ones(4_000_000, np.float32))
            except switchml.SwitchMLError as exc:
                results.put((rank, time.monotonic(), str(exc)))
                return


def test_a_part_that_fails_ends_the_rejoin_of_the_other_part_at_once():
    """A call over two switches: one restarts, and its part rejoins, waiting for
    every rank there; meanwhile a rank dies, and the other switch fails the job.
    The rejoin's wait ends with that failure at once, not at its deadline."""
    first, first_address = start_switch()
    second, second_address = start_switch()
    ctx = mp.get_context("spawn")
    started, results = ctx.Queue(), ctx.Queue()
    ranks = [ctx.Process(target=_rank_of_two_switches, daemon=True,
                         args=(f"{first_address},{second_address}", r, started, results))
             for r in range(3)]
    try:
        for p in ranks:
            p.start()
        for _ in ranks:
            started.get(timeout=60)
        time.sleep(0.3)
        os.kill(ranks[2].pid, signal.SIGSTOP)  # it cannot rejoin
        second.kill()
        second.wait(10)
        second, _ = start_switch(int(second_address.rsplit(":", 1)[1]))
        time.sleep(2.0)  # ranks 0 and 1 wait in the second switch's rejoin
        os.kill(ranks[2].pid, signal.SIGKILL)
        killed = time.monotonic()
        for _ in range(2):
            rank, at, error = results.get(timeout=30)
            assert "rank 2" in error and "disconnected" in error, error
            assert at - killed < 4.0, (rank, at - killed)  # its deadline: 12 s
    finally:
        for proc in (first, second):
            proc.kill()
            proc.wait(10)
        for p in ranks:
            p.kill()
