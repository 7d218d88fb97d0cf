"""Where a lossy allreduce's time goes, in the deterministic simulator (virtual time).

    python bench/sim_loss.py --loss 0 0.01 --seeds 3 --calls 3

A model of the testbed's 4 hosts at 1 Gbit/s with MTU 9000: 4 workers of 32
slots, 8320-byte packets (2048 float32 values in 8 blocks), 64 MiB a call; the
four 1 Gbit/s uplinks with their 256 KiB queues are one bottleneck of their sum
(4 Gbit/s, 1 MiB) into the switch; 50 µs one way (0.1 ms base round trip) and
``--loss`` on every datagram, both ways (``--jitter``: reordering as well).  Per
loss rate: the mean time of a call, goodput against the loss-free run, and per
worker and call the retransmissions, how many of them were fast (results of
later messages), probes and the timer's, and the spurious ones.  Every result
is checked against the loss-free run's, bit for bit.  ``--compiled``: the C
engine (the same figures).
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from switchml.bench.common import at_least, within  # noqa: E402
from switchml.sim.network import Bottleneck, Faults, Simulation  # noqa: E402

WORLD, SLOTS, K, BLOCK = 4, 32, 2048, 256
PACKET = 32 + 12 * (K // BLOCK) + 4 * K  # 8320 bytes


def calls(loss: float, seed: int, n_calls: int, mib: float, compiled: bool, latency: float,
          jitter: float):
    """Virtual seconds of each call, the outputs' bytes, rank-summed counters."""
    rng = np.random.default_rng(seed)
    size = int(mib * 2**20) // 4
    arrays = [rng.standard_normal(size).astype(np.float32) for _ in range(WORLD)]
    sim = Simulation(WORLD, slots=SLOTS, packet_elements=K, block_elements=BLOCK, seed=seed,
                     compiled=compiled, faults=Faults(loss=loss, latency=latency, jitter=jitter),
                     bottleneck=Bottleneck(rate=WORLD * 125e6, queue_bytes=WORLD * 256 * 1024))
    times, outputs = [], []
    for _ in range(n_calls):
        start = sim.now
        outs = sim.allreduce(arrays, max_time=1e6)
        times.append(sim.now - start)
        outputs.append([o.tobytes() for o in outs])
    counters: dict = {}
    for s in sim.memberships:
        for name, value in s.counters.items():
            counters[name] = counters.get(name, 0) + value
    return times, outputs, counters


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--loss", type=within(0, 0.99), nargs="+", default=[0.0, 0.01],
                   help="loss rates; the loss-free run, the reference, goes first whether "
                        "given or not")
    p.add_argument("--seeds", type=at_least(1), default=3)
    p.add_argument("--calls", type=at_least(1), default=3)
    p.add_argument("--mib", type=within(0, above_low=True), default=64)
    p.add_argument("--latency", type=float, default=50e-6, help="one way, seconds")
    p.add_argument("--jitter", type=float, default=0.0,
                   help="extra uniform delay of each datagram, seconds: reorders them")
    p.add_argument("--compiled", action="store_true")
    args = p.parse_args()
    # goodput and results are against the loss-free run: it comes first
    args.loss = [0.0] + [loss for loss in args.loss if loss != 0.0]
    free_time, expected = None, {}
    print(f"{'loss':>6} {'s/call':>8} {'goodput':>8} {'retx':>7} {'fast':>7} {'probe':>7} "
          f"{'timer':>7} {'spur':>7}  (per worker and call)")
    for loss in args.loss:
        total, counters, n = 0.0, {}, 0
        for seed in range(args.seeds):
            times, outputs, c = calls(loss, seed, args.calls, args.mib, args.compiled,
                                      args.latency, args.jitter)
            if seed in expected:
                assert outputs == expected[seed], "results differ from the loss-free run"
            else:
                expected[seed] = outputs
            total += sum(times)
            n += len(times)
            for name, value in c.items():
                counters[name] = counters.get(name, 0) + value
        mean = total / n
        if free_time is None:
            free_time = mean
        per = n * WORLD
        retx, fast = counters["retransmissions"], counters["fast_retransmissions"]
        probe = counters.get("probe_retransmissions", 0)  # none before the probes
        timer = retx - fast - probe
        print(f"{loss:>6.3f} {mean:>8.4f} {free_time / mean:>8.1%} {retx / per:>7.1f} "
              f"{fast / per:>7.1f} {probe / per:>7.1f} {timer / per:>7.1f} "
              f"{counters['spurious_retransmissions'] / per:>7.1f}")


if __name__ == "__main__":
    main()
