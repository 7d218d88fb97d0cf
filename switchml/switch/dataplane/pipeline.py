"""The switch's data plane, sans-IO: datagrams in, datagrams out.

It keeps to what switch hardware can do.  All state is allocated when it is
built: a pool of slots, two sets per slot (the shadow copy), and per slot and set
the values, a 12-byte register per lane (block), a worker bitmap, a contribution
counter, the message number it aggregates and the ids it echoes in results.
Values are added as 32-bit integers with wrap-around.  Nothing grows with tensor
size or job length.

A datagram is admitted from a member's address only when its header's
``session`` field holds that member's token (``Job.tokens``: each rank's own,
from its join), so no member passes for another and a spoofed source address
without the token changes nothing (``dropped_bad_token``).  Replies carry the
job's session.

Per slot and set ``v = msg & 1``, for a contribution from rank ``w``:

* a message newer than the one the set holds starts a fresh aggregation: its
  values overwrite the set (the shadow copy of two messages ago is no longer
  needed by anyone, because no worker can send message m+2 before every worker
  has received the result of message m);
* the same message from a rank not yet in the bitmap is added; the n-th
  contribution sends the result to every worker of the job;
* the same message from a rank already in the bitmap is a retransmission: if the
  set is complete its stored result goes back to that rank alone, otherwise it is
  dropped (counted as a duplicate).  Nothing is ever added twice;
* an older message is stale and dropped.

A probe (a retransmission as the header alone, ``wire.KIND_PROBE``: a worker's
tail probe, or its probe of a fast retransmission) asks the same question
without the values.  For a rank already in
the bitmap it is answered as a retransmission is (the stored result when the
set is complete, nothing while it waits for other ranks), for a rank not in it
(the set holds its message, or an older one, or none) with a resend
(``wire.KIND_RESEND``): the rank's contribution was lost, it sends it whole.  A
stale probe is dropped.  So a rank that times out because a peer's
contribution was lost sends 32 bytes (its query, below) into the congested
port, not a whole packet: whole copies from every rank the set already holds
would crowd the port that dropped the one contribution missing.

A query (``wire.KIND_QUERY``: a worker's timer retransmission) is a probe that a
complete set answers with a done (``wire.KIND_DONE``), the header alone, not the
result: the result left before the done on the same path, so a rank that gets
the done without the result lost it and sends its contribution whole, which is
answered with the stored result.  A timeout that was only late (a round trip
longer than the RTO, common where 16 ranks share two cores) then costs the
result's link 32 bytes, not a second copy of the result queued behind the
first on the link that delays it.  Each row keeps 32 bytes past the largest datagram for the
resend or done, as a switch builds a reply in its packet memory.

A contribution for the message a set holds whose ids (call number, packet,
dtype, mode, count and the header's ``call``: element count and sparseness)
differ from the set's is dropped, and, the first time in a job, recorded as a
``Mismatch``: the ranks disagree on what they call.  The controller then fails
the job with an error naming what each side asked for, at once, with no extra
exchange on the normal path (the switch compares what the packets carry).

Per lane, a contribution's exponent is maxed into the register; the values of
a ``MODE_MAX`` contribution (the sparse path's exponent rounds) are maxed, not
added, as a switch's register action can.  A sparse
contribution (OmniReduce) adds the blocks it flags into a zeroed set and keeps
per lane the least next position reported; its result carries the present
blocks only, compacted.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from ... import wire
from ...config import DEFAULT_BLOCK_ELEMENTS, DEFAULT_PACKET_ELEMENTS, DEFAULT_SLOTS

#: Most workers in one job: the contribution bitmap is 32 bits wide, as on Tofino.
MAX_WORKERS = 32
#: How many ended jobs keep their counters for ``stats()``.
ENDED_JOBS_KEPT = 16


@dataclass(frozen=True)
class Mismatch:
    """Ranks of a job that disagree on a call: ``ranks`` contributed ``first`` to the
    slot, ``rank`` sent ``other``; each is (call number, wire.call_id, dtype)."""

    ranks: tuple
    first: tuple
    rank: int
    other: tuple


class SlotPoolExhausted(Exception):
    """No contiguous range of free slots is large enough for a new job."""


@dataclass
class Job:
    """A job installed in the pipeline, as the controller's table entries would be."""

    name: str
    session: int
    world_size: int
    slot_base: int
    slot_count: int
    members: list  # data address of each rank, by rank
    #: Each rank's data-plane token: what its datagrams carry in the header's
    #: session field (``protocol.Ready.token``).  Results carry ``session``.
    tokens: list = field(default_factory=list)
    packet_elements: int = 0  # values per packet of this job (at most the pipeline's)
    block_elements: int = 0  # values per block (lane) of this job
    counters: Counter = field(default_factory=Counter)
    state: str = "running"  # then "ended" (every rank left) or "failed"
    # Views of the pipeline's slot rows laid out for this job's packet size:
    # (set, slot, lane) lane registers and (set, slot, value) values.
    # (install_job lays them out; empty until then)
    lane_regs: np.ndarray = field(default_factory=lambda: np.zeros((2, 0, 0), wire.LANE),
                                  repr=False)
    values: np.ndarray = field(default_factory=lambda: np.zeros((2, 0, 0), np.int32),
                               repr=False)
    lanes: int = field(init=False)  # blocks (lane records) per packet
    # The first disagreement between ranks seen, until the controller takes it.
    mismatch: Mismatch | None = None

    def __post_init__(self):
        self.lanes = self.packet_elements // self.block_elements if self.block_elements else 0

    def summary(self) -> dict:
        return {
            "session": self.session,
            "state": self.state,
            "world_size": self.world_size,
            "slot_base": self.slot_base,
            "slot_count": self.slot_count,
            "packet_elements": self.packet_elements,
            "block_elements": self.block_elements,
            "counters": dict(self.counters),
        }


class Pipeline:
    """Slot pool plus streaming aggregation; see the module docstring for the rules."""

    #: Whether workers may send runs of UDP GSO segments (``protocol.Ready.gso``): a
    #: socket's receive path cuts a run that reaches it whole into its datagrams.
    takes_gso_runs = True
    #: Threads that answer the slots, thread ``slot % data_threads`` each slot in
    #: the order its datagrams came (``protocol.Ready.data_threads``): one here.
    data_threads = 1

    def __init__(self, slots: int = DEFAULT_SLOTS, packet_elements: int = DEFAULT_PACKET_ELEMENTS,
                 *, block_elements: int | None = None, drop_rate: float = 0.0,
                 egress_drop_rate: float | None = None, seed: int | None = None):
        limit_blocks = block_elements or DEFAULT_BLOCK_ELEMENTS  # what a refusal names
        if block_elements is None:
            block_elements = DEFAULT_BLOCK_ELEMENTS
            if packet_elements % block_elements:
                block_elements = packet_elements  # one block (one exponent) per packet
        if not 1 <= slots <= 0xFFFF:
            raise ValueError(f"slots must be in 1..65535, got {slots}")
        if block_elements < 1 or packet_elements < 1 or packet_elements % block_elements:
            raise ValueError(f"packet_elements ({packet_elements}) must be a positive multiple "
                             f"of block_elements ({block_elements})")
        if packet_elements > wire.max_packet_elements(block_elements):
            raise ValueError(
                f"packet_elements {packet_elements} exceeds the limit of "
                f"{wire.max_packet_elements(limit_blocks)} elements per packet with "
                f"{limit_blocks}-value blocks (one UDP datagram)")
        self.slots = slots
        self.packet_elements = packet_elements
        self.block_elements = block_elements
        self.lanes = packet_elements // block_elements
        self.ingress_drop_rate = float(drop_rate)
        self.egress_drop_rate = float(drop_rate if egress_drop_rate is None else egress_drop_rate)
        self._rng = random.Random(seed)

        # Each row is a whole result datagram: header, lane table, values.  The row
        # holds the largest packet; a job with smaller packets lays its datagram out
        # from the row's start (its own lane count, then its values), see _job_views.
        self.datagram_size = wire.packet_size(self.lanes, packet_elements)
        self.row_size = self.datagram_size + wire.HEADER_SIZE  # and a resend's header
        self._rows = np.zeros((2, slots, self.row_size), dtype=np.uint8)
        # Per slot and set registers.  Python lists: scalar access is the hot path.
        self._valid = [[False] * slots for _ in range(2)]
        self._msg = [[0] * slots for _ in range(2)]
        self._bitmap = [[0] * slots for _ in range(2)]
        self._count = [[0] * slots for _ in range(2)]
        self._blocks = [[0] * slots for _ in range(2)]  # sparse blocks received this round
        # seq, pkt_id, dtype, mode, count, call
        self._ids = [[(0, 0, 0, 0, 0, 0)] * slots for _ in range(2)]
        self._mismatched: list[Job] = []  # jobs with a Mismatch not taken yet
        self._owner = [0] * slots  # session owning each slot, 0 = free

        self.jobs: dict[int, Job] = {}
        self.ended_jobs: dict[str, dict] = {}
        self._members: dict[tuple, tuple[Job, int]] = {}
        self.counters: Counter = Counter()  # drops not attributable to a job
        self.retired: Counter = Counter()  # counters of every removed job, summed

    # ------------------------------------------------------------------ control
    def free_slots(self) -> int:
        return self._owner.count(0)

    def allocate(self, count: int) -> int:
        """First-fit a contiguous range of ``count`` free slots; return its base."""
        if count < 1:
            raise ValueError(f"a job needs at least one slot, asked for {count}")
        run = 0
        for i, owner in enumerate(self._owner):
            run = run + 1 if owner == 0 else 0
            if run == count:
                return i - count + 1
        raise SlotPoolExhausted(
            f"no {count} contiguous free slots (pool {self.slots}, free {self.free_slots()})")

    def check_packet_size(self, packet_elements: int, block_elements: int) -> None:
        """Raise ValueError unless a job's packets of this size fit the slot rows."""
        if block_elements < 1 or packet_elements < 1 or packet_elements % block_elements:
            raise ValueError(f"a job's packet_elements ({packet_elements}) must be a positive "
                             f"multiple of its block_elements ({block_elements})")
        size = wire.packet_size(packet_elements // block_elements, packet_elements)
        if size > self.datagram_size:
            raise ValueError(
                f"packets of {packet_elements} elements in blocks of {block_elements} take "
                f"{size} bytes, more than the switch's slots hold ({self.datagram_size} bytes: "
                f"{self.packet_elements} elements in blocks of {self.block_elements})")

    def _job_views(self, job: Job) -> None:
        """Lane registers and values of every slot row, laid out for ``job``'s packets."""
        strides = (self.slots * self.row_size, self.row_size)
        job.lane_regs = np.ndarray((2, self.slots, job.lanes), wire.LANE, self._rows,
                                   wire.HEADER_SIZE, strides + (wire.LANE_SIZE,))
        job.values = np.ndarray((2, self.slots, job.packet_elements), np.int32, self._rows,
                                wire.HEADER_SIZE + wire.LANE_SIZE * job.lanes,
                                strides + (wire.VALUE_SIZE,))

    def install_job(self, name: str, session: int, members: list, slot_base: int,
                    slot_count: int, packet_elements: int | None = None,
                    block_elements: int | None = None, tokens: list | None = None) -> Job:
        """Admit data from ``members`` (rank -> address) on slots [base, base+count).

        The job's packets carry ``packet_elements`` values in blocks of
        ``block_elements`` (defaults: the pipeline's, its limit).  A rank's
        datagrams must carry its ``tokens`` entry (None: ``session`` for every
        rank; the controller gives each rank a random one).
        """
        tokens = [session] * len(members) if tokens is None else list(tokens)
        packet_elements = self.packet_elements if packet_elements is None else packet_elements
        block_elements = self.block_elements if block_elements is None else block_elements
        self.check_packet_size(packet_elements, block_elements)
        world = len(members)
        if not 1 <= world <= MAX_WORKERS:
            raise ValueError(f"a job has 1..{MAX_WORKERS} workers, got {world}")
        if slot_count < 1 or slot_base < 0 or slot_base + slot_count > self.slots:
            raise ValueError(f"slots {slot_base}..{slot_base + slot_count - 1} are not in the "
                             f"pool 0..{self.slots - 1}")
        if session in self.jobs or session == 0:
            raise ValueError(f"session {session} is taken or invalid")
        for s in range(slot_base, slot_base + slot_count):
            if self._owner[s] != 0:
                raise ValueError(f"slot {s} belongs to session {self._owner[s]}")
        for addr in members:
            if addr in self._members:
                raise ValueError(f"address {addr} already belongs to a job")
        if len(tokens) != world or not all(0 < t <= 0xFFFFFFFF for t in tokens):
            raise ValueError(f"a job needs a token in 1..2**32-1 per member, got {tokens}")
        job = Job(name, session, world, slot_base, slot_count, list(members), tokens,
                  packet_elements, block_elements)
        self._job_views(job)
        for s in range(slot_base, slot_base + slot_count):
            self._owner[s] = session
            for v in (0, 1):
                self._valid[v][s] = False
                self._bitmap[v][s] = 0
                self._count[v][s] = 0
        for rank, addr in enumerate(members):
            self._members[addr] = (job, rank)
        self.jobs[session] = job
        return job

    def remove_job(self, session: int, state: str = "ended") -> Job | None:
        """Free a job's slots and forget its addresses; keep its counters for stats.

        ``state`` ("ended" or "failed") is how the job finished, for ``stats()``.
        """
        job = self.jobs.pop(session, None)
        if job is None:
            return None
        job.state = state
        self.retired.update(job.counters)
        for s in range(job.slot_base, job.slot_base + job.slot_count):
            self._owner[s] = 0
        for addr in job.members:
            self._members.pop(addr, None)
        self.ended_jobs.pop(job.name, None)  # the newest last: the oldest goes first
        self.ended_jobs[job.name] = job.summary()
        while len(self.ended_jobs) > ENDED_JOBS_KEPT:
            self.ended_jobs.pop(next(iter(self.ended_jobs)))
        return job

    def slot_state(self, slot: int, msg: int) -> tuple[bool, int]:
        """(holds message ``msg``, contributor bitmap) of the set ``msg`` maps to."""
        v = msg & 1
        holds = self._valid[v][slot] and self._msg[v][slot] == msg
        return holds, self._bitmap[v][slot] if holds else 0

    def totals(self) -> Counter:
        """Every counter summed over the whole life of the pipeline: never decreases.

        The drops no job owns, plus the counters of every job, running or removed.
        """
        total = Counter(self.counters)
        total.update(self.retired)
        for job in self.jobs.values():
            total.update(job.counters)
        return total

    def stats_key(self, job: Job) -> str:
        """A running job's key in ``stats()["jobs"]``: its name, or where running
        jobs share it (their secrets differ) its name and session, ``name@1a2b3c4d``."""
        shared = any(other.name == job.name and other is not job for other in self.jobs.values())
        return f"{job.name}@{job.session:08x}" if shared else job.name

    def stats(self) -> dict:
        return {
            "slots": self.slots,
            "packet_elements": self.packet_elements,
            "block_elements": self.block_elements,
            "free_slots": self.free_slots(),
            "drop_rate": {"ingress": self.ingress_drop_rate, "egress": self.egress_drop_rate},
            "counters": dict(self.counters),
            "jobs": {self.stats_key(job): job.summary() for job in self.jobs.values()},
            "ended_jobs": dict(self.ended_jobs),
            "totals": dict(self.totals()),
        }

    # ------------------------------------------------------------------ data
    def receive_datagram(self, data, addr) -> list:
        """Process one datagram from ``addr``; return [(datagram, address), ...] to send.

        Returned datagrams are views of switch memory, valid until the next call.
        Never raises on bad input: it is dropped and counted by reason.
        """
        if self.ingress_drop_rate and self._rng.random() < self.ingress_drop_rate:
            self.counters["dropped_ingress_simulated"] += 1
            return []
        member = self._members.get(addr)
        if member is None:
            self.counters["dropped_unknown_source"] += 1
            return []
        job, rank = member
        counters = job.counters
        try:
            h = wire.decode_header(data)
        except wire.MalformedPacket as exc:
            counters["dropped_" + exc.reason] += 1
            return []
        if h.kind not in (wire.KIND_CONTRIBUTION, wire.KIND_PROBE, wire.KIND_QUERY):
            counters["dropped_bad_kind"] += 1
            return []
        if h.session != job.tokens[rank]:  # not this rank's token: forged, or an old job's
            counters["dropped_bad_token"] += 1
            return []
        slot = h.slot
        if not job.slot_base <= slot < job.slot_base + job.slot_count:
            counters["dropped_slot_out_of_range"] += 1
            return []
        if h.kind != wire.KIND_CONTRIBUTION:
            return self._answer_probe(job, rank, h, data)
        if h.lanes != job.lanes:
            counters["dropped_bad_lanes"] += 1
            return []
        if h.count > job.packet_elements:
            counters["dropped_too_many_values"] += 1
            return []
        sparse = h.mode & wire.MODE_SPARSE
        lanes = wire.lane_table(data, h.lanes)
        payload = wire.values(data, h.lanes, h.count)
        if sparse:
            flagged = np.nonzero(lanes["flag"] & wire.FLAG_BLOCK)[0]
            if h.count != len(flagged) * job.block_elements:
                counters["dropped_bad_block_count"] += 1
                return []
        counters["packets_in"] += 1

        msg = h.msg
        v = msg & 1
        bit = 1 << rank
        # Sparse contributions carry different blocks, hence different counts.
        ids = (h.seq, h.pkt_id, h.dtype, h.mode, 0 if sparse else h.count, h.call)
        regs = job.lane_regs[v, slot]
        if not self._valid[v][slot] or wire.msg_newer(msg, self._msg[v][slot]):
            self._valid[v][slot] = True
            self._msg[v][slot] = msg
            self._ids[v][slot] = ids
            self._bitmap[v][slot] = bit
            self._count[v][slot] = 1
            regs[:] = lanes
            if sparse:
                self._start_sparse(job, v, slot, regs, flagged, payload)
            else:
                job.values[v, slot, : h.count] = payload
        elif msg == self._msg[v][slot]:
            if self._bitmap[v][slot] & bit:
                if self._count[v][slot] == job.world_size:
                    return self._answer_retransmission(job, v, slot, rank)
                counters["duplicates"] += 1
                return []
            if ids != self._ids[v][slot]:
                self._record_mismatch(job, v, slot, rank, ids)
                counters["dropped_mismatch"] += 1
                return []
            if sparse and not (lanes["pos"] == regs["pos"]).all():
                counters["dropped_mismatch"] += 1  # the same call, out of step: no misuse
                return []
            if sparse:
                self._add_sparse(job, v, slot, regs, lanes, flagged, payload)
            else:
                row = job.values[v, slot, : h.count]
                if h.mode == wire.MODE_MAX:
                    np.maximum(row, payload, out=row)
                else:
                    np.add(row, payload, out=row)
                np.maximum(regs["exp"], lanes["exp"], out=regs["exp"])
            self._bitmap[v][slot] |= bit
            self._count[v][slot] += 1
        else:
            counters["dropped_stale"] += 1
            return []

        if self._count[v][slot] < job.world_size:
            return []
        count = self._finish_sparse(job, v, slot, regs, h.mode) if sparse else h.count
        seq, pkt_id, dtype, mode, _, call = ids
        self._ids[v][slot] = (seq, pkt_id, dtype, mode, count, call)
        return self._complete(job, v, slot)

    def _complete(self, job: Job, v: int, slot: int) -> list:
        """Every rank's contribution is in set ``v`` of ``slot``: it is the result,
        sent to every rank.  (A rack switch sends it up instead: ``racks/pipeline.py``.)"""
        seq, pkt_id, dtype, mode, count, call = self._ids[v][slot]
        wire.encode_header(self._rows[v, slot], wire.KIND_RESULT, dtype, mode, slot,
                           job.session, self._msg[v][slot], seq, pkt_id, count, job.lanes,
                           call=call)
        job.counters["results_completed"] += 1
        return self._emit(job, v, slot, job.members)

    def _answer_retransmission(self, job: Job, v: int, slot: int, rank: int) -> list:
        """A rank sent again a contribution the complete set already holds: its
        result was lost, so the stored result goes back to that rank alone."""
        job.counters["retransmissions_answered"] += 1
        return self._emit(job, v, slot, [job.members[rank]])

    def _answer_probe(self, job: Job, rank: int, h: wire.Header, data) -> list:
        """A rank's retransmission without its values, a probe or a query (module
        docstring)."""
        counters = job.counters
        if h.count or h.lanes:
            counters["dropped_bad_probe"] += 1
            return []
        counters["probes_in"] += 1
        slot, msg = h.slot, h.msg
        v = msg & 1
        if self._valid[v][slot] and msg == self._msg[v][slot]:
            if self._bitmap[v][slot] >> rank & 1:
                if self._count[v][slot] < job.world_size:
                    counters["probes_waiting"] += 1  # for another rank's contribution
                    return []
                if h.kind == wire.KIND_PROBE:
                    return self._answer_retransmission(job, v, slot, rank)
                return self._answer_query(job, v, slot, rank, data)
        elif self._valid[v][slot] and not wire.msg_newer(msg, self._msg[v][slot]):
            counters["dropped_stale"] += 1
            return []
        counters["resends_asked"] += 1
        return self._answer_header(job, v, slot, rank, data, wire.KIND_RESEND)

    def _answer_query(self, job: Job, v: int, slot: int, rank: int, data) -> list:
        """A query of a complete set: done (its result went out already)."""
        job.counters["queries_done"] += 1
        return self._answer_header(job, v, slot, rank, data, wire.KIND_DONE)

    def _answer_header(self, job: Job, v: int, slot: int, rank: int, data, kind: int) -> list:
        """The probe's (or query's) header as ``kind``, built past the slot's row, to
        the rank alone."""
        if self.egress_drop_rate and self._rng.random() < self.egress_drop_rate:
            job.counters["dropped_egress_simulated"] += 1
            return []
        reply = self._rows[v, slot, self.datagram_size:]
        reply[:] = np.frombuffer(data, np.uint8, wire.HEADER_SIZE)
        reply[3] = kind
        reply[8:12] = np.frombuffer(job.session.to_bytes(4, "little"), np.uint8)  # not the token
        return [(reply.data, job.members[rank])]

    def _record_mismatch(self, job: Job, v: int, slot: int, rank: int, ids: tuple) -> None:
        if job.mismatch is not None:
            return
        first = self._ids[v][slot]
        bitmap = self._bitmap[v][slot]
        job.mismatch = Mismatch(tuple(r for r in range(job.world_size) if bitmap >> r & 1),
                                (first[0], first[5], first[2]), rank, (ids[0], ids[5], ids[2]))
        self._mismatched.append(job)

    @property
    def has_mismatches(self) -> bool:
        """Whether take_mismatches() has something (cheap: the server asks per batch)."""
        return bool(self._mismatched)

    def take_mismatches(self) -> list:
        """[(job, Mismatch)] recorded since the last call, for the controller."""
        out = [(job, job.mismatch) for job in self._mismatched if job.session in self.jobs]
        self._mismatched = []
        return out

    # ------------------------------------------------------------------ sparse lanes
    def _start_sparse(self, job: Job, v, slot, regs, flagged, payload) -> None:
        blocks = job.values[v, slot].reshape(job.lanes, job.block_elements)
        blocks[:] = 0
        blocks[flagged] = payload.reshape(-1, job.block_elements)
        regs["flag"] &= wire.FLAG_BLOCK
        self._blocks[v][slot] = len(flagged)

    def _add_sparse(self, job: Job, v, slot, regs, lanes, flagged, payload) -> None:
        """Add the flagged blocks; keep per lane the least next position (and, as in
        the dense path, the largest exponent)."""
        blocks = job.values[v, slot].reshape(job.lanes, job.block_elements)
        blocks[flagged] += payload.reshape(-1, job.block_elements)
        np.minimum(regs["nxt"], lanes["nxt"], out=regs["nxt"])
        np.maximum(regs["exp"], lanes["exp"], out=regs["exp"])
        regs["flag"] |= lanes["flag"] & wire.FLAG_BLOCK
        self._blocks[v][slot] += len(flagged)

    def _finish_sparse(self, job: Job, v, slot, regs, mode) -> int:
        """Compact the present blocks to the front; count blocks seen and skipped."""
        n = job.world_size
        present = np.nonzero(regs["flag"])[0]
        if len(present) < job.lanes:
            blocks = job.values[v, slot].reshape(job.lanes, job.block_elements)
            blocks[: len(present)] = blocks[present]
        nxt = regs["nxt"].astype(np.int64)
        if mode & wire.MODE_SEED:
            skipped = n * int(nxt.sum())  # positions before every lane's first block
        else:
            pos = regs["pos"].astype(np.int64)
            active = nxt > pos  # an exhausted lane reports its column length again
            skipped = (n * int(active.sum()) - self._blocks[v][slot]
                       + n * int((nxt - pos - 1)[active].sum()))
        c = job.counters
        c["sparse_blocks_in"] += self._blocks[v][slot]
        c["sparse_blocks_skipped"] += skipped
        c["sparse_bytes_saved"] += skipped * job.block_elements * wire.VALUE_SIZE
        c["sparse_blocks_out"] += len(present) * n
        return len(present) * job.block_elements

    def _emit(self, job: Job, v: int, slot: int, destinations: list) -> list:
        count = self._ids[v][slot][4]
        datagram = self._rows[v, slot, : wire.packet_size(job.lanes, count)].data
        out = []
        for addr in destinations:
            if self.egress_drop_rate and self._rng.random() < self.egress_drop_rate:
                job.counters["dropped_egress_simulated"] += 1
                continue
            out.append((datagram, addr))
        job.counters["results_out"] += len(out)
        return out
