"""The switch's data plane in C: ``FastPipeline`` is a ``Pipeline`` whose per-packet
work runs in the compiled core (``_fastpath.c``, ``fastpath_core.c``).

Why a subclass and not a second class with the same API: the control plane
(slot allocation, job table, ended jobs, stats) runs a few times per job, so it
stays the Python reference's own code, and only what runs per packet moves to C:
validation, member lookup, shadow-copy sets, bitmaps, adds, sparse lanes,
retransmissions, emission and simulated drops.  The C core works in the same
slot rows the Python pipeline allocated (``_rows``, shared through the buffer
protocol), so the result datagrams are the same bytes in the same memory.

The C core counts into its own counters, with the Python names; they are merged
into ``pipeline.counters`` and each ``job.counters`` by ``sync_counters()``, which
``receive_datagram``, ``stats``, ``totals`` and ``remove_job`` call.  The switch's
socket loop calls ``drain`` (recvmmsg, the pipeline, sendmmsg, without the GIL)
and reads counters only through ``stats``/``totals``.

With ``threads`` above 1, the core has that many data threads of its own
(``serve``), each owning the slots ``s`` with ``s % threads`` equal to its index
and draining its own socket of the port's SO_REUSEPORT group, to which the
kernel steers each datagram by its slot (``steer_by_slot``).  No two threads
ever touch one slot, so slots need no lock and a server's cores add up; each
thread keeps its own counters, which ``take_counters`` sums; the job and member
tables, which the control plane changes, are behind a read-write lock the data
threads hold for reading across a batch (see ``fastpath_io.h``).

Member addresses are keys in the C member table: ``(ipv4 << 16) | port`` for an
IPv4 ``(host, port)`` as ``recvfrom`` gives it, which is what the socket loop
computes from a datagram's source; any other address (the simulator's names)
gets a key of its own, usable through ``receive_datagram`` only.
"""

from __future__ import annotations

import itertools
import socket

from ...config import DEFAULT_PACKET_ELEMENTS, DEFAULT_SLOTS, pure_python
from .pipeline import MAX_WORKERS, Job, Mismatch, Pipeline

try:
    from . import _fastpath  # typed by _fastpath.pyi
except ImportError:  # not built (no C compiler where it was installed)
    _fastpath = None  # type: ignore[assignment]

#: A key no member has: the source address of a datagram from a stranger.
KEY_NONE = 2**64 - 1


def available() -> bool:
    """True when the C core is built and SWITCHML_PURE_PYTHON is not 1."""
    return _fastpath is not None and not pure_python()


def ipv4_key(addr) -> int | None:
    """The member-table key of an IPv4 ``(host, port)`` as recvfrom returns it, or None."""
    try:
        host, port = addr
        packed = socket.inet_pton(socket.AF_INET, host)
    except (TypeError, ValueError, OSError):
        return None
    if type(port) is not int or not 0 <= port <= 0xFFFF or socket.inet_ntop(
            socket.AF_INET, packed) != host:
        return None
    return int.from_bytes(packed, "big") << 16 | port


class FastPipeline(Pipeline):
    """The same object as ``Pipeline``, with its data plane in C (see the module doc)."""

    def __init__(self, slots: int = DEFAULT_SLOTS, packet_elements: int = DEFAULT_PACKET_ELEMENTS,
                 *, block_elements: int | None = None, drop_rate: float = 0.0,
                 egress_drop_rate: float | None = None, seed: int | None = None,
                 threads: int = 1):
        if _fastpath is None:
            raise RuntimeError("switchml.switch.dataplane._fastpath is not built: "
                               "reinstall switchml with a C compiler, or use Pipeline")
        super().__init__(slots, packet_elements, block_elements=block_elements,
                         drop_rate=drop_rate, egress_drop_rate=egress_drop_rate, seed=seed)
        rows = self._rows.reshape(-1)
        # Every job holds a slot, so there are at most slots * MAX_WORKERS members.
        self._core = _fastpath.Core(rows, slots, self.row_size, slots * MAX_WORKERS, threads)
        #: Data threads (1: the switch's serving thread drains the socket itself).
        self.threads = threads
        self.data_threads = threads
        self._core.set_drop_rates(self.ingress_drop_rate, self.egress_drop_rate,
                                  self._rng.getrandbits(64))
        self._row_bytes = rows.data
        self._keys: dict = {}  # member address -> key in the C member table
        self._other_keys = itertools.count(1)
        self._job_at: dict[int, Job] = {}  # slot_base -> running job

    def install_job(self, name: str, session: int, members: list, slot_base: int,
                    slot_count: int, packet_elements: int | None = None,
                    block_elements: int | None = None, tokens: list | None = None) -> Job:
        job = super().install_job(name, session, members, slot_base, slot_count,
                                  packet_elements, block_elements, tokens)
        keys = []
        for addr in members:
            key = ipv4_key(addr)
            if key is None:
                key = _fastpath.KEY_NOT_IPV4 | next(self._other_keys)
            self._keys[addr] = key
            keys.append(key)
        self._core.install(slot_base, slot_count, session, job.lanes, job.packet_elements,
                           job.block_elements, keys, job.tokens)
        self._job_at[slot_base] = job
        return job

    def remove_job(self, session: int, state: str = "ended") -> Job | None:
        job = self.jobs.get(session)
        if job is None:
            return None
        # Out of the core first: from then on no data thread counts for it, so the
        # sync takes its last counts, and none come for a base no job holds.
        self._core.remove(job.slot_base)
        self.sync_counters()
        del self._job_at[job.slot_base]
        for addr in job.members:
            self._keys.pop(addr, None)
        return super().remove_job(session, state)

    def sync_counters(self) -> None:
        """Add what the C core counted since the last call to the Python counters."""
        for base, counts in self._core.take_counters():
            job = self._job_at.get(base)
            # (a base no job holds has none: whatever came is a removed job's)
            (self.counters if base < 0 else job.counters if job else self.retired).update(counts)

    def slot_state(self, slot: int, msg: int) -> tuple[bool, int]:
        return self._core.slot_state(slot, msg)

    @property
    def has_mismatches(self) -> bool:
        return bool(self._core.mismatches)

    def take_mismatches(self) -> list:
        out = []
        for base, bitmap, *first, rank, seq, call, dtype in self._core.take_mismatches():
            job = self._job_at[base]
            job.mismatch = Mismatch(tuple(r for r in range(job.world_size) if bitmap >> r & 1),
                                    tuple(first), rank, (seq, call, dtype))
            out.append((job, job.mismatch))
        return out

    def totals(self):
        self.sync_counters()
        return super().totals()

    def stats(self) -> dict:
        self.sync_counters()
        return super().stats()

    def receive_datagram(self, data, addr) -> list:
        out = self._core.receive(data, self._keys.get(addr, KEY_NONE))
        self.sync_counters()
        if not out:
            return []
        members = self._members[addr][0].members
        rows = self._row_bytes
        return [(rows[offset: offset + length], members[rank]) for offset, length, rank in out]

    def drain(self, fd: int, limit: int, gso: bool = True) -> tuple[int, int]:
        """Handle up to ``limit`` datagrams waiting on the UDP socket ``fd`` (recvmmsg,
        the pipeline, sendmmsg), with the GIL released; (received, sent).

        With ``gso``, results to one destination of one size leave in one send as
        UDP GSO segments, unless the kernel refused that once (``gso_refused``)."""
        return self._core.drain(fd, limit, gso)

    @property
    def gso_refused(self) -> bool:
        return bool(self._core.gso_refused)

    def serve(self, sockets: list, notify_fd: int = -1, gso: bool = True) -> None:
        """Start the data threads, thread i on ``sockets[i]`` (the port's SO_REUSEPORT
        group, in the order they were bound, steered with ``steer_by_slot``); a
        byte goes to ``notify_fd`` when a thread recorded a mismatch."""
        self._core.serve([s.fileno() for s in sockets], notify_fd, gso)

    def stop_serving(self) -> None:
        """Stop the data threads and join them (none running: nothing)."""
        self._core.stop()

    def thread_failures(self) -> list[tuple[int, int]]:
        """(thread, errno) of each data thread that ended without being told."""
        return self._core.failures()

    def threads_cpu_s(self) -> float:
        """The data threads' CPU time together, in seconds (0 when none served)."""
        return self._core.cpu_seconds()


def steer_by_slot(sock: socket.socket, threads: int) -> None:
    """Have the kernel give each datagram of the SO_REUSEPORT group of ``sock`` to
    its socket ``slot % threads`` (in the order the group's sockets were bound):
    a classic BPF program (SO_ATTACH_REUSEPORT_CBPF) reading the wire header's
    slot."""
    if _fastpath is None:
        raise RuntimeError("switchml.switch.dataplane._fastpath is not built")
    _fastpath.steer_by_slot(sock.fileno(), threads)
