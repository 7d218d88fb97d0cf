"""The software switch behind real sockets: UDP data plane, TCP control plane.

One thread runs everything: it drains the UDP socket through the pipeline and
serves control connections in between, so the sans-IO pipeline and controller
never see concurrent calls.  With the C data plane and ``threads`` above 1, the
datagrams are the C core's own data threads' instead: one socket each, bound to
the port in one SO_REUSEPORT group whose steering program gives each datagram
to the thread owning its slot (``fastpipeline.steer_by_slot``); the serving
thread keeps the control connections, and a data thread's failure stops the
switch with an error (``failure``).  The control port and the data port have the same
number (TCP and UDP).  Control replies are queued per connection and sent without
blocking: a client that does not read them is hung up on, never waited for.  Every
hang-up is counted by its reason: ``control_bad_message`` (not JSON lines),
``control_slow_reader`` (replies not read), ``control_lost`` (the connection
failed: reset, or timed out by TCP keepalive); a client closing is not one.
Connections that have not joined a job wait in the ``Lobby``: closed when they
do not join within ``join_deadline`` (``control_join_deadline``), or to make
room under its caps (``control_source_cap``, ``control_unjoined_cap``), so that
no flood of them takes the descriptors that members and joins need; members are
never closed for them.  At start the switch raises its soft descriptor limit to
the hard one and refuses a configuration that cannot fit in it
(``descriptors.py``).
Optionally, Prometheus metrics are served over HTTP on their own thread; they are
read from the counters at scrape time (see ``metrics.py``).
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import selectors
import socket
import struct
import sys
import threading
import time
from collections import Counter
from typing import TYPE_CHECKING

from ..auth import read_token, token_from_env
from ..config import SwitchConfiguration, auto_switch_threads, env, parse_address
from ..errors import DataPlaneUnavailableError, SwitchMLError
from ..netutil import (
    LineReader,
    drain_error_queue,
    enable_keepalive,
    encode_line,
    enlarge_buffers,
    forbid_fragmentation,
    is_loopback,
    report_local_drops,
    route_mtu,
    send_when_room,
    unacknowledged,
)
from ..protocol import Error, StatsQuery, StatusQuery
from . import descriptors
from .control import Controller
from .dataplane import fastpipeline
from .dataplane.pipeline import Pipeline
from .lobby import REASONS, Closing, Lobby
from .racks.control import RackController
from .racks.pipeline import RackPipeline, Uplink
from .racks.uplinks import Uplinks

if TYPE_CHECKING:  # imported when metrics are asked for: it needs prometheus-client
    from .metrics import MetricsServer
    from .xdp.pipeline import XdpPipeline  # imported when data_plane="xdp"

log = logging.getLogger("switchml.switch")

#: Datagrams handled between two looks at the control sockets.
DRAIN_BATCH = 256
#: linux/udp.h: a send's segment size, for UDP GSO; a GSO send's limits (the
#: kernel's UDP_MAX_SEGMENTS, and one IP packet's worth of payload)
UDP_SEGMENT = 103
#: linux/udp.h: a socket that takes a run of datagrams that arrived whole in one
#: receive (the C data plane cuts it)
UDP_GRO = 104
GSO_SEGMENTS = 64
GSO_BYTES = 65507
#: The same for the C data plane, whose datagrams cost a few microseconds each.
FAST_DRAIN_BATCH = 2048
#: Seconds between readings of the serving thread's CPU time (``cpu_s`` in stats).
CPU_READ_INTERVAL = 0.1
#: Seconds between looks for XDP switches gone from the interface (killed),
#: whose programs and maps the dispatcher would hold until another switch there
#: comes or goes.
XDP_SWEEP_INTERVAL = 1.0
#: Bytes of control replies its client has not acknowledged, queued in the switch or
#: in its kernel's send buffer, after which a connection that does not read is closed.
MAX_CONTROL_BACKLOG = 4 << 20
#: Seconds the listener rests after accept() failed (out of file descriptors, say).
ACCEPT_PAUSE = 0.2
#: Seconds between the DEBUG summaries of dropped packets (never one line per packet).
DROP_LOG_INTERVAL = 10.0
#: Connections accepted at most per look at the listener: a flood is taken off the
#: kernel's accept queue quickly (where a full queue would drop a job's SYN, and its
#: connect would wait a second for the retry), between looks at the members.
ACCEPT_BATCH = 64
#: The listener's accept queue (the kernel caps it at net.core.somaxconn).
LISTEN_BACKLOG = 4096
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


class Switch:
    """A software switch: ``with Switch() as sw: ...`` or ``start()`` / ``stop()``.

    Its settings are a ``config.SwitchConfiguration``: the keyword arguments
    given (``slots=64``, ... every field of it; ``host`` and ``port`` also by
    position), then SWITCHML_* variables, then the defaults; or
    ``configuration`` as it is, with the keyword arguments given over it.  The
    port defaults to 0: any free one (``address`` once started).
    """

    #: Seconds between DEBUG summaries of dropped packets; tests shorten it.
    drop_log_interval = DROP_LOG_INTERVAL
    #: C data plane: results to one worker leave as UDP GSO segments (bench compares).
    udp_gso = True
    #: C data plane: a worker's run of contributions that reaches the switch's
    #: socket whole (a worker on this host: loopback, a veth) is received whole,
    #: one receive instead of one a datagram, and cut in C (bench compares).
    udp_gro = True

    def __init__(self, host: str | None = None, port: int | None = None, *,
                 configuration: SwitchConfiguration | None = None, **settings):
        config = SwitchConfiguration.given(host, port, configuration, settings)
        #: The settings it runs with, wherever each came from.
        self.configuration = config
        self.keepalive = config.keepalive
        if config.metrics_port is not None:
            from .metrics import require_prometheus_client
            require_prometheus_client()  # fail here, not after the switch started
        fastpath = config.fastpath if config.data_plane is None else config.data_plane == "c"
        if fastpath is None:
            fastpath = fastpipeline.available() and config.upstream is None
        #: True when the data plane runs in C (FastPipeline and its socket loop).
        self.fastpath = bool(fastpath)
        if config.threads is not None and config.threads > 1 and not self.fastpath:
            raise DataPlaneUnavailableError(
                f"threads={config.threads} needs the C data plane, which is not built here "
                "(or SWITCHML_PURE_PYTHON=1)")
        #: "python", "c" or "xdp": where datagrams are aggregated.
        self.data_plane = config.data_plane or ("c" if self.fastpath else "python")
        #: Data threads of the C data plane (1: the serving thread drains the socket).
        self.threads = data_threads(config, self.data_plane)
        #: A rack switch's spine (host, port); None: a switch of one level.
        self.upstream = parse_address(config.upstream) if config.upstream else None
        self.pipeline: Pipeline
        if self.data_plane == "xdp":
            #: How the XDP program attaches (SWITCHML_XDP_MODE): "auto", the
            #: driver's native mode where it has one, else generic; "generic".
            self.xdp_mode = env("XDP_MODE", "auto").strip().lower()
            if self.xdp_mode not in ("auto", "generic"):
                raise ValueError(f"SWITCHML_XDP_MODE={self.xdp_mode!r}: auto (driver mode "
                                 f"where the interface has one, else generic) or generic")
            self.pipeline = _xdp_pipeline(config)
        else:
            pipeline_class = (RackPipeline if self.upstream else
                              fastpipeline.FastPipeline if self.fastpath else Pipeline)
            threaded = {"threads": self.threads} if self.threads > 1 else {}
            self.pipeline = pipeline_class(
                config.slots, config.packet_elements, block_elements=config.block_elements,
                drop_rate=config.drop_rate, egress_drop_rate=config.egress_drop_rate,
                seed=config.seed, **threaded)
        self._uplinks: Uplinks | None = None
        self._host = config.host
        self._port = config.port
        self._slots_per_job = config.slots_per_job
        self._max_jobs = config.max_jobs
        self._shared_link = config.shared_link
        # Read now: a missing or empty file fails the start, not a join.
        self._admission_token = (None if self.upstream else read_token(config.token_file)
                                 if config.token_file else token_from_env())
        self._metrics_port = config.metrics_port
        self._metrics_host = config.metrics_host or config.host
        self._metrics: MetricsServer | None = None
        self.metrics_address: tuple[str, int] | None = None
        self.controller: Controller | RackController | None = None
        self._lock = threading.RLock()
        self._thread: threading.Thread | None = None
        self._running = False
        self._tcp: socket.socket | None = None
        self._udp: socket.socket | None = None
        #: The data threads' sockets (threads > 1), the first being _udp.
        self._data_sockets: list[socket.socket] = []
        #: The socket takes UDP_GRO for the Python loop: a receive may be a run.
        self._socket_takes_runs = False
        #: Why the switch stopped serving by itself (a data thread failed); None.
        self.failure: SwitchMLError | None = None
        self._wake_r: socket.socket | None = None
        self._wake_w: socket.socket | None = None
        self.address: tuple[str, int] | None = None
        self._started_at = 0.0
        self._cpu_seconds = 0.0
        self._conns: dict[socket.socket, _Connection] = {}
        self._sel: selectors.BaseSelector | None = None
        self._drops_logged: Counter = Counter()
        self._next_drop_log = 0.0
        #: Control connections that have not joined: their deadline and caps.
        self.lobby = Lobby(config.join_deadline, config.max_unjoined,
                           config.max_unjoined_per_source)
        #: The soft RLIMIT_NOFILE the switch runs with (raised at start); None: none.
        self.descriptor_limit: int | None = None
        self._next_lobby_sweep = 0.0
        self._lobby_closed_logged: Counter = Counter()
        self._lobby_sources: Counter = Counter()  # sources of the closes not yet logged

    # -------------------------------------------------------------- lifecycle
    def start(self) -> Switch:
        if self._thread is not None:
            return self
        self.descriptor_limit = descriptors.raise_limit()
        descriptors.check_fits(self.configuration, self.descriptor_limit)
        tcp, udp = self._tcp, self._udp = _bind_pair(self._host, self._port,
                                                     reuse_port=self.threads > 1)
        self.address = (self._host, tcp.getsockname()[1])
        if self.threads > 1:
            try:
                self._data_sockets = _bind_group(udp, self.threads)
            except BaseException:
                tcp.close()
                udp.close()
                raise
        if isinstance(self.pipeline, fastpipeline.FastPipeline) and self.udp_gro:
            for sock in self._data_sockets or [udp]:
                _receive_runs_whole(sock)
        if self.data_plane == "xdp":
            try:  # the program takes the port's datagrams from here on
                ifindex = self._xdp.serve(self.address, mode=self.xdp_mode)
                if self._xdp.merges_results:  # GRO merges results only for a socket
                    _receive_runs_whole(udp)  # that takes runs (and they may reach it)
                    self._socket_takes_runs = True
            except BaseException:
                tcp.close()
                udp.close()
                self._xdp.close()  # unloaded: nothing of a switch that did not start stays
                raise
            log.info("XDP program attached (%s mode: %s) to %s%s; workers send %s",
                     self._xdp.mode, self._xdp.mode_reason, socket.if_indextoname(ifindex),
                     (", results fanned out by its TC program" if self._xdp.fans_out else "")
                     + (", in runs (GRO on)" if self._xdp.merges_results else ""),
                     "runs of UDP GSO segments" if self._xdp.takes_gso_runs else
                     "datagrams apart where their runs would reach the program whole")
        if self.upstream is not None:
            assert isinstance(self.pipeline, RackPipeline)
            uplinks = self._uplinks = Uplinks(self, self.upstream, self.keepalive)
            self.controller = RackController(self.pipeline, data_port=self.address[1],
                                             spine=uplinks.spine,
                                             uplink_address=uplinks.address_for,
                                             route_mtu=route_mtu, stats=self.stats)
        else:
            self.controller = Controller(
                self.pipeline, data_port=self.address[1], slots_per_job=self._slots_per_job,
                max_jobs=self._max_jobs, stats=self.stats,
                rcvbuf=udp.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF), route_mtu=route_mtu,
                shared_link=self._shared_link, admission_token=self._admission_token,
                loopback_only=is_loopback(tcp.getsockname()[0]))
        if self._metrics_port is not None:
            from .metrics import serve_metrics
            try:
                metrics = serve_metrics(self.stats, self._metrics_host, self._metrics_port)
            except BaseException:
                tcp.close()
                udp.close()
                if self.data_plane == "xdp":
                    self._xdp.detach()
                raise
            self._metrics = metrics
            self.metrics_address = metrics.address
        self._wake_r, self._wake_w = socket.socketpair()
        if self.threads > 1:
            try:  # a mismatch a data thread records wakes the serving thread
                self._fast.serve(self._data_sockets, self._wake_w.fileno(), self.udp_gso)
            except BaseException:
                for s in (tcp, *self._data_sockets, self._wake_r, self._wake_w):
                    s.close()
                if self._metrics is not None:
                    self._metrics.close()
                raise
        self._running = True
        self._started_at = time.monotonic()
        self._next_drop_log = self._started_at + self.drop_log_interval
        self._thread = threading.Thread(target=self._serve, name="switchml-switch", daemon=True)
        self._thread.start()
        log.info("switch listening on %s:%d (slots=%d, packet_elements=%d, max_jobs=%d, "
                 "descriptors=%s, data plane in %s%s)%s", *self.address, self.pipeline.slots,
                 self.pipeline.packet_elements, self._max_jobs,
                 self.descriptor_limit if self.descriptor_limit is not None else "unlimited",
                 {"c": "C", "python": "Python", "xdp": "XDP"}[self.data_plane],
                 "" if self.data_plane != "c" else
                 f", {self.threads} data thread{'s' if self.threads > 1 else ''}"
                 + (f" of {os.cpu_count()} cores: --threads sets it"
                    if self.configuration.threads is None else ""),
                 " as a rack switch under the spine at %s:%d" % self.upstream
                 if self.upstream else "")
        if config_chose_no_data_plane(self.configuration) and self.data_plane == "c" and \
                log.isEnabledFor(logging.INFO):  # (the reason loads libbpf: only if shown)
            log.info("XDP data plane not used: %s", why_not_xdp())
        if self.metrics_address:
            log.info("Prometheus metrics on http://%s:%d/metrics", *self.metrics_address)
        return self

    def stop(self) -> None:
        if self._thread is None:
            return
        self._running = False
        assert self._wake_w is not None
        self._wake_w.send(b"x")
        self._thread.join()
        self._thread = None
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None
        for s in (self._tcp, self._udp, *self._data_sockets[1:], self._wake_r, self._wake_w):
            if s is not None:
                s.close()
        if self.data_plane == "xdp":
            self._xdp.close()  # detached and unloaded: a stopped switch is not started again

    def __enter__(self) -> Switch:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def stats(self) -> dict:
        """Counters of the pool, of every job and of drops, admission, and CPU time."""
        with self._lock:
            stats = self.pipeline.stats()
            if self.controller is not None:
                stats["admission"] = self.controller.admission()
            stats = json.loads(json.dumps(stats))
            stats["control"] = self._control_stats()
        stats["data_plane"] = self.data_plane
        stats["uptime_s"] = time.monotonic() - self._started_at if self._thread else 0.0
        # the data threads' time read now: the serving thread, idle while they
        # work, reads its own only when it wakes
        stats["cpu_s"] = self._cpu_seconds + (self._fast.threads_cpu_s()
                                              if self.threads > 1 else 0.0)
        return stats

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

    def serve_forever(self) -> None:
        """Run until KeyboardInterrupt (for the CLI)."""
        self.start()
        assert self._thread is not None
        try:
            self._thread.join()
        finally:
            self.stop()
        if self.failure is not None:
            raise self.failure

    # -------------------------------------------------------------- the loop
    # What exists from start() on: the loop's methods run only then.
    @property
    def _sockets(self) -> tuple[socket.socket, socket.socket]:
        assert self._tcp is not None and self._udp is not None, "the switch is not started"
        return self._tcp, self._udp

    @property
    def _control(self) -> Controller | RackController:
        assert self.controller is not None, "the switch is not started"
        return self.controller

    @property
    def _rack_control(self) -> RackController:
        assert isinstance(self.controller, RackController), "not a rack switch"
        return self.controller

    @property
    def _selector(self) -> selectors.BaseSelector:
        assert self._sel is not None, "the switch is not started"
        return self._sel

    def _serve(self) -> None:
        tcp, udp = self._sockets
        wake = self._wake_r
        assert wake is not None
        sel = self._sel = selectors.DefaultSelector()
        sel.register(tcp, selectors.EVENT_READ, "accept")
        if self.threads == 1:  # else the data threads' own
            sel.register(udp, selectors.EVENT_READ, "data")
        sel.register(wake, selectors.EVENT_READ, "wake")
        buf = bytearray(65536)
        view = memoryview(buf)
        accept_paused_until = None
        next_cpu_read = next_sweep = 0.0
        next_lobby_log = time.monotonic()
        try:
            while self._running:
                with self._lock:
                    if self.threads > 1:
                        busy = False
                        if self._data_threads_failed():
                            break
                    elif self.fastpath:
                        busy = self._drain_fast()
                    else:  # Python, or what the XDP program passes up
                        busy = self._drain(buf, view)
                    if self.pipeline.has_mismatches:  # ranks disagree: fail their job now
                        self._send(self._control.handle_mismatches())
                        self._sweep_lobby_soon(time.monotonic())
                now = time.monotonic()
                if now >= next_cpu_read:  # a syscall: not once per batch of datagrams
                    next_cpu_read = now + CPU_READ_INTERVAL
                    self._cpu_seconds = time.thread_time()
                if now >= self._next_drop_log:
                    self._next_drop_log = now + self.drop_log_interval
                    self._log_drops()
                if self.data_plane == "xdp" and now >= next_sweep:
                    next_sweep = now + XDP_SWEEP_INTERVAL
                    for port in self._xdp.sweep_gone_switches():
                        log.info("the XDP switch of port %d on this interface is gone: its "
                                 "program is out of the dispatcher", port)
                    for name in self._xdp.adopt_new_ports():
                        log.info("port %s joined the bridge: served in driver mode", name)
                self._expire_lobby(now)
                if self._uplinks is not None:  # a rack switch's connects to its spine
                    self._uplinks.expire(now)
                if now >= self._next_lobby_sweep:
                    self._next_lobby_sweep = now + LOBBY_SWEEP_INTERVAL
                    self._sweep_lobby(now)
                if now >= next_lobby_log:
                    next_lobby_log = now + LOBBY_LOG_INTERVAL
                    self._log_lobby()
                wait = 0 if busy else min(1.0, self._next_drop_log - now)
                deadline = self.lobby.next_deadline()
                if deadline is not None:
                    wait = min(wait, deadline - now)
                wait = min(wait, self._next_lobby_sweep - now)
                connect = self._uplinks.next_deadline() if self._uplinks is not None else None
                if connect is not None:
                    wait = min(wait, connect - now)
                if accept_paused_until is not None:
                    if now >= accept_paused_until:
                        sel.register(tcp, selectors.EVENT_READ, "accept")
                        accept_paused_until = None
                    else:
                        wait = min(wait, accept_paused_until - now)
                for key, events in sel.select(max(0.0, wait)):
                    if key.data == "accept":
                        if not self._accept():
                            sel.unregister(tcp)
                            accept_paused_until = time.monotonic() + ACCEPT_PAUSE
                    elif key.data == "wake":
                        wake.recv(64)
                    elif isinstance(key.data, _Connection):
                        if events & selectors.EVENT_READ:
                            self._on_control(key.data)
                        if events & selectors.EVENT_WRITE and key.data.sock in self._conns:
                            self._flush(key.data)
                    elif callable(key.data):  # a rack switch's socket toward its spine
                        key.data(events)
        finally:
            if self.threads > 1:  # joined before stop() closes their sockets
                self._fast.stop_serving()
                self._cpu_seconds = time.thread_time()
            if self._uplinks is not None:
                self._uplinks.close_all()
            for conn in list(self._conns.values()):
                self.lobby.leave(conn.sock)
                sel.unregister(conn.sock)
                conn.sock.close()
            self._conns.clear()
            sel.close()

    def _drain(self, buf: bytearray, view: memoryview) -> bool:
        """The Python data plane: up to DRAIN_BATCH datagrams; True when there may be more.
        With the XDP data plane, what comes up is what the program did not answer
        itself (completed results for a rank it cannot reach, probes it had no
        room to answer, sparse contributions, which user space aggregates),
        each result for every rank: sent when the batch ends,
        those to one rank together (``_send_results``)."""
        if self.data_plane == "xdp":
            results: list = []
            try:
                return self._drain_into(buf, view, results.extend)
            finally:
                self._send_results(results)
        return self._drain_into(buf, view, self._send_datagrams)

    def _drain_into(self, buf: bytearray, view: memoryview, send) -> bool:
        udp, pipeline = self._sockets[1], self.pipeline
        runs = self._socket_takes_runs
        for _ in range(DRAIN_BATCH):
            try:
                if runs:  # UDP_GRO: a run of datagrams comes as one, its size beside it
                    n, ancillary, _flags, addr = udp.recvmsg_into([buf], GRO_CMSG_SPACE)
                    segment = _gro_segment(ancillary) or n
                else:
                    n, addr = udp.recvfrom_into(buf)
                    segment = n
            except BlockingIOError:
                return False
            except OSError as exc:  # e.g. ICMP errors surfacing on Linux
                pipeline.counters["socket_errors"] += 1
                log.debug("udp receive error: %s", exc)
                drain_error_queue(udp)
                continue
            for at in range(0, n, max(segment, 1)):
                end = min(at + segment, n)
                try:
                    replies = (self._xdp.passed_up(bytes(view[at:end]), addr)
                               if self.data_plane == "xdp" else
                               pipeline.receive_datagram(view[at:end], addr))
                except Exception:  # a bug must not take the switch down
                    pipeline.counters["internal_errors"] += 1
                    log.exception("pipeline failed on a datagram from %s", addr)
                    continue
                send(replies)
        return True

    def _send_results(self, replies) -> None:
        """Datagrams to workers, those of equal size to one worker as the segments of
        one UDP GSO send (as the C data plane sends a batch's results): one system
        call and one pass through the stack a run, not one a datagram.  A send the
        kernel refuses goes again datagram by datagram (``_send_one``)."""
        udp = self._sockets[1]
        by_dst: dict = {}
        for datagram, dst in replies:
            by_dst.setdefault(dst, []).append(datagram)
        for dst, datagrams in by_dst.items():
            i = 0
            while i < len(datagrams):
                size, j = len(datagrams[i]), i + 1
                most = min(GSO_SEGMENTS, GSO_BYTES // max(size, 1))
                while j < len(datagrams) and j - i < most and len(datagrams[j]) == size:
                    j += 1
                if j - i > 1 and self.udp_gso:
                    try:
                        segment = size.to_bytes(2, sys.byteorder)
                        udp.sendmsg([b"".join(datagrams[i:j])],
                                    [(socket.SOL_UDP, UDP_SEGMENT, segment)], 0, dst)
                        i = j
                        continue
                    except OSError:
                        self.pipeline.counters["gso_send_errors"] += 1
                for datagram in datagrams[i:j]:
                    self._send_one(udp, datagram, dst)
                i = j

    def _send_datagrams(self, replies) -> None:
        """What the pipeline answered: to workers, or up to a rack switch's spine."""
        udp = self._sockets[1]
        for datagram, dst in replies:
            if isinstance(dst, Uplink):
                assert self._uplinks is not None
                self._uplinks.send_datagram(datagram, dst)
                continue
            self._send_one(udp, datagram, dst)

    def _send_one(self, udp, datagram, dst) -> None:
        """One datagram to a worker; where this host's own queue refuses it (ENOBUFS:
        its link is full, ``report_local_drops``) try again after a pause, as the C
        data plane does (fastpath_io.c), rather than lose it."""
        def count_wait(waited):
            self.pipeline.counters["send_waits"] += 1

        try:
            send_when_room(udp, datagram, dst, count_wait)
        except OSError as exc:
            if exc.errno == errno.EMSGSIZE:
                self._send_fragmented(datagram, dst)
            else:
                self.pipeline.counters["send_errors"] += 1

    def _send_fragmented(self, datagram, dst) -> None:
        """A result larger than the path MTU, which IP_PMTUDISC_DO refuses: a job whose
        workers did not ask for frame-sized packets.  It goes out fragmented,
        counted (``send_fragmented``), so that such a job still works; the C data
        plane does the same."""
        udp = self._sockets[1]
        forbid_fragmentation(udp, False)
        try:
            udp.sendto(datagram, dst)
            self.pipeline.counters["send_fragmented"] += 1
        except OSError:
            self.pipeline.counters["send_errors"] += 1
        finally:
            forbid_fragmentation(udp)

    @property
    def _xdp(self) -> XdpPipeline:
        from .xdp.pipeline import XdpPipeline

        assert isinstance(self.pipeline, XdpPipeline), "not the XDP data plane"
        return self.pipeline

    @property
    def _fast(self) -> fastpipeline.FastPipeline:
        assert isinstance(self.pipeline, fastpipeline.FastPipeline), "not the C data plane"
        return self.pipeline

    def _data_threads_failed(self) -> bool:
        """A data thread that ended by itself (its socket failed) stops the switch:
        its slots would never be aggregated, and its workers would wait for them
        until their timeout; closing the control connections tells them now (they
        try to rejoin for their timeout, as after a restart, then raise)."""
        failures = self._fast.thread_failures()
        if failures:
            self.failure = SwitchMLError("the switch's C data plane stopped: " + "; ".join(
                f"data thread {thread} failed: {os.strerror(error)}"
                for thread, error in failures))
            log.error("%s", self.failure)
            self._running = False
        return bool(failures)

    def _drain_fast(self) -> bool:
        """The C data plane: recvmmsg, the pipeline and sendmmsg of up to
        FAST_DRAIN_BATCH datagrams in one call that releases the GIL (control
        changes wait for it under the lock); True when there may be more."""
        pipeline = self.pipeline
        assert isinstance(pipeline, fastpipeline.FastPipeline)
        try:
            received, _ = pipeline.drain(self._sockets[1].fileno(), FAST_DRAIN_BATCH,
                                         self.udp_gso)
        except Exception:  # a bug must not take the switch down
            self.pipeline.counters["internal_errors"] += 1
            log.exception("the C data plane failed")
            return False
        return received >= FAST_DRAIN_BATCH

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
                try:
                    replies += self._control.handle_message(conn.sock, message)
                except Exception:  # a bug must not take the switch down
                    self.pipeline.counters["internal_errors"] += 1
                    log.exception("controller failed on %r", message)
                    replies.append((conn.sock, Error("internal error").to_dict()))
            self._send(replies)
            if settle:
                self._settle(conn, messages, time.monotonic())

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
        replies = self._control.handle_disconnect(conn.sock)
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

    def _log_drops(self) -> None:
        """One DEBUG line with the drops since the last one, by reason."""
        if not log.isEnabledFor(logging.DEBUG):
            return
        with self._lock:
            totals = Counter({k[len("dropped_"):]: v for k, v in self.pipeline.totals().items()
                              if k.startswith("dropped_")})
        fresh = totals - self._drops_logged
        self._drops_logged = totals
        if fresh:
            log.debug("dropped in the last %gs: %s", self.drop_log_interval,
                      ", ".join(f"{reason} {n}" for reason, n in sorted(fresh.items())))


def _xdp_pipeline(config: SwitchConfiguration) -> XdpPipeline:
    """The XDP data plane's pipeline, or an error saying why it cannot run here."""
    from .xdp.pipeline import XdpPipeline, unavailable

    reason = unavailable()
    if reason:
        raise DataPlaneUnavailableError(f"data_plane='xdp' cannot run here: {reason}")
    return XdpPipeline(config.slots, config.packet_elements,
                       block_elements=config.block_elements, port=config.port or 0,
                       drop_rate=config.drop_rate, egress_drop_rate=config.egress_drop_rate,
                       seed=config.seed)


def _data_socket(reuse_port: bool) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    if reuse_port:  # before bind: the group is made at bind
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    return sock


def _set_up_data_socket(udp: socket.socket) -> None:
    udp.setblocking(False)
    enlarge_buffers(udp)
    forbid_fragmentation(udp)  # every datagram is one frame, or none
    report_local_drops(udp)  # a server's full link: wait, do not lose results


def config_chose_no_data_plane(config: SwitchConfiguration) -> bool:
    """Whether the data plane is the switch's default (none named, no ``fastpath``)."""
    return config.data_plane is None and config.fastpath is None


def why_not_xdp() -> str:
    """Why a switch left to its default runs the C data plane, not XDP: XDP cannot
    run here (the reason), or it can but is not the faster one (the figures)."""
    from .xdp.loader import unavailable

    reason = unavailable()
    if reason:
        return f"it cannot run here ({reason}); C is the default"
    return ("it runs here (--data-plane xdp) and sums in the kernel with a fraction of "
            "the C switch's CPU, but it is no faster on the links measured, and slower "
            "where the host's cores carry every frame (docs/benchmarks.md); C is the "
            "default")


def data_threads(config: SwitchConfiguration, data_plane: str) -> int:
    """The data threads a switch of ``config`` runs on ``data_plane``: those asked
    for, or on the C data plane of a one-level switch half the machine's cores
    (``config.auto_switch_threads``), else 1."""
    if config.threads is not None:
        return config.threads
    if data_plane == "c" and config.upstream is None:
        return auto_switch_threads()
    return 1


#: Room for the UDP_GRO control message of a receive (its segment size, an int).
GRO_CMSG_SPACE = socket.CMSG_SPACE(4)


def _gro_segment(ancillary: list) -> int:
    """The segment size of a run received whole (UDP_GRO's control message), or
    0 where the datagram came alone."""
    for level, kind, data in ancillary:
        if level == socket.SOL_UDP and kind == UDP_GRO and len(data) >= 4:
            return struct.unpack("i", data[:4])[0]
    return 0


def _receive_runs_whole(sock: socket.socket) -> None:
    """UDP_GRO on ``sock``, for the C data plane's loop (and the Python loop of an
    XDP switch whose results the kernel merges into runs, which GRO does only for
    such a socket); where the kernel has none (before Linux 5.0) every datagram
    stays a receive of its own."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_UDP, UDP_GRO, 1)


def _bind_group(first: socket.socket, threads: int) -> list[socket.socket]:
    """``first`` (bound with SO_REUSEPORT) and ``threads - 1`` more sockets bound to
    its address, in that order: the kernel steers each datagram to the socket of
    index ``slot % threads`` (the order of binding)."""
    group = [first]
    try:
        for _ in range(threads - 1):
            sock = _data_socket(reuse_port=True)
            group.append(sock)
            sock.bind(first.getsockname())
            _set_up_data_socket(sock)
        fastpipeline.steer_by_slot(first, threads)
    except BaseException:
        for sock in group[1:]:
            sock.close()
        raise
    return group


def _bind_pair(host: str, port: int, attempts: int = 50, reuse_port: bool = False):
    """A TCP listener and a UDP socket bound to the same port number (the UDP one
    the first of an SO_REUSEPORT group, with ``reuse_port``)."""
    last = None
    for _ in range(attempts if port == 0 else 1):
        tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        tcp.bind((host, port))
        udp = _data_socket(reuse_port)
        try:
            udp.bind((host, tcp.getsockname()[1]))
        except OSError as exc:
            tcp.close()
            udp.close()
            last = exc
            if exc.errno != errno.EADDRINUSE:
                raise
            continue
        tcp.listen(LISTEN_BACKLOG)
        tcp.setblocking(False)  # accepted in batches, until the queue is empty
        _set_up_data_socket(udp)
        return tcp, udp
    raise OSError(f"could not bind TCP and UDP to one port on {host}: {last}")
