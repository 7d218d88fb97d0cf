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

import switchml
from switchml.switch.process import SwitchProcess


def test_a_switch_process_serves_a_job_and_stops():
    with SwitchProcess(slots=16, slots_per_job=4, packet_elements=1024) as sp:
        child = sp._proc
        with switchml.Worker(sp.address, 0, 1, timeout=5) as w:
            assert np.array_equal(w.allreduce(np.arange(5000, dtype=np.int32)),
                                  np.arange(5000, dtype=np.int32))
    assert child.wait(5) == 0


def test_a_switch_that_cannot_listen_is_a_clear_error():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(switchml.SwitchMLError, match="exited with status"):
            SwitchProcess(port=taken.getsockname()[1]).start()


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # a zombie waiting for its (dead) parent's reaper counts as gone
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] == "Z"


def test_the_switch_process_dies_with_a_killed_parent():
    parent = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import time
        from switchml.switch.process import SwitchProcess
        sp = SwitchProcess().start()
        print(sp._proc.pid, flush=True)
        time.sleep(60)
    """)], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    assert not gone(child)
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 10
    while not gone(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gone(child)
