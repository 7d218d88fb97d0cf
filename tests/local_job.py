"""One rank of a local-stage job, for tests/test_local_runtime.py: runs the calls
its arguments name and prints one JSON line of what it got."""

import hashlib
import json
import os
import signal
import sys
import threading
import time

import numpy as np

import switchml


def inputs(rank: int, n: int):
    rng = np.random.default_rng(rank)
    floats = (rng.standard_normal(n) * 10.0 ** rng.integers(-3, 4, n)).astype(np.float32)
    floats[rng.random(n) < 0.7] = 0.0  # block-sparse enough for the sparse calls
    ints = rng.integers(-2**31, 2**31, n, dtype=np.int64).astype(np.int32)
    return floats, ints


def digest(array) -> str:
    return hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()[:16]


class Straight:
    """stage.DeviceCopies over numpy arrays that stand for a GPU's: each copy made
    when it is waited for, as late as a device may make it."""

    def __init__(self, src):
        self.src, self.out = src, np.empty_like(src)
        self.started: dict = {}

    def into_host(self, area, start, stop):
        self.started["in", start] = lambda: np.copyto(area, self.src[start:stop])

    def wait_into_host(self, start, stop):
        self.started.pop(("in", start))()

    def from_host(self, result, start, stop):
        self.started["out", start] = lambda: np.copyto(self.out[start:stop], result)

    def wait_from_host(self, start, stop):
        self.started.pop(("out", start))()

    def synchronize(self):
        """What a reader of the output waits for on the device: every copy started
        (a call ends with its last one on its way)."""
        for copy in self.started.values():
            copy()
        self.started.clear()


class Pipelined:
    """stage.DevicePipeline over numpy arrays that stand for a GPU's: the host
    copy's segments filled only as the stage asks for them."""

    def __init__(self, src):
        self.src, self.host = src, np.full_like(src, np.nan)
        self.out = np.empty_like(src)

    def arrive(self, start, stop):
        np.copyto(self.host[start:stop], self.src[start:stop])

    def depart(self, start, stop):
        np.copyto(self.out[start:stop], self.host[start:stop])


def device_calls(w, floats):
    """Calls whose arrays stand on a device, queued back to back: their results'
    digests (a one-host job), or the error a worker that refuses them raises."""
    if not hasattr(w, "takes_device_copies"):
        return None  # a worker of its own host: no local stage
    if not w.takes_device_copies:
        try:
            w.allreduce_async(floats, copies=Straight(floats))
        except ValueError as exc:
            return str(exc)
        return "taken"
    calls = [Straight(floats), Pipelined(floats), Straight(floats)]
    handles = [w.allreduce_async(c.host if isinstance(c, Pipelined) else np.empty_like(floats),
                                 out=c.host if isinstance(c, Pipelined) else None, copies=c)
               for c in calls]
    for h in handles:
        h.wait()
    for c in calls:
        if isinstance(c, Straight):
            c.synchronize()
    return [digest(c.out) for c in calls]


def inject(fault: str, rank: int) -> None:
    """``FAULT``: this rank dies (SIGKILL) at a moment of joining its host, the
    others arrive a little late, so that the moment is what they find:
    ``creator-dies-sizing`` (rank 0 while it sizes the segment: a ``.partial``
    file), ``creator-dies-made`` (rank 0 once the segment is whole: its name),
    ``last-dies-before-unlink`` (rank 1, the last to count itself in, before it
    removes the name)."""
    from switchml.worker.local import memory, worker

    def die(*_):
        os.kill(os.getpid(), signal.SIGKILL)

    def late(seconds):
        watch = worker.LocalStageWorker._watch_peers
        worker.LocalStageWorker._watch_peers = lambda self: (time.sleep(seconds), watch(self))[1]

    if fault == "creator-dies-sizing":
        if rank == 0:
            memory.os.posix_fallocate = die
        else:
            late(float(os.environ.get("LATE", "0.5")))
    elif fault == "creator-dies-made":
        if rank == 0:
            create = memory.Segment.create.__func__
            memory.Segment.create = classmethod(lambda cls, *a: (create(cls, *a), die())[0])
        else:
            late(float(os.environ.get("LATE", "0.5")))
    elif fault == "last-dies-before-unlink" and rank == 1:
        late(0.5)
        memory.Segment.unlink = die


def main():
    address, rank, world, n, mode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), \
        int(sys.argv[4]), sys.argv[5]
    if os.environ.get("FAULT"):
        inject(os.environ["FAULT"], rank)
    floats, ints = inputs(rank, n if mode != "mismatch" or rank != 1 else n + 1)
    report: dict = {"rank": rank}
    try:
        with switchml.Worker(address, rank, world, job="local", timeout=3.0) as w:
            report["kind"] = type(w).__name__
            stage = getattr(w, "stage", None)
            report["local_threads"] = stage.threads if stage is not None else None
            if mode == "calls":
                report["float32"] = digest(w.allreduce(floats))
                report["int32"] = digest(w.allreduce(ints))
                report["sparse"] = digest(w.allreduce(floats, sparse=True))
                report["auto"] = digest(w.allreduce(floats, sparse="auto"))
                report["float16"] = digest(w.allreduce(floats.astype(np.float16)))
                wire16 = w.allreduce(floats, bits=16)
                report["wire16"] = digest(wire16)
                np.save(os.environ["OUT"] + f"/{rank}-wire16.npy", wire16)
                np.save(os.environ["OUT"] + f"/{rank}.npy", w.allreduce(floats))
                # queued back to back: each call's last copy-out left to the next
                handles = [w.allreduce_async(ints + np.int32(i)) for i in range(4)]
                report["queued"] = [digest(h.wait()) for h in handles]
                report["device"] = device_calls(w, floats)
            elif mode == "ready":  # the first queued call of rank 1 cannot begin
                def fails():
                    raise RuntimeError("the device's copy failed")

                first = w.allreduce_async(ints, ready=fails if rank == 1 else None)
                second = w.allreduce_async(ints + np.int32(1))
                for name, handle in (("first", first), ("second", second)):
                    try:
                        report[name] = digest(handle.wait())
                    except Exception as exc:  # noqa: BLE001 - reported
                        report[name] = f"{type(exc).__name__}: {exc}"
            elif mode == "close-from-callback":  # rank 0 closes in its call's callback
                handle = w.allreduce_async(floats)
                if rank == 0:
                    handle.add_done_callback(lambda _: w.close())
                report["float32"] = digest(handle.wait())
                if rank == 0:  # then exits at once; an abort after the close is a no-op
                    w.abort(switchml.SwitchMLError("after the close"))
                else:
                    time.sleep(1.0)
                    report["failure"] = str(w._failure()) if w._failure() else None
            elif mode == "close-early":  # rank 0 leaves and exits, the others idle a while
                w.allreduce(floats)
                if rank != 0:
                    time.sleep(1.0)
                report["failure"] = str(w._failure()) if w._failure() else None
            else:
                w.allreduce(floats)
                if mode == "kill" and rank == int(os.environ["VICTIM"]):
                    threading.Timer(float(os.environ.get("AFTER", 0)),
                                    os.kill, (os.getpid(), signal.SIGKILL)).start()
                start = time.monotonic()
                try:
                    for _ in range(200):
                        w.allreduce(floats)
                except switchml.SwitchMLError as exc:
                    report["error"] = type(exc).__name__
                    report["message"] = str(exc)
                    report["missing"] = getattr(exc, "missing_ranks", None)
                    report["elapsed"] = time.monotonic() - start
            report["counters"] = w.counters
    except switchml.SwitchMLError as exc:
        report.setdefault("error", type(exc).__name__)
        report.setdefault("message", str(exc))
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
