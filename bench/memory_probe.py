"""The rates a host's memory and its GPU's copies run at: what the local stage and
a CUDA tensor's staging are built from, measured on the machine at hand.

    python bench/memory_probe.py --mib 45 --threads 1 2 4 8 --out probe.json

Rows (each the median of ``--repeats`` after one warm-up, on memory touched before):

* ``copy``: one 45 MiB ``memory.copy_into``; with T threads, T such copies at
  once (the host's bandwidth as T ranks see it) and one copy cut over T threads
  (what one rank gets from ``SWITCHML_LOCAL_THREADS=T``);
* ``reduce``: ``memory.reduce_into`` of 2 arrays into a third, as an owner sums
  its shard at K = 2; the same T ways;
* with a GPU: the copy of the tensor from the device into pinned memory, into
  pageable memory, and into a /dev/shm mapping registered with
  ``cudaHostRegister`` (how the local stage's shared memory would take it), whole
  and in 2 MiB pieces, and back.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import threading
import time

import numpy as np


def timed(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        begun = time.perf_counter()
        fn()
        times.append(time.perf_counter() - begun)
    return statistics.median(times)


def in_threads(jobs) -> None:
    threads = [threading.Thread(target=job) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def host_rows(n: int, threads: list[int], repeats: int) -> list[dict]:
    from switchml.worker.local import memory

    rows = []
    most = max(threads)
    srcs = [np.random.default_rng(i).random(n, dtype=np.float32) for i in range(most)]
    dsts = [np.full_like(s, 1) for s in srcs]
    peers = [s[::-1].copy() for s in srcs]
    mib = n * 4 / 2**20
    ops = {"copy": lambda i, t: memory.copy_into(dsts[i], srcs[i], t),
           "reduce": lambda i, t: memory.reduce_into(dsts[i], [srcs[i], peers[i]], t)}
    for t in threads:
        for name, op in ops.items():
            def side_by_side(op=op, t=t):
                in_threads([lambda i=i: op(i, 1) for i in range(t)])

            apart = timed(side_by_side, repeats)
            cut = timed(lambda op=op, t=t: op(0, t), repeats)
            rows.append({"op": name, "threads": t, "mib": mib,
                         "side_by_side_ms": apart * 1e3,
                         "gbyte_s_each": mib * 2**20 / apart / 1e9,
                         "one_cut_ms": cut * 1e3})
            print(f"{name:7s} T={t:2d}: {t} side by side {apart * 1e3:7.2f} ms "
                  f"({mib * 2**20 / apart / 1e9:5.1f} GB/s each); one cut over {t} threads "
                  f"{cut * 1e3:7.2f} ms", flush=True)
    return rows


def cuda_rows(n: int, repeats: int, piece: int) -> list[dict]:
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device: the copy rows are skipped")
        return []
    nbytes = n * 4
    device = torch.device("cuda")
    gpu = torch.rand(n, device=device)
    back = torch.empty_like(gpu)
    pinned = torch.empty(n, dtype=torch.float32, pin_memory=True)
    pageable = torch.empty(n, dtype=torch.float32)
    pageable.zero_()
    path = f"/dev/shm/switchml-probe-{os.getpid()}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.unlink(path)
    os.posix_fallocate(fd, 0, nbytes)
    area = mmap.mmap(fd, nbytes)
    os.close(fd)
    shared = torch.frombuffer(area, dtype=torch.float32)
    shared.zero_()
    registered = False
    try:
        cudart = torch.cuda.cudart()
        code = cudart.cudaHostRegister(shared.data_ptr(), nbytes, 0)
        registered = int(code) == 0
        print(f"cudaHostRegister of a /dev/shm mapping: {code}")
    except Exception as exc:  # noqa: BLE001 - a probe reports what it cannot do
        print(f"cudaHostRegister failed: {exc!r}")
    stream = torch.cuda.Stream()
    rows = []
    targets = [("pinned", pinned), ("pageable", pageable)]
    if registered:
        targets.append(("shm-registered", shared))
    mib = nbytes / 2**20
    for name, host in targets:
        for label, step in (("whole", n), ("pieces", piece)):
            def down(host=host, step=step):
                with torch.cuda.stream(stream):
                    for lo in range(0, n, step):
                        host[lo:lo + step].copy_(gpu[lo:lo + step], non_blocking=True)
                stream.synchronize()

            def up(host=host, step=step):
                with torch.cuda.stream(stream):
                    for lo in range(0, n, step):
                        back[lo:lo + step].copy_(host[lo:lo + step], non_blocking=True)
                stream.synchronize()

            d, u = timed(down, repeats), timed(up, repeats)
            rows.append({"op": "cuda", "host": name, "cut": label, "mib": mib,
                         "to_host_ms": d * 1e3, "to_device_ms": u * 1e3})
            print(f"cuda {name:15s} {label:6s}: to host {d * 1e3:6.2f} ms "
                  f"({nbytes / d / 1e9:5.1f} GB/s), to device {u * 1e3:6.2f} ms", flush=True)
    if registered:
        cudart.cudaHostUnregister(shared.data_ptr())
    del shared
    area.close()
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=float, default=45)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--piece-mib", type=float, default=2)
    parser.add_argument("--no-cuda", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    n = int(args.mib * 2**20) // 4
    print(f"{os.cpu_count()} cores; {args.mib:g} MiB float32")
    from switchml.worker.local import memory
    if memory.OPS is not None:
        print(f"float32 sums (reduce_into's kernels, timed at import): {memory.OPS.kernels()}")
    rows = host_rows(n, args.threads, args.repeats)
    if not args.no_cuda:
        rows += cuda_rows(n, args.repeats, int(args.piece_mib * 2**20) // 4)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"cores": os.cpu_count(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
