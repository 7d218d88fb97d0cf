"""Small socket helpers shared by the switch and the workers."""

from __future__ import annotations

import errno
import fcntl
import ipaddress
import json
import os
import socket
import struct
import sys
import time

from .config import check_keepalive

#: Socket buffer we ask for: a window of 64 KiB datagrams from many workers must fit.
SOCKET_BUFFER = 32 * 1024 * 1024
#: Longest control message accepted, in bytes.
MAX_CONTROL_LINE = 1 << 20


#: Python's socket module has no SO_RCVBUFFORCE / SO_SNDBUFFORCE (3.11): Linux's
#: values (asm-generic/socket.h), without which root got only net.core.*mem_max.
_LINUX_FORCE = {"rcv": 33, "snd": 32} if sys.platform.startswith("linux") else {}


def enlarge_buffers(sock: socket.socket, size: int = SOCKET_BUFFER) -> int:
    """Ask for large kernel buffers; beyond net.core.*mem_max only root gets them.

    Returns the receive buffer the kernel granted, in bytes.
    """
    for force, plain in ((getattr(socket, "SO_RCVBUFFORCE", _LINUX_FORCE.get("rcv")),
                          socket.SO_RCVBUF),
                         (getattr(socket, "SO_SNDBUFFORCE", _LINUX_FORCE.get("snd")),
                          socket.SO_SNDBUF)):
        try:
            if force is None:
                raise PermissionError
            sock.setsockopt(socket.SOL_SOCKET, force, size)
        except PermissionError:
            sock.setsockopt(socket.SOL_SOCKET, plain, size)
    return sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)




#: A send this host's own queue refused (ENOBUFS, see ``report_local_drops``) is
#: tried again after SEND_PAUSE seconds, for at most SEND_PATIENCE seconds, then
#: lost (udp_batch.h's UDP_SEND_PAUSE_NS and UDP_SEND_PATIENCE_NS, for both C loops).
SEND_PAUSE = 50e-6
SEND_PATIENCE = 0.2

#: Linux's IP_RECVERR (linux/in.h), which Python's socket module does not name.
_IP_RECVERR = 11


def report_local_drops(sock: socket.socket) -> bool:
    """Make a UDP send that this host's own queue toward the network drops fail
    with ENOBUFS instead of vanishing (Linux's IP_RECVERR; elsewhere nothing).

    A switch server sends its results through one link at the rate of all its
    ranks' contributions: when its queue is full the datagram is dropped as it
    is sent, and a rank waits for the timer.  Told so, the switch waits for the
    queue instead.  The socket then also queues ICMP errors for ``recvmsg(...,
    MSG_ERRQUEUE)``: its reader must read them away (``drain_error_queue``).
    Returns whether it is on.
    """
    if not sys.platform.startswith("linux"):
        return False
    sock.setsockopt(socket.IPPROTO_IP, getattr(socket, "IP_RECVERR", _IP_RECVERR), 1)
    return True


def send_when_room(sock, datagram, address, on_wait=None) -> int:
    """``sock.sendto(datagram, address)``; where this host's own queue toward the
    network refuses it (ENOBUFS, see ``report_local_drops``), tried again every
    SEND_PAUSE seconds for at most SEND_PATIENCE seconds, ``on_wait(waited)``
    (the seconds waited so far) before each pause.  Returns the bytes sent;
    raises the error that ended it: ENOBUFS past the patience, any other at once.
    """
    waited = 0.0
    while True:
        try:
            return sock.sendto(datagram, address)
        except OSError as exc:
            if exc.errno != errno.ENOBUFS or waited >= SEND_PATIENCE:
                raise
        if on_wait is not None:
            on_wait(waited)
        time.sleep(SEND_PAUSE)
        waited += SEND_PAUSE


def drain_error_queue(sock: socket.socket, most: int = 256) -> None:
    """Read away the errors IP_RECVERR queued (they take receive buffer space)."""
    for _ in range(most):
        try:
            sock.recvmsg(64, 256, socket.MSG_ERRQUEUE)
        except OSError:  # empty (EAGAIN), or no such queue
            return


def enable_keepalive(sock: socket.socket, seconds: float) -> None:
    """Make a TCP connection fail within ``seconds`` of its peer vanishing.

    Without this, a peer host that goes away without closing the connection
    (power off, network cut) leaves it open forever: an idle connection sends
    nothing that could fail.  Probes start after a silence, three of them, so
    that silence plus probes make ``seconds``; TCP_USER_TIMEOUT gives data left
    unacknowledged the same bound, which keepalive does not cover.  The kernel
    counts whole seconds, one at least per step: the bound is at least 4 s.
    """
    check_keepalive(seconds)
    interval = max(1, int(seconds // 6))
    idle = max(1, int(seconds - 3 * interval))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", idle), ("TCP_KEEPINTVL", interval),
                        ("TCP_KEEPCNT", 3),
                        ("TCP_USER_TIMEOUT", (idle + 3 * interval) * 1000)):
        option = getattr(socket, name, None)
        if option is not None:  # Linux has them all; elsewhere the system's defaults
            sock.setsockopt(socket.IPPROTO_TCP, option, value)


#: Linux's ioctl for the bytes of a TCP socket's send queue that its peer has not
#: acknowledged (SIOCOUTQ, the same number as TIOCOUTQ); None elsewhere.
SIOCOUTQ = 0x5411 if sys.platform.startswith("linux") else None


def unacknowledged(sock: socket.socket) -> int:
    """Bytes written to a TCP socket that its peer has not acknowledged, sent or not.

    What the peer's kernel did not take: a peer that does not read its replies
    stops acknowledging once its receive buffer is full, and the rest waits in
    this socket's send buffer (up to net.ipv4.tcp_wmem's maximum, 4 MiB by
    default).  0 where the system cannot tell (not Linux).
    """
    if SIOCOUTQ is None:
        return 0
    try:
        return struct.unpack("i", fcntl.ioctl(sock.fileno(), SIOCOUTQ, bytes(4)))[0]
    except OSError:
        return 0


#: Linux's socket options for the path MTU (Python's socket module lacks some).
IP_MTU_DISCOVER = getattr(socket, "IP_MTU_DISCOVER", 10)
IP_PMTUDISC_DONT = getattr(socket, "IP_PMTUDISC_DONT", 0)
IP_PMTUDISC_DO = getattr(socket, "IP_PMTUDISC_DO", 2)
_IP_MTU = getattr(socket, "IP_MTU", 14)
#: MTU assumed where the system cannot tell (not Linux): Ethernet's.
FALLBACK_MTU = 1500


def is_ipv4(host) -> bool:
    """Whether ``host`` is an IPv4 address as the kernel writes one ("10.0.0.2"),
    never a name, which would have to be resolved."""
    try:
        return socket.inet_ntop(socket.AF_INET, socket.inet_pton(socket.AF_INET, host)) == host
    except (OSError, TypeError, ValueError):
        return False


def route_mtu(address: tuple) -> int:
    """The MTU of the route to ``address`` (an IPv4 address, port): what one frame
    carries.  OSError for a name: it is never resolved (no DNS on a serving thread)."""
    if not is_ipv4(address[0]):
        raise OSError(errno.EINVAL, f"not an IPv4 address: {address[0]!r}")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect(address)  # picks the route; sends nothing
        try:
            return probe.getsockopt(socket.IPPROTO_IP, _IP_MTU)
        except OSError:
            return FALLBACK_MTU


#: ioctl that reads an interface's IPv4 address (linux/sockios.h)
_SIOCGIFADDR = 0x8915


def interface_of(local_ip: str) -> str | None:
    """The name of the interface holding the IPv4 address ``local_ip`` (None: none
    found, or not Linux)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            try:
                answer = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR,
                                     struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address
                continue
            if socket.inet_ntoa(answer[20:24]) == local_ip:
                return name
    return None


def route_link_mbit(address: tuple) -> int | None:
    """The speed, in Mbit/s, of the interface the route to ``address`` (host, port)
    leaves by, as its driver reports it (``/sys/class/net/*/speed``); None where
    none is reported (loopback, most virtual interfaces, a link down)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(address)  # picks the route; sends nothing
            name = interface_of(probe.getsockname()[0])
        if name is None:
            return None
        with open(f"/sys/class/net/{name}/speed") as speed:
            mbit = int(speed.read())
    except (OSError, ValueError):
        return None
    return mbit if mbit > 0 else None


def runs_leave_cut(local_ip: str, remote_ip: str) -> bool:
    """Whether a UDP GSO run sent from ``local_ip`` to ``remote_ip`` leaves this host
    as separate frames: the remote address is another host's, and the interface
    holding ``local_ip`` is a NIC (it cuts runs on the wire, or the kernel cuts
    them for it) or cuts runs in software as they leave (``tx-udp-segmentation``
    off).  A virtual interface that carries runs whole (a veth, loopback) does
    not: an XDP program beyond it would see a run as one frame."""
    if interface_of(remote_ip) is not None:  # this host: through loopback
        return False
    name = interface_of(local_ip)
    if name is None:
        return False
    if os.path.exists(f"/sys/class/net/{name}/device"):  # a NIC: frames on the wire
        return True
    from .ethtool import features  # (ctypes, loaded only where an XDP switch asks)

    try:
        return features(name).get("tx-udp-segmentation") is False
    except OSError:
        return False


def forbid_fragmentation(sock: socket.socket, forbid: bool = True) -> None:
    """Set DF on a UDP socket's datagrams: one too large for the path fails to send
    (EMSGSIZE) instead of leaving as IP fragments, which no switch can parse and
    of which one lost loses the whole datagram.  ``forbid=False`` lifts it."""
    try:
        sock.setsockopt(socket.IPPROTO_IP, IP_MTU_DISCOVER,
                        IP_PMTUDISC_DO if forbid else IP_PMTUDISC_DONT)
    except OSError:  # not Linux: the packet sizes alone keep datagrams within a frame
        pass


def is_loopback(address: str) -> bool:
    """Whether a bound socket's address (numeric, as ``getsockname`` gives it) is a
    loopback one, which no other host reaches; the wildcard ``0.0.0.0`` is not."""
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def datagrams_that_fit(rcvbuf: int, packet_bytes: int) -> int:
    """How many datagrams of ``packet_bytes`` a receive buffer holds (kernel overhead included)."""
    return rcvbuf // (packet_bytes + packet_bytes // 4 + 1024)


def encode_line(message: dict) -> bytes:
    return json.dumps(message, separators=(",", ":")).encode() + b"\n"


class LineReader:
    """Splits a TCP byte stream into JSON messages, one per line."""

    def __init__(self):
        self._buf = bytearray()

    def feed(self, data: bytes) -> list:
        """Messages completed by ``data``; raises ValueError on an oversized or bad line."""
        self._buf += data
        out: list = []
        while True:
            end = self._buf.find(b"\n")
            if end < 0:
                if len(self._buf) > MAX_CONTROL_LINE:
                    raise ValueError("control line too long")
                return out
            line = bytes(self._buf[:end])
            del self._buf[: end + 1]
            if line.strip():
                try:
                    out.append(json.loads(line))
                except RecursionError:  # not a ValueError, and it must not escape
                    raise ValueError("control message nested too deeply") from None
