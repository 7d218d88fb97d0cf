"""A rack switch's control plane, sans-IO: its workers' joins relayed to the spine.

A switch started with an upstream spine (``switchml switch --upstream HOST:PORT``)
is a rack switch: every job on it is one level of a two-level job
(docs/protocol.md, "Two levels: racks under a spine").  Its workers join it
exactly as they join a flat switch; it relays each join to the spine as a
``RackJoin`` on a control connection of the job's own, with the rack's own data
address in the spine's job (one UDP socket per job).  The spine gathers the
world, numbers the racks and answers each with ``RackReady``; the rack then
installs its local job (its ranks, the spine's window and packet geometry, an
``Uplink`` to the spine's slots) and tells its workers ``Ready``.

What it returns, per call: (worker connection, event JSON) pairs as
``Controller`` does, and for the spine ``ToSpine(job, request)`` (the server
opens the job's connection and uplink socket at its first) and
``CloseUplink(job)``.  The spine's events come in through ``handle_upstream``;
its connection's end through ``handle_uplink_closed``.

Authenticated jobs: the spine checks every rank's proof.  A join or gather
with a key goes up as it came; the spine's ``Challenge`` comes down to the
rank it names, and the rank's ``Prove`` goes up on the same connection.  A
rack names a job by its name and key (``relay_name``), as the spine does, so
that a process with the name but not the secret is another job here too.

Failures: the spine's ``failed`` fails the local job and is relayed to the
workers; a worker that disconnects or aborts fails the local job and is relayed
up as ``abort`` (the spine fails the job on every rack, naming it); the
spine's connection lost fails the local job naming the spine; ranks of the rack
that disagree on a call fail it the same way.  A spine answers a relayed join,
proof and status query at once: one that says nothing on the job's connection
for ``SPINE_ANSWER_S`` after being asked is hung or stopped, and the job fails
naming it (``expire``), before its workers would blame this rack switch
(``config.SWITCH_ANSWER_S``).  Failures of the spine reach the workers as the
switch's (``switch_lost``; at join an ``Error`` with reason "unreachable"):
``SwitchUnreachableError``, which sends a torch job to gloo.
"""

from __future__ import annotations

import json
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from ... import protocol
from ...protocol import UNREACHABLE, Error, Failed, Joined, Ready, StatsReply, StatusReply
from ..control import RECENT_SESSIONS_KEPT, describe_mismatch, new_session, new_tokens
from ..dataplane.pipeline import MAX_WORKERS, SlotPoolExhausted
from .pipeline import RackPipeline, Uplink

log = logging.getLogger("switchml.switch")

__all__ = ["RackController", "ToSpine", "CloseUplink"]

#: Seconds the spine has to say something on a job's connection once asked (a
#: join, a proof, a status query), counted from the rack's request: under the
#: workers' ``SWITCH_ANSWER_S`` (10), so that they hear the spine named, and
#: above the connect's own bound (``uplinks.CONNECT_TIMEOUT``, 5).
SPINE_ANSWER_S = 7.0


@dataclass(frozen=True)
class ToSpine:
    """A request for the spine on job ``job``'s own control connection."""

    job: str
    request: protocol.Request


@dataclass(frozen=True)
class CloseUplink:
    """The job is over at this rack: close its connection and socket to the spine."""

    job: str


def relay_name(job: str, key: str | None, gather_rank: int | None = None) -> str:
    """The name of a job's connection to the spine (or of one rank's gather): no
    other job, key and rank give it, whatever text a job's name is.  A job
    without a key is named by its name alone, unless that looks like another's."""
    if key is None and gather_rank is None and not job.startswith("["):
        return job
    return json.dumps([job, key] if gather_rank is None else [job, key, gather_rank])


@dataclass
class RackJob:
    name: str
    world_size: int
    uplink_addr: tuple                          # the rack's data address in the spine's job
    relay: str = ""                             # relay_name: this job's key in ``jobs``
    conns: dict = field(default_factory=dict)   # global rank -> worker connection
    addrs: dict = field(default_factory=dict)   # global rank -> worker data address
    left: set = field(default_factory=set)
    session: int = 0                            # the local job's, once running
    # Workers' status queries waiting for the spine's answer, in the order asked:
    # (connection, rows so far, [(row index, spine's (slot, number))]).
    statuses: deque = field(default_factory=deque)
    #: When the rack asked the spine what it has not answered since (None: nothing).
    asked: float | None = None

    @property
    def ranks(self) -> list:
        return sorted(self.conns)


class RackController:
    """Relays joins, leaves and failures between a rack's workers and the spine.

    ``uplink_address(job)``: the server opens the job's UDP socket toward the
    spine and says its address; ``route_mtu(address)``: the MTU of the rack's
    route to an address (None: the workers' figures alone).
    """

    def __init__(self, pipeline: RackPipeline, *, data_port: int, spine: tuple[str, int],
                 uplink_address: Callable[[str], tuple], route_mtu=None, stats=None,
                 clock: Callable[[], float] = time.monotonic):
        self.pipeline = pipeline
        self.data_port = data_port
        self.spine = spine
        self.uplink_address = uplink_address
        self.route_mtu = route_mtu
        self._stats = stats or pipeline.stats
        self._clock = clock
        self.jobs: dict[str, RackJob] = {}  # relay name -> job
        self._conn_job: dict = {}  # worker connection -> (relay name, rank)
        # A gather at join (who shares a host) spans racks: each rank's is relayed
        # to the spine on a connection of its own, named by _gather_name.
        self._gathers: dict = {}  # relay name -> worker connection
        self._conn_gather: dict = {}  # worker connection -> relay name
        # the sessions of the last jobs that ended here, none of which a new one gets
        # (an old job's late datagram is then no new job's), as the flat switch's
        self._recent: deque[int] = deque(maxlen=RECENT_SESSIONS_KEPT)

    def admission(self) -> dict:
        """The jobs of this rack: running (with their spine) and gathering."""
        return {
            "upstream": "%s:%d" % self.spine,
            "running": sum(1 for j in self.jobs.values() if j.session),
            "gathering": [{"job": j.name, "world_size": j.world_size, "present": j.ranks}
                          for j in self.jobs.values() if not j.session],
        }

    def holds(self, conn) -> bool:
        """Whether a worker's ``conn`` holds a rank of a job here, or a gather relayed
        to the spine (``Controller.holds``)."""
        return conn in self._conn_job or conn in self._conn_gather

    # ------------------------------------------------------------------ from workers
    def handle_message(self, conn, msg) -> list:
        try:
            request = msg if isinstance(msg, protocol.Request) else protocol.decode_request(msg)
        except protocol.VersionMismatch as exc:
            return self._to(conn, Error(str(exc), None, protocol.PROTOCOL_VERSION))
        except protocol.UnknownMessage as exc:  # answered; the connection stays
            self.pipeline.counters["control_unknown_request"] += 1
            return self._to(conn, Error(str(exc)))
        except protocol.BadRequest as exc:
            self.pipeline.counters["control_join_refused"] += 1
            return self._to(conn, Error(str(exc)))
        if isinstance(request, protocol.RackJoin):
            return self._to(conn, Error("this switch is a rack switch: racks join its spine"))
        if isinstance(request, protocol.Join):
            return self._join(conn, request)
        if isinstance(request, protocol.Gather):
            return self._gather(conn, request)
        if isinstance(request, protocol.Prove):
            return self._prove(conn, request)
        if isinstance(request, protocol.Leave):
            return self._leave(conn)
        if isinstance(request, protocol.Abort):
            return self._abort(conn, request)
        if isinstance(request, protocol.StatusQuery):
            return self._status(conn, request)
        return self._to(conn, StatsReply(self._stats()))

    def _join(self, conn, join: protocol.Join) -> list:
        name, rank, world = join.job, join.rank, join.world_size
        relay = relay_name(name, join.key)
        refused = None
        job = self.jobs.get(relay)
        if conn in self._conn_job:
            refused = "this connection already joined a job"
        elif world > MAX_WORKERS:
            refused = (f"world_size {world} exceeds the limit of {MAX_WORKERS} workers per "
                       f"job (max_workers)")
        elif rank >= world:
            refused = f"rank {rank} is outside 0..{world - 1}"
        elif job is not None and job.session:
            refused = f"job '{name}' is already running and rank {rank} belongs to it"
        elif job is not None and job.world_size != world:
            refused = f"job '{name}' has world_size {job.world_size}, this worker says {world}"
        elif job is not None and rank in job.conns:
            refused = f"rank {rank} of job '{name}' has already joined"
        elif job is not None and join.data_addr in job.addrs.values():
            refused = f"data address {join.data_addr} is already used by another rank"
        elif any(join.data_addr in other.addrs.values() for other in self.jobs.values()):
            # the data plane tells members apart by address: one job's each
            refused = f"data address {join.data_addr} is already used by a rank of another job"
        if refused is not None:
            self.pipeline.counters["control_join_refused"] += 1
            return self._to(conn, Error(refused, "max_workers" if world > MAX_WORKERS else None))
        if job is None:
            job = self.jobs[relay] = RackJob(name, world, tuple(self.uplink_address(relay)),
                                             relay)
        mtu = join.mtu
        if self.route_mtu is not None:
            try:
                mtus = [self.route_mtu(self.spine), self.route_mtu(join.data_addr)]
                mtu = min(mtus + ([mtu] if mtu is not None else []))
            except OSError as exc:
                log.warning("job %s: no MTU for the routes of rank %d: %s", name, rank, exc)
        relayed = protocol.RackJoin(name, rank, world, job.uplink_addr, join.slots,
                                    join.rcvbuf, mtu, join.wait, link_share=join.link_share,
                                    key=join.key, rack=f"{job.uplink_addr[0]}:{self.data_port}")
        job.conns[rank], job.addrs[rank] = conn, join.data_addr
        self._conn_job[conn] = (relay, rank)
        log.info("job %s: rank %d/%d joined the rack from %s:%d; relayed to the spine",
                 name, rank, world, *join.data_addr)
        return self._ask_spine(job, relayed)

    def _prove(self, conn, prove: protocol.Prove) -> list:
        """A rank's proof for the spine's challenge: up on its join's or gather's
        connection (the spine checks it)."""
        entry = self._conn_job.get(conn)
        relay = self._conn_gather.get(conn) or (entry[0] if entry else None)
        job = self.jobs.get(relay) if relay is not None else None
        # the spine challenges ranks only while their job forms: a proof for a
        # running one would be refused up there, for the job's connection
        if relay is None or (job is not None and job.session):
            return self._to(conn, Error("no challenge is open on this connection"))
        return self._ask_spine(job, prove) if job is not None else [ToSpine(relay, prove)]

    def _leave(self, conn) -> list:
        entry = self._conn_job.get(conn)
        if entry is None:
            return self._to(conn, protocol.Left())
        relay, rank = entry
        job = self.jobs[relay]
        if not job.session:
            return self._disconnect(conn)
        job.left.add(rank)
        out = self._to(conn, protocol.Left())
        if job.left == set(job.conns):  # the rack is done: it leaves the spine's job
            self._end(job, "ended")
            out += [ToSpine(relay, protocol.Leave()), CloseUplink(relay)]
        return out

    def _abort(self, conn, abort: protocol.Abort) -> list:
        entry = self._conn_job.get(conn)
        job = self.jobs.get(entry[0]) if entry else None
        if entry is None or job is None or not job.session:
            return []
        reason = f"rank {entry[1]} of job '{job.name}' gave up: {abort.reason}"
        return self._fail(job, Failed(abort.missing, reason, switch_lost=abort.switch_lost,
                                      culprits=abort.culprits),
                          skip=conn, up=protocol.Abort(abort.reason, abort.missing,
                                                       abort.switch_lost, abort.culprits))

    def _gather(self, conn, gather: protocol.Gather) -> list:
        """A rank's host record for its job's ranks, in every rack: to the spine."""
        name = relay_name(gather.job, gather.key, gather.rank)
        if name in self._gathers or conn in self._conn_gather:
            return self._to(conn, Error(f"rank {gather.rank} of job '{gather.job}' is "
                                        "gathering already"))
        self._gathers[name] = conn
        self._conn_gather[conn] = name
        return [ToSpine(name, gather)]

    def _gather_answered(self, name: str, event) -> list:
        """The spine's answer to a relayed gather, down to its rank; the relay ends
        with the gather (all records, or an error)."""
        conn = self._gathers[name]
        if isinstance(event, (protocol.Gathered, Error)):
            del self._gathers[name]
            self._conn_gather.pop(conn, None)
            return self._to(conn, event) + [CloseUplink(name)]
        return self._to(conn, event)

    def handle_disconnect(self, conn) -> list:
        """A worker's control connection closed."""
        relay = self._conn_gather.pop(conn, None)
        if relay is not None:  # its rank leaves the spine's gathering with it
            del self._gathers[relay]
            return [CloseUplink(relay)] + self._disconnect(conn)
        return self._disconnect(conn)

    def _disconnect(self, conn) -> list:
        entry = self._conn_job.pop(conn, None)
        if entry is None:
            return []
        relay, rank = entry
        job = self.jobs.get(relay)
        if job is None or rank in job.left:
            return []
        name = job.name
        if not job.session:
            # The spine holds this rank through the rack's one connection for the job,
            # which cannot take a rank back: the rack's part of the gathering ends
            # (the spine forgets its ranks), and its other ranks are told to join
            # again, rather than left waiting for a job that cannot form.
            del self.jobs[relay]
            for c in job.conns.values():
                self._conn_job.pop(c, None)
            error = Error(f"job '{name}': rank {rank} left its rack switch before the job "
                          f"started; the rack's ranks must join again")
            return [(c, error.to_dict()) for r, c in sorted(job.conns.items())
                    if r != rank] + [CloseUplink(relay)]
        reason = f"rank {rank} of job '{name}' disconnected"
        return self._fail(job, Failed((rank,), reason), skip=conn,
                          up=protocol.Abort("disconnected from its rack switch", (rank,)))

    def _status(self, conn, query: protocol.StatusQuery) -> list:
        """The rack's own contributor bitmaps, its local ranks' bits as the job's
        ranks; for a message complete here, the spine is asked which racks' ranks
        it has (the answer comes back through ``handle_upstream``)."""
        entry = self._conn_job.get(conn)
        job = self.jobs.get(entry[0]) if entry else None
        if job is None or not job.session:
            return self._to(conn, StatusReply())
        installed = self.pipeline.jobs[job.session]
        uplink = self.pipeline.uplinks[job.session]
        low, high = installed.slot_base, installed.slot_base + installed.slot_count
        ranks = job.ranks
        rows: list = []
        ask = []
        for slot, number in query.slots:
            if low <= slot < high:
                holds, bitmap = self.pipeline.slot_state(slot, number)
                rows.append([slot, number, holds,
                             sum(1 << g for i, g in enumerate(ranks) if bitmap >> i & 1)])
                if holds and bitmap == (1 << len(ranks)) - 1:
                    ask.append((len(rows) - 1, (uplink.slot_base + slot - low, number)))
        if not ask:
            return self._to(conn, StatusReply(tuple(map(tuple, rows))))
        job.statuses.append((conn, rows, ask))
        return self._ask_spine(job, protocol.StatusQuery(tuple(spine for _, spine in ask)))

    def _spine_status(self, job: RackJob, reply: StatusReply) -> list:
        """The spine's answer to the oldest status query relayed: its ranks added."""
        if not job.statuses:
            return []
        conn, rows, ask = job.statuses.popleft()
        job.asked = self._clock() if job.statuses else None
        spine = {(slot, number): bitmap for slot, number, holds, bitmap in reply.slots
                 if holds}
        for index, key in ask:
            rows[index][3] |= spine.get(key, 0)
        return self._to(conn, StatusReply(tuple(map(tuple, rows))))

    def handle_mismatches(self) -> list:
        """Ranks of this rack disagree on a call: fail the job here and at the spine."""
        out: list = []
        for installed, m in self.pipeline.take_mismatches():
            job = next((j for j in self.jobs.values() if j.session == installed.session), None)
            if job is None:
                continue
            ranks = job.ranks
            m = type(m)(tuple(ranks[i] for i in m.ranks), m.first, ranks[m.rank], m.other)
            reason = describe_mismatch(job.name, m)
            self.pipeline.counters["jobs_mismatched"] += 1
            out += self._fail(job, Failed((), reason, True),
                              up=protocol.Abort(reason, mismatch=True))
        return out

    # ------------------------------------------------------------------ from the spine
    def handle_upstream(self, name: str, msg) -> list:
        """An event from the spine on job ``name``'s connection."""
        if name in self._gathers:
            try:
                event = msg if isinstance(msg, protocol.Event) else protocol.decode_event(msg)
            except protocol.MalformedMessage as exc:
                event = Error(f"the spine switch at {self._spine_name()} sent {exc}")
            return self._gather_answered(name, event)
        job = self.jobs.get(name)
        if job is None:
            return []
        try:
            event = msg if isinstance(msg, protocol.Event) else protocol.decode_event(msg)
        except protocol.MalformedMessage as exc:
            return self._fail(job, Failed((), f"job '{job.name}': the spine switch at "
                                              f"{self._spine_name()} sent {exc}"))
        # the spine answers: what is still asked of it waits from now
        job.asked = self._clock() if job.statuses else None
        if isinstance(event, protocol.RackReady):
            return self._start(job, event)
        if isinstance(event, protocol.Challenge):  # for the rank it names alone
            conn = job.conns.get(event.rank)
            return self._to(conn, event) if conn is not None else []
        if isinstance(event, (Joined, protocol.Waiting)):
            return self._to_all(job, event)
        if isinstance(event, Error):
            if event.rank is not None and event.rank in job.conns and not job.session:
                return self._drop_rank(job, event.rank, event)  # that rank's request alone
            if job.session:  # out of the pipeline too: its slots are free again
                return self._fail(job, Failed((), event.message))
            del self.jobs[name]
            for c in job.conns.values():
                self._conn_job.pop(c, None)
            return self._to_all(job, event) + [CloseUplink(name)]
        if isinstance(event, Failed):
            return self._fail(job, event, up=None)
        if isinstance(event, StatusReply):
            return self._spine_status(job, event)
        return []  # left, stats: nothing for the workers

    def _drop_rank(self, job: RackJob, rank: int, error: Error) -> list:
        """The spine refused one rank's request (its join, its proof: a process
        with the job's name and key but not its secret, say): that rank alone
        hears it and leaves the job here, as it would be refused alone at a
        switch of one level; the job's other ranks wait on."""
        conn = job.conns.pop(rank)
        job.addrs.pop(rank, None)
        self._conn_job.pop(conn, None)
        out = self._to(conn, error)
        if not job.conns:
            del self.jobs[job.relay]
            out.append(CloseUplink(job.relay))
        return out

    def handle_uplink_closed(self, name: str, why: str = "closed the connection") -> list:
        """Job ``name``'s connection to the spine ended (or could not be opened): the
        job fails as the switch's (its workers raise ``SwitchUnreachableError``)."""
        if name in self._gathers:
            return self._gather_answered(
                name, Error(f"the spine switch at {self._spine_name()} {why}",
                            reason=UNREACHABLE))
        job = self.jobs.get(name)
        if job is None:
            return []
        reason = f"job '{job.name}': the spine switch at {self._spine_name()} {why}"
        if not job.session:
            del self.jobs[name]
            for c in job.conns.values():
                self._conn_job.pop(c, None)
            return self._to_all(job, Error(reason, reason=UNREACHABLE)) + [CloseUplink(name)]
        return self._fail(job, Failed((), reason, switch_lost=True), up=None)

    def expire(self, now: float) -> list:
        """Fail the jobs whose spine did not answer within ``SPINE_ANSWER_S``."""
        out: list = []
        for job in [j for j in self.jobs.values()
                    if j.asked is not None and now >= j.asked + SPINE_ANSWER_S]:
            log.warning("job %s: the spine at %s did not answer within %gs",
                        job.name, self._spine_name(), SPINE_ANSWER_S)
            out += self.handle_uplink_closed(
                job.relay, f"did not answer within {SPINE_ANSWER_S:g}s (stopped or hung?)")
        return out

    def next_deadline(self) -> float | None:
        """When ``expire`` has work next (None: the spine owes no answer)."""
        return min((j.asked + SPINE_ANSWER_S for j in self.jobs.values()
                    if j.asked is not None), default=None)

    def _start(self, job: RackJob, ready: protocol.RackReady) -> list:
        if list(ready.ranks) != job.ranks:  # a rank came or went as the job started
            reason = (f"job '{job.name}': the spine started it with ranks {list(ready.ranks)} "
                      f"behind this rack switch, which has ranks {job.ranks}")
            return self._fail(job, Failed((), reason), up=protocol.Abort(reason))
        try:
            base = self.pipeline.allocate(ready.slot_count)
        except SlotPoolExhausted as exc:
            reason = (f"job '{job.name}': the rack switch has no room for the spine's window "
                      f"of {ready.slot_count} slots ({exc})")
            return self._fail(job, Failed((), reason), up=protocol.Abort(reason))
        session = new_session(lambda s: s in self.pipeline.jobs or s in self._recent)
        uplink = Uplink((self.spine[0], ready.data_port), job.uplink_addr, ready.session,
                        ready.slot_base, ready.member, ready.token)
        tokens = new_tokens(len(job.ranks), session)
        try:
            self.pipeline.install_job(job.name, session, [job.addrs[r] for r in job.ranks],
                                      base, ready.slot_count, ready.packet_elements,
                                      ready.block_elements, tokens, uplink=uplink)
        except ValueError as exc:  # the spine's packets do not fit this rack's slots
            reason = f"job '{job.name}': the rack switch cannot take the spine's job: {exc}"
            return self._fail(job, Failed((), reason), up=protocol.Abort(reason))
        job.session = session
        self.pipeline.counters["jobs_started"] += 1
        log.info("job %s started on the rack: ranks %s, rack %d of %d, slots %d..%d",
                 job.name, job.ranks, ready.member, ready.members, base,
                 base + ready.slot_count - 1)
        return [(job.conns[r], Ready(session, base, ready.slot_count, ready.packet_elements,
                                     ready.block_elements, self.data_port,
                                     token=token, gso=self.pipeline.takes_gso_runs).to_dict())
                for r, token in zip(job.ranks, tokens)]

    # ------------------------------------------------------------------ helpers
    def _ask_spine(self, job: RackJob, request: protocol.Request) -> list:
        """``request`` up, the spine's answer awaited (``expire``)."""
        if job.asked is None:
            job.asked = self._clock()
        return [ToSpine(job.relay, request)]

    def _fail(self, job: RackJob, failed: Failed, skip=None, up=None) -> list:
        """The job is over here: workers told (but ``skip``), the spine told ``up``."""
        log.warning("job %s failed: %s", job.name, failed.reason)
        out: list = [(c, failed.to_dict()) for r, c in sorted(job.conns.items())
               if c != skip and r not in job.left]
        self._end(job, "failed")
        self.pipeline.counters["jobs_failed"] += 1
        if up is not None:
            out.append(ToSpine(job.relay, up))
        return out + [CloseUplink(job.relay)]

    def _end(self, job: RackJob, state: str) -> None:
        if job.session:
            self.pipeline.remove_job(job.session, state)
            self._recent.append(job.session)
        self.jobs.pop(job.relay, None)
        for c in job.conns.values():
            self._conn_job.pop(c, None)
        if state == "ended":
            self.pipeline.counters["jobs_ended"] += 1

    def _to_all(self, job: RackJob, event: protocol.Event) -> list:
        message = event.to_dict()
        return [(c, message) for _, c in sorted(job.conns.items())]

    @staticmethod
    def _to(conn, event: protocol.Event) -> list:
        return [(conn, event.to_dict())]

    def _spine_name(self) -> str:
        return "%s:%d" % self.spine

