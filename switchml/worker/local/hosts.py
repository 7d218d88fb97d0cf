"""Which ranks share a host, and how a host's ranks split a call among them (sans-IO).

Ranks that can map one another's memory combine their arrays there before the
switch (``stage.py``), so that each host's link carries the tensor once.  Every
rank describes itself in a ``HostRecord``; the job's ranks exchange their
records once, at join (through the switch's control port, or a torch store:
``rendezvous.py``); ``Placement`` turns the records into the same plan on every
rank, whatever launched them.

Two ranks share memory when they run on the same boot of the same machine, see
the same ``/dev/shm``, in the same IPC and PID namespaces (the PID is how a peer
is watched), as the same user (segments are 0600) and in the same network
namespace (the link they share).  ``SWITCHML_LOCAL_GROUP`` can only split such a
group further (ranks naming different groups never combine), never merge ranks
of different machines.  Ranks that share a machine's network but not its memory
(another container, another user) are told so in a log line and take the flat
path, as separate hosts.

The plan, for groups of k_0 ... k_{H-1} ranks (H hosts, groups ordered by their
lowest rank, ranks in a group by rank): ``shards`` = min k_h.  A call is cut
into segments and each segment into ``shards`` shards; shard s of every host is
summed (``stage.py``) by the group's rank of local index s, which sends it
through the switch in a job of H members (the hosts, numbered by group), named
``shard_job(job, s)``.  Ranks of local index ``shards`` or more only combine.

Every rank cuts its calls into segments of the same size: SWITCHML_LOCAL_SEGMENT
where the ranks set it (alike), else ``auto_segment`` of the host that can take
the least, from what each record says of its cores and free shared memory.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
from dataclasses import dataclass
from functools import cached_property

from ...config import DEFAULT_LOCAL_SEGMENT, LOCAL_SLOTS, auto_local_threads, env, usable_cores
from ...errors import JoinRefusedError

__all__ = ["HostRecord", "Hosts", "Placement", "auto_segment", "host_record", "local_segment",
           "shard_job"]

log = logging.getLogger("switchml.worker")

#: Longest encoded record: well within a control message's name limit.
MAX_RECORD = 120


def _digest(*parts) -> str:
    return hashlib.sha256("\0".join(map(str, parts)).encode()).hexdigest()[:16]


def _inode(path: str):
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:  # not Linux: the host's name is the best we have
        return socket.gethostname()


@dataclass(frozen=True)
class HostRecord:
    """What one rank says of itself: ``memory`` (ranks with the same value can map
    one another's shared memory and share a link), ``machine`` (ranks with the
    same value share a link, whether or not they can share memory), ``pid``
    (its process, which peers watch), ``segment`` (the elements of the local
    stage's segments it was told to cut its calls into, which every rank of the
    job must cut alike; 0 where it was told nothing), and what the job's
    segment is chosen from where no rank was told: ``cores`` (the CPUs it may
    run on) and ``free_shm`` (bytes free in /dev/shm; 0 if unknown)."""

    memory: str
    machine: str
    pid: int
    segment: int
    cores: int = 1
    free_shm: int = 0

    def encode(self) -> str:
        return (f"{self.memory} {self.machine} {self.pid} {self.segment} {self.cores} "
                f"{self.free_shm}")

    @classmethod
    def decode(cls, text: str) -> HostRecord:
        """A record as ``encode`` wrote it; ValueError for anything else."""
        parts = text.split(" ") if isinstance(text, str) and len(text) <= MAX_RECORD else []
        if len(parts) != 6 or not all(p.isdigit() for p in parts[2:]) or not all(parts[:2]):
            raise ValueError(f"not a host record: {text!r}")
        return cls(parts[0], parts[1], *(int(p) for p in parts[2:]))


@dataclass(frozen=True)
class Hosts:
    """Every rank's record, by rank, and a nonce the exchange made (it names the
    hosts' shared memory): what ``Worker(..., hosts=...)`` takes when the ranks
    exchanged their records already (the torch backend, through its store)."""

    records: tuple[HostRecord, ...]
    nonce: str


def local_segment() -> int:
    """Elements of a local-stage segment that SWITCHML_LOCAL_SEGMENT (bytes) asks
    for, in whole multiples of 1024 elements; 0 where it is not set (the job
    chooses: ``auto_segment``)."""
    size = env("LOCAL_SEGMENT", 0, int)
    if not size:
        return 0
    elements = size // 4 // 1024 * 1024
    if elements < 1024:
        raise ValueError(f"SWITCHML_LOCAL_SEGMENT={size}: at least 4096 bytes")
    return elements


def auto_segment(ranks: int, cores: int, free_shm: int = 0) -> int:
    """Elements of a segment for a host of ``ranks`` ranks on ``cores`` cores where
    none is asked for: 2 MiB for each thread a rank copies and sums with
    (``auto_local_threads``), so that each thread's share of a segment stays as
    large as one thread's whole segment (on a 16-core host, with 4 threads a
    rank, 8 MiB took 10-15% off a CPU call of 45 MiB and half off a CUDA one);
    halved, down to 2 MiB, while the host's shared memory would take more than
    half of ``free_shm`` (bytes free in /dev/shm; 0: unknown)."""
    least = DEFAULT_LOCAL_SEGMENT // 4
    elements = least * auto_local_threads(ranks, cores)
    while free_shm and elements > least and _shared_bytes(ranks, elements) > free_shm // 2:
        elements //= 2
    return elements


def _shared_bytes(ranks: int, elements: int) -> int:
    """What a host's shared memory (``memory.Layout``) takes for ``ranks`` ranks and
    segments of ``elements``, its header of a page or two aside: every slot holds
    an area a rank and a result area."""
    return LOCAL_SLOTS * (ranks + 1) * elements * 4


def _free_shm() -> int:
    try:
        stat = os.statvfs("/dev/shm")
    except OSError:
        return 0
    return stat.f_bavail * stat.f_frsize


def host_record(group: str | None = None) -> HostRecord:
    """This process's record.  ``group``: SWITCHML_LOCAL_GROUP unless given (ranks
    of one host that name different groups do not combine)."""
    group = env("LOCAL_GROUP", "") if group is None else group
    boot, net = _boot_id(), _inode("/proc/self/ns/net")
    shm = _inode("/dev/shm")
    machine = _digest(boot, net)
    if shm is None:  # no shared memory to combine in: a host of its own
        memory = _digest(boot, net, "pid", os.getpid())
    else:
        memory = _digest(boot, net, shm, _inode("/proc/self/ns/ipc"),
                         _inode("/proc/self/ns/pid"), os.getuid(), group)
    return HostRecord(memory, machine, os.getpid(), local_segment(), usable_cores(),
                      _free_shm())


def shard_job(job: str, shard: int) -> str:
    """The name of the switch job that sums shard ``shard`` of job ``job``'s calls."""
    return f"{job}.shard{shard}"


@dataclass(frozen=True)
class Placement:
    """The plan of a job's ranks from their records: the same on every rank.

    ``groups``: the ranks of each host (by group index), ``shards``: how many
    ranks of each host send a shard through the switch.  For ``rank``:
    ``group`` (its host's index, its rank in the shard jobs), ``index`` (its
    place among its host's ranks), ``peers`` (its host's ranks) and ``shard``
    (the shard it sums and sends, or None).
    """

    rank: int
    groups: tuple[tuple[int, ...], ...]
    records: tuple[HostRecord, ...]

    @classmethod
    def of(cls, records, rank: int) -> Placement:
        records = tuple(records)
        if not 0 <= rank < len(records):
            raise ValueError(f"rank {rank} is outside 0..{len(records) - 1}")
        segments = sorted({record.segment for record in records})
        if len(segments) > 1:
            said = "; ".join(f"ranks {[r for r, rec in enumerate(records) if rec.segment == s]}"
                             + (f" {s * 4} bytes" if s else " nothing") for s in segments)
            raise JoinRefusedError(f"the ranks cut their calls into local-stage segments of "
                                   f"different sizes (SWITCHML_LOCAL_SEGMENT: {said}): set "
                                   "it alike on every rank, or on none")
        by_memory: dict[str, list[int]] = {}
        for r, record in enumerate(records):
            by_memory.setdefault(record.memory, []).append(r)
        groups = tuple(sorted((tuple(ranks) for ranks in by_memory.values()),
                              key=lambda g: g[0]))
        return cls(rank, groups, records)

    @cached_property
    def segment(self) -> int:
        """Elements of every local-stage segment: what the ranks were told (alike:
        checked), else ``auto_segment`` of the host that takes the smallest."""
        if self.records[0].segment:
            return self.records[0].segment
        return min(auto_segment(len(group), min(self.records[r].cores for r in group),
                                min((self.records[r].free_shm for r in group
                                     if self.records[r].free_shm), default=0))
                   for group in self.groups)

    @property
    def hosts(self) -> int:
        return len(self.groups)

    @property
    def shards(self) -> int:
        return min(len(g) for g in self.groups)

    @property
    def group(self) -> int:
        return next(g for g, ranks in enumerate(self.groups) if self.rank in ranks)

    @property
    def peers(self) -> tuple[int, ...]:
        return self.groups[self.group]

    @property
    def index(self) -> int:
        return self.peers.index(self.rank)

    @property
    def shard(self) -> int | None:
        return self.index if self.index < self.shards else None

    @property
    def combines(self) -> bool:
        """Whether any host has several ranks (else every rank goes to the switch)."""
        return any(len(g) > 1 for g in self.groups)

    def shard_members(self, shard: int) -> tuple[int, ...]:
        """The ranks that send shard ``shard``, one a host, by host index."""
        return tuple(g[shard] for g in self.groups)

    def apart(self) -> list[tuple[int, ...]]:
        """Groups of ranks that share a machine's network but not its memory: each
        group of the machine stays a host of its own (another IPC namespace or
        /dev/shm, another user, another SWITCHML_LOCAL_GROUP)."""
        machines: dict[str, set[str]] = {}
        for record in self.records:
            machines.setdefault(record.machine, set()).add(record.memory)
        return [tuple(r for r, rec in enumerate(self.records) if rec.machine == machine)
                for machine, memories in machines.items() if len(memories) > 1]

    def describe(self) -> str:
        sizes = sorted({len(g) for g in self.groups})
        each = " or ".join(map(str, sizes))
        return (f"{len(self.records)} ranks on {self.hosts} host(s) of {each} rank(s); "
                f"{self.shards} shard(s) a host through the switch")
