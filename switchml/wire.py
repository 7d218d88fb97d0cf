"""Datagram layout of the data plane, and its validation.

Every data-plane datagram is a fixed 32-byte header followed by ``count`` 32-bit
integers, little-endian::

    offset size field
         0    2 magic      0x4D53 ("SM")
         2    1 version    1
         3    1 kind       1 = contribution (worker -> switch), 2 = result (switch -> worker)
         4    1 dtype      0 = int32, 1 = float32 as block floating point
         5    1 reserved   0
         6    2 slot       absolute slot index in the switch's pool
         8    4 session    random id of the job, given at join
        12    4 msg        per-slot message number; the shadow-copy set is msg & 1
        16    4 seq        allreduce sequence number within the session
        20    4 pkt_id     packet index within the allreduce
        24    2 exponent   int16: block exponent (see quant.py)
        26    2 count      number of int32 values that follow
        28    4 reserved   0
        32  4*c values

The worker's rank is deliberately not in the packet: like a switch's table entry,
the switch knows it from the source address that joined the job.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

MAGIC = 0x4D53
VERSION = 1
KIND_CONTRIBUTION = 1
KIND_RESULT = 2
DTYPE_INT32 = 0
DTYPE_FLOAT32 = 1

HEADER = struct.Struct("<HBBBBHIIIIhHI")
HEADER_SIZE = HEADER.size
assert HEADER_SIZE == 32
VALUE_SIZE = 4

#: Largest UDP payload over IPv4.
MAX_DATAGRAM = 65507
#: Most values one datagram can carry.
MAX_PACKET_ELEMENTS = (MAX_DATAGRAM - HEADER_SIZE) // VALUE_SIZE


class MalformedPacket(ValueError):
    """A datagram that is not a valid switchml packet; ``reason`` names why."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class Header(NamedTuple):
    kind: int
    dtype: int
    slot: int
    session: int
    msg: int
    seq: int
    pkt_id: int
    exponent: int
    count: int


def decode_header(data) -> Header:
    """Parse and validate the header of ``data`` (bytes-like).

    Raises MalformedPacket when the datagram is too short, not ours, of another
    version or kind, or its length disagrees with its value count.
    """
    if len(data) < HEADER_SIZE:
        raise MalformedPacket("truncated")
    (magic, version, kind, dtype, _r0, slot, session, msg, seq, pkt_id, exponent,
     count, _r1) = HEADER.unpack_from(data)
    if magic != MAGIC:
        raise MalformedPacket("bad_magic")
    if version != VERSION:
        raise MalformedPacket("bad_version")
    if kind not in (KIND_CONTRIBUTION, KIND_RESULT):
        raise MalformedPacket("bad_kind")
    if dtype not in (DTYPE_INT32, DTYPE_FLOAT32):
        raise MalformedPacket("bad_dtype")
    if len(data) != HEADER_SIZE + VALUE_SIZE * count:
        raise MalformedPacket("bad_length")
    return Header(kind, dtype, slot, session, msg, seq, pkt_id, exponent, count)


def encode_header(buf, kind: int, dtype: int, slot: int, session: int, msg: int,
                  seq: int, pkt_id: int, exponent: int, count: int, offset: int = 0) -> None:
    """Write a header into ``buf`` at ``offset``; the values follow it."""
    HEADER.pack_into(buf, offset, MAGIC, VERSION, kind, dtype, 0, slot, session,
                     msg & 0xFFFFFFFF, seq & 0xFFFFFFFF, pkt_id, exponent, count, 0)


def packet_size(count: int) -> int:
    return HEADER_SIZE + VALUE_SIZE * count


def encode(kind: int, dtype: int, slot: int, session: int, msg: int, seq: int,
           pkt_id: int, exponent: int, values=b"") -> bytes:
    """Build a whole datagram; ``values`` is bytes-like of int32 (tests and tools)."""
    payload = memoryview(values).cast("B")
    count = len(payload) // VALUE_SIZE
    buf = bytearray(HEADER_SIZE + len(payload))
    encode_header(buf, kind, dtype, slot, session, msg, seq, pkt_id, exponent, count)
    buf[HEADER_SIZE:] = payload
    return bytes(buf)


def msg_newer(a: int, b: int) -> bool:
    """True when per-slot message number ``a`` comes after ``b`` (serial arithmetic)."""
    return 0 < ((a - b) & 0xFFFFFFFF) < 0x80000000
