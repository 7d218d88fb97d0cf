"""Deterministic simulation of a switch and its workers over a lossy network.

The same sans-IO pipeline and engine that run behind real sockets run here on a
virtual clock, with seeded loss, duplication and reordering (random extra delay).
An optional ``Bottleneck`` (a rate and a finite drop-tail queue on the link into
the switch) lets the congestion window be watched, and several jobs can share
one switch and one network.  Used by the tests; also handy to explore protocol
behaviour quickly.
"""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import dataclass

import numpy as np

from ..switch.dataplane.pipeline import Pipeline
from ..worker.engine import nonfinite
from ..worker.engine.dense import Membership
from ..worker.multi import part_bounds

SWITCH = ("switch", 0)


def rank_token(session: int, rank: int) -> int:
    """A rank's data-plane token in a simulated job: distinct from the session and
    from the other ranks' (the controller draws them at random), never 0."""
    return ((session ^ (0x9E3779B9 * (rank + 1))) & 0xFFFFFFFF) or 1


@dataclass
class Faults:
    loss: float = 0.0        # probability a datagram is lost (each direction)
    duplicate: float = 0.0   # probability a datagram is delivered twice
    jitter: float = 0.0      # extra uniform delay in seconds: reorders datagrams
    latency: float = 50e-6   # one-way base delay in seconds

    def __post_init__(self):
        # (a negative delay ran the clock backwards)
        if not (0.0 <= self.loss <= 1.0 and 0.0 <= self.duplicate <= 1.0
                and 0.0 <= self.jitter < math.inf and 0.0 <= self.latency < math.inf):
            raise ValueError(f"{self}: probabilities 0 to 1, delays finite and 0 or more")


@dataclass
class Bottleneck:
    """The link into the switch, shared by every worker of every job on the network.

    Datagrams leave it one after another at ``rate`` bytes per second; one that
    would make the bytes waiting more than ``queue_bytes`` is dropped (tail drop),
    as in a switch port's buffer.  With ``refuse``, the queue is the senders' own (a
    host's queue toward its link, where the uplink is the bottleneck): a
    datagram that does not fit is refused instead (the sender's call hears
    ``send_refused``) and enters as soon as there is room, as a sender does that
    waits while the kernel answers ENOBUFS.
    """
    rate: float
    queue_bytes: int
    refuse: bool = False

    def __post_init__(self):
        if not (0.0 < self.rate < math.inf and self.queue_bytes >= 0):
            raise ValueError(f"{self}: a rate above 0 and a queue of 0 bytes or more")


class StalledSimulation(RuntimeError):
    pass


#: Timer events at one virtual instant, in a row, past which a worker's timer is
#: taken to be stuck (fired, and due again at once: a broken engine), not busy.
MAX_EVENTS_AT_ONE_INSTANT = 10_000
#: The slack of the bottleneck's queue test: its backlog is a sum of floats, and
#: a queue of q packets kept q - 1 where rounding put a hair over the bound.
QUEUE_SLACK_BYTES = 1e-6


class Network:
    """The virtual clock and the datagrams in flight, shared by the jobs simulated on it."""

    def __init__(self, faults: Faults | None = None, seed: int = 0,
                 bottleneck: Bottleneck | None = None):
        self.faults = faults or Faults()
        self.bottleneck = bottleneck
        self.rng = random.Random(seed)
        self.now = 0.0
        self._order = 0
        self._queue: list = []
        self._link_free_at = 0.0  # when the bottleneck has sent all it holds
        self.timers_at_this_instant = 0  # next_event's: timer events at ``now`` in a row
        self.datagrams = 0
        self.bottleneck_drops = 0
        #: (time it left the bottleneck, sender, bytes) of each datagram that crossed it.
        self.departures: list[tuple[float, object, int]] = []

    def send(self, data, src, dst, faults: Faults | None = None,
             through_bottleneck: bool | None = None) -> bool:
        """Put a copy of ``data`` on the wire, subject to the faults (the network's, or
        ``faults`` for this link) and the bottleneck, which what goes to the switch
        crosses (or what ``through_bottleneck`` says).  Returns whether a refusing
        bottleneck refused it at first (it waited for room)."""
        f = faults or self.faults
        refused = False
        if f.loss and self.rng.random() < f.loss:
            return refused
        data = bytes(data)
        copies = 2 if f.duplicate and self.rng.random() < f.duplicate else 1
        for _ in range(copies):
            departure = self.now
            shaped = dst == SWITCH if through_bottleneck is None else through_bottleneck
            if shaped and self.bottleneck is not None:
                link = self.bottleneck
                start = max(self.now, self._link_free_at)
                if ((start - self.now) * link.rate + len(data)
                        > link.queue_bytes + QUEUE_SLACK_BYTES):
                    if not link.refuse:
                        self.bottleneck_drops += 1
                        continue
                    refused = True  # it waits for room, then leaves in its turn
                departure = self._link_free_at = start + len(data) / link.rate
                self.departures.append((departure, src, len(data)))
            delay = f.latency + (self.rng.random() * f.jitter if f.jitter else 0.0)
            self._order += 1
            heapq.heappush(self._queue, (departure + delay, self._order, src, dst, data))
            self.datagrams += 1
        return refused

    def bottleneck_bytes(self, senders, t0: float, t1: float) -> int:
        """Bytes of ``senders``' datagrams that left the bottleneck between t0 and t1."""
        return sum(n for t, src, n in self.departures if t0 <= t < t1 and src in senders)

    def next_arrival(self) -> float:
        return self._queue[0][0] if self._queue else float("inf")

    def pop(self):
        """Advance the clock to the next arrival; return (src, dst, data)."""
        self.now, _, src, dst, data = heapq.heappop(self._queue)
        return src, dst, data


class CallDriver:
    """Whole allreduces of one job's workers on a virtual clock: what a job needs
    from its simulation is ``network``, ``memberships``, ``addresses`` (each rank's
    data address), ``compiled``, ``_send`` and ``step``."""

    network: Network
    #: Where this job's workers send: its switch's address on the network.
    switch_address: tuple = SWITCH
    memberships: list
    addresses: list
    compiled: bool
    ops: list
    call_ops: list

    @property
    def now(self) -> float:
        return self.network.now

    @property
    def datagrams(self) -> int:
        return self.network.datagrams

    def _send(self, data, src, dst) -> bool:
        """Put ``data`` on the network; whether the sender's own queue refused it."""
        raise NotImplementedError

    def _send_all(self, op, addr) -> None:
        """What ``op`` (the call of the rank at ``addr``) has to send, to the switch;
        a datagram its host's queue refused, ``op`` hears of."""
        for d in op.datagrams_to_send():
            if self._send(d, addr, self.switch_address):
                op.send_refused(self.now)

    def step(self, give_up: float = float("inf"), max_time: float = float("inf")) -> None:
        raise NotImplementedError

    def begin(self, arrays: list[np.ndarray], sparse: bool = False,
              wire_bits: int = 32) -> list[np.ndarray]:
        """Start an allreduce of ``arrays[r]`` on every rank r; return the outputs."""
        outs = [np.zeros_like(a) for a in arrays]  # zeros: chunks left unwritten are 0
        extra: dict = {"compiled": True} if self.compiled else {}
        if wire_bits != 32:
            extra["wire_bits"] = wire_bits
        self.ops = [s.allreduce(a, o, self.now, sparse, **extra)
                    for s, a, o in zip(self.memberships, arrays, outs)]
        for addr, op in zip(self.addresses, self.ops):
            self._send_all(op, addr)
        return outs

    @property
    def finished(self) -> bool:
        return all(op.done for op in self.ops)

    def allreduce(self, arrays: list[np.ndarray], max_time: float = 600.0,
                  sparse: bool = False, wire_bits: int = 32) -> list[np.ndarray]:
        """Run one allreduce of ``arrays[r]`` on every rank r; return each rank's result.

        Raises StalledSimulation when it takes more than ``max_time`` virtual seconds.
        """
        outs = self._run_call(arrays, max_time, sparse, wire_bits, main=True)
        self.follow_up(arrays, outs, max_time, wire_bits)
        return outs

    def follow_up(self, arrays, outs, max_time: float = 600.0, wire_bits: int = 32) -> None:
        """After the call of ``arrays`` into ``outs``: the exchange of its chunks that
        held an inf or a NaN, if any (nonfinite.py)."""
        ops = self.call_ops
        chunks = getattr(ops[0], "nonfinite_chunks", None) if ops else None
        # The follow-up exchange, as Worker._run runs it.  Ranks disagree on the
        # flagged chunks only after a forged result; they are left as they are then.
        if chunks and all(op.nonfinite_chunks == chunks for op in ops):
            index = nonfinite.positions(chunks, ops[0].chunk_values, arrays[0].size)
            parts = [nonfinite.split(a.reshape(-1), index) for a in arrays]
            value_sums = self._run_call([v for v, _ in parts], max_time, False, wire_bits)
            code_sums = self._run_call([c for _, c in parts], max_time, False, 32)
            for out, v, c in zip(outs, value_sums, code_sums):
                nonfinite.apply(out.reshape(-1), index, v, c)

    def _run_call(self, arrays, max_time, sparse, wire_bits, main=False) -> list[np.ndarray]:
        give_up = self.now + max_time
        outs = self.begin(arrays, sparse, wire_bits)
        if main:
            self.call_ops = self.ops  # the call's own, not its follow-ups
        while not self.finished:
            self.step(give_up, max_time)
        return outs


class Simulation(CallDriver):
    """n workers of one job and a switch pipeline, driven by a virtual clock.

    Several jobs share one switch and one network when built with the same
    ``pipeline`` and ``network``; ``run_concurrently`` drives them together.
    """

    def __init__(self, world_size: int, *, slots: int = 8, packet_elements: int | None = None,
                 faults: Faults | None = None, seed: int = 0, pipeline: Pipeline | None = None,
                 session: int = 0x5EED, slot_base: int | None = None,
                 progress_timeout: float = 60.0, block_elements: int | None = None,
                 bottleneck: Bottleneck | None = None, network: Network | None = None,
                 compiled: bool = False, addresses: list | None = None,
                 switch_address: tuple = SWITCH, data_threads: int = 1):
        """``packet_elements`` and ``block_elements`` are the job's packet size: with a
        given ``pipeline`` they may be smaller than its own (its defaults when None);
        without one, the pipeline built here has that size (64 values by default).
        ``addresses``: the workers' data addresses, by rank (names by default);
        ``switch_address``: the switch's, for several switches on one network;
        ``data_threads``: the switch's data threads the workers are told of
        (``protocol.Ready.data_threads``)."""
        self.switch_address = switch_address
        if network is not None and (faults is not None or bottleneck is not None or seed):
            # (they were ignored: the network's own hold)
            raise ValueError("faults, bottleneck and seed are the network's: give them to "
                             "Network(...), not beside network=")
        self.network = network or Network(faults, seed, bottleneck)
        if self.network.bottleneck is not None and switch_address != SWITCH:
            # (its traffic went around the bottleneck, unsaid)
            raise ValueError(f"the bottleneck is the link into the switch at {SWITCH}: a job "
                             f"on {switch_address} would not cross it")
        self.faults = self.network.faults
        if pipeline is None:
            pipeline = Pipeline(slots=slots, packet_elements=packet_elements or 64,
                                block_elements=block_elements)
            packet_elements, block_elements = pipeline.packet_elements, pipeline.block_elements
        self.pipeline = pipeline
        addrs = addresses or [("worker", r, session) for r in range(world_size)]
        self.rank_of = {addr: rank for rank, addr in enumerate(addrs)}
        self.addresses = list(addrs)
        base = self.pipeline.allocate(slots) if slot_base is None else slot_base
        tokens = [rank_token(session, r) for r in range(world_size)]
        self.job = self.pipeline.install_job(f"sim-{session}", session, addrs, base, slots,
                                             packet_elements, block_elements, tokens)
        self.memberships = [Membership(session=session, token=tokens[r], rank=r,
                                       world_size=world_size,
                                       slot_base=base, slot_count=slots,
                                       packet_elements=self.job.packet_elements,
                                       block_elements=self.job.block_elements,
                                       progress_timeout=progress_timeout,
                                       data_threads=data_threads)
                            for r in range(world_size)]
        self.ops: list = []
        self.call_ops: list = []
        self.compiled = compiled  # calls on the C engine (worker/engine/compiled.py)

    def _send(self, data, src, dst) -> bool:
        return self.network.send(data, src, dst)

    def step(self, give_up: float = float("inf"), max_time: float = float("inf")) -> None:
        """Deliver the next datagram or fire the next timers of the call running."""
        _step([self], give_up, max_time)


def next_event(network: Network, ops: list, give_up: float, max_time: float):
    """The next arrival, (src, dst, data), or None where the calls' timers come
    first: the clock is then at them."""
    timers = [t for t in (op.get_timer() for op in ops) if t is not None]
    next_timer = min(timers, default=float("inf"))
    next_packet = network.next_arrival()
    if min(next_timer, next_packet) == math.inf:
        raise StalledSimulation(f"nothing scheduled at t={network.now:.6f}: no datagram "
                                f"in flight and no timer set, the calls unfinished")
    if min(next_timer, next_packet) > give_up:
        raise StalledSimulation(f"not finished after {max_time} virtual seconds")
    if next_packet <= next_timer:
        network.timers_at_this_instant = 0
        return network.pop()
    if next_timer <= network.now:  # due now again, right after they fired
        network.timers_at_this_instant += 1
        if network.timers_at_this_instant > MAX_EVENTS_AT_ONE_INSTANT:
            raise StalledSimulation(
                f"a timer fired {MAX_EVENTS_AT_ONE_INSTANT} times at t={network.now:.6f} "
                f"and is due again: it does not move on (the engine's handle_timer)")
    else:
        network.timers_at_this_instant = 0
        network.now = next_timer
    return None


def _step(sims: list[Simulation], give_up: float, max_time: float, flows=()) -> None:
    """Deliver the next datagram or fire the next timers, whichever comes first.
    ``flows``: competitors beside the jobs (``tcp.TcpLikeFlow``)."""
    network = sims[0].network
    for sim in sims:
        if any(op.error for op in sim.ops):
            raise StalledSimulation(f"a worker stalled at t={network.now:.3f}")
    arrival = next_event(network, [op for sim in sims for op in sim.ops] + list(flows),
                         give_up, max_time)
    if arrival is not None:
        src, dst, data = arrival
        flow = next((f for f in flows if dst in f.addresses), None)
        if flow is not None:
            flow.receive(dst, data, network.now)
            return
        switch = next((sim for sim in sims if sim.switch_address == dst), None)
        if switch is not None:
            for out, addr in switch.pipeline.receive_datagram(data, src):
                (_owner(sims, addr) or switch)._send(out, dst, addr)
        else:
            owner = _owner(sims, dst)
            if owner is None or not owner.ops:
                return  # a job between calls: a late datagram, dropped
            op = owner.ops[owner.rank_of[dst]]
            op.receive_datagram(data, network.now)
            owner._send_all(op, dst)
    else:
        for sim in sims:
            for addr, op in zip(sim.job.members, sim.ops):
                op.handle_timer(network.now)
                sim._send_all(op, addr)
        for flow in flows:
            flow.handle_timer(network.now)


def _owner(sims: list[Simulation], addr) -> Simulation | None:
    for sim in sims:
        if addr in sim.rank_of:
            return sim
    return None


def run_concurrently(sims: list[Simulation], arrays: list[list[np.ndarray]], until: float,
                     start_at: list[float] | None = None,
                     max_time: float = 600.0, flows=()) -> list[list[float]]:
    """Run allreduces back to back on every job (sharing a network) until ``until``.

    Job i starts at ``start_at[i]`` (default 0) and sums ``arrays[i]`` again as soon
    as its previous call finished; returns, per job, the virtual times at which
    its calls finished.  ``flows`` (``tcp.TcpLikeFlow``) start at once and run
    beside them.
    """
    for flow in flows:
        flow.start(sims[0].network.now)
    start_at = start_at or [0.0] * len(sims)
    finished: list[list[float]] = [[] for _ in sims]
    started = [False] * len(sims)
    network = sims[0].network
    give_up = network.now + max_time
    while network.now < until:
        for i, sim in enumerate(sims):
            if not started[i] and network.now >= start_at[i]:
                started[i] = True
                sim.begin(arrays[i])
        running = [sim for i, sim in enumerate(sims) if started[i]]
        # Wake up for a job's start even when nothing else is due before it.
        pending_start = min((t for i, t in enumerate(start_at) if not started[i]),
                            default=float("inf"))
        if pending_start < network.next_arrival() and pending_start < min(
                (t for op in [op for sim in running for op in sim.ops] + list(flows)
                 if (t := op.get_timer()) is not None), default=float("inf")):
            network.now = pending_start
            continue
        _step(running or sims[:1], give_up, max_time, flows)
        for i, sim in enumerate(sims):
            if started[i] and sim.finished:
                finished[i].append(network.now)
                sim.begin(arrays[i])
    return finished


class StripedSimulation:
    """One job over K switches on one network, as ``worker/multi.py`` runs it with
    sockets: each call cut at chunk boundaries into K parts (``part_bounds``), part
    k summed on switch k, all parts at once; then each part's follow-up exchange
    of chunks with an inf or a NaN, on its switch.  ``parts[k]`` is the
    ``Simulation`` of switch k (its pipeline, its workers' memberships)."""

    def __init__(self, world_size: int, switches: int, *, slots: int = 8,
                 packet_elements: int = 64, block_elements: int | None = None,
                 faults: Faults | None = None, seed: int = 0, compiled: bool = False):
        self.network = Network(faults, seed)
        self.parts = [Simulation(world_size, slots=slots, packet_elements=packet_elements,
                                 block_elements=block_elements, network=self.network,
                                 session=0x5EED + k, compiled=compiled,
                                 switch_address=("switch", k),
                                 addresses=[("worker", r, k) for r in range(world_size)])
                      for k in range(switches)]

    def allreduce(self, arrays: list[np.ndarray], max_time: float = 600.0,
                  sparse: bool = False, wire_bits: int = 32) -> list[np.ndarray]:
        """Every rank's result: bit for bit what one switch gives."""
        unit = self.parts[0].job.packet_elements * (2 if wire_bits == 16 else 1)
        outs = [np.zeros_like(a) for a in arrays]
        flat = [a.reshape(-1) for a in arrays]
        running = []
        for sim, (start, stop) in zip(self.parts, part_bounds(arrays[0].size, unit,
                                                              len(self.parts))):
            if stop > start:
                part = [a[start:stop] for a in flat]
                running.append((sim, start, stop, part, sim.begin(part, sparse, wire_bits)))
                sim.call_ops = sim.ops
        give_up = self.network.now + max_time
        sims = [sim for sim, *_ in running]
        while not all(sim.finished for sim in sims):
            _step(sims, give_up, max_time)
        for sim, start, stop, part, part_outs in running:
            sim.follow_up(part, part_outs, max_time, wire_bits)
            for out, part_out in zip(outs, part_outs):
                out.reshape(-1)[start:stop] = part_out
        return outs
