"""A rack switch's sockets toward its spine: one control connection and one UDP
socket per job (docs/protocol.md, "Two levels: racks under a spine").

``Switch(upstream="spine:7300")`` makes a rack switch: its data plane is the
Python ``RackPipeline`` (the compiled fast path has no rack role; it stays as it
is for every other switch) and its control plane the sans-IO
``RackController``, whose ``ToSpine`` and ``CloseUplink`` this module carries
out on the switch's one thread.  The spine's results arrive on the job's UDP
socket and go through the pipeline like any datagram; the spine's events
arrive on the job's control connection and go to the controller.  Both
sockets are in the switch's selector, with a callable as their key's data.
"""

from __future__ import annotations

import errno
import logging
import os
import selectors
import socket
import time
from typing import Any

from ...netutil import LineReader, enable_keepalive, enlarge_buffers, forbid_fragmentation
from .control import CloseUplink, ToSpine
from .pipeline import Uplink

log = logging.getLogger("switchml.switch")

#: Seconds a rack switch waits for its spine to accept a job's control connection.
CONNECT_TIMEOUT = 5.0
#: Seconds a control message to the spine may take to leave (a few hundred bytes).
SEND_TIMEOUT = 5.0


class Uplinks:
    """The per-job sockets of a rack switch toward its spine ``spine`` (host, port).

    ``switch`` is the ``server.Switch`` they belong to (not imported: the server
    imports this module); they use its selector, lock, pipeline and controller,
    and send through its ``_send`` and ``_send_datagrams``.
    """

    def __init__(self, switch: Any, spine: tuple[str, int], keepalive: float):
        self.switch = switch
        # The spine's results come from its numeric address: resolve a name once.
        self.spine = (socket.gethostbyname(spine[0]), spine[1])
        self.keepalive = keepalive
        self._udp: dict[str, socket.socket] = {}
        self._tcp: dict[str, socket.socket] = {}
        self._by_source: dict[tuple, socket.socket] = {}
        # connections still being opened, without blocking the switch's thread: the
        # deadline of each and the requests that wait for it
        self._connecting: dict[str, tuple[float, bytearray]] = {}
        self._next: float | None = None  # next_deadline's, for expire
        self._buf = bytearray(65536)

    def address_for(self, job: str) -> tuple:
        """The job's UDP socket toward the spine (opened now): its address, which is
        the rack's data address in the spine's job."""
        self._close_udp(job)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(self.spine)  # the local address the kernel routes toward it
            local = probe.getsockname()[0]
        udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        udp.bind((local, 0))
        udp.setblocking(False)
        enlarge_buffers(udp)
        forbid_fragmentation(udp)
        address = udp.getsockname()
        self._udp[job] = udp
        self._by_source[address] = udp
        self.switch._selector.register(udp, selectors.EVENT_READ,
                                       lambda events, job=job: self._on_datagrams(job))
        return address

    def carry_out(self, items) -> list:
        """Do the ``ToSpine`` and ``CloseUplink`` among a controller's answers; return
        the rest, (worker connection, event) pairs, and what the spine's absence
        adds to them."""
        rest: list = []
        for item in items:
            if isinstance(item, ToSpine):
                rest += self._request(item)
            elif isinstance(item, CloseUplink):
                self.close(item.job)
            else:
                rest.append(item)
        return rest

    def send_datagram(self, datagram, uplink: Uplink) -> None:
        """A partial sum up to the spine, from the job's own socket."""
        udp = self._by_source.get(uplink.source)
        if udp is None:
            return  # the job closed between the datagram and now
        try:
            udp.sendto(datagram, uplink.spine)
        except OSError:
            self.switch.pipeline.counters["send_errors"] += 1

    def close(self, job: str) -> None:
        self._close_tcp(job)
        self._close_udp(job)

    def close_all(self) -> None:
        for job in list(self._tcp.keys() | self._udp.keys()):
            self.close(job)

    def expire(self, now: float) -> None:
        """Fail the jobs whose connection to the spine is not open by its deadline,
        or whose spine did not answer what it was asked (the switch's thread)."""
        if self._next is None or now < self._next:  # (every turn of the loop: no
            return                                  # lock taken for nothing)
        with self.switch._lock:
            for job in [job for job, (deadline, _) in self._connecting.items()
                        if now >= deadline]:
                self.switch._send(self._unreachable(job, OSError(
                    errno.ETIMEDOUT, f"no answer within {CONNECT_TIMEOUT:g}s")))
            self.switch._send(self.carry_out(self.switch._rack_control.expire(now)))

    def next_deadline(self) -> float | None:
        """The earliest connect or answer deadline (None: none under way), kept for
        ``expire`` (the switch's thread, under its lock or not)."""
        self._next = None
        if not self._tcp:  # no job's connection: nothing to wait for (no lock taken)
            return None
        with self.switch._lock:
            connects = (deadline for deadline, _ in self._connecting.values())
            self._next = min(connects, default=None)
            answer = self.switch._rack_control.next_deadline()
        if answer is not None and (self._next is None or answer < self._next):
            self._next = answer
        return self._next

    # ------------------------------------------------------------------ inside
    def _close_tcp(self, job: str) -> None:
        self._connecting.pop(job, None)
        tcp = self._tcp.pop(job, None)
        if tcp is not None:
            self.switch._selector.unregister(tcp)
            tcp.close()

    def _close_udp(self, job: str) -> None:
        udp = self._udp.pop(job, None)
        if udp is not None:
            self._by_source.pop(udp.getsockname(), None)
            self.switch._selector.unregister(udp)
            udp.close()

    def _request(self, item: ToSpine) -> list:
        """Send ``item`` to the spine on its job's connection, opened first where the
        job has none: the connect runs on in the switch's selector (a spine that
        does not answer stalls no other job), and the requests wait for it."""
        tcp = self._tcp.get(item.job)
        try:
            if tcp is None:
                tcp = self._connect(item.job)
            waiting = self._connecting.get(item.job)
            if waiting is not None:
                waiting[1].extend(item.request.encode())
                return []
            self._send_now(tcp, item.request.encode())
        except OSError as exc:
            return self._unreachable(item.job, exc)
        return []

    def _connect(self, job: str) -> socket.socket:
        tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        tcp.setblocking(False)
        code = tcp.connect_ex(self.spine)
        if code not in (0, errno.EINPROGRESS):
            tcp.close()
            raise OSError(code, os.strerror(code))
        self._tcp[job] = tcp
        self._connecting[job] = (time.monotonic() + CONNECT_TIMEOUT, bytearray())
        reader = LineReader()
        self.switch._selector.register(
            tcp, selectors.EVENT_READ | selectors.EVENT_WRITE,
            lambda events, job=job, reader=reader: self._on_tcp(job, reader, events))
        return tcp

    def _on_tcp(self, job: str, reader: LineReader, events: int) -> None:
        if job not in self._connecting:
            self._on_events(job, reader)
            return
        if not events & selectors.EVENT_WRITE:
            return
        tcp = self._tcp[job]
        with self.switch._lock:
            _, waiting = self._connecting.pop(job)
            code = tcp.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            try:
                if code:
                    raise OSError(code, os.strerror(code))
                tcp.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                enable_keepalive(tcp, self.keepalive)
                self.switch._selector.modify(
                    tcp, selectors.EVENT_READ,
                    lambda events, job=job, reader=reader: self._on_tcp(job, reader, events))
                self._send_now(tcp, bytes(waiting))
            except OSError as exc:
                self.switch._send(self._unreachable(job, exc))

    @staticmethod
    def _send_now(tcp: socket.socket, data: bytes) -> None:
        # Control messages are a few hundred bytes: sent whole, the spine reads them.
        tcp.settimeout(SEND_TIMEOUT)
        try:
            tcp.sendall(data)
        finally:
            tcp.setblocking(False)

    def _unreachable(self, job: str, exc: OSError) -> list:
        log.warning("job %s: the spine at %s:%d: %s", job, *self.spine, exc)
        self._close_tcp(job)
        return self.carry_out(self.switch._rack_control.handle_uplink_closed(
            job, f"could not be reached ({exc})"))

    def _on_events(self, job: str, reader: LineReader) -> None:
        tcp = self._tcp.get(job)
        if tcp is None:
            return
        try:
            data = tcp.recv(65536)
            messages = reader.feed(data) if data else None
        except (OSError, ValueError) as exc:
            log.warning("job %s: connection to the spine lost: %s", job, exc)
            messages = None
        control = self.switch._rack_control
        with self.switch._lock:
            if messages is None:
                out = control.handle_uplink_closed(job, "closed the connection")
                self.close(job)
            else:
                out = []
                for message in messages:
                    out += control.handle_upstream(job, message)
            self.switch._send(out)

    def _on_datagrams(self, job: str) -> None:
        """The spine's results for ``job``, through the pipeline, down to the workers."""
        udp = self._udp.get(job)
        if udp is None:
            return
        pipeline, view = self.switch.pipeline, memoryview(self._buf)
        with self.switch._lock:
            for _ in range(256):
                try:
                    n, addr = udp.recvfrom_into(self._buf)
                except BlockingIOError:
                    return
                except OSError:
                    pipeline.counters["socket_errors"] += 1
                    continue
                try:
                    replies = pipeline.receive_datagram(view[:n], addr)
                except Exception:  # a bug must not take the switch down (as _drain_into)
                    pipeline.counters["internal_errors"] += 1
                    log.exception("pipeline failed on a datagram from the spine at %s", addr)
                    continue
                self.switch._send_datagrams(replies)
