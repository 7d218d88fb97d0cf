"""The switch's UDP sockets: bound beside its TCP listener, grouped for the C data
plane's threads, taking runs of datagrams whole (UDP_GRO), and sending results in
runs (UDP GSO), waiting where this host's own queue is full and fragmenting only
what the path cannot carry otherwise.
"""

from __future__ import annotations

import contextlib
import errno
import socket
import struct
import sys
from collections import Counter

from ..netutil import enlarge_buffers, forbid_fragmentation, report_local_drops, send_when_room
from .dataplane import fastpipeline

#: linux/udp.h: a send's segment size, for UDP GSO; a GSO send's limits (the
#: kernel's UDP_MAX_SEGMENTS, and one IP packet's worth of payload)
UDP_SEGMENT = 103
#: linux/udp.h: a socket that takes a run of datagrams that arrived whole in one
#: receive (the C data plane cuts it)
UDP_GRO = 104
GSO_SEGMENTS = 64
GSO_BYTES = 65507
#: The listener's accept queue (the kernel caps it at net.core.somaxconn).
LISTEN_BACKLOG = 4096


def data_socket(reuse_port: bool) -> socket.socket:
    """A UDP socket, one of an SO_REUSEPORT group once bound (``reuse_port``)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    if reuse_port:  # before bind: the group is made at bind
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    return sock


def set_up_data_socket(udp: socket.socket) -> None:
    """A bound data socket made ready: non-blocking, large buffers, no fragments."""
    udp.setblocking(False)
    enlarge_buffers(udp)
    forbid_fragmentation(udp)  # every datagram is one frame, or none
    report_local_drops(udp)  # a server's full link: wait, do not lose results


#: Room for the UDP_GRO control message of a receive (its segment size, an int).
GRO_CMSG_SPACE = socket.CMSG_SPACE(4)


def gro_segment(ancillary: list) -> int:
    """The segment size of a run received whole (UDP_GRO's control message), or
    0 where the datagram came alone."""
    for level, kind, data in ancillary:
        if level == socket.SOL_UDP and kind == UDP_GRO and len(data) >= 4:
            return struct.unpack("i", data[:4])[0]
    return 0


def receive_runs_whole(sock: socket.socket) -> None:
    """UDP_GRO on ``sock``, for the C data plane's loop (and the Python loop of an
    XDP switch whose results the kernel merges into runs, which GRO does only for
    such a socket); where the kernel has none (before Linux 5.0) every datagram
    stays a receive of its own."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_UDP, UDP_GRO, 1)


def bind_group(first: socket.socket, threads: int) -> list[socket.socket]:
    """``first`` (bound with SO_REUSEPORT) and ``threads - 1`` more sockets bound to
    its address, in that order: the kernel steers each datagram to the socket of
    index ``slot % threads`` (the order of binding)."""
    group = [first]
    try:
        for _ in range(threads - 1):
            sock = data_socket(reuse_port=True)
            group.append(sock)
            sock.bind(first.getsockname())
            set_up_data_socket(sock)
        fastpipeline.steer_by_slot(first, threads)
    except BaseException:
        for sock in group[1:]:
            sock.close()
        raise
    return group


def bind_pair(host: str, port: int, attempts: int = 50, reuse_port: bool = False):
    """A TCP listener and a UDP socket bound to the same port number (the UDP one
    the first of an SO_REUSEPORT group, with ``reuse_port``)."""
    last = None
    for _ in range(attempts if port == 0 else 1):
        tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        tcp.bind((host, port))
        udp = data_socket(reuse_port)
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
        set_up_data_socket(udp)
        return tcp, udp
    raise OSError(f"could not bind TCP and UDP to one port on {host}: {last}")


def send_results(udp: socket.socket, replies, counters: Counter, gso: bool = True) -> None:
    """Datagrams to workers, those of equal size to one worker as the segments of
    one UDP GSO send (``gso``; as the C data plane sends a batch's results): one
    system call and one pass through the stack a run, not one a datagram.  A send
    the kernel refuses goes again datagram by datagram (``send_one``)."""
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
            if j - i > 1 and gso:
                try:
                    segment = size.to_bytes(2, sys.byteorder)
                    udp.sendmsg([b"".join(datagrams[i:j])],
                                [(socket.SOL_UDP, UDP_SEGMENT, segment)], 0, dst)
                    i = j
                    continue
                except OSError:
                    counters["gso_send_errors"] += 1
            for datagram in datagrams[i:j]:
                send_one(udp, datagram, dst, counters)
            i = j


def send_one(udp: socket.socket, datagram, dst, counters: Counter) -> None:
    """One datagram to a worker; where this host's own queue refuses it (ENOBUFS:
    its link is full, ``report_local_drops``) try again after a pause, as the C
    data plane does (fastpath_io.c), rather than lose it."""
    def count_wait(waited):
        counters["send_waits"] += 1

    try:
        send_when_room(udp, datagram, dst, count_wait)
    except OSError as exc:
        if exc.errno == errno.EMSGSIZE:
            send_fragmented(udp, datagram, dst, counters)
        else:
            counters["send_errors"] += 1


def send_fragmented(udp: socket.socket, datagram, dst, counters: Counter) -> None:
    """A result larger than the path MTU, which IP_PMTUDISC_DO refuses: a job whose
    workers did not ask for frame-sized packets.  It goes out fragmented,
    counted (``send_fragmented``), so that such a job still works; the C data
    plane does the same."""
    forbid_fragmentation(udp, False)
    try:
        udp.sendto(datagram, dst)
        counters["send_fragmented"] += 1
    except OSError:
        counters["send_errors"] += 1
    finally:
        forbid_fragmentation(udp)
