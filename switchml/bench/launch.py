"""Where the benchmark's processes run: on loopback, or one per testbed namespace.

A cluster starts role processes (roles.py) and says which addresses they
use; ``Roles`` watches a set of them: their JSON lines arrive on one queue, and a
process that fails ends the run with its stderr in the message.
"""

from __future__ import annotations

import ctypes
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from typing import Any

#: The folder the switchml package is in (a source checkout's root, or
#: site-packages): the role processes import it from there, installed or not.
PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _pythonpath() -> str:
    """PYTHONPATH for a role process: the package's folder first, then the caller's."""
    return os.pathsep.join(p for p in (PACKAGE_PARENT, os.environ.get("PYTHONPATH")) if p)


class BenchError(RuntimeError):
    """A benchmark process failed or stopped answering; the message says which and why."""


#: linux/prctl.h
PR_SET_PDEATHSIG = 1
_prctl: Any
try:  # looked up here: the forked child only calls it
    _prctl = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):  # not Linux
    _prctl = None


def die_with_parent() -> None:
    """In a role's process, before its program runs: SIGTERM when the bench that
    started it dies (PR_SET_PDEATHSIG, kept across exec, ``ip netns exec``'s
    too), so that a bench killed or stopped by a signal leaves no rank waiting
    out its timeout."""
    if _prctl is not None:
        _prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM))


def run_to_its_end(argv: list, cwd: str | None = None) -> int:
    """``argv`` (a bench of its own) to completion; its exit status.  Interrupted
    here (Ctrl-C, or TERM under ``signals_end_the_run``), it is asked to stop
    with TERM and given a minute to take its processes and testbed away, rather
    than killed with them in place."""
    proc = subprocess.Popen(argv, cwd=cwd)
    try:
        return proc.wait()
    except BaseException:
        ask_to_stop(proc, 60)
        raise


def end_processes(procs, pipes=()) -> None:
    """TERM to the ``multiprocessing`` processes ``procs`` still running, 5 s each
    to end; then this side's ends of their ``pipes`` closed."""
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
        proc.join(5)
    for pipe in pipes:
        pipe.close()


def ask_to_stop(proc: subprocess.Popen, seconds: float) -> tuple:
    """Stop ``proc`` with TERM, giving it ``seconds`` to take away what it made,
    then kill it; what it wrote to the pipes it has (``communicate``'s answer)."""
    proc.terminate()
    try:
        return proc.communicate(timeout=seconds)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.communicate()


def role_argv(role: str, spec: dict) -> list:
    return [sys.executable, "-m", "switchml.bench.roles", role, json.dumps(spec)]


class Loopback:
    """Every process on this machine's loopback; no link rate."""

    name = "loopback"
    link_bps = None
    #: (where, host, port) of each switch the job spreads over
    switch_binds = [("switch", "127.0.0.1", 0)]
    switch_servers = 0  # no switch behind a link of its own

    def popen(self, where, argv, **kw) -> subprocess.Popen:
        return subprocess.Popen(argv, env={**os.environ, "PYTHONPATH": _pythonpath()}, **kw)

    def ifname(self, rank):
        return None  # loopback carries every rank: no per-worker link to count

    def master(self):
        with socket.socket() as s:  # a free port for gloo's TCP store
            s.bind(("127.0.0.1", 0))
            return "127.0.0.1", s.getsockname()[1]

    def describe(self) -> dict:
        return {"kind": self.name}

    rack_binds: list = []  # no racks on loopback

    def rack_of(self, rank):
        return None

    def uplink_bytes(self, since=None):
        return None


class OnTestbed:
    """Rank i in host namespace i, the switch on the bridge in the switch namespace."""

    name = "testbed"

    def __init__(self, testbed):
        self.tb = testbed
        self.link_bps = testbed.link_bps
        from ..testbed import SWITCH_PORT
        # switch servers, each in its namespace behind a shaped link, or the
        # switch on the bridge
        self.switch_servers = testbed.switches
        self.switch_binds = ([(f"s{k}", testbed.address(f"s{k}"), SWITCH_PORT)
                              for k in range(testbed.switches)]
                             or [("switch", testbed.switch_address, SWITCH_PORT)])
        #: (host, port) of the first (bench/two_jobs.py's one switch)
        self.switch_bind = self.switch_binds[0][1:]
        #: the rack switches' binds, rack by rack (with racks: the first bind is the spine)
        self.rack_binds = [(f"r{k}", testbed.address(f"r{k}"), SWITCH_PORT)
                           for k in range(testbed.racks)]

    def rack_of(self, rank) -> int | None:
        return self.tb.rack_of(rank)

    def rack_layout(self, args) -> dict:
        """``lower_bound_s``'s rack arguments: hosts a rack, the uplinks' rate."""
        if not self.tb.racks:
            return {}
        from ..testbed import racks

        return {"rack_hosts": len(racks.hosts_of(self.tb, 0)),
                "uplink_bps": racks.uplink_bps(self.tb, 0), "flat": args.flat}

    def uplink_bytes(self, since=None) -> list | None:
        """Each rack uplink's byte counters (less ``since``'s); None without racks."""
        if not self.tb.racks:
            return None
        from ..testbed import racks

        now = [racks.uplink_counters(self.tb, k) for k in range(self.tb.racks)]
        if since is None:
            return now
        return [{key: value - before.get(key, 0) for key, value in c.items()
                 if isinstance(value, (int, float))} for c, before in zip(now, since)]

    def popen(self, where, argv, **kw) -> subprocess.Popen:
        return self.tb.popen(where, argv, env={"PYTHONPATH": _pythonpath()}, **kw)

    def ifname(self, rank):
        return self.tb.ifname(rank)

    def master(self):
        return self.tb.address(0), 29500  # inside host 0's own namespace: always free

    def describe(self) -> dict:
        tb = self.tb
        return {"kind": self.name, "hosts": tb.hosts, "switch_servers": tb.switches,
                "racks": tb.racks, "oversubscription": tb.oversubscription,
                "link": tb.link, "link_bps": tb.link_bps,
                "mtu": tb.mtu or 1500, "loss": tb.loss, "tbf_burst_bytes": tb.burst,
                "tbf_queue_bytes": tb.queue, "host_queue": tb.host_queue,
                "prefix": tb.prefix}


class Roles:
    """Role processes whose stdout lines (JSON) are gathered on one queue."""

    def __init__(self, cluster, timeout: float):
        self.cluster = cluster
        self.timeout = timeout
        self.events: queue.Queue = queue.Queue()
        self.procs: dict = {}
        self._stderr: dict = {}

    def start(self, name, where, role, spec, stdin=False) -> subprocess.Popen:
        err = tempfile.TemporaryFile(mode="w+")
        proc = self.cluster.popen(where, role_argv(role, spec), stdout=subprocess.PIPE,
                                  stderr=err, stdin=subprocess.PIPE if stdin else None,
                                  text=True, preexec_fn=die_with_parent)
        self.procs[name], self._stderr[name] = proc, err
        threading.Thread(target=self._read, args=(name, proc), daemon=True).start()
        return proc

    def _read(self, name, proc) -> None:
        for line in proc.stdout:
            try:
                self.events.put((name, json.loads(line)))
            except ValueError:  # a stray print: not ours
                continue
        self.events.put((name, {"event": "exit", "code": proc.wait()}))

    def next(self) -> tuple:
        """The next (process name, message); a failed process raises BenchError."""
        try:
            name, msg = self.events.get(timeout=self.timeout)
        except queue.Empty:
            raise BenchError(f"no progress for {self.timeout:g}s from {sorted(self.procs)}; "
                             + self._tails()) from None
        if msg["event"] == "exit" and msg["code"] != 0:
            raise BenchError(f"{name} exited with status {msg['code']}: {self.stderr(name)}")
        return name, msg

    def stderr(self, name) -> str:
        err = self._stderr[name]
        err.seek(0)
        lines = err.read().strip().splitlines()
        return "\n".join(lines[-15:]) or "(no stderr)"

    def _tails(self) -> str:
        return "; ".join(f"{n}: {self.stderr(n)}" for n in self.procs)

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for err in self._stderr.values():
            err.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
