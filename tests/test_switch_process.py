"""The embedded switch in a child process: serves, stops, and never outlives its parent."""

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from conftest import run_ranks

import switchml
from switchml.switch.process import SwitchProcess


def test_a_switch_process_serves_a_job_and_stops():
    with SwitchProcess(slots=16, slots_per_job=4, packet_elements=1024) as sp:
        child = sp._proc
        with switchml.Worker(sp.address, 0, 1, timeout=5) as w:
            assert np.array_equal(w.allreduce(np.arange(5000, dtype=np.int32)),
                                  np.arange(5000, dtype=np.int32))
    assert child.wait(5) == 0


def joined_pair(switch: SwitchProcess, job: str) -> list:
    """The two workers of a job on ``switch``, joined at once (each join waits for
    the other rank)."""
    return run_ranks(2, lambda rank: switchml.Worker(switch.address, rank, 2, job=job,
                                                     timeout=5), timeout=10)


def test_a_draining_stop_waits_for_the_jobs_other_ranks_to_leave(caplog):
    """stop(drain=S), as the job's own switch stops at its rank's shutdown: the
    other rank, leaving a moment later, leaves a switch that is still there (it
    never hears the switch go, and does not try to rejoin it); a job whose ranks
    never leave holds the stop S seconds at most."""
    import logging
    import threading
    caplog.set_level(logging.WARNING, logger="switchml")
    sp = SwitchProcess(slots=16, slots_per_job=4, packet_elements=1024).start()
    workers = joined_pair(sp, "drain")
    workers[0].close()
    late = threading.Timer(0.5, workers[1].close)
    late.start()
    start = time.monotonic()
    sp.stop(drain=3.0)
    took = time.monotonic() - start
    late.join()
    assert 0.4 < took < 2.0, took
    assert not [r for r in caplog.records if "closed the control connection" in r.message]
    with SwitchProcess(slots=16, slots_per_job=4, packet_elements=1024) as held:
        stay = joined_pair(held, "held")
        start = time.monotonic()
        held.stop(drain=1.0)
        assert 0.9 < time.monotonic() - start < 2.5
        for w in stay:
            w.close()


def test_a_switch_that_cannot_listen_is_a_clear_error():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        # the child's own reason, in the parent's error (not only on a stderr that a
        # notebook or a redirected rank log loses)
        with pytest.raises(switchml.SwitchMLError, match="exited with status.*in use"):
            SwitchProcess(port=taken.getsockname()[1]).start()


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # a zombie waiting for its (dead) parent's reaper counts as gone
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] == "Z"


@pytest.mark.parametrize("helper", [False, True], ids=["alone", "with-a-forked-helper"])
def test_the_switch_process_dies_with_a_killed_parent(helper):
    """(A helper the parent forked after, a data loader's worker, holds the pipe
    open: the switch also looks at its parent.)"""
    parent = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import multiprocessing, sys, time
        from switchml.switch.process import SwitchProcess
        sp = SwitchProcess().start()
        if sys.argv[1] == "True":
            multiprocessing.get_context("fork").Process(target=time.sleep, args=(30,)).start()
        print(sp._proc.pid, flush=True)
        time.sleep(60)
    """), str(helper)], stdout=subprocess.PIPE, text=True, start_new_session=True)
    child = int(parent.stdout.readline())
    assert not gone(child)
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 10
    while not gone(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        assert gone(child)
    finally:
        os.killpg(parent.pid, signal.SIGKILL)  # the helper
