"""A switch in a child process: embedded in a job without sharing its interpreter.

A switch thread inside a training process competes with training and with the
rank's own worker thread for that process's GIL; in a child process it gets a
core of its own.  The child stops when its stdin reaches end of file, which
happens when the parent closes it or dies in any way (even SIGKILL), or when
its parent is gone (a process the parent forked, a data loader's worker, holds
the pipe open after it), so an embedded switch never outlives its job.  A
parent that stops it with ``drain`` writes how long it may wait for its running
jobs to end first.  A switch that cannot start says why on its stdout, and the
parent raises it.
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import subprocess
import sys
import time

from ..config import SwitchConfiguration
from ..errors import SwitchMLError

#: Seconds between the child's looks at whether its parent is still there.
PARENT_LOOK_S = 0.5


class SwitchProcess:
    """``Switch(...)`` run by ``python -m switchml.switch.process``; ``.address`` once
    started.  Takes what ``Switch`` takes; the settings are resolved here, in the
    parent (a bad one raises here, and the child reads no variable of its own)."""

    def __init__(self, host: str | None = None, port: int | None = None, *,
                 configuration: SwitchConfiguration | None = None, **settings):
        #: The settings the child's switch runs with.
        self.configuration = SwitchConfiguration.given(host, port, configuration, settings)
        self._proc: subprocess.Popen | None = None
        self.address: tuple[str, int] | None = None

    def start(self) -> SwitchProcess:
        if self._proc is not None:
            return self
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "switchml.switch.process",
             json.dumps(self.configuration.to_dict()), str(os.getpid())],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert self._proc.stdout is not None
        line = self._proc.stdout.readline()
        said = json.loads(line) if line.startswith(b"{") else {}
        if "address" not in said:
            code = self._proc.wait()
            self._proc = None
            why = said.get("error") or "its error is on stderr above"
            raise SwitchMLError(f"the embedded switch process exited with status {code} "
                                f"before listening: {why}")
        host, port = said["address"]
        self.address = (host, int(port))
        return self

    def stop(self, timeout: float = 5.0, drain: float = 0.0) -> None:
        """Stop the switch; with ``drain``, once its running jobs have ended (every
        member left, or the job failed) or ``drain`` seconds have passed, so that
        the job's other ranks, finishing a moment later, leave a switch that is
        still there instead of losing it."""
        if self._proc is None:
            return
        proc, self._proc = self._proc, None
        assert proc.stdin is not None and proc.stdout is not None
        try:
            if drain > 0:
                proc.stdin.write(f"drain {drain}\n".encode())
            proc.stdin.close()
        except BrokenPipeError:  # it is gone already
            pass
        try:
            proc.wait(timeout + drain)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stdout.close()

    def __enter__(self) -> SwitchProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def main() -> None:
    from .server import Switch

    logging.basicConfig(level=logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Ctrl-C in a terminal reaches the whole process group: the parent decides,
    # and its exit closes our stdin.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = int(sys.argv[2]) if len(sys.argv) > 2 else os.getppid()
    try:
        switch = Switch(configuration=SwitchConfiguration(**json.loads(sys.argv[1]))).start()
    except Exception as exc:  # said to the parent, which raises it
        print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}), flush=True)
        sys.exit(1)
    assert switch.address is not None
    print(json.dumps({"address": list(switch.address)}), flush=True)
    # until the parent closes the pipe or is gone; "drain S" first: wait up to S
    # seconds for the running jobs to end
    said = b""
    while os.getppid() == parent:
        ready, _, _ = select.select([sys.stdin.buffer], [], [], PARENT_LOOK_S)
        if ready:
            data = os.read(sys.stdin.fileno(), 4096)
            if not data:
                break
            said += data
    asked = said.split()
    if len(asked) == 2 and asked[0] == b"drain":
        deadline = time.monotonic() + float(asked[1])
        while time.monotonic() < deadline and switch.stats()["admission"]["running"]:
            time.sleep(0.02)
    switch.stop()


if __name__ == "__main__":
    main()
