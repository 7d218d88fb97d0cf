"""The switch's data plane as an XDP program: ``XdpPipeline`` is a ``Pipeline``
whose per-packet work runs in ``pipeline.bpf.c``, in the kernel.

The dense path (validation and every drop reason, members, shadow-copy sets,
adds, MODE_MAX, duplicates, stale messages, retransmissions, probes and
queries, results), tested against the Python pipeline through
``BPF_PROG_TEST_RUN`` on Ethernet/IPv4/UDP frames (tests/test_xdp.py, also two
CPUs at once), and served for real by ``Switch(data_plane="xdp")``: ``serve``
runs it on the interface holding the switch's address, and beside it, on
that interface's TC ingress, the program that sends each completed result to
every rank (tests/test_xdp_serve.py, in network namespaces).  Where and how it
attaches to an interface: serving.py.

As ``FastPipeline`` does, the control plane (slot allocation, the job table,
ended jobs, stats) stays the Python reference's own code; ``install_job`` and
``remove_job`` also write the program's maps (a hash map of member addresses,
the address each rank's copy of a result goes to, the job's entry with each
rank's token, a reset of its sets), and the counters the program keeps per CPU
with the Python names are added into
``pipeline.counters`` and each ``job.counters`` by ``sync_counters()``.

How a datagram's fate reads in XDP (the program's header comment says why):
``XDP_DROP`` for nothing sent, ``XDP_TX`` for an answer to its sender alone
(the frame rewritten, addresses swapped; on a veth in driver mode, whose
XDP_TX reaches the peer only where the peer polls with NAPI, which the
switch can neither tell nor set, ``XDP_PASS`` with a mark in the frame's
metadata instead, and the TC program sends it back out of the device it came
in by: ``answers_by_stack``), ``XDP_PASS`` for a sparse
contribution (untouched: user space aggregates it, below) and for a completed
result, which goes to every rank from the kernel: the TC program ``fan_out_results``
(the same object, the same maps), which runs next on the same interface,
sends one copy a rank (``bpf_clone_redirect`` out of the interface, through its
normal transmit path: on a bridge, each copy to the port its Ethernet address
is behind, through that port's qdisc), each rewritten as the switch's socket
would address it (Ethernet, IP and UDP destination; from the switch's address
and port; fresh IP checksum, no UDP checksum, as the XDP_TX answers), counted
as ``results_fanned_out`` (``results_fanout_failed`` for a copy the kernel
refused: that rank's probe recovers it).  Several ranks behind one port or
host each get their copy.  On veths in driver mode whose UDP segmentation
offload is on, results leave in runs (``merges_results``): ``serve`` turns
GRO on there (the last switch on the device to ``detach`` turns it off
again) and the switch's socket takes
UDP_GRO, so the kernel merges the results the program passes, one sender's,
into one skb (a result keeps its contribution's UDP checksum, which GRO
needs, and a mark in its metadata, which keeps it apart from anything else),
and the fan-out program sends each rank the run whole, its checksum field
the pseudo-header's sum from which the kernel or a NIC completes each
datagram's as the run is cut (``result_runs_fanned_out``; a copy of n
results counts n in ``results_fanned_out``).  What then reaches the socket
may be a run too, which the switch cuts into its datagrams.

A rank's Ethernet address is the one its datagrams come from on the served
interface, which the XDP program learns (as a switch learns the port a host
is behind) once the rank's token matched; a result for
a job with a rank not learned (one on the switch's own host, whose datagrams
come by the loopback device, or by another interface) goes up to the
switch's socket instead, which sends it to every rank (``passed_up``, counted
as ``results_passed_up``), as it does where the TC program is not attached
(a switch on a loopback interface).

A UDP GSO super-packet (a run of datagrams that a sender on the same host, a
veth peer or loopback, hands over whole; a NIC cuts it before the wire) is
one frame to XDP: the program passes it up (``gso_passed_up``), the kernel
cuts it into its datagrams for the switch's socket, and ``passed_up`` runs
each through the program, a system call a datagram.  In driver mode no run
reaches the program whole (on a NIC runs are cut before the wire; a veth
with a native XDP program has the kernel take software GSO off its peer,
which then cuts each run as it leaves), so ``takes_gso_runs`` (the ``ready``'s
``gso``) is true and the workers send runs, one system call for up to 64
datagrams; in generic mode it is false, and the workers send their datagrams
apart where their runs would reach it whole.

Simulated drops (``drop_rate``, ``egress_drop_rate``) are the program's: a
datagram coming in, or an answer or a result's copy going out, is lost when
the kernel's random number (``bpf_get_prandom_u32``) falls below the rate
(``dropped_ingress_simulated``, ``dropped_egress_simulated``), at the Python
pipeline's rates, not on the same datagrams (``seed`` seeds the copies user
space sends alone).

Packets of any size the Python pipeline takes, up to 64 lanes (the default,
16128 values in 63 blocks of 256, a 65,300-byte datagram, among them): the
program is built for the pipeline's row size (``-DXDP_MAX_VALUES``, so that its
maps and the loops the verifier walks are as long as the packets need), and
loaded as ``xdp.frags``: a frame past one page comes in several buffers
(multi-buffer XDP), which the program reads and writes with
``bpf_xdp_load_bytes`` and ``bpf_xdp_store_bytes``.  An answer longer than the
frame it replaces (a result for a 32-byte probe) needs room at the frame's
tail, which a frame past one page and a generic-mode skb do not have: the
program passes such a probe up (``probes_passed_up``) and ``passed_up`` runs it
again in a frame padded to the result's length.

Sparse calls (``MODE_SPARSE``, with or without ``MODE_SEED``): the program
checks a sparse contribution as any (member, header, token, slot, lanes,
count) and passes it up as it came (``XDP_PASS``, counted as
``sparse_passed_up``); the switch's socket hands it to ``passed_up``, which
runs ``Pipeline.receive_datagram`` itself, the reference's sparse path, drops
and counters included, on the set the datagram names, read from the program's
maps into the reference's registers and row and written back (under the set's
lock, in an order in which the program, running meanwhile, always sees a state
it answers rightly: ``_sparse_in_user_space``, ``_store_set``).  The result
goes to every rank from the socket; the program answers the set's probes and
queries from its maps, as for a dense set, and a job's dense and sparse calls
share its slots.  The switch logs once per job that its sparse calls go
through user space, where they run at the Python data plane's speed.

The object is built lazily, by clang (``-O2 -g -target bpf``), into a cache
named by a hash of the sources, clang's version and the flags
(``$SWITCHML_XDP_CACHE``, else ``$XDG_CACHE_HOME/switchml/xdp``); it is loaded
with libbpf (``libbpf.so.1``) through ctypes: no Python dependency
(``loader.py``: the toolchain and the loader).  Loading
needs root (CAP_BPF and CAP_NET_ADMIN, or CAP_SYS_ADMIN); ``unavailable()`` says
what is missing.

Not done yet, each a difference from the Python pipeline that the tests keep
out of their traffic: the sparse path in the program itself (in user space,
above), IPv6, packets of more than 64 lanes (blocks), the UDP
checksum of received datagrams (the kernel drops a bad one before the Python
switch's socket; the program does not check it yet),
secondary addresses of an interface (``interface_of`` reads the primary one),
and a UDP checksum on the results (sent without one, which IPv4 allows).
"""

from __future__ import annotations

import ctypes
import logging
import re
import socket
import struct
from collections import Counter

import numpy as np

from ... import wire
from ...config import DEFAULT_PACKET_ELEMENTS, DEFAULT_PORT, DEFAULT_SLOTS
from ..dataplane.pipeline import MAX_WORKERS, Job, Mismatch, Pipeline
from .dispatch import Dispatcher
from .loader import (
    HERE,
    SOURCE,
    build_object,
    libbpf,
    load,
    unavailable,
)
from .serving import InterfaceServing

__all__ = ["HERE", "XdpPipeline", "unavailable"]

log = logging.getLogger("switchml.switch")

XDP_ABORTED, XDP_DROP, XDP_PASS, XDP_TX, XDP_REDIRECT = range(5)
ACTIONS = {XDP_ABORTED: "aborted", XDP_DROP: "drop", XDP_PASS: "pass", XDP_TX: "tx",
           XDP_REDIRECT: "redirect"}

ETH_HEADER = 14
IP_HEADER = 20
UDP_HEADER = 8
FRAME_HEADERS = ETH_HEADER + IP_HEADER + UDP_HEADER
#: What BPF_PROG_TEST_RUN puts in a frame's first buffer: one page less XDP's
#: headroom (256) and the kernel's skb_shared_info (320); the rest of a longer
#: frame goes in pages of its own (multi-buffer XDP, which the program takes).
FIRST_BUFFER = 4096 - 256 - 320
#: The switch's side of the frames ``receive_datagram`` builds.
SWITCH_MAC = bytes.fromhex("020000000001")
WORKER_MAC = bytes.fromhex("020000000002")
SWITCH_IP = "10.255.0.1"


def _source_constants() -> tuple[list[str], int, int]:
    """The counter names (the program's enum), its bound on lanes and on the
    bridge ports it serves, read from the source, so that they have one
    definition."""
    text = SOURCE.read_text()
    enum = re.search(r"enum xdp_counter \{(.*?)\};", text, re.S)
    if enum is None:
        raise RuntimeError(f"{SOURCE.name}: no enum xdp_counter")
    body = re.sub(r"/\*.*?\*/", "", enum.group(1), flags=re.S)
    names = [n.strip() for n in body.split(",") if n.strip()]
    if names[-1] != "XDP_NCOUNTERS" or not all(n.startswith("C_") for n in names[:-1]):
        raise RuntimeError(f"{SOURCE.name}: enum xdp_counter is not C_* then XDP_NCOUNTERS")

    def define(name: str) -> int:
        found = re.search(rf"#define {name} (\d+)", text)
        if found is None:
            raise RuntimeError(f"{SOURCE.name}: no #define {name}")
        return int(found.group(1))

    return [n[2:].lower() for n in names[:-1]], define("XDP_MAX_LANES"), define("XDP_MAX_PORTS")


#: MAX_BRIDGE_PORTS: the bridge ports served in driver mode at most (the ``ports`` map)
COUNTER_NAMES, MAX_LANES, MAX_BRIDGE_PORTS = _source_constants()


def max_values(datagram_size: int) -> int:
    """The values a slot row of the program holds (its XDP_MAX_VALUES, which
    bounds its loops) for a pipeline whose datagrams take ``datagram_size``
    bytes: as many as one lane leaves room for, a multiple of 8."""
    values = max(1, (datagram_size - wire.HEADER_SIZE - wire.LANE_SIZE) // wire.VALUE_SIZE)
    return -(-values // 8) * 8


def row_size(values: int) -> int:
    """Bytes of a slot row in the program's map (XDP_ROW_SIZE) for ``values``."""
    return wire.HEADER_SIZE + wire.LANE_SIZE * MAX_LANES + wire.VALUE_SIZE * values + \
        wire.HEADER_SIZE


# ---------------------------------------------------------------- map values
class _Config(ctypes.Structure):
    _fields_ = [("slots", ctypes.c_uint32), ("port", ctypes.c_uint16),
                ("pad", ctypes.c_uint16), ("ifindex", ctypes.c_uint32),
                ("ingress_drop", ctypes.c_uint32), ("egress_drop", ctypes.c_uint32),
                ("answers_by_stack", ctypes.c_uint32), ("results_in_runs", ctypes.c_uint32),
                ("addr", ctypes.c_uint8 * 4)]


def drop_threshold(rate: float) -> int:
    """A simulated drop rate as the program takes it: a datagram is lost when a
    random u32 falls below this."""
    return min(int(round(rate * 2**32)), 2**32 - 1)


class _MemberKey(ctypes.Structure):
    _fields_ = [("addr", ctypes.c_uint8 * 4), ("port", ctypes.c_uint8 * 2),
                ("pad", ctypes.c_uint16)]


class _Member(ctypes.Structure):
    _fields_ = [("job", ctypes.c_uint32), ("rank", ctypes.c_uint32)]


class _RankAddress(ctypes.Structure):
    _fields_ = [("addr", ctypes.c_uint8 * 4), ("port", ctypes.c_uint8 * 2),
                ("mac", ctypes.c_uint8 * 6), ("learned", ctypes.c_uint32),
                ("pad", ctypes.c_uint32)]


class _Job(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint32) for name in (
        "session", "world", "slot_base", "slot_count", "lanes", "packet_elements",
        "block_elements", "pad")] + [("tokens", ctypes.c_uint32 * MAX_WORKERS)]


#: pipeline.py's _ids, in the program's order
SET_IDS = ("seq", "pkt_id", "dtype", "mode", "id_count", "call")


class _Set(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint32) for name in (
        "lock", "valid", "msg", "bitmap", "count") + SET_IDS]


class _Mismatch(ctypes.Structure):
    _fields_ = [("state", ctypes.c_uint32), ("record", ctypes.c_uint32 * 8)]


def _u32(value: int) -> ctypes.c_uint32:
    return ctypes.c_uint32(value)


def member_key(addr) -> _MemberKey:
    """The member table's key of an IPv4 ``(host, port)``; ValueError otherwise."""
    try:
        host, port = addr
        packed = socket.inet_pton(socket.AF_INET, host)
    except (TypeError, ValueError, OSError):
        raise ValueError(f"the XDP data plane takes IPv4 (host, port) members, not "
                         f"{addr!r}") from None
    if type(port) is not int or not 0 <= port <= 0xFFFF:
        raise ValueError(f"not a UDP port: {port!r}")
    key = _MemberKey()
    key.addr[:] = list(packed)
    key.port[:] = list(port.to_bytes(2, "big"))
    return key


# ---------------------------------------------------------------- frames
def _ip_checksum(header: bytes) -> int:
    total = sum(struct.unpack("!10H", header))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF


def udp_frame(src, dst, payload: bytes, src_mac: bytes = WORKER_MAC,
              dst_mac: bytes = SWITCH_MAC) -> bytes:
    """An Ethernet/IPv4/UDP frame (DF, no UDP checksum) from ``src`` to ``dst``."""
    ip = bytearray(struct.pack("!BBHHHBBH4s4s", 0x45, 0, IP_HEADER + UDP_HEADER + len(payload),
                               0, 0x4000, 64, socket.IPPROTO_UDP, 0,
                               socket.inet_aton(src[0]), socket.inet_aton(dst[0])))
    ip[10:12] = _ip_checksum(bytes(ip)).to_bytes(2, "big")
    udp = struct.pack("!HHHH", src[1], dst[1], UDP_HEADER + len(payload), 0)
    return dst_mac + src_mac + b"\x08\x00" + bytes(ip) + udp + bytes(payload)


def parse_udp_frame(frame: bytes) -> tuple[tuple, tuple, bytes]:
    """(source, destination, payload) of a frame ``udp_frame`` describes."""
    ip = frame[ETH_HEADER:ETH_HEADER + IP_HEADER]
    total, = struct.unpack("!H", ip[2:4])
    src = (socket.inet_ntoa(ip[12:16]), int.from_bytes(frame[34:36], "big"))
    dst = (socket.inet_ntoa(ip[16:20]), int.from_bytes(frame[36:38], "big"))
    length = int.from_bytes(frame[38:40], "big")
    return src, dst, frame[FRAME_HEADERS: FRAME_HEADERS + length - UDP_HEADER] \
        if total >= IP_HEADER + length else b""


def _is_sparse_contribution(data) -> bool:
    """Whether ``data``'s header says a sparse contribution (its kind and mode
    bytes: wire.HEADER), the datagrams the program passes up to user space."""
    return len(data) >= wire.HEADER_SIZE and data[3] == wire.KIND_CONTRIBUTION and \
        bool(data[5] & wire.MODE_SPARSE)


def _longer_than_its_header(datagram: bytes) -> bool:
    """The program's test for a UDP GSO super-packet (pipeline.bpf.c,
    receive_datagram): a datagram longer by a header or more than its header
    says (its lanes and values)."""
    if len(datagram) < wire.HEADER_SIZE or datagram[3] not in (
            wire.KIND_CONTRIBUTION, wire.KIND_PROBE, wire.KIND_QUERY):
        return False
    count, lanes = struct.unpack_from("<HH", datagram, 24)
    return len(datagram) - wire.packet_size(lanes, count) >= wire.HEADER_SIZE


# ---------------------------------------------------------------- the pipeline
class XdpPipeline(InterfaceServing, Pipeline):
    """The same object as ``Pipeline``, with its data plane in the XDP program
    (see the module doc).  ``port``: the switch's UDP port, which the program
    serves (other traffic passes to the host); ``close()`` unloads it.
    ``serve`` (serving.py) runs it on an interface."""

    max_bridge_ports = MAX_BRIDGE_PORTS


    def __init__(self, slots: int = DEFAULT_SLOTS, packet_elements: int = DEFAULT_PACKET_ELEMENTS,
                 *, block_elements: int | None = None, port: int = DEFAULT_PORT,
                 switch_ip: str = SWITCH_IP, drop_rate: float = 0.0,
                 egress_drop_rate: float | None = None, seed: int | None = None):
        super().__init__(slots, packet_elements, block_elements=block_elements,
                         drop_rate=drop_rate, egress_drop_rate=egress_drop_rate, seed=seed)
        if self.lanes > MAX_LANES:
            raise ValueError(
                f"the XDP data plane handles packets of at most {MAX_LANES} lanes (blocks, "
                f"each an exponent register: the bound of the program's loop over them); "
                f"{self.packet_elements} values in blocks of {self.block_elements} are "
                f"{self.lanes}: set packet_elements (--packet-elements, "
                f"SWITCHML_PACKET_ELEMENTS) to at most {MAX_LANES * self.block_elements}")
        reason = unavailable()
        if reason:
            raise RuntimeError(f"the XDP data plane cannot run here: {reason}")
        self.port = port
        self.address = (switch_ip, port)
        #: the values a row of the program holds (its loops' bound)
        self.max_values = max_values(self.datagram_size)
        self._row_size = row_size(self.max_values)
        self._prog = load(build_object(self.max_values), {
            "members": slots * MAX_WORKERS, "rank_addresses": slots * MAX_WORKERS,
            "jobs": slots, "mismatches": slots,
            "sets": 2 * slots, "rows": 2 * slots, "counts": slots + 1,
            "scratch": libbpf().libbpf_num_possible_cpus()})
        self.verifier_stats = self._prog.verifier_stats
        self._counts_type = ctypes.c_uint64 * (len(COUNTER_NAMES) * self._prog.cpus)
        self._counted: dict[int, list[int]] = {}  # counts entry -> its sums already taken
        self._job_at: dict[int, Job] = {}  # slot_base -> running job
        self._link: int | None = None  # serve(driver=True): the BPF link's fd
        #: serve(): its holds on the dispatchers (one, or one a port of a bridge)
        self._dispatches: list[Dispatcher] = []
        self._fan_out_links: list[int] = []  # serve(): the fan-out program's links
        self._ports: list[int] = []  # serve(): the bridge ports in the `ports` map
        self._ports_refused: set[int] = set()  # adopt_new_ports(): left to the socket
        self._answers_by_stack = False
        self.ifindex: int | None = None
        #: How ``serve`` attached the program: "driver" (the driver's native mode,
        #: on the interface or on each port of the bridge that is it), "generic",
        #: or None before it serves; ``mode_reason`` says why.
        self.mode: str | None = None
        self.mode_reason = ""
        #: Whether workers may send runs of UDP GSO segments (``protocol.Ready.gso``):
        #: where the program runs in driver mode, no run reaches it whole (a NIC's
        #: are cut before the wire; a veth with a native XDP program has its peer
        #: cut them, as the kernel takes software GSO off the peer's features).
        #: In generic mode a run from this host (another namespace, a container)
        #: crosses veths and bridges whole, and the program could only pass it
        #: up, to be summed a datagram at a time: the workers send datagrams apart.
        self.takes_gso_runs = False
        #: Whether completed results leave in runs: on veths in driver mode, the
        #: kernel's GRO (turned on there by ``serve``, off again by the last
        #: switch on the device to ``detach``)
        #: merges the results the program passes, a flow's, into one skb, which
        #: the fan-out program sends each rank whole (pipeline.bpf.c,
        #: ``results_in_runs``); the switch's socket then takes UDP_GRO, and what
        #: reaches it may be a run (a sparse contribution's, a result's for a rank
        #: the kernel cannot reach), which it cuts into its datagrams.
        self.merges_results = False
        self._gro_turned_on: list[str] = []
        self._configure(ifindex=0)
        self._sparse_logged: set[int] = set()  # sessions whose sparse path was logged

    def close(self) -> None:
        """Detach and unload the program (its maps go with it)."""
        self.detach()
        self._prog.close()

    def _configure(self, ifindex: int) -> None:
        """The program's settings: the pool, the port, the interface served (0:
        none), the simulated drop rates."""
        for device in self._ports:  # the bridge's ports, where a rank's address is learned
            self._prog.update("ports", _u32(device), _u32(1))
        # the switch's own address where it serves an interface: others' datagrams
        # to its port (a bridge's port sees every container's) pass
        addr = (ctypes.c_uint8 * 4)(*socket.inet_aton(self.address[0])) if ifindex else \
            (ctypes.c_uint8 * 4)()
        self._prog.update("config", _u32(0), _Config(
            self.slots, socket.htons(self.port), 0, ifindex,
            drop_threshold(self.ingress_drop_rate), drop_threshold(self.egress_drop_rate),
            int(self._answers_by_stack and ifindex != 0),
            int(self.merges_results and ifindex != 0), addr))

    def passed_up(self, data, addr) -> list:
        """What the switch's socket sends for a datagram it received while the
        program serves its port.  A result (the program drops every result a
        member sends) is one the program completed, passed up from the
        completing contribution's address, which the fan-out program did not
        send (a rank of the job it cannot reach, or no fan-out program): for
        every rank of that member's job (``results_passed_up``).  A sparse
        contribution is one the program checked and passed up
        (``sparse_passed_up``): ``Pipeline``'s own code aggregates it into the
        set in the program's maps (``_sparse_in_user_space``).  Anything else
        did not get its answer from the program: a probe it had no room to
        answer in its frame (``probes_passed_up``), or a datagram that
        never went through it (sent from this host, or before the attach); it
        goes through the program now, by BPF_PROG_TEST_RUN (``receive_datagram``),
        as if it had come in by the interface.

        Trust: a result is sent on only where it is the row of a set the
        program completed (``_to_every_rank``), whatever reached the socket.
        A sparse contribution that did not pass through the program is
        aggregated all the same (the reference checks everything the program
        would), only not counted as ``sparse_passed_up``."""
        if len(data) >= wire.HEADER_SIZE and data[3] == wire.KIND_RESULT and \
                addr in self._members:
            return self._to_every_rank(data, addr)
        if _is_sparse_contribution(data) and addr in self._members:
            return self._sparse_in_user_space(data, addr)
        try:
            return self._through_program(data, addr, self._to_every_rank)
        except ValueError:  # not an IPv4 member's address: nothing the program takes
            self.counters["dropped_unknown_source"] += 1
            return []

    def _to_every_rank(self, result: bytes, addr) -> list:
        """A completed result that the switch's socket sends to every rank of the
        job of member ``addr``: counted as the job's ``results_passed_up`` (the
        fan-out program sends the others).  Only the program's own: the set it
        names holds its message, complete, and its row is these bytes.  Anything
        else (a result forged from a member's address, inside a run of UDP GSO
        segments the program passed up whole on its first header's word, or one
        stale because every rank had it and the set moved on) is dropped and
        counted (``dropped_unverified_result``)."""
        job = self._members[addr][0]
        if not self._completed_here(job, result):
            job.counters["dropped_unverified_result"] += 1
            return []
        job.counters["results_passed_up"] += 1
        return self._to_members(job, result)

    def _completed_here(self, job: Job, result: bytes) -> bool:
        """Whether ``result`` is the row of a set of ``job`` that the program completed."""
        try:
            header = wire.decode_header(result)
        except wire.MalformedPacket:
            return False
        if header.kind != wire.KIND_RESULT or not \
                job.slot_base <= header.slot < job.slot_base + job.slot_count:
            return False
        v = header.msg & 1
        regs = self.set_registers(v, header.slot)
        if not regs["valid"] or regs["msg"] != header.msg or regs["count"] != job.world_size:
            return False
        row = self._prog.lookup("rows", _u32(v * self.slots + header.slot),
                                (ctypes.c_uint8 * self._row_size)())
        return bytes(row)[: len(result)] == bytes(result)

    def _to_members(self, job: Job, result: bytes) -> list:
        """A completed result's datagrams to every rank of ``job``, as the fan-out
        program sends them: each copy lost at the simulated egress drop rate (the
        program counted every rank's in ``results_out``: a lost one is taken
        out)."""
        out = []
        for member in job.members:
            if self.egress_drop_rate and self._rng.random() < self.egress_drop_rate:
                job.counters["dropped_egress_simulated"] += 1
                job.counters["results_out"] -= 1
                continue
            out.append((result, member))
        return out

    # ---------------------------------------------------------------- sparse
    def _sparse_in_user_space(self, data, addr) -> list:
        """A sparse contribution from member ``addr``, which the program passes up:
        ``Pipeline.receive_datagram`` (the reference's code, drops and counters
        included) run on the set it names, loaded from the program's maps into
        the reference's registers and row, and written back when it changed, so
        that the program answers the set's probes and retransmissions, and
        starts its next message, from what the sparse path left.  What it sends
        (a completed result, to every rank; a stored one, to the sender) goes
        out of the switch's socket.  Logged once per job.

        Concurrency: user space runs one datagram at a time (the switch's
        loop), but the program may run a datagram of the same set meanwhile, on
        any CPU.  It writes the set only for a dense contribution of the set's
        message (a set started by a sparse contribution holds a sparse mode:
        the ids differ, a mismatch, nothing written) or of a newer message,
        which no rank sends before the result of the message this completes
        went out (a rank sends message m+2 of a slot only once it has m+1's
        result, which needs every rank's m+1, each sent once its m's result
        came); a faulty rank that did would have its contribution undone by
        the write-back below: lost, never added twice, and its probe asks it
        again.  The program reads the row only for a complete set.  So the
        write-back goes in an order in which each state the program can see is
        one it answers rightly (``_store_set``), each register write whole
        (BPF_F_LOCK: under the set's lock, which the program holds while it
        reads a set and snapshots its row)."""
        job = self._members[addr][0]
        if job.session not in self._sparse_logged:
            self._sparse_logged.add(job.session)
            log.info("job '%s' makes sparse calls: the XDP program passes them up and the "
                     "switch aggregates them in user space (its dense calls stay in the "
                     "program)", job.name)
        try:
            header = wire.decode_header(data)
            slot, msg = header.slot, header.msg
        except wire.MalformedPacket:  # the reference drops it and counts why
            slot = msg = -1
        if not 0 <= slot < self.slots:  # no set to load: the reference drops it
            return self._reference_on(data, addr)
        v = msg & 1
        before = self._load_set(v, slot)
        out = self._reference_on(data, addr)
        self._store_set(v, slot, before)
        return out

    def _reference_on(self, data, addr) -> list:
        """``Pipeline.receive_datagram`` on ``data``, its datagrams out copied (the
        socket sends them after the batch), without its simulated ingress drop:
        the program drew it for the datagram already (for a UDP GSO run it
        passed up, once for the run).  Its simulated egress drops stay: user
        space sends these copies alone."""
        rate, self.ingress_drop_rate = self.ingress_drop_rate, 0.0
        try:
            return [(bytes(d), a) for d, a in Pipeline.receive_datagram(self, data, addr)]
        finally:
            self.ingress_drop_rate = rate

    def _python_registers(self, v: int, slot: int) -> tuple:
        return (int(self._valid[v][slot]), self._msg[v][slot], self._bitmap[v][slot],
                self._count[v][slot]) + tuple(self._ids[v][slot])

    def _load_set(self, v: int, slot: int) -> tuple:
        """Set ``v`` of ``slot`` from the program's maps into the reference's
        registers (``_valid``, ``_msg``, ``_bitmap``, ``_count``, ``_ids``) and
        ``_rows``; returns (registers, row) as loaded.  ``_blocks`` (the sparse
        blocks this message received) is the reference's own: only this path
        reads or writes it, and it starts afresh with each sparse message."""
        state = self._prog.lookup("sets", _u32(v * self.slots + slot), _Set(), locked=True)
        self._valid[v][slot] = bool(state.valid)
        self._msg[v][slot] = state.msg
        self._bitmap[v][slot] = state.bitmap
        self._count[v][slot] = state.count
        self._ids[v][slot] = tuple(getattr(state, name) for name in SET_IDS)
        row = self._prog.lookup("rows", _u32(v * self.slots + slot),
                                (ctypes.c_uint8 * self._row_size)())
        self._rows[v, slot] = np.frombuffer(row, np.uint8, self.row_size)
        return self._python_registers(v, slot), bytes(self._rows[v, slot])

    def _store_set(self, v: int, slot: int, before: tuple) -> None:
        """Write set ``v`` of ``slot`` back to the maps if the reference changed it
        (a mismatch, a duplicate or a stale message changes nothing: nothing is
        written, nor can a concurrent write of the program's be undone).  The
        order keeps each state the program sees a right one:

        - a message newer than the set's (or a set not valid) first becomes the
          set's registers with no contribution in: the program then reads no
          row of the set (not complete: a probe of the new message asks a
          resend, one of the old is stale) and writes none (a dense
          contribution of it mismatches);
        - the row next;
        - the registers last: a set complete only once its row holds the result.
        """
        registers = self._python_registers(v, slot)
        row = bytes(self._rows[v, slot])
        if (registers, row) == before:
            return
        key = _u32(v * self.slots + slot)
        valid, msg, bitmap, count, *ids = registers
        if not before[0][0] or before[0][1] != msg:
            self._prog.update("sets", key, _Set(0, valid, msg, 0, 0, *ids), locked=True)
        buffer = (ctypes.c_uint8 * self._row_size)()
        ctypes.memmove(buffer, row, len(row))
        self._prog.update("rows", key, buffer)
        self._prog.update("sets", key, _Set(0, valid, msg, bitmap, count, *ids), locked=True)

    # ---------------------------------------------------------------- control
    def install_job(self, name: str, session: int, members: list, slot_base: int,
                    slot_count: int, packet_elements: int | None = None,
                    block_elements: int | None = None, tokens: list | None = None) -> Job:
        keys = [member_key(addr) for addr in members]  # before anything changes
        packet = self.packet_elements if packet_elements is None else packet_elements
        block = self.block_elements if block_elements is None else block_elements
        if block >= 1 and packet // block > MAX_LANES:
            raise ValueError(f"the XDP data plane handles at most {MAX_LANES} lanes a packet")
        job = super().install_job(name, session, members, slot_base, slot_count,
                                  packet_elements, block_elements, tokens)
        prog = self._prog
        entry = _Job(job.session, job.world_size, slot_base, slot_count, job.lanes,
                     job.packet_elements, job.block_elements, 0)
        entry.tokens[: job.world_size] = job.tokens
        prog.update("jobs", _u32(slot_base), entry)
        prog.update("mismatches", _u32(slot_base), _Mismatch())
        prog.update("counts", _u32(slot_base), self._counts_type())
        self._counted[slot_base] = [0] * len(COUNTER_NAMES)
        for s in range(slot_base, slot_base + slot_count):
            for v in (0, 1):  # as pipeline.install_job: msg and ids stay
                state = prog.lookup("sets", _u32(v * self.slots + s), _Set())
                state.valid = state.bitmap = state.count = 0
                prog.update("sets", _u32(v * self.slots + s), state)
        for rank, key in enumerate(keys):  # not learned: the program learns them
            prog.update("rank_addresses", _u32(slot_base * MAX_WORKERS + rank),
                        _RankAddress(key.addr, key.port))
        # the members last: a datagram finds the job through them
        for rank, key in enumerate(keys):
            prog.update("members", key, _Member(slot_base, rank))
        self._job_at[slot_base] = job
        return job

    def remove_job(self, session: int, state: str = "ended") -> Job | None:
        job = self.jobs.get(session)
        if job is None:
            return None
        for addr in job.members:  # first: no datagram of it gets in after this
            self._prog.delete("members", member_key(addr))
        self.sync_counters()
        del self._job_at[job.slot_base]
        self._prog.update("jobs", _u32(job.slot_base), _Job())
        return super().remove_job(session, state)

    def _counts_by_cpu(self, index: int) -> list[list[int]]:
        """The program's counters at ``counts[index]``, a list of them per CPU."""
        values = self._prog.lookup("counts", _u32(index), self._counts_type())
        n = len(COUNTER_NAMES)
        return [list(values[cpu * n:(cpu + 1) * n]) for cpu in range(self._prog.cpus)]

    def counted_by_cpu(self, job: Job, name: str) -> list[int]:
        """What each CPU's runs of the program counted as ``name`` for ``job`` so
        far: which CPUs ran its datagrams."""
        i = COUNTER_NAMES.index(name)
        return [counts[i] for counts in self._counts_by_cpu(job.slot_base)]

    def _take_counts(self, index: int) -> Counter:
        """What the program counted at ``counts[index]`` since the last call."""
        n = len(COUNTER_NAMES)
        # modulo 2**64: the program uncounts with a -1 on one CPU (C_PROBES_PASSED_UP)
        sums = [sum(column) % 2**64 for column in zip(*self._counts_by_cpu(index))]
        before = self._counted.get(index, [0] * n)
        self._counted[index] = sums
        return Counter({COUNTER_NAMES[i]: sums[i] - before[i] for i in range(n)
                        if sums[i] != before[i]})

    def sync_counters(self) -> None:
        """Add what the program counted since the last call to the Python counters."""
        self.counters.update(self._take_counts(self.slots))
        for base, job in self._job_at.items():
            job.counters.update(self._take_counts(base))

    def totals(self):
        self.sync_counters()
        return super().totals()

    def stats(self) -> dict:
        """The reference's stats, and the kernel's count of the programs' runs and
        their time (zero unless run-time statistics are on:
        ``loader.count_run_time``)."""
        self.sync_counters()
        stats = super().stats()
        times = self._prog.run_times()
        stats["program_runs"] = {name: runs for name, (_, runs) in times.items()}
        stats["program_time_s"] = {name: ns / 1e9 for name, (ns, _) in times.items()}
        stats["xdp_mode"] = self.mode  # "driver" or "generic" (None: not serving)
        stats["xdp_results_in_runs"] = self.merges_results
        return stats

    def set_registers(self, v: int, slot: int) -> dict:
        """The program's registers of set ``v`` of ``slot``: valid, msg, bitmap,
        count and the ids (``SET_IDS``)."""
        state = self._prog.lookup("sets", _u32(v * self.slots + slot), _Set())
        return {name: getattr(state, name) for name in
                ("valid", "msg", "bitmap", "count") + SET_IDS}

    def row(self, v: int, slot: int) -> bytes:
        """The program's slot row of set ``v`` of ``slot``, as long as pipeline.py's
        rows are up to the reply it builds past the datagram (``datagram_size``)."""
        row = self._prog.lookup("rows", _u32(v * self.slots + slot),
                                (ctypes.c_uint8 * self._row_size)())
        return bytes(row)[: self.datagram_size]

    def slot_state(self, slot: int, msg: int) -> tuple[bool, int]:
        regs = self.set_registers(msg & 1, slot)
        holds = bool(regs["valid"]) and regs["msg"] == msg
        return holds, regs["bitmap"] if holds else 0

    @property
    def has_mismatches(self) -> bool:
        return super().has_mismatches or \
            any(self._prog.lookup("mismatches", _u32(base), _Mismatch()).state == 2
                for base in self._job_at)

    def take_mismatches(self) -> list:
        """The program's records and the sparse path's (``Pipeline``'s own, from
        ``_sparse_in_user_space``), the first of a job only, as the reference:
        a job whose first one the sparse path recorded (``job.mismatch``) has
        the program's record taken and not reported."""
        out = super().take_mismatches()
        for base, job in self._job_at.items():
            found = self._prog.lookup("mismatches", _u32(base), _Mismatch())
            if found.state != 2:
                continue
            found.state = 3  # taken: the program records no other for this job
            self._prog.update("mismatches", _u32(base), found)
            if job.mismatch is not None:
                continue
            bitmap, seq0, call0, dtype0, rank, seq, call, dtype = found.record
            job.mismatch = Mismatch(tuple(r for r in range(job.world_size) if bitmap >> r & 1),
                                    (seq0, call0, dtype0), rank, (seq, call, dtype))
            out.append((job, job.mismatch))
        return out

    # ---------------------------------------------------------------- data
    def run_frame(self, frame: bytes) -> tuple[int, bytes]:
        """The program on one frame, as a NIC would run it: (XDP action, frame out).

        A frame the program passes up as a UDP GSO super-packet (longer than its
        header says, by a header or more) is one datagram here, in user space,
        where the kernel has cut every GSO run into its datagrams already: it is
        dropped, and counted as ``dropped_bad_length``, as the Python pipeline
        counts it."""
        action, out = self._prog.test_run(frame, FRAME_HEADERS + self.datagram_size + 4096)
        self.sync_counters()
        if action == XDP_PASS:
            src, _, payload = parse_udp_frame(out)
            if src in self._members and _longer_than_its_header(payload):
                job = self._members[src][0]
                job.counters["gso_passed_up"] -= 1
                job.counters["dropped_bad_length"] += 1
                return XDP_DROP, out
        return action, out

    def receive_datagram(self, data, addr) -> list:
        """``Pipeline.receive_datagram`` through the program: ``data`` from ``addr``
        in a frame to the switch; the datagrams it sends and where.  A completed
        result (``XDP_PASS``) goes to every rank of the sender's job, as the
        switch's socket sends it.  The frame is padded (past its IP packet, as
        Ethernet pads short frames) to a whole result's length: the program
        answers a probe in place, in a frame too short for the result otherwise
        (one page is, for packets past it)."""
        return self._through_program(
            data, addr, lambda result, a: self._to_members(self._members[a][0], result))

    def _through_program(self, data, addr, to_every_rank) -> list:
        """``receive_datagram``, a completed result's datagrams made by
        ``to_every_rank(result, addr)``."""
        member_key(addr)  # IPv4 only: refuse anything else before building a frame
        frame = udp_frame(addr, self.address, bytes(data))
        room = FRAME_HEADERS + self.datagram_size
        action, out = self.run_frame(frame + bytes(max(0, room - len(frame))))
        if action == XDP_DROP:
            return []
        src, dst, payload = parse_udp_frame(out)
        if action == XDP_TX and dst == tuple(addr) and src == self.address:
            return [(payload, tuple(addr))]
        if action == XDP_PASS and payload[3:4] == bytes([wire.KIND_RESULT]) and \
                addr in self._members:
            return to_every_rank(payload, tuple(addr))
        if action == XDP_PASS and _is_sparse_contribution(payload) and addr in self._members:
            return self._sparse_in_user_space(payload, tuple(addr))
        raise RuntimeError(f"the XDP program answered {ACTIONS.get(action, action)} with a "
                           f"frame from {src} to {dst}")
