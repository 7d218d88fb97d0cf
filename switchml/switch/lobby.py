"""Control connections that have not joined yet, sans-IO: their deadline and their caps.

A connection to the switch's control port costs a descriptor and a little memory
until something closes it.  Members of jobs are worth that; a connection that
never joins is not, and enough of them (a flood, a scan, clients that hang)
would leave no descriptor for the members and joins that matter.  So every
connection waits in the lobby from the moment it is accepted until it holds a
rank of a job or of a gathering (``Controller.holds``), and while there:

* it must join within ``deadline`` seconds of its arrival, or it is closed
  (``join_deadline``).  Bytes do not buy time: a line that arrives byte by byte
  is as late as one that never comes.  An operator's request answered there
  (``stats``, ``status``) starts a fresh deadline, so a monitor may keep its
  connection and ask again.
* at most ``max_per_source`` connections from one source address and at most
  ``max_total`` in all wait at once.  One more arriving closes the oldest that
  waits, from its own source (``source_cap``) or else of all (``unjoined_cap``),
  so a new join always finds room, and one source's flood takes room from that
  source alone.

A member is never in the lobby, so nothing here ever closes one.  A connection
whose job ended (or was refused) while it stays open enters again, with a fresh
deadline (``arrive``).

Nothing here reads a clock or touches a socket: the server passes the time in,
closes what ``arrive`` and ``expire`` return (counting them by their reason), and
wakes up at ``next_deadline``.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

__all__ = ["Lobby", "Closing", "JOIN_DEADLINE", "SOURCE_CAP", "UNJOINED_CAP"]

#: Why the lobby closes a connection (its counters' names).
JOIN_DEADLINE = "join_deadline"
SOURCE_CAP = "source_cap"
UNJOINED_CAP = "unjoined_cap"
REASONS = (JOIN_DEADLINE, SOURCE_CAP, UNJOINED_CAP)


@dataclass(frozen=True)
class Closing:
    """Close ``conn`` (from ``source``) for ``reason``: one of ``REASONS``."""

    conn: Any
    source: str
    reason: str


class Lobby:
    """The connections waiting to join, oldest deadline first."""

    def __init__(self, deadline: float, max_total: int, max_per_source: int):
        if not deadline > 0:
            raise ValueError(f"the join deadline must be above 0 seconds, got {deadline}")
        if max_total < 1 or max_per_source < 1:
            raise ValueError(f"the caps on connections not joined must be at least 1, got "
                             f"{max_total} in all and {max_per_source} a source")
        self.deadline = float(deadline)
        self.max_total = max_total
        self.max_per_source = min(max_per_source, max_total)
        # conn -> (source, deadline), in the order of the deadlines: each one's is
        # later than those before it (arrival or renewal is the latest).
        self._waiting: OrderedDict[Any, tuple[str, float]] = OrderedDict()
        self._by_source: dict[str, OrderedDict[Any, None]] = {}

    def __len__(self) -> int:
        return len(self._waiting)

    def __contains__(self, conn) -> bool:
        return conn in self._waiting

    def sources(self) -> dict[str, int]:
        """Connections waiting, by source address."""
        return {source: len(conns) for source, conns in self._by_source.items()}

    def arrive(self, conn, source: str, now: float) -> list[Closing]:
        """``conn`` from ``source`` waits to join until ``now + deadline``.  Returns
        the connections to close to make room for it: the oldest
        of its own source when that source is at its cap, else the oldest of all
        when the lobby is full."""
        self.leave(conn)
        out: list[Closing] = []
        mine = self._by_source.get(source)
        if mine is not None and len(mine) >= self.max_per_source:
            out.append(self._evict(next(iter(mine)), SOURCE_CAP))
        elif len(self._waiting) >= self.max_total:
            out.append(self._evict(next(iter(self._waiting)), UNJOINED_CAP))
        self._waiting[conn] = (source, now + self.deadline)
        self._by_source.setdefault(source, OrderedDict())[conn] = None
        return out

    def renew(self, conn, now: float) -> None:
        """An operator's request on ``conn`` was answered: a fresh deadline."""
        held = self._waiting.pop(conn, None)
        if held is not None:
            self._waiting[conn] = (held[0], now + self.deadline)
            self._by_source[held[0]].move_to_end(conn)

    def leave(self, conn) -> None:
        """``conn`` joined, or closed: it no longer waits."""
        held = self._waiting.pop(conn, None)
        if held is None:
            return
        source = held[0]
        mine = self._by_source[source]
        del mine[conn]
        if not mine:
            del self._by_source[source]

    def expire(self, now: float) -> list[Closing]:
        """The connections whose deadline is ``now`` or past, to close."""
        out = []
        while self._waiting:
            conn, (_, deadline) = next(iter(self._waiting.items()))
            if deadline > now:
                break
            out.append(self._evict(conn, JOIN_DEADLINE))
        return out

    def next_deadline(self) -> float | None:
        """When ``expire`` has something to close next; None: nothing waits."""
        if not self._waiting:
            return None
        return next(iter(self._waiting.values()))[1]

    def _evict(self, conn, reason: str) -> Closing:
        source = self._waiting[conn][0]
        self.leave(conn)
        return Closing(conn, source, reason)
