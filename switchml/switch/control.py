"""The switch's control plane, sans-IO: admission, joins, leaves and failures of jobs.

It plays the part of a switch controller installing table entries.  It takes
control messages per connection (decoded JSON lines, or ``protocol`` requests)
and returns (connection, message) pairs to send, each message the JSON object
of a ``protocol`` event; the server does the TCP and JSON framing.  The
messages' fields and their checks are in ``protocol.py``.

Job life cycle:

* *gathering*: ranks join one by one; ``joined`` events tell everyone who is
  present.
* When all ``world_size`` ranks are there the job is *admitted* if it fits: fewer
  than ``max_jobs`` jobs run, and its window fits in a contiguous run of free
  slots.  It gets a session id and the slot range, and every rank gets ``ready``.
* A job that does not fit is refused (``error`` naming the limit), or, when every
  rank asked to wait, *waits* (``waiting`` naming the limit) until a job ends or
  fails.  Waiting jobs are retried in arrival order; a job never takes slots
  another job holds.  A waiting rank that goes away (its own deadline) puts the
  job back to gathering.
* A running job *ends* when every rank said ``leave``; it *fails* when a rank's
  connection drops without ``leave``, or when a rank ``abort``s because it gave up
  waiting for the others (its timeout).  Either way its slots are freed at once,
  the other ranks get ``failed`` naming the missing ranks, and waiting jobs are
  retried.  It also fails when the pipeline saw its ranks disagree on a call
  (``handle_mismatches``): every rank gets ``failed`` with ``mismatch`` set and a
  reason naming what each side asked for.

A rank that restarts while its job runs is refused until the job has failed (its
old connection dropped, or the others timed out); it then joins the job name
afresh, and the job re-forms with a new session when the others rejoin too.

Authentication (docs/protocol.md, "Authenticated jobs"): a job is its name and
its public key (``Join.key``, derived from the job's secret: ``auth.py``), so a
process that knows the name but not the secret is another job, which never
holds a rank of the real one nor sees its sums.  A job's first rank that joins
while ranks of another key gather under the same name is told so
(``OtherSecretWaiting``), where it is the one rank theirs lacks, and they are told
that a join with another secret was seen (``OtherSecretSeen``): a mistyped
secret fails fast, and neither learns more of the other.  A join or gather that carries
a key, and every one where the switch has an admission token, is answered with
a ``Challenge`` and taken only once its ``Prove`` checks out: a signature by the
job's key and an HMAC by the token over a nonce made for that request, so a
captured proof is never accepted again.  A job without a key is open: joined
by name alone, and logged as such when it starts.  Every rank of a running job
gets a data-plane token of its own in its ``Ready``, which its datagrams carry
(``pipeline.Job.tokens``).
"""

from __future__ import annotations

import logging
import secrets
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

from .. import auth, protocol, wire
from ..config import DEFAULT_MAX_JOBS
from ..netutil import datagrams_that_fit
from ..protocol import (
    PROTOCOL_VERSION,
    Error,
    Failed,
    Joined,
    Ready,
    StatsReply,
    StatusReply,
    Waiting,
)
from .dataplane.pipeline import MAX_WORKERS, Mismatch, Pipeline, SlotPoolExhausted
from .gather import Gatherings, GatherRefused

log = logging.getLogger("switchml.switch")

__all__ = ["Controller", "describe_mismatch", "PROTOCOL_VERSION", "LIMIT_MAX_WORKERS",
           "LIMIT_MAX_JOBS", "LIMIT_SLOTS"]

#: Names of the limits a join can hit (``limit`` of ``error`` and ``waiting`` events).
LIMIT_MAX_WORKERS = "max_workers"
LIMIT_MAX_JOBS = "max_jobs"
LIMIT_SLOTS = "slots"
#: Sessions of recently ended jobs that a new job never gets.
RECENT_SESSIONS_KEPT = 4096
#: Most requests one connection may hold unproven (a rack switch relays several).
MAX_CHALLENGES_PER_CONNECTION = 64
#: Refusal reasons of a request whose proof failed (``Error.reason``).
REASON_AUTHENTICATION = "authentication"
REASON_ADMISSION = "admission"


def describe_mismatch(name: str, m) -> str:
    """A pipeline.Mismatch in words: the call numbers and what each side asked for."""
    ranks = ", ".join(map(str, m.ranks))
    (seq, call, dtype), (other_seq, other_call, other_dtype) = m.first, m.other
    first = f"{'rank' if len(m.ranks) == 1 else 'ranks'} {ranks}"
    if seq != other_seq:
        return (f"ranks of job '{name}' are at different calls: {first} at allreduce "
                f"#{seq} ({wire.describe_call(call, dtype)}), rank {m.rank} at #{other_seq} "
                f"({wire.describe_call(other_call, other_dtype)}); every rank must make "
                f"the same calls in the same order")
    return (f"ranks of job '{name}' disagree on allreduce #{seq}: {first} asked for "
            f"{wire.describe_call(call, dtype)}, rank {m.rank} for "
            f"{wire.describe_call(other_call, other_dtype)}")


@dataclass
class JobEntry:
    name: str
    world_size: int
    slot_request: int
    key: str | None = None                        # the job's public key; None: an open job
    conns: dict = field(default_factory=dict)     # rank -> connection id
    addrs: dict = field(default_factory=dict)     # rank -> data address
    left: set = field(default_factory=set)
    rcvbufs: dict = field(default_factory=dict)   # rank -> its data socket's receive buffer
    mtus: dict = field(default_factory=dict)      # rank -> MTU of its route to the switch
    patient: set = field(default_factory=set)     # ranks that asked to wait for room
    session: int = 0                              # 0 until admitted
    packet_elements: int = 0                      # packet geometry, fixed once every rank joined
    block_elements: int = 0
    slot_count: int = 0                           # the window, fixed once every rank joined
    waiting: bool = False                         # complete, queued for room
    rejoined: bool = False                        # a rank said it ran on a switch here before
    threads: int = 1                              # I/O threads a rank: the least asked for
    member_ranks: list = field(default_factory=list)  # each pipeline member's ranks, from start

    @property
    def ident(self) -> tuple:
        """What names the job on the switch: its name and key."""
        return self.name, self.key


class Controller:
    """Admits workers to jobs and installs/removes them in the pipeline."""

    def __init__(self, pipeline: Pipeline, *, data_port: int, slots_per_job: int = 32,
                 max_jobs: int = DEFAULT_MAX_JOBS, stats=None, rcvbuf: int | None = None,
                 route_mtu=None, shared_link: bool = False,
                 admission_token: bytes | None = None, loopback_only: bool = False):
        if max_jobs < 1:
            raise ValueError(f"max_jobs must be at least 1, got {max_jobs}")
        self.pipeline = pipeline
        self.rcvbuf = rcvbuf
        #: address -> MTU of the switch's route to it (the server asks the kernel);
        #: None: the workers' own figures alone size a job's packets.
        self.route_mtu = route_mtu
        self._stats = stats or pipeline.stats
        self.data_port = data_port
        self.slots_per_job = slots_per_job
        #: A server behind one link its ranks share (SwitchConfiguration.shared_link).
        self.shared_link = shared_link
        self.max_jobs = max_jobs
        #: Without it, no job can be created at all (``switchml switch --token-file``).
        self.admission_token = admission_token
        #: The switch listens on a loopback address: no other host can reach it, so
        #: an open job is logged at INFO, not warned of.
        self.loopback_only = loopback_only
        self.jobs: dict[tuple, JobEntry] = {}  # (name, key) -> job
        self._conn_job: dict = {}  # connection id -> ((name, key), its first rank)
        #: data address -> the job whose rank (or rack switch) sends from it: the
        #: data plane tells members apart by address, so no two jobs share one.
        self._address_job: dict[tuple, tuple] = {}
        #: Requests waiting for their proof: connection -> rank -> (request, nonce).
        self._challenges: dict[Any, dict[int, tuple[Any, str]]] = {}
        self._racks: dict = {}  # connections of rack switches (several ranks each) -> name
        self._queue: list[tuple] = []  # (name, key) of waiting jobs, in arrival order
        self._recent: deque[int] = deque(maxlen=RECENT_SESSIONS_KEPT)
        self.refused: Counter = Counter()  # joins refused, by reason
        #: Ranks exchanging their host records before they join (``protocol.Gather``).
        self.gatherings = Gatherings()

    def holds(self, conn) -> bool:
        """Whether ``conn`` holds a rank of a job (gathering, waiting or running) or of
        a gathering of host records: a member, which the server never closes for
        being slow to join (``lobby.py``)."""
        return conn in self._conn_job or self.gatherings.holds(conn)

    def handle_message(self, conn, msg) -> list:
        """Answer one message: a decoded JSON line (a dict, as the server reads it) or a
        ``protocol.Request``.  Returns (connection, event's JSON object) pairs."""
        return _on_wire(self.handle_request(conn, msg))

    def handle_disconnect(self, conn) -> list:
        """A control connection closed: fail or shrink its job.  (connection, JSON) pairs."""
        return _on_wire(self._disconnect(conn))

    def handle_request(self, conn, msg) -> list:
        """``handle_message`` with the answers as ``protocol`` events."""
        try:
            request = msg if isinstance(msg, protocol.Request) else protocol.decode_request(msg)
        except protocol.UnknownMessage as exc:  # answered; the connection stays
            self.pipeline.counters["control_unknown_request"] += 1
            return [(conn, Error(str(exc)))]
        except protocol.VersionMismatch as exc:
            return self._refuse(conn, "version", str(exc), version=PROTOCOL_VERSION)
        except protocol.BadRequest as exc:
            if conn in self._conn_job:  # as for a good join: that it joined comes first
                return self._refuse(conn, "bad_request", "this connection already joined a job")
            return self._refuse(conn, "bad_request", str(exc))
        if isinstance(request, (protocol.Gather, protocol.Join)):
            if request.key is not None or self.admission_token is not None:
                return self._challenge(conn, request)
            return self._take(conn, request)
        if isinstance(request, protocol.Prove):
            return self._prove(conn, request)
        if isinstance(request, protocol.Leave):
            return self._leave(conn)
        if isinstance(request, protocol.Abort):
            return self._abort(conn, request)
        if isinstance(request, protocol.StatusQuery):
            return self._status(conn, request)
        return [(conn, StatsReply(self._stats()))]

    def _take(self, conn, request) -> list:
        """A gather or join, proven where it had to be."""
        if isinstance(request, protocol.Gather):
            try:
                return self.gatherings.gather(conn, request)
            except GatherRefused as exc:
                return self._refuse(conn, exc.reason, str(exc))
        return self._join(conn, request)

    # ------------------------------------------------------------------ proofs
    def _challenge(self, conn, request) -> list:
        """Ask for the request's proof: a nonce of its own (module docstring)."""
        if request.key is not None:
            try:
                auth.check_available()
            except auth.AuthUnavailableError as exc:
                return self._refuse(conn, REASON_AUTHENTICATION,
                                    f"job '{request.job}' rank {request.rank}: this switch "
                                    f"cannot check job secrets: {exc}", proof_failed=True,
                                    rank=request.rank)
        pending = self._challenges.setdefault(conn, {})
        if len(pending) >= MAX_CHALLENGES_PER_CONNECTION:
            return self._refuse(conn, "bad_request", "too many requests waiting for their proof",
                                rank=request.rank)
        nonce = auth.new_nonce()
        pending[request.rank] = (request, nonce)
        return [(conn, protocol.Challenge(nonce, request.rank,
                                          self.admission_token is not None))]

    def _prove(self, conn, prove: protocol.Prove) -> list:
        """Check a proof; take the request it proves, or refuse it naming why."""
        held = self._challenges.get(conn, {}).pop(prove.rank, None)
        if held is None:
            return self._refuse(conn, "bad_request", f"no challenge is open for rank "
                                f"{prove.rank} on this connection", rank=prove.rank)
        request, nonce = held
        what = f"job '{request.job}' rank {request.rank}"
        message = auth.transcript(nonce, request.job, request.rank, request.key)
        if self.admission_token is not None and not auth.admitted(
                self.admission_token, prove.admission, message):
            return self._refuse(conn, REASON_ADMISSION, f"{what}: this switch admits only "
                                f"workers that know its admission token (SWITCHML_SWITCH_TOKEN "
                                f"or SWITCHML_SWITCH_TOKEN_FILE), and this one did not prove "
                                f"it", proof_failed=True, rank=request.rank)
        if request.key is not None and (prove.signature is None or not auth.verify(
                request.key, prove.signature, message)):
            return self._refuse(conn, REASON_AUTHENTICATION, f"{what}: the request did not "
                                f"prove the job's secret", proof_failed=True, rank=request.rank)
        return self._take(conn, request)

    def _disconnect(self, conn) -> list:
        self._challenges.pop(conn, None)
        gathering = self.gatherings.disconnect(conn)
        return gathering + self._leave_job(conn)

    def _leave_job(self, conn) -> list:
        """A connection that held ranks of a job closed: fail or shrink the job."""
        entry = self._conn_job.pop(conn, None)
        if entry is None:
            return []
        rack = self._racks.pop(conn, None)
        ident, rank = entry
        job = self.jobs.get(ident)
        if job is None:
            return []
        name = job.name
        ranks = _ranks_of(job, conn)
        for r in ranks:
            job.conns.pop(r, None)
        if set(ranks) <= job.left:
            return []
        if not job.session:
            for r in ranks:
                self._forget_address(job, job.addrs.pop(r, None))
                job.rcvbufs.pop(r, None)
                job.mtus.pop(r, None)
                job.patient.discard(r)
            if job.waiting:
                job.waiting = False
                self._queue.remove(ident)
            log.info("job %s: ranks %s went away before the job started", name, ranks)
            if not job.conns:
                del self.jobs[ident]
                return []
            return self._announce_present(job)
        if rack:
            who = f"the rack switch at {rack} (ranks {', '.join(map(str, ranks))})"
            why = f"{who} of job '{name}' disconnected"
        else:
            who, why = f"rank {rank}", f"rank {rank} of job '{name}' disconnected"
        log.warning("job %s failed: %s disconnected without leaving", name, who)
        return self._fail(job, ranks, why)

    def admission(self) -> dict:
        """Limits, and the jobs running, waiting for room and gathering ranks."""
        waiting = [self.jobs[ident] for ident in self._queue]
        return {
            "max_jobs": self.max_jobs,
            "max_workers": MAX_WORKERS,
            "slots_per_job": self.slots_per_job,
            "running": sum(1 for j in self.jobs.values() if j.session),
            "waiting": [{"job": j.name, "world_size": j.world_size, "slots": j.slot_count}
                        for j in waiting],
            "gathering": [{"job": j.name, "world_size": j.world_size, "present": sorted(j.conns)}
                          for j in self.jobs.values() if not j.session and not j.waiting]
            + self.gatherings.describe(),
            "refused": dict(self.refused),
        }

    # ------------------------------------------------------------------ joining
    def _refuse(self, conn, reason: str, why: str, limit: str | None = None,
                version: int | None = None, *, proof_failed: bool = False,
                rank: int | None = None) -> list:
        """Refuse a request, counted by ``limit`` or ``reason``; ``proof_failed`` puts
        ``reason`` in the error (the worker raises AuthenticationError); ``rank``:
        the rank whose request it was (a join, a proof), where the refusal is its
        alone: a rack switch relays several ranks' on one connection."""
        self.pipeline.counters["control_join_refused"] += 1
        self.refused[limit or reason] += 1
        log.warning("join refused: %s", why)
        return [(conn, Error(why, limit, version, reason if proof_failed else None, rank))]

    def _join(self, conn, join: protocol.Join) -> list:
        # A rack switch relays its ranks' joins on one connection (several ranks, one
        # data address: the rack's in this job); any other connection holds one rank.
        relayed = isinstance(join, protocol.RackJoin)
        if conn in self._conn_job and not (relayed and conn in self._racks
                                           and self._conn_job[conn][0] == (join.job, join.key)):
            return self._refuse(conn, "bad_request", "this connection already joined a job",
                                rank=join.rank)
        name, world, rank, addr = join.job, join.world_size, join.rank, join.data_addr
        # A rank whose link carries several jobs at once (its host's shards) asks for
        # its share of the window that link carries.
        request = -(-(join.slots if join.slots is not None else self.slots_per_job)
                    // join.link_share)
        rcvbuf, mtu = join.rcvbuf, join.mtu
        if world > MAX_WORKERS:
            return self._refuse(
                conn, "max_workers", f"world_size {world} exceeds the limit of {MAX_WORKERS} "
                f"workers per job (max_workers: the switch's contribution bitmap has "
                f"{MAX_WORKERS} bits)", LIMIT_MAX_WORKERS, rank=rank)
        if rank >= world:
            return self._refuse(conn, "bad_request", f"rank {rank} is outside 0..{world - 1}",
                                rank=rank)
        ident = (name, join.key)
        if self._address_job.get(addr, ident) != ident:
            return self._refuse(conn, "duplicate_address",
                                f"data address {addr} is already used by a rank of another job",
                                rank=rank)
        job = self.jobs.get(ident)
        created = job is None
        if job is None:
            job = self.jobs[ident] = JobEntry(name, world, request, join.key,
                                              threads=join.threads)
        elif job.session:
            return self._refuse(
                conn, "job_running", f"job '{name}' is already running and rank {rank} "
                f"belongs to it; a restarted rank can join again once the job has failed "
                f"(its old connection dropped, or the other ranks timed out)", rank=rank)
        elif job.world_size != world:
            return self._refuse(conn, "world_size_mismatch", f"job '{name}' has world_size "
                                f"{job.world_size}, this worker says {world}", rank=rank)
        if rank in job.conns:
            return self._refuse(conn, "duplicate_rank",
                                f"rank {rank} of job '{name}' has already joined", rank=rank)
        if addr in job.addrs.values() and not (relayed and {
                job.conns.get(r) for r, a in job.addrs.items() if a == addr} == {conn}):
            return self._refuse(conn, "duplicate_address",
                                f"data address {addr} is already used by another rank",
                                rank=rank)
        job.conns[rank] = conn
        job.addrs[rank] = addr
        self._address_job[addr] = ident
        job.rejoined = job.rejoined or join.rejoin
        job.threads = min(job.threads, join.threads)
        if rcvbuf > 0:
            job.rcvbufs[rank] = rcvbuf
        if mtu is not None:
            job.mtus[rank] = mtu
        if join.wait:
            job.patient.add(rank)
        self._conn_job.setdefault(conn, (ident, rank))
        if isinstance(join, protocol.RackJoin):
            self._racks[conn] = join.rack or "%s:%d" % addr
        log.info("job %s: rank %d/%d joined from %s:%d%s", name, rank, world, *addr,
                 " (a rack switch)" if relayed else "")
        if len(job.conns) < world:
            news = self._other_secrets(job, conn, rank) if created and not relayed else []
            return self._announce_present(job) + news
        job.packet_elements, job.block_elements = self._geometry(job)
        # Each rank sends through ``threads`` jobs, one a thread, all through its one
        # link: each gets that share of the window the link carries.
        job.slot_request = -(-job.slot_request // job.threads)
        job.slot_count = min(job.slot_request, self.pipeline.slots, self._window_limit(job),
                             self._link_share(job))
        return self._admit_or_refuse(job)

    def _other_secrets(self, job: JobEntry, conn, rank: int) -> list:
        """The first rank of a job joined under a name that ranks of another key
        (another secret, or none) gather under: they hear that a join with another
        secret was seen, and the new rank, where it is the one rank theirs lacks
        (the same world size, every other rank there), that they wait with another secret
        (``OtherSecretWaiting``), so that a mistyped secret fails in a second,
        not at the timeout.  Nothing else about either job goes to the other."""
        others = [j for j in self.jobs.values()
                  if j.name == job.name and j.key != job.key and not j.session
                  and not j.waiting and not any(c in self._racks for c in j.conns.values())]
        if not others:
            return []
        log.warning("job %s: rank %d joined with another secret than ranks of that name "
                    "waiting here (a mistyped secret, or a process without it)",
                    job.name, rank)
        seen = protocol.OtherSecretSeen(job.name)
        out: list = [(c, seen) for other in others for c in _members(other)]
        # only where it would complete theirs: a process that holds some ranks of a
        # name cannot make a real job's first rank give up, and two jobs that share
        # a name (the default one) do not make each other fail
        if any(other.world_size == job.world_size and rank not in other.conns
               and len(other.conns) == other.world_size - 1 for other in others):
            out.append((conn, protocol.OtherSecretWaiting(job.name)))
        return out

    def _geometry(self, job: JobEntry) -> tuple[int, int]:
        """The job's (packet_elements, block_elements): the largest packet that fits one
        frame on every rank's path, both ways, within the switch's limit."""
        p = self.pipeline
        mtus = list(job.mtus.values())
        if self.route_mtu is not None:
            for addr in job.addrs.values():
                try:
                    mtus.append(self.route_mtu(addr))
                except OSError as exc:  # no route back: the worker's own figure stands
                    log.warning("job %s: no MTU for the route to %s: %s", job.name, addr, exc)
        if not mtus:  # workers that did not say (older clients): the switch's packets
            return p.packet_elements, p.block_elements
        return wire.frame_geometry(min(mtus), p.packet_elements, p.block_elements)

    def _announce_present(self, job: JobEntry) -> list:
        present = tuple(sorted(job.conns))
        return [(c, Joined(job.name, present)) for c in _members(job)]

    def _admit_or_refuse(self, job: JobEntry) -> list:
        blocked = self._blocking_limit(job)
        if blocked is None:
            return self._start(job)
        limit, why = blocked
        if job.patient == set(job.conns):
            job.waiting = True
            self._queue.append(job.ident)
            log.info("job %s waits for room: %s", job.name, why)
            waiting = Waiting(job.name, limit, why)
            return [(c, waiting) for c in _members(job)]
        return self._refuse_job(job, limit, f"{why} (workers may wait for room: "
                                            f"wait_for_slots)", limit=limit)

    def _refuse_job(self, job: JobEntry, reason: str, why: str,
                    limit: str | None = None) -> list:
        """Every rank of a job that cannot start hears why (``limit``: the switch's
        limit it exceeds), counted by ``reason``; the job is forgotten."""
        conns = _members(job)
        for c in conns:
            self._conn_job.pop(c, None)
            self._racks.pop(c, None)
        if job.waiting:
            job.waiting = False
            self._queue.remove(job.ident)
        del self.jobs[job.ident]
        self._forget_addresses(job)
        self.pipeline.counters["control_join_refused"] += len(job.conns)
        self.refused[reason] += len(job.conns)
        log.warning("job %s refused: %s", job.name, why)
        error = Error(f"job '{job.name}' refused: {why}", limit)
        return [(c, error) for c in conns]

    def _blocking_limit(self, job: JobEntry):
        """None when ``job`` can start now, else (limit, why not)."""
        running = [j.name for j in self.jobs.values() if j.session]
        if len(running) >= self.max_jobs:
            return LIMIT_MAX_JOBS, (f"the switch runs at most {self.max_jobs} jobs at once "
                                    f"(max_jobs), and runs {', '.join(sorted(running))}")
        try:
            self.pipeline.allocate(job.slot_count)
        except SlotPoolExhausted:
            holders = ", ".join(f"{j.name} {j.slot_base}..{j.slot_base + j.slot_count - 1}"
                                for j in sorted(self.pipeline.jobs.values(),
                                                key=lambda j: j.slot_base))
            return LIMIT_SLOTS, (f"its window of {job.slot_count} slots does not fit in the "
                                 f"switch's pool of {self.pipeline.slots} slots "
                                 f"({self.pipeline.free_slots()} free; held by {holders})")
        return None

    def _start(self, job: JobEntry) -> list:
        base = self.pipeline.allocate(job.slot_count)
        session = new_session(lambda s: s in self.pipeline.jobs or s in self._recent)
        # The pipeline's members: a worker, or a rack switch for the ranks behind it
        # (their partial sum), in the order of their lowest rank.
        conns = _members(job)
        members = [job.addrs[_ranks_of(job, c)[0]] for c in conns]
        # Each member's own token, which only its own connection hears: no member
        # can pass for another, and a spoofed source address without it adds nothing.
        tokens = new_tokens(len(conns), session)
        try:
            self.pipeline.install_job(job.name, session, members, base, job.slot_count,
                                      packet_elements=job.packet_elements,
                                      block_elements=job.block_elements, tokens=tokens)
        except ValueError as exc:  # the data plane cannot hold it: this job alone fails
            return self._refuse_job(job, "bad_request", f"the data plane cannot take it: {exc}")
        job.session = session
        # what the slots' bitmaps are of, for status answers after a rank has left
        job.member_ranks = [_ranks_of(job, c) for c in conns]
        self.pipeline.counters["jobs_started"] += 1
        if job.rejoined:  # its ranks ran it on a switch here that went away
            self.pipeline.counters["jobs_rejoined"] += 1
        log.info("job %s %s: session %08x, %d ranks, slots %d..%d", job.name,
                 "rejoined" if job.rejoined else "started", session,
                 job.world_size, base, base + job.slot_count - 1)
        if job.key is None:
            self.pipeline.counters["jobs_unauthenticated"] += 1
            self.pipeline.counters["jobs_open"] += 1  # its old name, kept for one version
            if self.loopback_only:  # no other host reaches it: nothing to warn of
                log.info("job %s is unauthenticated (the switch listens on loopback: only "
                         "this host's processes can join it)", job.name)
            else:
                log.warning("job %s is unauthenticated: any host that knows its name can "
                            "join it; give its workers a secret (SWITCHML_JOB_SECRET) to "
                            "close it", job.name)
        geometry = (session, base, job.slot_count, job.packet_elements, job.block_elements,
                    self.data_port)
        return [(c, protocol.RackReady(*geometry, i, len(conns), tuple(_ranks_of(job, c)),
                                       token=tokens[i])
                 if c in self._racks else Ready(*geometry, link_window=job.slot_request,
                                                token=tokens[i],
                                                gso=self.pipeline.takes_gso_runs,
                                                threads=job.threads,
                                                data_threads=self.pipeline.data_threads))
                for i, c in enumerate(conns)]

    def _admit_waiting(self) -> list:
        """Start the waiting jobs that fit now, in arrival order."""
        out = []
        for ident in list(self._queue):
            job = self.jobs[ident]
            if self._blocking_limit(job) is None:
                self._queue.remove(ident)
                job.waiting = False
                out += self._start(job)
        return out

    def _link_share(self, job: JobEntry) -> int:
        """A job's slots on a server behind one link (``shared_link``): its ranks'
        share of the window one link carries (the job's request), since every
        rank's packets queue at that link, where a switch has a port per rank.
        Slots, not only the window: a set completes when its last rank's
        contribution comes, so ranks out of step complete up to slots x ranks
        results at once, a burst the server's one link must queue: more slots
        than the link's share put more in flight than a 256 KiB port holds, and
        the results lost at the servers' own queues cost more than the slots
        gain (docs/protocol.md, "Design rationale")."""
        if not self.shared_link:
            return job.slot_request
        return max(1, -(-job.slot_request // job.world_size))

    def _window_limit(self, job: JobEntry) -> int:
        """Most slots whose bursts fit the receive buffers: beyond that, bursts drop."""
        size = wire.packet_size(job.packet_elements // job.block_elements, job.packet_elements)
        limits = [datagrams_that_fit(b, size) for b in job.rcvbufs.values()]
        if self.rcvbuf:
            limits.append(datagrams_that_fit(self.rcvbuf, size) // job.world_size)
        limit = max(1, min(limits, default=job.slot_request))
        if limit < job.slot_request:
            log.warning("job %s: window cut from %d to %d slots because socket receive "
                        "buffers are small (raise net.core.rmem_max, or grant CAP_NET_ADMIN)",
                        job.name, job.slot_request, limit)
        return limit

    # ------------------------------------------------------------------ leaving, failing
    def _leave(self, conn) -> list:
        entry = self._conn_job.get(conn)
        if entry is None:  # the job already ended or failed
            return [(conn, protocol.Left())]
        ident, rank = entry
        job = self.jobs[ident]
        name = job.name
        if not job.session:
            return self._disconnect(conn)
        job.left.update(_ranks_of(job, conn))
        log.info("job %s: rank %d left", name, rank)
        out: list = [(conn, protocol.Left())]
        if len(job.left) == job.world_size:
            out += self._end(job, "ended")
            log.info("job %s ended; its slots are free", name)
        return out

    def _abort(self, conn, abort: protocol.Abort) -> list:
        """A rank gave up (no progress within its timeout): the job fails for everyone."""
        entry = self._conn_job.get(conn)
        job = self.jobs.get(entry[0]) if entry else None
        if entry is None or job is None or not job.session:
            return []
        rank = entry[1]
        missing = sorted({r for r in abort.missing if 0 <= r < job.world_size})
        reason = abort.reason
        if abort.mismatch and conn in self._racks:  # its ranks disagreed: said as they did
            log.warning("job %s failed: %s", job.name, reason)
            self.pipeline.counters["jobs_mismatched"] += 1
            return self._fail(job, missing, reason, skip=conn, mismatch=True)
        log.warning("job %s failed: rank %d gave up: %s", job.name, rank, reason)
        return self._fail(job, missing, f"rank {rank} of job '{job.name}' gave up: {reason}",
                          skip=conn, switch_lost=abort.switch_lost, culprits=abort.culprits)

    def handle_mismatches(self) -> list:
        """Fail every job whose ranks the pipeline saw disagree on a call."""
        out: list = []
        for installed, m in self.pipeline.take_mismatches():
            job = self._by_session(installed.session)
            if job is None:
                continue
            members = [_ranks_of(job, c) for c in _members(job)]
            if len(members) < job.world_size:  # rack switches: the pipeline's members
                # are racks; name the ranks behind them (each rack's agree: it checked)
                m = Mismatch(tuple(g for i in m.ranks for g in members[i]), m.first,
                             members[m.rank][0], m.other)
            reason = describe_mismatch(job.name, m)
            log.warning("job %s failed: %s", job.name, reason)
            self.pipeline.counters["jobs_mismatched"] += 1
            out += self._fail(job, [], reason, mismatch=True)
        return _on_wire(out)

    def _fail(self, job: JobEntry, missing: list, reason: str, skip=None,
              mismatch: bool = False, switch_lost: bool = False, culprits=()) -> list:
        conns = list(dict.fromkeys(c for r, c in sorted(job.conns.items())
                                   if r not in job.left and c != skip))
        out = self._end(job, "failed")
        self.pipeline.counters["jobs_failed"] += 1
        failed = Failed(tuple(missing), reason, mismatch, switch_lost, tuple(culprits))
        return [(c, failed) for c in conns] + out

    def _end(self, job: JobEntry, state: str) -> list:
        """Free the job's slots and connections; start waiting jobs that now fit."""
        self.pipeline.remove_job(job.session, state)
        self._recent.append(job.session)
        self.jobs.pop(job.ident, None)
        self._forget_addresses(job)
        for c in job.conns.values():
            self._conn_job.pop(c, None)
            self._racks.pop(c, None)
        if state == "ended":
            self.pipeline.counters["jobs_ended"] += 1
        return self._admit_waiting()

    def _forget_address(self, job: JobEntry, addr) -> None:
        """``addr`` is free for other jobs once no rank of ``job`` sends from it."""
        if addr in self._address_job and addr not in job.addrs.values() \
                and self._address_job[addr] == job.ident:
            del self._address_job[addr]

    def _forget_addresses(self, job: JobEntry) -> None:
        """A job that ended, failed or was refused frees its data addresses."""
        for addr in job.addrs.values():
            if self._address_job.get(addr) == job.ident:
                del self._address_job[addr]

    def _by_session(self, session: int) -> JobEntry | None:
        return next((j for j in self.jobs.values() if j.session == session), None)

    def _status(self, conn, query: protocol.StatusQuery) -> list:
        entry = self._conn_job.get(conn)
        job = self.jobs.get(entry[0]) if entry else None
        if job is None or not job.session:
            return [(conn, StatusReply())]
        rows = []
        installed = self.pipeline.jobs[job.session]
        low, high = installed.slot_base, installed.slot_base + installed.slot_count
        # Bitmaps are of the pipeline's members as the job started (with rack
        # switches, racks), which the answer gives as the ranks behind them.
        for slot, number in query.slots:
            if low <= slot < high:
                holds, bitmap = self.pipeline.slot_state(slot, number)
                bitmap = sum(1 << g for i, ranks in enumerate(job.member_ranks)
                             if bitmap >> i & 1 for g in ranks)
                rows.append((slot, number, holds, bitmap))
        return [(conn, StatusReply(tuple(rows)))]


def new_session(taken) -> int:
    """A new job's session: 32 random bits, never 0 nor one that ``taken`` says a
    running or recently ended job has (an old job's late datagram is no new job's)."""
    session = 0
    while session == 0 or taken(session):
        session = secrets.randbits(32)
    return session


def new_tokens(count: int, session: int) -> list[int]:
    """``count`` random data-plane tokens, distinct, none 0 or ``session``."""
    tokens: list[int] = []
    while len(tokens) < count:
        token = secrets.randbits(32)
        if token not in (0, session) and token not in tokens:
            tokens.append(token)
    return tokens


def _ranks_of(job: JobEntry, conn) -> list:
    """The ranks a connection holds: one, or a rack switch's several."""
    return sorted(r for r, c in job.conns.items() if c == conn)


def _members(job: JobEntry) -> list:
    """The job's connections, each once, in the order of their lowest rank."""
    return list(dict.fromkeys(job.conns[r] for r in sorted(job.conns)))


def _on_wire(out: list) -> list:
    """(connection, event) pairs as (connection, the event's JSON object)."""
    return [(conn, event.to_dict()) for conn, event in out]
