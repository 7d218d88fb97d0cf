"""What the benchmarks share: the inputs every system gets, timing summaries, bounds."""

from __future__ import annotations

import argparse
import math
import statistics

import numpy as np


def make_block_sparse(rank, elements, density, block, seed=0):
    """OmniReduce's micro-benchmark input: non-zero blocks placed at random per rank."""
    rng = np.random.default_rng([seed, rank])
    data = rng.standard_normal(elements).astype(np.float32)
    blocks = -(-elements // block)
    keep = rng.random(blocks) < density
    data[np.repeat(~keep, block)[:elements]] = 0
    return data


def make_tensor(rank, elements, density=None, block=256, seed=0):
    """Rank ``rank``'s float32 input: dense normal values, or block-sparse at ``density``.

    Every system of a run calls this with the same arguments, so they all sum the
    same tensors; any rank can rebuild every other rank's input to check a result.
    """
    if density is None:
        return np.random.default_rng([seed, rank]).standard_normal(elements).astype(np.float32)
    return make_block_sparse(rank, elements, density, block, seed)


def summarize(per_rank_times, nbytes):
    """Median, min and max over iterations of the slowest rank's time, and goodput."""
    per_iter = np.max(np.array(per_rank_times), axis=0)  # the slowest rank finishes it
    median = float(statistics.median(per_iter))
    return {"median_s": median, "min_s": float(per_iter.min()), "max_s": float(per_iter.max()),
            "goodput_GBps_per_worker": nbytes / median / 1e9,
            "call_s": [round(float(t), 6) for t in per_iter]}  # each timed call, in order


def ring_bytes(world, nbytes):
    """Bytes a ring allreduce sends (and receives) per worker: 2(n-1)/n * S."""
    return 2 * (world - 1) / world * nbytes


def union_density(density, world):
    """Fraction of blocks non-zero on at least one of ``world`` ranks (independent blocks)."""
    return 1.0 - (1.0 - density) ** world


def lower_bound_s(system, world, nbytes, link_bps, density=None, switch_servers=0,
                  rack_hosts=0, uplink_bps=None, flat=False, ranks_per_host=1):
    """The least time the links allow: bytes over the busier direction of a worker's
    link, or, with ``switch_servers`` K (switches on servers behind links of the same
    rate), of a server's, which carries n·S/K each way: max(S, n·S/K)/B.

    Racks of ``rack_hosts`` hosts under a spine, uplinks of ``uplink_bps``: a rack
    switch sends one partial up and takes one total down, S each way on the
    uplink; through the spine without rack switches (``flat``), each host's S
    crosses it; gloo's ring (ranks in rack order) crosses it once each way.

    ``ranks_per_host`` k > 1 (switchml without the local stage): k ranks' tensors
    share one host link.  With the local stage a host sends S, as one rank does,
    and gloo's ring (ranks in host order) crosses a host's link once each way:
    both as k = 1."""
    if not link_bps:
        return None
    if ranks_per_host > 1 and system.startswith("switchml"):
        # every rank of a host sends its whole tensor through the host's link (no local
        # stage); gloo's ring, ranks in host order, crosses each host's link once
        return ranks_per_host * lower_bound_s(system, world, nbytes, link_bps, density)
    if rack_hosts and uplink_bps:
        own = lower_bound_s(system, world, nbytes, link_bps, density)
        busiest = own * link_bps / 8  # bytes on a host's busier direction
        on_uplink = busiest * (rack_hosts if flat and system.startswith("switchml") else 1)
        return max(own, on_uplink * 8 / uplink_bps)
    if switch_servers and system.startswith("switchml"):
        per_worker = lower_bound_s(system, world, nbytes, link_bps, density)
        return per_worker * max(1.0, world / switch_servers)
    if system == "gloo":
        busiest = ring_bytes(world, nbytes)
    elif system == "gloo-fp16":
        busiest = ring_bytes(world, nbytes / 2)
    elif system == "switchml-dense16":
        busiest = nbytes / 2  # two values a 32-bit word
    elif system == "switchml-sparse":
        busiest = union_density(density, world) * nbytes  # the union comes back down
    else:
        busiest = nbytes  # in-network aggregation: S up and S down
    return busiest * 8 / link_bps


def at_least(low: int):
    """An argparse ``type``: an integer of ``low`` or more (0 runs, -3 ranks and
    the like ran, and printed figures of nothing)."""
    def cast(text: str) -> int:
        value = int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"{text}: give {low} or more")
        return value
    cast.__name__ = "integer"
    return cast


def within(low: float, high: float = math.inf, *, above_low: bool = False):
    """An argparse ``type``: a number from ``low`` (above it, with ``above_low``) to
    ``high`` (a density or a loss past its range, 0 MiB, ...)."""
    def cast(text: str) -> float:
        value = float(text)
        if not (value > low if above_low else value >= low) or not value <= high:
            raise argparse.ArgumentTypeError(
                f"{text}: give a number {'above' if above_low else 'from'} {low:g}"
                + (f" to {high:g}" if high < math.inf else ""))
        return value
    cast.__name__ = "number"
    return cast
