"""The software switch behind real sockets: UDP data plane, TCP control plane.

One thread runs everything: it drains the UDP socket through the pipeline and
serves control connections in between (connections.py), so the sans-IO pipeline
and controller never see concurrent calls.  With the C data plane and ``threads``
above 1, the datagrams are the C core's own data threads' instead: one socket
each, bound to the port in one SO_REUSEPORT group whose steering program gives
each datagram to the thread owning its slot (``fastpipeline.steer_by_slot``,
sockets.py); the serving thread keeps the control connections, and a data
thread's failure stops the switch with an error (``failure``).  The control port
and the data port have the same number (TCP and UDP).  At start the switch raises
its soft descriptor limit to the hard one and refuses a configuration that cannot
fit in it (``descriptors.py``).
Optionally, Prometheus metrics are served over HTTP on their own thread; they are
read from the counters at scrape time (see ``metrics.py``).
"""

from __future__ import annotations

import json
import logging
import os
import selectors
import socket
import threading
import time
from collections import Counter
from typing import TYPE_CHECKING

from ..auth import read_token, token_from_env
from ..config import SwitchConfiguration, auto_switch_threads, env, parse_address
from ..errors import DataPlaneUnavailableError, SwitchMLError
from ..netutil import drain_error_queue, is_loopback, route_mtu
from . import descriptors
from .connections import (
    ACCEPT_PAUSE,
    LOBBY_LOG_INTERVAL,
    LOBBY_SWEEP_INTERVAL,
    ControlConnections,
    _Connection,
)
from .control import Controller
from .dataplane import fastpipeline
from .dataplane.pipeline import Pipeline
from .lobby import Lobby
from .racks.control import RackController
from .racks.pipeline import RackPipeline, Uplink
from .racks.uplinks import Uplinks
from .sockets import (
    GRO_CMSG_SPACE,
    bind_group,
    bind_pair,
    gro_segment,
    receive_runs_whole,
    send_one,
    send_results,
)

if TYPE_CHECKING:  # imported when metrics are asked for: it needs prometheus-client
    from .metrics import MetricsServer
    from .xdp.pipeline import XdpPipeline  # imported when data_plane="xdp"

log = logging.getLogger("switchml.switch")

#: Datagrams handled between two looks at the control sockets.
DRAIN_BATCH = 256
#: The same for the C data plane, whose datagrams cost a few microseconds each.
FAST_DRAIN_BATCH = 2048
#: Seconds between readings of the serving thread's CPU time (``cpu_s`` in stats).
CPU_READ_INTERVAL = 0.1
#: Seconds between looks for XDP switches gone from the interface (killed),
#: whose programs and maps the dispatcher would hold until another switch there
#: comes or goes.
XDP_SWEEP_INTERVAL = 1.0
#: Seconds between the DEBUG summaries of dropped packets (never one line per packet).
DROP_LOG_INTERVAL = 10.0


class Switch(ControlConnections):
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
        tcp, udp = self._tcp, self._udp = bind_pair(self._host, self._port,
                                                     reuse_port=self.threads > 1)
        self.address = (self._host, tcp.getsockname()[1])
        if self.threads > 1:
            try:
                self._data_sockets = bind_group(udp, self.threads)
            except BaseException:
                tcp.close()
                udp.close()
                raise
        if isinstance(self.pipeline, fastpipeline.FastPipeline) and self.udp_gro:
            for sock in self._data_sockets or [udp]:
                receive_runs_whole(sock)
        if self.data_plane == "xdp":
            try:  # the program takes the port's datagrams from here on
                ifindex = self._xdp.serve(self.address, mode=self.xdp_mode)
                if self._xdp.merges_results:  # GRO merges results only for a socket
                    receive_runs_whole(udp)  # that takes runs (and they may reach it)
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
                        self._send(self._guarded(self._control.handle_mismatches) or [])
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
                    self._sweep_xdp()
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
        except Exception as exc:  # a bug: stop with an error, not a silent thread's death
            self.failure = SwitchMLError(f"the switch stopped serving: {exc!r}")
            log.exception("the switch's serving thread failed")
            self._running = False
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

    def _sweep_xdp(self) -> None:
        """The XDP switch's look around its interface, once a second: switches gone
        from it, ports new on its bridge.  A failure there is logged and counted
        (``internal_errors``): the datagrams are served all the same."""
        try:
            for port in self._xdp.sweep_gone_switches():
                log.info("the XDP switch of port %d on this interface is gone: its "
                         "program is out of the dispatcher", port)
            for name in self._xdp.adopt_new_ports():
                log.info("port %s joined the bridge: served in driver mode", name)
        except Exception:  # a bug must not take the switch down
            self.pipeline.counters["internal_errors"] += 1
            log.exception("the XDP switch's look at its interface failed")

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
                    segment = gro_segment(ancillary) or n
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
            for at in range(0, max(n, 1), max(segment, 1)):  # an empty one too: counted
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
        """Results to workers, in runs of UDP GSO segments (``sockets.send_results``)."""
        send_results(self._sockets[1], replies, self.pipeline.counters, self.udp_gso)

    def _send_datagrams(self, replies) -> None:
        """What the pipeline answered: to workers, or up to a rack switch's spine."""
        udp = self._sockets[1]
        for datagram, dst in replies:
            if isinstance(dst, Uplink):
                assert self._uplinks is not None
                self._uplinks.send_datagram(datagram, dst)
                continue
            send_one(udp, datagram, dst, self.pipeline.counters)

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

