"""Two levels of aggregation in the deterministic simulator: racks under a spine.

R rack switches (``switch/racks/pipeline.py``'s ``RackPipeline``) each aggregate the ranks
placed on them and send one partial sum per slot up to a spine switch (an
ordinary ``Pipeline``, where each rack is one member of the job); the spine's
results come back down through the racks.  The workers' engines, the pipelines
and the seeded network (loss, duplication, reordering) are those of ``sim/network.py``:
a worker's datagram goes to its rack, a rack's partial to the spine from the
rack's per-job uplink address.  ``uplink_faults`` gives the rack–spine links
faults of their own (by default every link has the network's).

Several jobs share the racks and the spine (``run_together``).  A rack can be
killed (``Fabric.kill``): it drops everything from then on, as a dead process
would.  A call that stalls raises ``StalledSimulation``, or ``RackFailure``
naming the rack switch or the ranks that hold it up, found as a worker's status
query finds them: its own rack's contributor bitmap, then the spine's.
"""

from __future__ import annotations

import numpy as np

from ..switch.dataplane.pipeline import Pipeline
from ..switch.racks.pipeline import RackPipeline, Uplink
from ..worker.engine.dense import Membership
from .network import SWITCH, CallDriver, Faults, Network, StalledSimulation, next_event, rank_token

__all__ = ["Fabric", "RackedJob", "RackFailure", "run_together", "SPINE"]

SPINE = ("spine", 0)


class RackFailure(StalledSimulation):
    """A stalled two-level call, with who holds it up: ``racks`` (rack indices in the
    fabric) whose partial sums the spine lacks or whose switch is dead, and
    ``ranks`` (the job's ranks behind them, or missing at their rack)."""

    def __init__(self, message: str, racks: list[int], ranks: list[int]):
        super().__init__(message)
        self.racks = racks
        self.ranks = ranks


class Fabric:
    """R rack switches under one spine switch, on one seeded network."""

    def __init__(self, racks: int, *, slots: int = 64, packet_elements: int = 64,
                 block_elements: int | None = None, faults: Faults | None = None,
                 uplink_faults: Faults | None = None, seed: int = 0):
        if racks < 1:
            raise ValueError(f"a fabric has at least one rack, got {racks}")
        self.network = Network(faults, seed)
        self.uplink_faults = uplink_faults
        self.racks = [RackPipeline(slots, packet_elements, block_elements=block_elements)
                      for _ in range(racks)]
        self.spine = Pipeline(slots, packet_elements, block_elements=block_elements)
        self.rack_addresses = [("rack", r) for r in range(racks)]
        self.dead: set[int] = set()
        self._rack_at: dict = {addr: r for r, addr in enumerate(self.rack_addresses)}
        self._worker_at: dict = {}  # worker address -> (job, rank)

    def kill(self, rack: int) -> None:
        """Rack ``rack``'s switch dies: from now on it takes and sends nothing."""
        self.dead.add(rack)

    def _send(self, data, src, dst) -> bool:
        uplink = SPINE in (src, dst)
        return self.network.send(data, src, dst, self.uplink_faults if uplink else None)

    def deliver(self, src, dst, data) -> None:
        """One datagram arrives at ``dst``: the spine, a rack or a worker."""
        now = self.network.now
        if dst == SPINE:
            for out, to in self.spine.receive_datagram(data, src):
                self._send(out, SPINE, to)
            return
        rack = self._rack_at.get(dst)
        if rack is not None:
            if rack in self.dead:
                return
            for out, to in self.racks[rack].receive_datagram(data, src):
                if isinstance(to, Uplink):
                    self._send(out, to.source, to.spine)
                else:
                    self._send(out, self.rack_addresses[rack], to)
            return
        job, rank = self._worker_at.get(dst, (None, 0))
        if job is None or not job.ops:
            return  # a job between calls: a late datagram, dropped
        op = job.ops[rank]
        op.receive_datagram(data, now)
        for d in op.datagrams_to_send():
            job._send(d, dst, SWITCH)


class RackedJob(CallDriver):
    """One job whose ranks sit on the fabric's racks (``placement[rank]``): each rack
    with ranks of the job installs it with an ``Uplink`` to the spine's job, in
    which the racks are members in the order of their lowest rank."""

    def __init__(self, fabric: Fabric, placement: list[int], *, slots: int = 8,
                 session: int = 0x5EED, spine_session: int | None = None,
                 progress_timeout: float = 60.0, compiled: bool = False,
                 packet_elements: int | None = None, block_elements: int | None = None):
        world = len(placement)
        if not world or not all(0 <= r < len(fabric.racks) for r in placement):
            raise ValueError(f"placement {placement} must name racks 0..{len(fabric.racks) - 1}")
        self.fabric = fabric
        self.network = fabric.network
        self.name = f"racked-{session}"
        self.placement = list(placement)
        self.addresses = [("worker", g, session) for g in range(world)]
        # The spine's members: the racks in order of their lowest rank.
        self.racks = sorted(set(placement), key=placement.index)
        self.ranks_behind = {r: [g for g in range(world) if placement[g] == r]
                             for r in self.racks}
        spine = fabric.spine
        spine_session = session ^ 0x5A5A5A5A if spine_session is None else spine_session
        sources = [("uplink", r, session) for r in self.racks]
        spine_base = spine.allocate(slots)
        spine_tokens = [rank_token(spine_session, m) for m in range(len(sources))]
        self.spine_job = spine.install_job(f"spine-{session}", spine_session, sources,
                                           spine_base, slots, packet_elements, block_elements,
                                           spine_tokens)
        self.rack_jobs = {}
        for member, (r, source) in enumerate(zip(self.racks, sources)):
            rack = fabric.racks[r]
            uplink = Uplink(SPINE, source, spine_session, spine_base, member,
                            spine_tokens[member])
            self.rack_jobs[r] = rack.install_job(
                self.name, session, [self.addresses[g] for g in self.ranks_behind[r]],
                rack.allocate(slots), slots, self.spine_job.packet_elements,
                self.spine_job.block_elements, [rank_token(session, g)
                                                for g in self.ranks_behind[r]],
                uplink=uplink)
            fabric._rack_at[source] = r
        for g, addr in enumerate(self.addresses):
            fabric._worker_at[addr] = (self, g)
        self._rack_address = {addr: fabric.rack_addresses[r]
                              for addr, r in zip(self.addresses, placement)}
        # Workers quantise with the global world size: the spine's sum must fit.
        self.memberships = [Membership(session=session, token=rank_token(session, g), rank=g,
                                       world_size=world,
                                       slot_base=self.rack_jobs[placement[g]].slot_base,
                                       slot_count=slots,
                                       packet_elements=self.spine_job.packet_elements,
                                       block_elements=self.spine_job.block_elements,
                                       progress_timeout=progress_timeout)
                            for g in range(world)]
        self.ops: list = []
        self.call_ops: list = []
        self.compiled = compiled

    def _send(self, data, src, dst) -> bool:
        if dst == SWITCH:  # a worker's switch is its rack's
            dst = self._rack_address[src]
        return self.fabric._send(data, src, dst)

    def step(self, give_up: float = float("inf"), max_time: float = float("inf")) -> None:
        _step([self], give_up, max_time)

    def diagnose(self) -> StalledSimulation:
        """Why the call stalled, as the first rank that gave up finds it."""
        for g, op in enumerate(self.ops):
            if op.error:
                return self.why_stalled(g)
        return StalledSimulation(f"job '{self.name}': no rank stalled")

    def why_stalled(self, g: int) -> StalledSimulation:
        """Why rank ``g``'s call makes no progress, found as its status query would:
        its rack switch is dead, racks' partial sums are missing at the spine, or
        ranks of its rack did not contribute.  Those missing from every stalled
        slot are named (a rank or rack merely slow misses only some), else those
        missing from any."""
        fabric = self.fabric
        r = self.placement[g]
        if r in fabric.dead:
            return RackFailure(f"job '{self.name}': rank {g} lost its switch, rack {r} at "
                               f"{fabric.rack_addresses[r]}", [r], self.ranks_behind[r])
        job, local = self.rack_jobs[r], self.ranks_behind[r]
        ranks_missing, racks_missing = [], []
        for slot, msg in self.ops[g].pending():
            _, bitmap = fabric.racks[r].slot_state(slot, msg)
            missing = {local[i] for i in range(len(local)) if not bitmap >> i & 1}
            if missing:
                ranks_missing.append(missing)
                continue
            spine_slot = self.spine_job.slot_base + slot - job.slot_base
            _, bitmap = fabric.spine.slot_state(spine_slot, msg)
            racks = {rack for i, rack in enumerate(self.racks) if not bitmap >> i & 1}
            if racks:
                racks_missing.append(racks)
        if racks_missing:
            culprits = sorted(set.intersection(*racks_missing) or set.union(*racks_missing))
            named = ", ".join(
                f"rack {rack} at {fabric.rack_addresses[rack]}"
                f"{' (dead)' if rack in fabric.dead else ''} with ranks "
                f"{self.ranks_behind[rack]}" for rack in culprits)
            return RackFailure(f"job '{self.name}': the spine has no partial sums from "
                               f"{named}", culprits,
                               sorted(h for rack in culprits for h in self.ranks_behind[rack]))
        if ranks_missing:
            ranks = sorted(set.intersection(*ranks_missing) or set.union(*ranks_missing))
            return RackFailure(f"job '{self.name}': ranks {ranks} did not contribute at "
                               f"rack {r}", [], ranks)
        return StalledSimulation(f"job '{self.name}': rank {g} stalled at "
                                 f"t={self.network.now:.3f}")


def _step(jobs: list[RackedJob], give_up: float, max_time: float) -> None:
    """Deliver the next datagram or fire the next timers, whichever comes first."""
    network = jobs[0].network
    for job in jobs:
        if any(op.error for op in job.ops):
            raise job.diagnose()
    arrival = next_event(network, [op for job in jobs for op in job.ops], give_up, max_time)
    if arrival is not None:
        jobs[0].fabric.deliver(*arrival)
    else:
        for job in jobs:
            for addr, op in zip(job.addresses, job.ops):
                op.handle_timer(network.now)
                for d in op.datagrams_to_send():
                    job._send(d, addr, SWITCH)


def run_together(jobs: list[RackedJob], arrays: list[list[np.ndarray]],
                 max_time: float = 600.0) -> list[list[np.ndarray]]:
    """One allreduce on every job at once (sharing the racks, the spine and the
    network); each job's results.  (Dense calls: no follow-up exchange.)"""
    network = jobs[0].network
    give_up = network.now + max_time
    outs = [job.begin(a) for job, a in zip(jobs, arrays)]
    while not all(job.finished for job in jobs):
        _step(jobs, give_up, max_time)
    return outs
