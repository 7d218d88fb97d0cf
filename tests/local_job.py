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


def main():
    address, rank, world, n, mode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), \
        int(sys.argv[4]), sys.argv[5]
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
                report["wire16"] = digest(w.allreduce(floats, bits=16))
                np.save(os.environ["OUT"] + f"/{rank}.npy", w.allreduce(floats))
                # queued back to back: each call's last copy-out left to the next
                handles = [w.allreduce_async(ints + np.int32(i)) for i in range(4)]
                report["queued"] = [digest(h.wait()) for h in handles]
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
