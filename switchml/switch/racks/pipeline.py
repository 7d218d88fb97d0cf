"""A rack switch's data plane, sans-IO: the first of two levels of aggregation.

A rack switch adds its own hosts' contributions for a slot as any switch does
(``pipeline.py``), but a job with an ``Uplink`` does not send the complete set
to its workers: the set is the rack's *partial sum*, sent up to the spine
switch as one contribution of the spine's job (where the rack is one member of
R).  The spine is an ordinary switch; its result comes back down, becomes the
set's result and goes to every worker of the rack (docs/protocol.md, "Two
levels: racks under a spine").

Per slot and set, one more register: the message number whose spine result
the set holds.  A set complete at the rack without it keeps the partial (the
shadow copy) until the spine answers.  No timer: loss recovery is driven by
the workers' retransmissions, as in SwitchML's multi-rack design.  A worker's
retransmission for a complete set

* without the spine's result makes the rack send its partial up again (the
  spine answers a partial it already has with its result, to this rack alone);
* with it, is answered to that worker alone, as on a flat switch.

The exponent max and the int32 wrap-around add are associative, and workers
quantise with the job's global world size, so two levels give bit for bit what
one flat switch gives.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from ... import wire
from ..dataplane.pipeline import Job, Pipeline

__all__ = ["RackPipeline", "Uplink"]


@dataclass(frozen=True)
class Uplink:
    """Where a rack job's partial sums go: its membership of the spine's job.

    ``source`` is the rack's own data address in the spine's job; the spine knows
    a member by its source address and an address belongs to one job, so each
    job of a rack has its own (one UDP socket per job, as a worker has).  A
    datagram the rack returns for an ``Uplink`` goes from ``source`` to ``spine``.
    """

    spine: tuple        # the spine switch's data address
    source: tuple       # this rack's data address in the spine's job
    session: int        # the spine job's session
    slot_base: int      # the spine job's first slot (its window is the rack job's)
    member: int = 0     # this rack's rank in the spine's job, for errors and stats
    token: int = 0      # what its partials carry as session (``Ready.token``; 0: session)

    @property
    def sender_token(self) -> int:
        return self.token or self.session


class RackPipeline(Pipeline):
    """A ``Pipeline`` whose jobs may be one level of a two-level job (``Uplink``).

    ``receive_datagram`` takes the spine's results too (from an uplink's spine
    address); what it returns is (datagram, worker address) as a flat switch's,
    or (datagram, ``Uplink``) for a partial sum going up.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # Per slot and set: the message number whose spine result the set holds.
        self._result_of: list[list[int | None]] = [[None] * self.slots for _ in range(2)]
        self.uplinks: dict[int, Uplink] = {}        # local session -> its uplink
        self._up_jobs: dict[tuple, Job] = {}         # (spine address, spine session) -> job
        self._spines: Counter = Counter()            # spine addresses of the jobs installed

    # ------------------------------------------------------------------ control
    def install_job(self, name: str, session: int, members: list, slot_base: int,
                    slot_count: int, packet_elements: int | None = None,
                    block_elements: int | None = None, tokens: list | None = None,
                    uplink: Uplink | None = None) -> Job:
        """``Pipeline.install_job``; with ``uplink``, the job's complete sets go up
        to the spine's job, whose window (``slot_count``) is the same."""
        if uplink is not None:
            if (uplink.spine, uplink.session) in self._up_jobs:
                raise ValueError(f"spine session {uplink.session} at {uplink.spine} already "
                                 f"belongs to a job of this rack")
            if uplink.spine in self._members or uplink.source in self._members:
                raise ValueError(f"the uplink's addresses {uplink.spine} and {uplink.source} "
                                 f"must not be a worker's")
            if uplink.source in (u.source for u in self.uplinks.values()):
                raise ValueError(f"uplink address {uplink.source} already belongs to a job "
                                 f"(the spine knows a job's rack by it: one per job)")
        job = super().install_job(name, session, members, slot_base, slot_count,
                                  packet_elements, block_elements, tokens)
        for s in range(slot_base, slot_base + slot_count):
            self._result_of[0][s] = self._result_of[1][s] = None
        if uplink is not None:
            self.uplinks[session] = uplink
            self._up_jobs[uplink.spine, uplink.session] = job
            self._spines[uplink.spine] += 1
        return job

    def remove_job(self, session: int, state: str = "ended") -> Job | None:
        uplink = self.uplinks.pop(session, None)
        if uplink is not None:
            del self._up_jobs[uplink.spine, uplink.session]
            self._spines[uplink.spine] -= 1
            if not self._spines[uplink.spine]:
                del self._spines[uplink.spine]
        return super().remove_job(session, state)

    def stats(self) -> dict:
        out = super().stats()
        for job in self.jobs.values():
            uplink = self.uplinks.get(job.session)
            if uplink is not None:
                out["jobs"][self.stats_key(job)]["uplink"] = {
                    "spine": list(uplink.spine), "source": list(uplink.source),
                    "session": uplink.session, "slot_base": uplink.slot_base,
                    "member": uplink.member}
        return out

    # ------------------------------------------------------------------ data
    def receive_datagram(self, data, addr) -> list:
        if addr in self._spines:
            if self.ingress_drop_rate and self._rng.random() < self.ingress_drop_rate:
                self.counters["dropped_ingress_simulated"] += 1
                return []
            return self._from_spine(data, addr)
        return super().receive_datagram(data, addr)

    def _complete(self, job: Job, v: int, slot: int) -> list:
        uplink = self.uplinks.get(job.session)
        if uplink is None:
            return super()._complete(job, v, slot)
        job.counters["partials_up"] += 1
        return self._send_up(job, uplink, v, slot)

    def _answer_retransmission(self, job: Job, v: int, slot: int, rank: int) -> list:
        uplink = self.uplinks.get(job.session)
        if uplink is None or self._result_of[v][slot] == self._msg[v][slot]:
            return super()._answer_retransmission(job, v, slot, rank)
        # The worker has waited for the result in vain: the partial or the spine's
        # result was lost on the uplink.  Only the spine can answer; ask it again.
        job.counters["upstream_resent"] += 1
        return self._send_up(job, uplink, v, slot)

    def _answer_query(self, job: Job, v: int, slot: int, rank: int, data) -> list:
        uplink = self.uplinks.get(job.session)
        if uplink is None or self._result_of[v][slot] == self._msg[v][slot]:
            return super()._answer_query(job, v, slot, rank, data)
        return self._answer_retransmission(job, v, slot, rank)  # no result yet: ask the spine

    def _send_up(self, job: Job, uplink: Uplink, v: int, slot: int) -> list:
        """The set's row as a contribution to the spine's slot: its header rewritten
        in place (the lane registers and values follow it already)."""
        seq, pkt_id, dtype, mode, count, call = self._ids[v][slot]
        wire.encode_header(self._rows[v, slot], wire.KIND_CONTRIBUTION, dtype, mode,
                           uplink.slot_base + slot - job.slot_base, uplink.sender_token,
                           self._msg[v][slot], seq, pkt_id, count, job.lanes, call=call)
        if self.egress_drop_rate and self._rng.random() < self.egress_drop_rate:
            job.counters["dropped_egress_simulated"] += 1
            return []
        job.counters["bytes_up"] += wire.packet_size(job.lanes, count)
        return [(self._rows[v, slot, : wire.packet_size(job.lanes, count)].data, uplink)]

    def _from_spine(self, data, addr) -> list:
        """The spine's result for one of this rack's partials: the set's result, to
        every worker of the rack.  Anything else is dropped and counted."""
        try:
            h = wire.decode_header(data)
        except wire.MalformedPacket as exc:
            self.counters["dropped_upstream_" + exc.reason] += 1
            return []
        job = self._up_jobs.get((addr, h.session))
        if job is None:
            self.counters["dropped_upstream_unknown_session"] += 1
            return []
        counters = job.counters
        j = h.slot - self.uplinks[job.session].slot_base
        if h.kind != wire.KIND_RESULT or not 0 <= j < job.slot_count:
            counters["dropped_upstream_foreign"] += 1
            return []
        if h.lanes != job.lanes or h.count > job.packet_elements:
            counters["dropped_upstream_bad_size"] += 1
            return []
        slot = job.slot_base + j
        v = h.msg & 1
        if not (self._valid[v][slot] and self._msg[v][slot] == h.msg
                and self._count[v][slot] == job.world_size):
            counters["dropped_upstream_stale"] += 1  # the set moved on, or never sent it
            return []
        if self._result_of[v][slot] == h.msg:
            counters["upstream_duplicates"] += 1
            return []
        seq, pkt_id, dtype, mode, _, call = self._ids[v][slot]
        if (h.seq, h.pkt_id, h.dtype, h.mode, h.call) != (seq, pkt_id, dtype, mode, call):
            counters["dropped_upstream_mismatch"] += 1
            return []
        counters["results_from_spine"] += 1
        job.lane_regs[v, slot] = wire.lane_table(data, h.lanes)
        job.values[v, slot, : h.count] = wire.values(data, h.lanes, h.count)
        self._ids[v][slot] = (seq, pkt_id, dtype, mode, h.count, call)
        self._result_of[v][slot] = h.msg
        return super()._complete(job, v, slot)
