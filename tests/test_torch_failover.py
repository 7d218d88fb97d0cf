"""A torch job whose switch dies: real ranks, a real `switchml switch`, SIGKILL."""

import subprocess
import sys
import time

import pytest

torch = pytest.importorskip("torch", reason="the torch extra is not installed")

from test_torch import collect, start  # noqa: E402

CLI = [sys.executable, "-m", "switchml.cli"]
WORLD = 3


class SwitchProcess:
    """`switchml switch` in a child process, SIGKILLed and started again on its port."""

    def __init__(self, *args):
        self.args = list(args)
        self.port = 0
        self.proc = None
        self.start()

    def start(self):
        self.proc = subprocess.Popen(CLI + ["switch", "--port", str(self.port),
                                            "--log-level", "warning", *self.args],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        assert "listening on" in line, line + self.proc.stderr.read()
        self.address = line.split("SWITCHML_SWITCH=")[1].strip()
        self.port = int(self.address.rsplit(":", 1)[1])

    def kill(self):
        self.proc.kill()
        self.proc.wait(10)

    def stop(self):
        if self.proc.poll() is None:
            self.kill()


def run_with_switch_faults(tmp_path, scenario, steps, kill_at, restart_at=None, env=None):
    """``scenario`` (switch-dies or switch-dies-hook) as WORLD ranks, each a host of its
    own, on a switch SIGKILLed before step ``kill_at`` and started again on its port
    before ``restart_at``; each rank's RESULT and the switch's address."""
    switch = SwitchProcess()
    restart_at = steps + 1 if restart_at is None else restart_at
    try:
        procs = start(WORLD, scenario, "gloo" if scenario.endswith("hook") else "switchml",
                      steps, kill_at, restart_at,
                      env={"SWITCHML_SWITCH": switch.address, "SWITCHML_LOCAL_STAGE": "0",
                           "SWITCHML_TIMEOUT": "5", "CONTROL_DIR": str(tmp_path), **(env or {})})
        for point, action, done in (("kill", switch.kill, "killed"),
                                    ("restart", switch.start, "restarted")):
            if point == "restart" and restart_at > steps:
                break
            deadline = time.monotonic() + 60
            while not (tmp_path / point).exists():
                assert time.monotonic() < deadline and all(p.poll() is None for p in procs), \
                    [p.communicate()[1][-2000:] for p in procs if p.poll() is not None]
                time.sleep(0.01)
            action()
            (tmp_path / done).touch()
        return collect(procs, timeout=90), switch.address
    finally:
        switch.stop()


@pytest.mark.parametrize("scenario", ["switch-dies", "switch-dies-hook"])
def test_a_switch_killed_mid_training_is_an_error_in_the_script_not_a_crash(tmp_path, scenario):
    """DDP's reducer read a failed call's exception as the bucket's tensors and indexed
    an empty list: every rank died of SIGSEGV (the hook: a RuntimeError "Unable to cast
    ... to Tensor").  With fallback off, the named error reaches the script on every
    rank (``collect`` fails on a rank killed by a signal)."""
    results, address = run_with_switch_faults(tmp_path, scenario, steps=8, kill_at=3,
                                              env={"SWITCHML_FALLBACK": "0"})
    for out in results:
        assert out["steps"] == 3, out["steps"]
        assert "SwitchUnreachableError" in out["error"] and address in out["error"], out["error"]
