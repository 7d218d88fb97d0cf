"""Datagram layout of the data plane, and its validation.

Every data-plane datagram is a 32-byte header, a table of ``lanes`` 12-byte lane
records, then ``count`` int32 values, all little-endian::

    offset size field
         0    2 magic      0x4D53 ("SM")
         2    1 version    5
         3    1 kind       1 = contribution (worker -> switch), 2 = result (switch -> worker),
                           3 = probe (worker -> switch: a retransmission without its
                           lane table and values), 4 = resend (switch -> worker: the
                           probed contribution is missing, send it whole), 5 = query
                           (worker -> switch: a probe by the timer), 6 = done (switch
                           -> worker: the queried set is complete, its result went out
                           before this)
         4    1 dtype      0 = int32, 1 = float32 as block floating point,
                           2 = floats as 16-bit block floating point, two a word
         5    1 mode       bit 0: sparse (OmniReduce); bit 1: sparse seed round;
                              4 alone: values maxed (sparse exponent rounds)
         6    2 slot       absolute slot index in the switch's pool
         8    4 session    from the switch: the job's random id, given at join;
                           from a worker: its own token, given at join
                           (``protocol.Ready.token``), which the switch checks
        12    4 msg        per-slot message number; the shadow-copy set is msg & 1
        16    4 seq        allreduce sequence number within the session
        20    4 pkt_id     packet index within the allreduce
        24    2 count      number of int32 values after the lane table
        26    2 lanes      number of lane records (blocks per packet)
        28    4 call       what the allreduce is (``call_id``): its element count
                           (mod 2**31), bit 31 set for a sparse call; the switch
                           compares it between ranks to name a mismatch at once

A packet covers ``lanes`` blocks of ``block_elements`` values.  Lane record::

    pos  u32  sparse: column position of the block this record is about
    nxt  u32  sparse: the sender's next non-zero position (result: the minimum)
    exp  i16  exponent (result: the max); dense: record 0 holds the exponent of
              the chunk the slot sends next; sparse seed round: one chunk each
    flag u16  bit 0: a block for this lane is in the values (result: present)

A probe, a query, a resend and a done are the 32-byte header alone (``count``
and ``lanes`` 0), with the ids of the contribution they are about: a worker's
tail probes (and probes of its fast retransmissions) are probes and its timer's
retransmissions queries, so that a rank
whose contribution the switch holds (it waits for a peer's lost one) costs the
congested port 32 bytes, not a packet.  The switch answers both with a resend
when the rank's contribution is not in the set, and not at all when the set
waits for others.  When it is complete, a probe gets the stored result; a query
gets a done: its result left before the done, on the same path, so a rank that
gets the done without the result lost it and sends its contribution whole
(which the switch answers with the stored result), and a timeout that was only
late costs 32 bytes, not a second copy of the result.

Dense packets carry their values as they are (``count`` may end mid-block at the
tensor's end); sparse packets carry one full block per flagged lane, in lane
order.  The worker's rank is deliberately not in the packet: like a switch's
table entry, the switch knows it from the source address that joined the job,
and the rank's token in ``session`` proves it.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

import numpy as np

MAGIC = 0x4D53
VERSION = 5  # 3: MODE_MAX, the sparse path's exponent rounds; 4: probes and resends;
#             5: the timer's probe (query), answered "done" when the set is complete
KIND_CONTRIBUTION = 1
KIND_RESULT = 2
#: A retransmission as the header alone: "is my contribution in, and is the set done?"
KIND_PROBE = 3
#: The switch's answer to a probe whose contribution it does not hold: send it whole.
KIND_RESEND = 4
#: A timer's retransmission as the header alone: a probe that a complete set
#: answers with a done, not its result.
KIND_QUERY = 5
#: The switch's answer to a query of a complete set: its result went out before
#: this answer, on the same path, so a rank still without it when this comes lost it.
KIND_DONE = 6
KINDS = (KIND_CONTRIBUTION, KIND_RESULT, KIND_PROBE, KIND_RESEND, KIND_QUERY, KIND_DONE)
DTYPE_INT32 = 0
DTYPE_FLOAT32 = 1
#: The 16-bit wire: each int32 "value" is a word of two biased uint16 values (low
#: half first), which the switch's 32-bit adds sum without a carry between them.
DTYPE_FLOAT16_WIRE = 2
MODE_SPARSE = 1
MODE_SEED = 2
#: A dense contribution whose values the switch maxes (signed int32) instead of
#: adding: the sparse path's exponent rounds, a slot's chunk exponents at a time.
MODE_MAX = 4
#: Every mode a packet may carry.
MODES = (0, MODE_SPARSE, MODE_SPARSE | MODE_SEED, MODE_MAX)
FLAG_BLOCK = 1
#: Sparse position meaning "none": the lane's column is exhausted.
POS_END = 0xFFFFFFFF

HEADER = struct.Struct("<HBBBBHIIIIHHI")
HEADER_SIZE = HEADER.size
assert HEADER_SIZE == 32
VALUE_SIZE = 4
LANE = np.dtype([("pos", "<u4"), ("nxt", "<u4"), ("exp", "<i2"), ("flag", "<u2")])
LANE_SIZE = LANE.itemsize
assert LANE_SIZE == 12

#: Largest UDP payload over IPv4.
MAX_DATAGRAM = 65507


class MalformedPacket(ValueError):
    """A datagram that is not a valid switchml packet; ``reason`` names why."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class Header(NamedTuple):
    kind: int
    dtype: int
    mode: int
    slot: int
    session: int
    msg: int
    seq: int
    pkt_id: int
    count: int  # type: ignore[assignment]  # the field shadows tuple.count, on purpose
    lanes: int
    call: int = 0


#: ``call`` bit of a sparse call.
CALL_SPARSE = 0x80000000


def call_id(elements: int, sparse: bool) -> int:
    """The header's ``call``: what every rank's packets of one allreduce share."""
    return (elements & 0x7FFFFFFF) | (CALL_SPARSE if sparse else 0)


def describe_call(call: int, dtype: int) -> str:
    """``call_id`` and dtype in words, for an error naming what each rank asked for."""
    kind = "sparse" if call & CALL_SPARSE else "dense"
    name = {DTYPE_FLOAT32: "float32", DTYPE_INT32: "int32",
            DTYPE_FLOAT16_WIRE: "float (16-bit wire)"}.get(dtype, f"dtype {dtype}")
    return f"{call & 0x7FFFFFFF} {name} values, {kind}"


#: Bytes of IPv4 and UDP headers in front of every datagram.
IP_UDP_OVERHEAD = 28
#: Values in a packet are rounded down to a multiple of this (whole vector loads).
VALUE_ALIGN = 8


def frame_geometry(mtu: int, limit_elements: int, block_elements: int) -> tuple[int, int]:
    """(packet_elements, block_elements) of the largest packet that fits one frame.

    ``mtu``: of the path (IP packet bytes); ``limit_elements``/``block_elements``:
    the switch's packet limit and block.  Whole blocks of ``block_elements`` when
    at least two fit (the sparse path's unit stays the switch's); otherwise one
    block per packet, as many values as the frame holds (a 1500-byte frame holds
    352 values where it holds one 256-value block).  Never more than the limit.
    """
    budget = mtu - IP_UDP_OVERHEAD - HEADER_SIZE
    lanes = budget // (LANE_SIZE + VALUE_SIZE * block_elements)
    if lanes >= 2 or (lanes == 1 and block_elements >= limit_elements):
        elements = min(lanes * block_elements, limit_elements // block_elements * block_elements)
        return elements, block_elements
    single = min((budget - LANE_SIZE) // VALUE_SIZE, limit_elements)
    if single >= VALUE_ALIGN:
        single -= single % VALUE_ALIGN
    if single < 1:
        raise ValueError(f"an MTU of {mtu} bytes leaves no room for a packet's values")
    return single, single


def packet_size(lanes: int, count: int) -> int:
    return HEADER_SIZE + LANE_SIZE * lanes + VALUE_SIZE * count


def max_packet_elements(block_elements: int) -> int:
    """Most values (whole blocks) one datagram can carry with its lane table."""
    per_block = LANE_SIZE + VALUE_SIZE * block_elements
    return (MAX_DATAGRAM - HEADER_SIZE) // per_block * block_elements


def decode_header(data) -> Header:
    """Parse and validate the header of ``data`` (bytes-like).

    Raises MalformedPacket when the datagram is too short, not ours, of another
    version, kind, dtype or mode, or its length disagrees with its counts.
    """
    if len(data) < HEADER_SIZE:
        raise MalformedPacket("truncated")
    (magic, version, kind, dtype, mode, slot, session, msg, seq, pkt_id, count, lanes,
     call) = HEADER.unpack_from(data)
    if magic != MAGIC:
        raise MalformedPacket("bad_magic")
    if version != VERSION:
        raise MalformedPacket("bad_version")
    if kind not in KINDS:
        raise MalformedPacket("bad_kind")
    if dtype not in (DTYPE_INT32, DTYPE_FLOAT32, DTYPE_FLOAT16_WIRE):
        raise MalformedPacket("bad_dtype")
    if mode not in MODES:
        raise MalformedPacket("bad_mode")
    if len(data) != packet_size(lanes, count):
        raise MalformedPacket("bad_length")
    return Header(kind, dtype, mode, slot, session, msg, seq, pkt_id, count, lanes, call)


def lane_table(data, lanes: int) -> np.ndarray:
    """The lane records of a datagram, as a structured array viewing its bytes."""
    return np.frombuffer(data, dtype=LANE, count=lanes, offset=HEADER_SIZE)


def values(data, lanes: int, count: int) -> np.ndarray:
    """The int32 values of a datagram, as an array viewing its bytes."""
    return np.frombuffer(data, dtype=np.int32, count=count,
                         offset=HEADER_SIZE + LANE_SIZE * lanes)


_FIRST_EXP = struct.Struct("<h")
_FIRST_EXP_OFFSET = HEADER_SIZE + dict(LANE.fields or {})["exp"][1]


def first_lane_exponent(data) -> int:
    """The ``exp`` of the first lane record: a dense packet's chunk exponent."""
    return _FIRST_EXP.unpack_from(data, _FIRST_EXP_OFFSET)[0]


def encode_header(buf, kind: int, dtype: int, mode: int, slot: int, session: int, msg: int,
                  seq: int, pkt_id: int, count: int, lanes: int, offset: int = 0,
                  call: int = 0) -> None:
    """Write a header into ``buf`` at ``offset``; the lane table and values follow it."""
    HEADER.pack_into(buf, offset, MAGIC, VERSION, kind, dtype, mode, slot, session,
                     msg & 0xFFFFFFFF, seq & 0xFFFFFFFF, pkt_id & 0xFFFFFFFF, count, lanes,
                     call & 0xFFFFFFFF)


def encode(kind: int, dtype: int, slot: int, session: int, msg: int, seq: int, pkt_id: int,
           lane_records=None, values=b"", mode: int = 0, call: int = 0) -> bytes:
    """Build a whole datagram (tests and tools). ``lane_records``: array of LANE or None."""
    table = np.zeros(0, LANE) if lane_records is None else np.asarray(lane_records, LANE)
    if not isinstance(values, (bytes, bytearray, memoryview)):
        values = np.ascontiguousarray(values, dtype=np.int32)
    payload = memoryview(values).cast("B") if len(values) else b""
    count = len(payload) // VALUE_SIZE
    buf = bytearray(packet_size(len(table), count))
    encode_header(buf, kind, dtype, mode, slot, session, msg, seq, pkt_id, count, len(table),
                  call=call)
    buf[HEADER_SIZE:HEADER_SIZE + LANE_SIZE * len(table)] = table.tobytes()
    buf[HEADER_SIZE + LANE_SIZE * len(table):] = payload
    return bytes(buf)


def probe_of(contribution, kind: int = KIND_PROBE) -> bytes:
    """The probe (or query) of a contribution: its header alone, no lane table or values."""
    probe = bytearray(contribution[:HEADER_SIZE])
    probe[3] = kind
    probe[24:28] = bytes(4)  # count and lanes
    return bytes(probe)


def answer_of(probe, kind: int) -> bytes:
    """A probe's header with another kind: the switch's resend or done."""
    out = bytearray(probe[:HEADER_SIZE])
    out[3] = kind
    return bytes(out)


def msg_newer(a: int, b: int) -> bool:
    """True when per-slot message number ``a`` comes after ``b`` (serial arithmetic)."""
    return 0 < ((a - b) & 0xFFFFFFFF) < 0x80000000
