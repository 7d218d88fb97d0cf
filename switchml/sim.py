"""Deterministic simulation of a switch and its workers over a lossy network.

The same sans-IO pipeline and engine that run behind real sockets run here on a
virtual clock, with seeded loss, duplication and reordering (random extra delay).
Used by the tests; also handy to explore protocol behaviour quickly.
"""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass

import numpy as np

from .switch.pipeline import Pipeline
from .worker.engine import Session

SWITCH = ("switch", 0)


@dataclass
class Faults:
    loss: float = 0.0        # probability a datagram is lost (each direction)
    duplicate: float = 0.0   # probability a datagram is delivered twice
    jitter: float = 0.0      # extra uniform delay in seconds: reorders datagrams
    latency: float = 50e-6   # one-way base delay in seconds


class StalledSimulation(RuntimeError):
    pass


class Simulation:
    """n workers of one job and a switch pipeline, driven by a virtual clock."""

    def __init__(self, world_size: int, *, slots: int = 8, packet_elements: int | None = None,
                 faults: Faults | None = None, seed: int = 0, pipeline: Pipeline | None = None,
                 session: int = 0x5EED, slot_base: int | None = None,
                 progress_timeout: float = 60.0, block_elements: int | None = None,
                 addresses: list | None = None):
        """``packet_elements`` and ``block_elements`` are the job's packet size: with a
        given ``pipeline`` they may be smaller than its own (its defaults when None);
        without one, the pipeline built here has that size (64 values by default).
        ``addresses``: the workers' data addresses, by rank (names by default)."""
        self.faults = faults or Faults()
        self.rng = random.Random(seed)
        if pipeline is None:
            pipeline = Pipeline(slots=slots, packet_elements=packet_elements or 64,
                                block_elements=block_elements)
            packet_elements, block_elements = pipeline.packet_elements, pipeline.block_elements
        self.pipeline = pipeline
        self.now = 0.0
        self._order = 0
        self._queue: list = []
        addrs = addresses or [("worker", r) for r in range(world_size)]
        base = self.pipeline.allocate(slots) if slot_base is None else slot_base
        self.job = self.pipeline.install_job(f"sim-{session}", session, addrs, base, slots,
                                             packet_elements, block_elements)
        self.sessions = [Session(session=session, rank=r, world_size=world_size,
                                 slot_base=base, slot_count=slots,
                                 packet_elements=self.job.packet_elements,
                                 block_elements=self.job.block_elements,
                                 progress_timeout=progress_timeout)
                         for r in range(world_size)]
        self.datagrams = 0

    def _send(self, data, src, dst) -> None:
        """Put a copy of ``data`` on the wire, subject to the configured faults."""
        f = self.faults
        if f.loss and self.rng.random() < f.loss:
            return
        data = bytes(data)
        copies = 2 if f.duplicate and self.rng.random() < f.duplicate else 1
        for _ in range(copies):
            delay = f.latency + (self.rng.random() * f.jitter if f.jitter else 0.0)
            self._order += 1
            heapq.heappush(self._queue, (self.now + delay, self._order, src, dst, data))
            self.datagrams += 1

    def allreduce(self, arrays: list[np.ndarray], max_time: float = 600.0,
                  sparse: bool = False) -> list[np.ndarray]:
        """Run one allreduce of ``arrays[r]`` on every rank r; return each rank's result.

        Raises StalledSimulation when it takes more than ``max_time`` virtual seconds.
        """
        give_up = self.now + max_time
        outs = [np.empty_like(a) for a in arrays]
        ops = [s.allreduce(a, o, self.now, sparse) for s, a, o in zip(self.sessions, arrays, outs)]
        addrs = self.job.members
        rank_of = {addr: rank for rank, addr in enumerate(addrs)}
        for addr, op in zip(addrs, ops):
            for d in op.datagrams_to_send():
                self._send(d, addr, SWITCH)
        while not all(op.done for op in ops):
            if any(op.error for op in ops):
                raise StalledSimulation(f"a worker stalled at t={self.now:.3f}")
            timers = [t for t in (op.get_timer() for op in ops) if t is not None]
            next_timer = min(timers, default=float("inf"))
            next_packet = self._queue[0][0] if self._queue else float("inf")
            if min(next_timer, next_packet) > give_up:
                raise StalledSimulation(f"not finished after {max_time} virtual seconds")
            if next_packet <= next_timer:
                self.now, _, src, dst, data = heapq.heappop(self._queue)
                if dst == SWITCH:
                    for out, addr in self.pipeline.receive_datagram(data, src):
                        self._send(out, SWITCH, addr)
                else:
                    op = ops[rank_of[dst]]
                    op.receive_datagram(data, self.now)
                    for d in op.datagrams_to_send():
                        self._send(d, dst, SWITCH)
            else:
                self.now = next_timer
                for addr, op in zip(addrs, ops):
                    op.handle_timer(self.now)
                    for d in op.datagrams_to_send():
                        self._send(d, addr, SWITCH)
        return outs
