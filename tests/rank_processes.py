"""Rank processes for the torch tests, forked from a server that has imported torch.

Importing torch costs about 3 s of CPU a process, most of what a short test of a few
ranks spends; multiprocessing's forkserver imports it once (``set_forkserver_preload``)
and forks each rank from there.  A rank is still a process of its own, run as
``python job args`` would run it (``__main__``, ``sys.argv``, its environment, its
output), killed by a real signal where a test kills it.  Only what the interpreter or a
library reads once at start-up is the server's: ``sys.path`` gets the rank's
``PYTHONPATH`` in front, and torch's thread count is set from ``OMP_NUM_THREADS``.
The server imports torch (and torch._dynamo, on a CPU build) and switchml's worker
and switch (switchml reads its settings when it runs, not at import), and never
touches a device, so each rank initialises CUDA afresh where it uses it."""

import multiprocessing
import os
import runpy
import socket
import subprocess
import sys
import tempfile

import torch

_context = multiprocessing.get_context("forkserver")
# switchml's own modules too, all but switchml.torch, which asks torch whether CUDA
# is there (a process that asked cannot give its forks a working CUDA); and, where
# torch has no CUDA to be asked about by accident, torch._dynamo, which DDP's
# constructor imports (2 s of CPU a rank on a slow core)
_context.set_forkserver_preload(
    ["torch", "torch.distributed", "switchml.worker.client", "switchml.switch.server"]
    + ([] if torch.backends.cuda.is_built() else ["torch._dynamo"]))


def _run(job: str, args: list, env: dict, out_path: str, err_path: str) -> None:
    """In the forked rank: its output into the files, its environment, its job."""
    for fd, path in ((1, out_path), (2, err_path)):
        target = os.open(path, os.O_WRONLY)
        os.dup2(target, fd)
        os.close(target)
    os.environ.clear()
    os.environ.update(env)
    sys.path[:0] = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path.insert(0, os.path.dirname(os.path.abspath(job)))
    if env.get("OMP_NUM_THREADS"):
        import torch
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    sys.argv = [job, *args]
    runpy.run_path(job, run_name="__main__")


class RankProcess:
    """``python job args`` with environment ``env``, as far as the tests see it a
    ``subprocess.Popen`` with text output (``poll``, ``wait``, ``kill``,
    ``communicate``, ``returncode``, ``pid``)."""

    def __init__(self, job: str, args: list, env: dict):
        self._files = [tempfile.NamedTemporaryFile(prefix="rank-", suffix=s, delete=False)
                       for s in (".out", ".err")]
        for f in self._files:
            f.close()
        self._process = _context.Process(
            target=_run, args=(job, [str(a) for a in args], dict(env),
                               *(f.name for f in self._files)))
        self._process.start()
        self.pid = self._process.pid
        self.returncode = None

    def poll(self):
        if self.returncode is None and not self._process.is_alive():
            self._process.join()
            self.returncode = self._process.exitcode
        return self.returncode

    def wait(self, timeout=None):
        self._process.join(timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired(f"rank {self.pid}", timeout)
        return self.returncode

    def kill(self):
        if self.poll() is None:
            self._process.kill()

    def communicate(self, timeout=None):
        """Its output once it has ended (``TimeoutExpired`` if it has not by
        ``timeout``); the files go with the first read."""
        self.wait(timeout)
        if not hasattr(self, "_output"):
            self._output = []
            for f in self._files:
                with open(f.name, errors="replace") as text:
                    self._output.append(text.read())
                os.unlink(f.name)
        return tuple(self._output)

    def __del__(self):
        for f in getattr(self, "_files", []):
            if os.path.exists(f.name):
                os.unlink(f.name)


def torchrun_environment(env: dict, rank: int, world: int, port: int) -> dict:
    """``env`` with what ``torchrun --standalone --nproc-per-node=world`` gives its
    rank ``rank`` (its own store: rank 0 serves it at ``port``, as without torchrun)."""
    return {**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world), "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1",
            "ROLE_NAME": "default", "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(world),
            "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
            "TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_USE_AGENT_STORE": "False",
            "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1")}


def run_as_torchrun(script: str, args: list, world: int, env: dict,
                    timeout: float) -> subprocess.CompletedProcess:
    """``script`` on ``world`` ranks as torchrun would start them on one host, each
    forked from the server (no launcher, no fresh interpreters): for the runs a
    test compares against, where torchrun itself is not what it tests.  Returns
    the first failed rank's exit status (0: none failed) and every rank's stderr."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ranks = [RankProcess(script, args, torchrun_environment(env, r, world, port))
             for r in range(world)]
    try:
        outputs = [rank.communicate(timeout) for rank in ranks]
    finally:
        for rank in ranks:
            rank.kill()
    codes = [rank.returncode for rank in ranks]
    failed = next((c for c in codes if c), 0)
    return subprocess.CompletedProcess(script, failed, "".join(o for o, _ in outputs),
                                       "".join(e for _, e in outputs))
