"""Where a sparse allreduce's CPU goes: the sans-IO simulator under cProfile.

    python bench/profile_sparse.py --mib 64 --workers 4 --density 0.1

No sockets: n workers and the switch pipeline in one process, so the figures are
the protocol's own CPU (set-up, rounds, switch) without the kernel's.  Prints the
dense and sparse times without the profiler, then the profile of the sparse run
and a per-worker summary.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import numpy as np

from switchml.sim.network import Simulation


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=float, default=64)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--density", type=float, default=0.1)
    p.add_argument("--slots", type=int, default=32)
    args = p.parse_args()
    n, block = args.workers, 256
    size = int(args.mib * 2**20) // 4 // block * block
    rng = np.random.default_rng(0)
    arrays = []
    for _ in range(n):
        x = rng.standard_normal(size).astype(np.float32)
        x[np.repeat(rng.random(size // block) >= args.density, block)] = 0
        arrays.append(x)

    def simulation():
        return Simulation(n, slots=args.slots, packet_elements=16128, block_elements=block)

    for sparse in (False, True):
        sim = simulation()
        start = time.perf_counter()
        sim.allreduce(arrays, sparse=sparse)
        print(f"{'sparse' if sparse else 'dense '}: {time.perf_counter() - start:.3f} s of one "
              f"core, {sim.datagrams} datagrams")
    sim = simulation()
    profile = cProfile.Profile()
    profile.enable()
    sim.allreduce(arrays, sparse=True)
    profile.disable()
    stats = pstats.Stats(profile)
    stats.sort_stats("cumulative").print_stats(20)
    rounds = sim.datagrams // 2
    funcs = {f"{k[0].rsplit('/', 1)[-1]}:{k[2]}": v[3] for k, v in stats.stats.items()}
    setup = funcs.get("sparse.py:__init__", 0.0)
    worker = funcs.get("stream.py:receive_datagram", 0.0)
    switch = funcs.get("pipeline.py:receive_datagram", 0.0)
    print(f"per worker: set-up {1e3 * setup / n:.0f} ms, {rounds // n} rounds at "
          f"{1e6 * worker / rounds:.0f} us; switch {1e6 * switch / rounds:.0f} us per datagram "
          "(under cProfile)")
    union = 1 - (1 - args.density) ** n
    print(f"ideal rounds per worker (union of {union:.0%} in full packets): "
          f"{union * size / block / 63:.0f}")


if __name__ == "__main__":
    main()
