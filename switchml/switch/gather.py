"""Allgathers among a job's ranks on the control port, sans-IO (``protocol.Gather``).

Before they join, the ranks of a job exchange their host records this way
(worker/local/hosts.py): who shares a host, and so how the job's calls are cut.  A
gathering is keyed by the job's name and key (``protocol.Gather.key``: the
job's identity, as for a join) and lives only until every rank sent its value:
then each gets ``Gathered`` with all of them, by rank, and a random nonce, and
the switch forgets it.  While ranks are missing, the present ones get
``Joined`` as a job's ranks do, so that a rank that gives up names the missing
ones; a gathering's first rank under a name that ranks of another key gather
under is told so, and they are told of it, as for joins (``control.py``).  A
rank that disconnects before the end drops out of its gathering.
Nothing here touches the data plane: a gathering holds no slots.
"""

from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass, field

from ..protocol import Gather, Gathered, Joined, OtherSecretSeen, OtherSecretWaiting

log = logging.getLogger("switchml.switch")

__all__ = ["Gatherings", "GatherRefused"]


class GatherRefused(Exception):
    """A gather the switch will not take: ``reason`` (a counter's name) and the message."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


@dataclass
class _Gathering:
    world_size: int
    values: dict = field(default_factory=dict)  # rank -> value
    conns: dict = field(default_factory=dict)   # rank -> connection


class Gatherings:
    """The open gatherings.  Each connection holds one rank's value, of at most
    ``protocol.MAX_NAME`` characters, so their memory grows with the connections
    the switch holds, as joins' does, and they have no cap of their own: a cap
    that idle gatherings could fill would lock every job out of the switch."""

    def __init__(self) -> None:
        self._open: dict[tuple, _Gathering] = {}  # (job name, key) -> its gathering
        self._conn: dict = {}  # connection -> ((job name, key), rank)

    def __len__(self) -> int:
        return len(self._open)

    def holds(self, conn) -> bool:
        """Whether ``conn`` holds a rank of an open gathering."""
        return conn in self._conn

    def gather(self, conn, request: Gather) -> list:
        """Take one rank's value: (connection, event) pairs to send; GatherRefused."""
        name, ident = request.job, (request.job, request.key)
        if conn in self._conn:
            raise GatherRefused("bad_request", "this connection already gathers")
        entry = self._open.get(ident)
        created = entry is None
        if entry is None:
            entry = self._open[ident] = _Gathering(request.world_size)
        elif entry.world_size != request.world_size:
            raise GatherRefused("world_size_mismatch",
                                f"job '{name}' gathers {entry.world_size} ranks, this "
                                f"rank says {request.world_size}")
        if request.rank in entry.values:
            raise GatherRefused("duplicate_rank",
                                f"rank {request.rank} of job '{name}' is gathering already")
        entry.values[request.rank] = request.value
        entry.conns[request.rank] = conn
        self._conn[conn] = (ident, request.rank)
        if len(entry.values) < entry.world_size:
            present = Joined(name, tuple(sorted(entry.values)))
            news = self._other_secrets(ident, conn, request.rank) if created else []
            return [(c, present) for c in entry.conns.values()] + news
        del self._open[ident]
        for c in entry.conns.values():
            del self._conn[c]
        done = Gathered(name, tuple(entry.values[r] for r in range(entry.world_size)),
                        secrets.token_hex(8))
        return [(c, done) for c in entry.conns.values()]

    def _other_secrets(self, ident: tuple, conn, rank: int) -> list:
        """A gathering's first rank, under a name that ranks of another key gather
        under: as ``Controller._other_secrets`` for joins."""
        name, key = ident
        others = [g for (other_name, other_key), g in self._open.items()
                  if other_name == name and other_key != key]
        if not others:
            return []
        log.warning("job %s: rank %d gathers with another secret than ranks of that name "
                    "gathering here (a mistyped secret, or a process without it)", name, rank)
        seen = OtherSecretSeen(name)
        out: list = [(c, seen) for g in others for c in g.conns.values()]
        if any(g.world_size == self._open[ident].world_size and rank not in g.values
               for g in others):
            out.append((conn, OtherSecretWaiting(name)))
        return out

    def disconnect(self, conn) -> list:
        """A connection closed: its rank leaves its gathering (the others are told)."""
        held = self._conn.pop(conn, None)
        if held is None:
            return []
        ident, rank = held
        entry = self._open[ident]
        del entry.values[rank], entry.conns[rank]
        if not entry.values:
            del self._open[ident]
            return []
        present = Joined(ident[0], tuple(sorted(entry.values)))
        return [(c, present) for c in entry.conns.values()]

    def describe(self) -> list:
        """The open gatherings: job, world size, ranks present."""
        return [{"job": name, "world_size": g.world_size, "present": sorted(g.values)}
                for (name, _key), g in self._open.items()]
