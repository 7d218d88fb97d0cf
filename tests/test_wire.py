"""Wire format: header round trip, validation of bad datagrams, serial message numbers."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from switchml import wire
from switchml.wire import MalformedPacket

FAST = settings(max_examples=200, derandomize=True, deadline=None)

u32 = st.integers(0, 0xFFFFFFFF)


def _raw_header(magic=wire.MAGIC, version=wire.VERSION, kind=wire.KIND_CONTRIBUTION,
                dtype=wire.DTYPE_INT32, slot=0, session=1, msg=0, seq=0, pkt_id=0,
                exponent=0, count=0) -> bytes:
    """A header packed by hand, independently of encode_header."""
    return struct.pack("<HBBBBHIIIIhHI", magic, version, kind, dtype, 0, slot, session, msg,
                       seq, pkt_id, exponent, count, 0)


def _reason(data) -> str:
    with pytest.raises(MalformedPacket) as info:
        wire.decode_header(data)
    assert isinstance(info.value, ValueError)
    return info.value.reason


# ---------------------------------------------------------------- layout
def test_header_is_32_bytes_and_layout_matches_docstring():
    assert wire.HEADER_SIZE == 32
    data = wire.encode(wire.KIND_RESULT, wire.DTYPE_FLOAT32, slot=0x1234, session=0xDEADBEEF,
                       msg=0x01020304, seq=0x0A0B0C0D, pkt_id=0x11223344, exponent=-2,
                       values=np.array([7, -1], dtype=np.int32))
    assert len(data) == 32 + 8
    assert data[0:2] == b"\x53\x4D"  # 0x4D53 little-endian ("SM")
    assert data[2] == 1
    assert data[3] == wire.KIND_RESULT
    assert data[4] == wire.DTYPE_FLOAT32
    assert data[5] == 0
    assert int.from_bytes(data[6:8], "little") == 0x1234
    assert int.from_bytes(data[8:12], "little") == 0xDEADBEEF
    assert int.from_bytes(data[12:16], "little") == 0x01020304
    assert int.from_bytes(data[16:20], "little") == 0x0A0B0C0D
    assert int.from_bytes(data[20:24], "little") == 0x11223344
    assert int.from_bytes(data[24:26], "little", signed=True) == -2
    assert int.from_bytes(data[26:28], "little") == 2
    assert data[28:32] == b"\x00\x00\x00\x00"
    assert np.frombuffer(data, dtype="<i4", offset=32).tolist() == [7, -1]


def test_packet_size_and_max_elements():
    assert wire.packet_size(0) == 32
    assert wire.packet_size(10) == 72
    assert wire.packet_size(wire.MAX_PACKET_ELEMENTS) <= wire.MAX_DATAGRAM
    assert wire.packet_size(wire.MAX_PACKET_ELEMENTS + 1) > wire.MAX_DATAGRAM


# ---------------------------------------------------------------- round trip
@FAST
@given(kind=st.sampled_from([wire.KIND_CONTRIBUTION, wire.KIND_RESULT]),
       dtype=st.sampled_from([wire.DTYPE_INT32, wire.DTYPE_FLOAT32]),
       slot=st.integers(0, 0xFFFF), session=u32, msg=u32, seq=u32, pkt_id=u32,
       exponent=st.integers(-32768, 32767),
       values=st.lists(st.integers(-2**31, 2**31 - 1), max_size=40))
def test_encode_decode_round_trip(kind, dtype, slot, session, msg, seq, pkt_id, exponent,
                                  values):
    arr = np.array(values, dtype=np.int32)
    data = wire.encode(kind, dtype, slot, session, msg, seq, pkt_id, exponent, arr)
    assert len(data) == wire.packet_size(len(values))
    h = wire.decode_header(data)
    assert h == wire.Header(kind, dtype, slot, session, msg, seq, pkt_id, exponent, len(values))
    assert np.frombuffer(data, dtype=np.int32, offset=wire.HEADER_SIZE).tolist() == values
    # Other bytes-like containers decode identically.
    assert wire.decode_header(bytearray(data)) == h
    assert wire.decode_header(memoryview(data)) == h
    # And the header matches one packed independently.
    assert data[:32] == _raw_header(wire.MAGIC, wire.VERSION, kind, dtype, slot, session, msg,
                                    seq, pkt_id, exponent, len(values))


@FAST
@given(msg=st.integers(-2**40, 2**40), seq=st.integers(-2**40, 2**40))
def test_encode_header_wraps_msg_and_seq_modulo_2_32(msg, seq):
    buf = bytearray(wire.packet_size(0))
    wire.encode_header(buf, wire.KIND_CONTRIBUTION, wire.DTYPE_INT32, 3, 9, msg, seq, 0, 0, 0)
    h = wire.decode_header(buf)
    assert h.msg == msg % 2**32
    assert h.seq == seq % 2**32


def test_encode_header_at_offset_leaves_other_bytes():
    buf = bytearray(b"\xAA" * 100)
    wire.encode_header(buf, wire.KIND_RESULT, wire.DTYPE_INT32, 5, 6, 7, 8, 9, 10, 1, offset=20)
    assert buf[:20] == b"\xAA" * 20
    assert buf[52:] == b"\xAA" * 48
    h = wire.decode_header(bytes(buf[20:56]))
    assert (h.kind, h.slot, h.session, h.msg, h.seq, h.pkt_id, h.exponent, h.count) == \
        (wire.KIND_RESULT, 5, 6, 7, 8, 9, 10, 1)


# ---------------------------------------------------------------- validation
@pytest.mark.parametrize("length", [0, 1, 2, 16, 31])
def test_truncated(length):
    good = wire.encode(wire.KIND_CONTRIBUTION, wire.DTYPE_INT32, 0, 1, 0, 0, 0, 0,
                       np.arange(4, dtype=np.int32))
    assert _reason(good[:length]) == "truncated"


@pytest.mark.parametrize("magic", [0, 0x534D, 0x4D54, 0xFFFF])
def test_bad_magic(magic):
    assert _reason(_raw_header(magic=magic)) == "bad_magic"


@pytest.mark.parametrize("version", [0, 2, 255])
def test_bad_version(version):
    assert _reason(_raw_header(version=version)) == "bad_version"


@pytest.mark.parametrize("kind", [0, 3, 255])
def test_bad_kind(kind):
    assert _reason(_raw_header(kind=kind)) == "bad_kind"


@pytest.mark.parametrize("dtype", [2, 3, 255])
def test_bad_dtype(dtype):
    assert _reason(_raw_header(dtype=dtype)) == "bad_dtype"


@pytest.mark.parametrize("count,payload_bytes", [
    (0, 4), (1, 0), (1, 3), (1, 5), (2, 4), (3, 16), (0xFFFF, 0), (5, 19),
])
def test_length_not_matching_count(count, payload_bytes):
    assert _reason(_raw_header(count=count) + b"\x01" * payload_bytes) == "bad_length"


@pytest.mark.parametrize("count", [0, 1, 7])
def test_length_matching_count_is_accepted(count):
    h = wire.decode_header(_raw_header(count=count) + b"\x00" * (4 * count))
    assert h.count == count


def test_checks_are_ordered_magic_before_version_before_kind_before_dtype_before_length():
    assert _reason(_raw_header(magic=1, version=9, kind=9, dtype=9, count=3)) == "bad_magic"
    assert _reason(_raw_header(version=9, kind=9, dtype=9, count=3)) == "bad_version"
    assert _reason(_raw_header(kind=9, dtype=9, count=3)) == "bad_kind"
    assert _reason(_raw_header(dtype=9, count=3)) == "bad_dtype"
    assert _reason(_raw_header(count=3)) == "bad_length"


@FAST
@given(data=st.binary(max_size=80))
def test_random_bytes_decode_or_raise_malformed(data):
    try:
        h = wire.decode_header(data)
    except MalformedPacket as exc:
        assert exc.reason in {"truncated", "bad_magic", "bad_version", "bad_kind",
                              "bad_dtype", "bad_length"}
    else:
        assert len(data) == 32 + 4 * h.count


# ---------------------------------------------------------------- msg_newer
def test_msg_newer_simple():
    assert wire.msg_newer(1, 0)
    assert not wire.msg_newer(0, 1)
    assert not wire.msg_newer(5, 5)
    assert wire.msg_newer(0x7FFFFFFF, 0)
    assert not wire.msg_newer(0x80000000, 0)


def test_msg_newer_wrap_around():
    assert wire.msg_newer(0, 0xFFFFFFFF)
    assert not wire.msg_newer(0xFFFFFFFF, 0)
    assert wire.msg_newer(1, 0xFFFFFFFE)
    assert wire.msg_newer(5, 0xFFFFFFF0)
    assert not wire.msg_newer(0xFFFFFFF0, 5)


@FAST
@given(b=u32, d=st.integers(1, 2**31 - 1))
def test_msg_newer_property(b, d):
    a = (b + d) & 0xFFFFFFFF
    assert wire.msg_newer(a, b)
    assert not wire.msg_newer(b, a)
    assert not wire.msg_newer(a, a)
