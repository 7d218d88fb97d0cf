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

import logging
import selectors
import socket
from typing import Any

from ...netutil import LineReader, enable_keepalive, enlarge_buffers, forbid_fragmentation
from .control import CloseUplink, ToSpine
from .pipeline import Uplink

log = logging.getLogger("switchml.switch")

#: Seconds a rack switch waits for its spine to accept a job's control connection.
CONNECT_TIMEOUT = 5.0


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
        tcp = self._tcp.pop(job, None)
        if tcp is not None:
            self.switch._selector.unregister(tcp)
            tcp.close()
        self._close_udp(job)

    def close_all(self) -> None:
        for job in list(self._tcp.keys() | self._udp.keys()):
            self.close(job)

    # ------------------------------------------------------------------ inside
    def _close_udp(self, job: str) -> None:
        udp = self._udp.pop(job, None)
        if udp is not None:
            self._by_source.pop(udp.getsockname(), None)
            self.switch._selector.unregister(udp)
            udp.close()

    def _request(self, item: ToSpine) -> list:
        tcp = self._tcp.get(item.job)
        try:
            if tcp is None:
                tcp = socket.create_connection(self.spine, timeout=CONNECT_TIMEOUT)
                tcp.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                enable_keepalive(tcp, self.keepalive)
                self._tcp[item.job] = tcp
                reader = LineReader()
                self.switch._selector.register(
                    tcp, selectors.EVENT_READ,
                    lambda events, job=item.job, reader=reader: self._on_events(job, reader))
            # Control messages are a few hundred bytes: sent whole, the spine reads them.
            tcp.settimeout(CONNECT_TIMEOUT)
            tcp.sendall(item.request.encode())
            tcp.setblocking(False)
        except OSError as exc:
            log.warning("job %s: the spine at %s:%d: %s", item.job, *self.spine, exc)
            control = self.switch._rack_control
            return self.carry_out(control.handle_uplink_closed(
                item.job, f"could not be reached ({exc})"))
        return []

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
                self.switch._send_datagrams(pipeline.receive_datagram(view[:n], addr))
