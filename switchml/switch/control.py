"""The switch's control plane, sans-IO: joins, leaves and failures of jobs.

It plays the part of a switch controller installing table entries.  It takes
control messages (dicts) per connection and returns (connection, message) pairs to
send; the server does the TCP and JSON framing.

Job life cycle: ranks join one by one (``joined`` events tell everyone who is
present); when all ``world_size`` ranks are there the job gets a session id and a
slot range and every rank gets ``ready``.  A rank that says ``leave`` is done; the
job's slots are freed once every rank left.  A rank whose connection drops without
``leave`` fails the job: its slots are freed at once and the other ranks get
``failed`` naming it.
"""

from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass, field

from .. import wire
from ..netutil import datagrams_that_fit
from .pipeline import MAX_WORKERS, Pipeline, SlotPoolExhausted

log = logging.getLogger("switchml.switch")

PROTOCOL_VERSION = 1


@dataclass
class JobEntry:
    name: str
    world_size: int
    slot_request: int
    conns: dict = field(default_factory=dict)     # rank -> connection id
    addrs: dict = field(default_factory=dict)     # rank -> data address
    left: set = field(default_factory=set)
    rcvbufs: dict = field(default_factory=dict)   # rank -> its data socket's receive buffer
    session: int = 0                              # 0 while still gathering ranks


class Controller:
    """Admits workers to jobs and installs/removes them in the pipeline."""

    def __init__(self, pipeline: Pipeline, *, data_port: int, slots_per_job: int = 32,
                 stats=None, rcvbuf: int | None = None):
        self.pipeline = pipeline
        self.rcvbuf = rcvbuf
        self._stats = stats or pipeline.stats
        self.data_port = data_port
        self.slots_per_job = slots_per_job
        self.jobs: dict[str, JobEntry] = {}
        self._conn_job: dict = {}  # connection id -> (job name, rank)

    def handle_message(self, conn, msg: dict) -> list:
        op = msg.get("op") if isinstance(msg, dict) else None
        if op == "join":
            return self._join(conn, msg)
        if op == "leave":
            return self._leave(conn)
        if op == "status":
            return self._status(conn, msg)
        if op == "stats":
            return [(conn, {"event": "stats", "stats": self._stats()})]
        self.pipeline.counters["control_bad_message"] += 1
        return [(conn, {"event": "error", "message": f"unknown control message {op!r}"})]

    def handle_disconnect(self, conn) -> list:
        entry = self._conn_job.pop(conn, None)
        if entry is None:
            return []
        name, rank = entry
        job = self.jobs.get(name)
        if job is None:
            return []
        job.conns.pop(rank, None)
        if rank in job.left:
            return []
        if not job.session:
            job.addrs.pop(rank, None)
            log.info("job %s: rank %d went away before the job started", name, rank)
            if not job.conns:
                del self.jobs[name]
                return []
            return self._announce_present(job)
        log.warning("job %s failed: rank %d disconnected without leaving", name, rank)
        return self._fail(job, [rank], f"rank {rank} of job '{name}' disconnected")

    # ------------------------------------------------------------------
    def _join(self, conn, msg: dict) -> list:
        def refuse(reason: str) -> list:
            self.pipeline.counters["control_join_refused"] += 1
            log.warning("join refused: %s", reason)
            return [(conn, {"event": "error", "message": reason})]

        try:
            name = str(msg["job"])
            rank = int(msg["rank"])
            world = int(msg["world_size"])
            host, port = msg["data_addr"]
            addr = (str(host), int(port))
            request = int(msg.get("slots") or self.slots_per_job)
            rcvbuf = int(msg.get("rcvbuf") or 0)
        except (KeyError, TypeError, ValueError):
            return refuse("join needs job, rank, world_size and data_addr")
        if msg.get("version", PROTOCOL_VERSION) != PROTOCOL_VERSION:
            return refuse(f"protocol version {msg.get('version')} unsupported "
                          f"(switch speaks {PROTOCOL_VERSION})")
        if conn in self._conn_job:
            return refuse("this connection already joined a job")
        if not 1 <= world <= MAX_WORKERS:
            return refuse(f"world_size {world} is outside 1..{MAX_WORKERS} "
                          f"(the switch's contribution bitmap has {MAX_WORKERS} bits)")
        if not 0 <= rank < world:
            return refuse(f"rank {rank} is outside 0..{world - 1}")
        if request < 1:
            return refuse(f"a job needs at least one slot, asked for {request}")
        job = self.jobs.get(name)
        if job is None:
            job = self.jobs[name] = JobEntry(name, world, request)
        elif job.session:
            return refuse(f"job '{name}' is already running; pick another job name")
        elif job.world_size != world:
            return refuse(f"job '{name}' has world_size {job.world_size}, "
                          f"this worker says {world}")
        if rank in job.conns:
            return refuse(f"rank {rank} of job '{name}' has already joined")
        if addr in job.addrs.values():
            return refuse(f"data address {addr} is already used by another rank")
        job.conns[rank] = conn
        job.addrs[rank] = addr
        if rcvbuf > 0:
            job.rcvbufs[rank] = rcvbuf
        self._conn_job[conn] = (name, rank)
        log.info("job %s: rank %d/%d joined from %s:%d", name, rank, world, *addr)
        if len(job.conns) < world:
            return self._announce_present(job)
        return self._start(job)

    def _announce_present(self, job: JobEntry) -> list:
        present = sorted(job.conns)
        return [(c, {"event": "joined", "job": job.name, "present": present})
                for c in job.conns.values()]

    def _start(self, job: JobEntry) -> list:
        count = min(job.slot_request, self.pipeline.slots, self._window_limit(job))
        try:
            base = self.pipeline.allocate(count)
        except SlotPoolExhausted as exc:
            conns = list(job.conns.values())
            for c in conns:
                self._conn_job.pop(c, None)
            del self.jobs[job.name]
            return [(c, {"event": "error", "message": f"job '{job.name}': {exc}"}) for c in conns]
        session = 0
        while session == 0 or session in self.pipeline.jobs:
            session = secrets.randbits(32)
        members = [job.addrs[r] for r in range(job.world_size)]
        self.pipeline.install_job(job.name, session, members, base, count)
        job.session = session
        log.info("job %s started: session %08x, slots %d..%d", job.name, session, base,
                 base + count - 1)
        ready = {"event": "ready", "session": session, "slot_base": base, "slot_count": count,
                 "packet_elements": self.pipeline.packet_elements,
                 "block_elements": self.pipeline.block_elements, "data_port": self.data_port}
        return [(c, ready) for c in job.conns.values()]

    def _window_limit(self, job: JobEntry) -> int:
        """Most slots whose bursts fit the receive buffers: beyond that, bursts drop."""
        size = wire.packet_size(self.pipeline.lanes, self.pipeline.packet_elements)
        limits = [datagrams_that_fit(b, size) for b in job.rcvbufs.values()]
        if self.rcvbuf:
            limits.append(datagrams_that_fit(self.rcvbuf, size) // job.world_size)
        limit = max(1, min(limits, default=job.slot_request))
        if limit < job.slot_request:
            log.warning("job %s: window cut from %d to %d slots because socket receive "
                        "buffers are small (raise net.core.rmem_max, or grant CAP_NET_ADMIN)",
                        job.name, job.slot_request, limit)
        return limit

    def _leave(self, conn) -> list:
        entry = self._conn_job.get(conn)
        if entry is None:  # the job already ended or failed
            return [(conn, {"event": "left"})]
        name, rank = entry
        job = self.jobs[name]
        if not job.session:
            return self.handle_disconnect(conn)
        job.left.add(rank)
        log.info("job %s: rank %d left", name, rank)
        if len(job.left) == job.world_size:
            self._end(job)
            log.info("job %s ended; its slots are free", name)
        return [(conn, {"event": "left"})]

    def _fail(self, job: JobEntry, missing: list, reason: str) -> list:
        self._end(job)
        self.pipeline.counters["jobs_failed"] += 1
        event = {"event": "failed", "missing": missing, "reason": reason}
        return [(c, event) for r, c in job.conns.items() if r not in job.left]

    def _end(self, job: JobEntry) -> None:
        self.pipeline.remove_job(job.session)
        self.jobs.pop(job.name, None)
        for c in job.conns.values():
            self._conn_job.pop(c, None)

    def _status(self, conn, msg: dict) -> list:
        entry = self._conn_job.get(conn)
        job = self.jobs.get(entry[0]) if entry else None
        if job is None or not job.session:
            return [(conn, {"event": "status", "slots": []})]
        rows = []
        installed = self.pipeline.jobs[job.session]
        low, high = installed.slot_base, installed.slot_base + installed.slot_count
        for item in msg.get("slots", [])[:4096]:
            try:
                slot, number = int(item[0]), int(item[1])
            except (TypeError, ValueError, IndexError):
                continue
            if low <= slot < high:
                holds, bitmap = self.pipeline.slot_state(slot, number)
                rows.append([slot, number, holds, bitmap])
        return [(conn, {"event": "status", "slots": rows})]
