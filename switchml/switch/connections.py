"""The switch's control connections: accepted, read and answered, and hung up on
for a reason.

``Switch`` (server.py) takes these methods from ``ControlConnections``; its
serving thread calls them between batches of datagrams.  Replies are queued per
connection and sent without blocking: a client that does not read them is hung
up on, never waited for.  Every hang-up is counted by its reason:
``control_bad_message`` (not JSON lines), ``control_slow_reader`` (replies not
read), ``control_lost`` (the connection failed: reset, or timed out by TCP
keepalive); a client closing is not one.  Connections that have not joined a
job wait in the ``Lobby`` (lobby.py): closed when they do not join within its
deadline (``control_join_deadline``), or to make room under its caps
(``control_source_cap``, ``control_unjoined_cap``), so that no flood of them
takes the descriptors that members and joins need; members are never closed
for them.
"""

from __future__ import annotations

import logging
import selectors
import socket
import threading
import time
from collections import Counter
from typing import TYPE_CHECKING

from ..netutil import LineReader, enable_keepalive, encode_line, unacknowledged
from ..protocol import Error, StatsQuery, StatusQuery
from .control import Controller
from .lobby import REASONS, Closing, Lobby
from .racks.control import RackController

if TYPE_CHECKING:
    from .dataplane.pipeline import Pipeline
    from .racks.uplinks import Uplinks

log = logging.getLogger("switchml.switch")

#: Bytes of control replies its client has not acknowledged, queued in the switch or
#: in its kernel's send buffer, after which a connection that does not read is closed.
MAX_CONTROL_BACKLOG = 4 << 20
#: Seconds the listener rests after accept() failed (out of file descriptors, say).
ACCEPT_PAUSE = 0.2
#: Connections accepted at most per look at the listener: a flood is taken off the
#: kernel's accept queue quickly (where a full queue would drop a job's SYN, and its
#: connect would wait a second for the retry), between looks at the members.
ACCEPT_BATCH = 64
#: Seconds between looks for connections that stopped being members (their job ended
#: or was refused while they stay open): they wait in the lobby again.
LOBBY_SWEEP_INTERVAL = 1.0
#: ... and the soonest look after a request or a close that may have ended a job
#: (at most one look this often, whatever the rate of joins and leaves).
LOBBY_SWEEP_SOON = 0.05
#: Requests after which a connection that is no member may have ended others' jobs.
MEMBERSHIP_REQUESTS = ("join", "rack_join", "prove", "leave", "abort")
#: Seconds between the WARNING summaries of connections the lobby closed.
LOBBY_LOG_INTERVAL = 10.0
#: Requests an operator makes without joining: answered, they renew the join deadline.
OPERATOR_REQUESTS = (StatsQuery.name, StatusQuery.name)
#: The pipeline counter of each of the lobby's reasons to close a connection.
LOBBY_COUNTERS = {reason: f"control_{reason}" for reason in REASONS}
#: Every reason a control connection is hung up on, as ``stats()["control"]["closed"]``.
CLOSE_REASONS = ("bad_message", "slow_reader", "lost", *REASONS)


class _Connection:
    """A control connection: its socket, the lines it sent so far, replies not yet sent."""

    __slots__ = ("sock", "source", "reader", "outbox")

    def __init__(self, sock: socket.socket, source: str):
        self.sock = sock
        self.source = source
        self.reader = LineReader()
        self.outbox = bytearray()

class ControlConnections:
    """``Switch``'s control connections.  What it uses of the switch: its listener
    (``_sockets``), selector, lock, controller (``_control``), pipeline (whose
    counters count the hang-ups), lobby, a rack switch's uplinks, and the
    keepalive its connections get."""

    keepalive: float
    pipeline: Pipeline
    lobby: Lobby
    descriptor_limit: int | None
    _lock: threading.RLock
    _conns: dict[socket.socket, _Connection]
    _uplinks: Uplinks | None
    _next_lobby_sweep: float
    _lobby_closed_logged: Counter
    _lobby_sources: Counter

    @property
    def _sockets(self) -> tuple[socket.socket, socket.socket]:
        raise NotImplementedError

    @property
    def _control(self) -> Controller | RackController:
        raise NotImplementedError

    @property
    def _selector(self) -> selectors.BaseSelector:
        raise NotImplementedError

    def _control_stats(self) -> dict:
        """The control connections: held, waiting to join, the lobby's settings, and
        every hang-up by reason (``CLOSE_REASONS``)."""
        counters = self.pipeline.counters
        return {
            "connections": len(self._conns),
            "unjoined": len(self.lobby),
            "join_deadline_s": self.lobby.deadline,
            "max_unjoined": self.lobby.max_total,
            "max_unjoined_per_source": self.lobby.max_per_source,
            "descriptor_limit": self.descriptor_limit,
            "closed": {reason: counters.get(f"control_{reason}", 0) for reason in CLOSE_REASONS},
        }

    def _accept(self) -> bool:
        """Accept up to ACCEPT_BATCH control connections, each into the lobby (which
        may close older ones that wait); False when accept() failed (no descriptors)."""
        listener = self._sockets[0]
        for _ in range(ACCEPT_BATCH):
            try:
                sock, addr = listener.accept()
            except BlockingIOError:
                return True
            except OSError as exc:
                self.pipeline.counters["control_accept_errors"] += 1
                log.warning("cannot accept control connections for %gs: %s", ACCEPT_PAUSE, exc)
                return False
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            enable_keepalive(sock, self.keepalive)
            conn = self._conns[sock] = _Connection(sock, addr[0])
            self._selector.register(sock, selectors.EVENT_READ, conn)
            with self._lock:
                self._close_for_lobby(self.lobby.arrive(sock, conn.source, time.monotonic()))
            # A client sends its join as it connects: often here already, taken now,
            # it never waits in the lobby among a flood that would push it out.
            self._on_control(conn)
        return True

    # -------------------------------------------------------------- the lobby
    def _close_for_lobby(self, closings: list[Closing]) -> None:
        """Close what the lobby let go, each counted by its reason (under the lock).
        Each gets a last look first: a complete request it sent that is not read
        yet is taken, and a connection it made a member stays (part of a line
        does not save it)."""
        for closing in closings:
            conn = self._conns.get(closing.conn)
            if conn is None:
                continue
            self._on_control(conn, settle=False)
            if conn.sock not in self._conns or self._control.holds(conn.sock):
                continue
            self.pipeline.counters[LOBBY_COUNTERS[closing.reason]] += 1
            self._lobby_sources[closing.source] += 1
            log.debug("closing a control connection from %s that did not join: %s",
                      closing.source, closing.reason)
            self._close(conn)

    def _expire_lobby(self, now: float) -> None:
        deadline = self.lobby.next_deadline()
        if deadline is not None and deadline <= now:
            with self._lock:
                self._close_for_lobby(self.lobby.expire(now))

    def _settle(self, conn: _Connection, messages: list, now: float) -> None:
        """After ``conn``'s requests: a member leaves the lobby; a connection that
        stopped being one (its job ended or was refused) waits there again; an
        operator's answered request gives it a fresh deadline (under the lock)."""
        sock = conn.sock
        if sock not in self._conns:
            return
        if self._control.holds(sock):
            self.lobby.leave(sock)
            return
        ops = {m.get("op") for m in messages if isinstance(m, dict)}
        if not ops.isdisjoint(MEMBERSHIP_REQUESTS):  # others' jobs may have ended with it
            self._sweep_lobby_soon(now)
        if sock not in self.lobby:
            self._close_for_lobby(self.lobby.arrive(sock, conn.source, now))
        elif not ops.isdisjoint(OPERATOR_REQUESTS):
            self.lobby.renew(sock, now)

    def _sweep_lobby_soon(self, now: float) -> None:
        self._next_lobby_sweep = min(self._next_lobby_sweep, now + LOBBY_SWEEP_SOON)

    def _sweep_lobby(self, now: float) -> None:
        """Connections neither members nor waiting (another's request ended their job)
        wait in the lobby again."""
        with self._lock:
            control = self._control
            for sock, conn in list(self._conns.items()):
                if sock in self._conns and sock not in self.lobby and not control.holds(sock):
                    self._close_for_lobby(self.lobby.arrive(sock, conn.source, now))

    def _log_lobby(self) -> None:
        """One WARNING line with what the lobby closed since the last one, if anything."""
        with self._lock:
            closed = Counter({reason: self.pipeline.counters.get(counter, 0)
                              for reason, counter in LOBBY_COUNTERS.items()})
            fresh = closed - self._lobby_closed_logged
            self._lobby_closed_logged = closed
            sources, self._lobby_sources = self._lobby_sources, Counter()
        if fresh:
            top = ", ".join(f"{source} {n}" for source, n in sources.most_common(3))
            log.warning("closed %d control connections that did not join (%s); most from %s",
                        sum(fresh.values()), ", ".join(f"{reason} {n}" for reason, n in
                                                       sorted(fresh.items())), top)

    def _on_control(self, conn: _Connection, *, settle: bool = True) -> None:
        """Read and answer what ``conn`` sent; ``settle``: then its place in the lobby
        follows (``_settle``), not while the lobby is closing it."""
        try:
            data = conn.sock.recv(65536)
            messages = conn.reader.feed(data) if data else None
        except BlockingIOError:  # nothing yet (a look when accepted, or a last look)
            return
        except OSError as exc:
            self._hang_up(conn, "control_lost", logging.INFO, "control connection lost: %s", exc)
            return
        except ValueError as exc:  # not JSON lines: hang up on it
            self._hang_up(conn, "control_bad_message", logging.INFO,
                          "closing a control connection that sent a bad message: %s", exc)
            return
        with self._lock:
            if messages is None:  # the client closed it
                self._close(conn)
                return
            if not messages:  # part of a line: it buys no time (the lobby's deadline)
                return
            replies: list = []
            for message in messages:
                answer = self._guarded(self._control.handle_message, conn.sock, message)
                replies += [(conn.sock, Error("internal error").to_dict())] \
                    if answer is None else answer
            self._send(replies)
            if settle:
                self._settle(conn, messages, time.monotonic())

    def _guarded(self, handle, *args) -> list | None:
        """The controller's answer to ``handle(*args)``; None where it failed: a bug
        there is logged and counted (``internal_errors``), and the switch serves on
        (under the lock)."""
        try:
            return handle(*args)
        except Exception:  # a bug must not take the switch down
            self.pipeline.counters["internal_errors"] += 1
            log.exception("the controller failed on %s%r", handle.__name__, args[1:])
            return None

    def _hang_up(self, conn: _Connection, counter: str, level: int, why: str, *args) -> None:
        """Close a control connection for a reason, counted as ``counter`` and logged;
        the count and the close are one step for ``stats()``."""
        with self._lock:
            if conn.sock not in self._conns:  # closed already
                return
            self.pipeline.counters[counter] += 1
            log.log(level, why, *args)
            self._close(conn)

    def _close(self, conn: _Connection) -> None:
        """Forget a control connection; the controller fails or shrinks its job."""
        if self._conns.pop(conn.sock, None) is None:
            return
        if conn.sock not in self.lobby:  # a member: its job fails or shrinks
            self._sweep_lobby_soon(time.monotonic())
        self.lobby.leave(conn.sock)
        self._selector.unregister(conn.sock)
        replies = self._guarded(self._control.handle_disconnect, conn.sock) or []
        conn.sock.close()
        self._send(replies)

    def _send(self, replies) -> None:
        if self._uplinks is not None:  # a rack switch's requests for its spine
            replies = self._uplinks.carry_out(replies)
        for sock, message in replies:
            conn = self._conns.get(sock)
            if conn is not None:
                conn.outbox += encode_line(message)
                self._flush(conn)

    def _flush(self, conn: _Connection) -> None:
        """Send what the socket takes now; watch for writability while replies remain.

        The backlog bound counts the replies the kernel took but the client did not
        acknowledge: the kernel's send buffer grows to some MiB, and a client that
        does not read could otherwise fill it, stall its side of the exchange, and
        be timed out by TCP (``control_lost``) before the switch's own queue grew.
        """
        try:
            while conn.outbox:
                del conn.outbox[: conn.sock.send(conn.outbox)]
        except BlockingIOError:
            pass
        except OSError as exc:  # reset, or timed out: the client is gone
            self._hang_up(conn, "control_lost", logging.INFO, "control connection lost: %s", exc)
            return
        backlog = len(conn.outbox) + unacknowledged(conn.sock)
        if backlog > MAX_CONTROL_BACKLOG:
            self._hang_up(conn, "control_slow_reader", logging.WARNING,
                          "closing a control connection that does not read its replies "
                          "(%d bytes not acknowledged)", backlog)
            return
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if conn.outbox else 0)
        if self._selector.get_key(conn.sock).events != events:
            self._selector.modify(conn.sock, events, conn)
