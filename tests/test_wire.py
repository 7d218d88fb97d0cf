"""Wire format: header round trip, lane records, validation of bad datagrams, serial
message numbers."""

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
MODES = list(wire.MODES)


def _raw_header(magic=wire.MAGIC, version=wire.VERSION, kind=wire.KIND_CONTRIBUTION,
                dtype=wire.DTYPE_INT32, mode=0, slot=0, session=1, msg=0, seq=0, pkt_id=0,
                count=0, lanes=0, reserved=0) -> bytes:
    """A header packed by hand, independently of encode_header."""
    return struct.pack("<HBBBBHIIIIHHI", magic, version, kind, dtype, mode, slot, session, msg,
                       seq, pkt_id, count, lanes, reserved)


def _raw_lane(pos=0, nxt=0, exp=0, flag=0) -> bytes:
    """A lane record packed by hand."""
    return struct.pack("<IIhH", pos, nxt, exp, flag)


def _lanes(records) -> np.ndarray:
    """A LANE array from (pos, nxt, exp, flag) tuples."""
    return np.array(list(records), dtype=wire.LANE)


def _reason(data) -> str:
    with pytest.raises(MalformedPacket) as info:
        wire.decode_header(data)
    assert isinstance(info.value, ValueError)
    return info.value.reason


# ---------------------------------------------------------------- layout
def test_header_is_32_bytes_and_layout_matches_docstring():
    assert wire.HEADER_SIZE == 32
    assert wire.LANE_SIZE == 12
    assert wire.VERSION == 5
    lanes = _lanes([(0x01020304, 0x0A0B0C0D, -2, 1), (wire.POS_END, 7, 32767, 0)])
    data = wire.encode(wire.KIND_RESULT, wire.DTYPE_FLOAT32, slot=0x1234, session=0xDEADBEEF,
                       msg=0x01020304, seq=0x0A0B0C0D, pkt_id=0x11223344, lane_records=lanes,
                       values=np.array([7, -1, 2**31 - 1], dtype=np.int32),
                       mode=wire.MODE_SPARSE | wire.MODE_SEED)
    assert len(data) == 32 + 2 * 12 + 3 * 4
    assert data[0:2] == b"\x53\x4D"  # 0x4D53 little-endian ("SM")
    assert data[2] == 5
    assert data[3] == wire.KIND_RESULT
    assert data[4] == wire.DTYPE_FLOAT32
    assert data[5] == 3  # mode: sparse | seed
    assert int.from_bytes(data[6:8], "little") == 0x1234
    assert int.from_bytes(data[8:12], "little") == 0xDEADBEEF
    assert int.from_bytes(data[12:16], "little") == 0x01020304
    assert int.from_bytes(data[16:20], "little") == 0x0A0B0C0D
    assert int.from_bytes(data[20:24], "little") == 0x11223344
    assert int.from_bytes(data[24:26], "little") == 3  # count
    assert int.from_bytes(data[26:28], "little") == 2  # lanes
    assert data[28:32] == b"\x00\x00\x00\x00"
    # lane records: pos u32, nxt u32, exp i16, flag u16
    assert data[32:44] == _raw_lane(0x01020304, 0x0A0B0C0D, -2, 1)
    assert data[44:56] == _raw_lane(0xFFFFFFFF, 7, 32767, 0)
    assert int.from_bytes(data[32:36], "little") == 0x01020304
    assert int.from_bytes(data[40:42], "little", signed=True) == -2
    assert np.frombuffer(data, dtype="<i4", offset=56).tolist() == [7, -1, 2**31 - 1]


def test_header_has_no_exponent_any_more():
    assert wire.Header._fields == ("kind", "dtype", "mode", "slot", "session", "msg", "seq",
                                   "pkt_id", "count", "lanes", "call")
    assert wire.LANE.names == ("pos", "nxt", "exp", "flag")


def test_packet_size():
    assert wire.packet_size(0, 0) == 32
    assert wire.packet_size(0, 10) == 72
    assert wire.packet_size(1, 0) == 44
    assert wire.packet_size(3, 10) == 32 + 36 + 40
    assert wire.packet_size(63, 16128) == 32 + 63 * 12 + 16128 * 4


def test_max_packet_elements_default_block():
    assert wire.max_packet_elements(256) == 16128  # 63 blocks of 256
    assert wire.packet_size(63, 16128) <= wire.MAX_DATAGRAM
    assert wire.packet_size(64, 16128 + 256) > wire.MAX_DATAGRAM


@pytest.mark.parametrize("block", [1, 2, 7, 16, 64, 100, 255, 256, 1000, 4096, 16365])
def test_max_packet_elements_is_the_most_whole_blocks_that_fit(block):
    m = wire.max_packet_elements(block)
    assert m % block == 0 and m >= block
    lanes = m // block
    assert wire.packet_size(lanes, m) <= wire.MAX_DATAGRAM
    assert wire.packet_size(lanes + 1, m + block) > wire.MAX_DATAGRAM


def test_max_packet_elements_of_a_block_too_big_for_a_datagram_is_zero():
    assert wire.max_packet_elements(16365) == 16365  # 32 + 12 + 4 * 16365 = 65504
    assert wire.max_packet_elements(16366) == 0


# ---------------------------------------------------------------- round trip
lane_record = st.tuples(u32, u32, st.integers(-32768, 32767), st.integers(0, 0xFFFF))


@settings(max_examples=120, derandomize=True, deadline=None)
@given(kind=st.sampled_from([wire.KIND_CONTRIBUTION, wire.KIND_RESULT]),
       dtype=st.sampled_from([wire.DTYPE_INT32, wire.DTYPE_FLOAT32]),
       mode=st.sampled_from(MODES),
       slot=st.integers(0, 0xFFFF), session=u32, msg=u32, seq=u32, pkt_id=u32,
       records=st.lists(lane_record, max_size=6),
       values=st.lists(st.integers(-2**31, 2**31 - 1), max_size=40))
def test_encode_decode_round_trip(kind, dtype, mode, slot, session, msg, seq, pkt_id, records,
                                  values):
    arr = np.array(values, dtype=np.int32)
    table = _lanes(records)
    data = wire.encode(kind, dtype, slot, session, msg, seq, pkt_id, table, arr, mode=mode)
    assert len(data) == wire.packet_size(len(records), len(values))
    h = wire.decode_header(data)
    assert h == wire.Header(kind, dtype, mode, slot, session, msg, seq, pkt_id, len(values),
                            len(records))
    assert wire.lane_table(data, h.lanes).tolist() == [tuple(r) for r in records]
    assert wire.values(data, h.lanes, h.count).tolist() == values
    # Other bytes-like containers decode identically.
    assert wire.decode_header(bytearray(data)) == h
    assert wire.decode_header(memoryview(data)) == h
    # And the datagram matches one packed independently.
    assert data == (_raw_header(wire.MAGIC, wire.VERSION, kind, dtype, mode, slot, session, msg,
                                seq, pkt_id, len(values), len(records))
                    + b"".join(_raw_lane(*r) for r in records)
                    + struct.pack(f"<{len(values)}i", *values))


def test_encode_without_lanes_or_values():
    data = wire.encode(wire.KIND_CONTRIBUTION, wire.DTYPE_INT32, 1, 2, 3, 4, 5)
    assert data == _raw_header(slot=1, session=2, msg=3, seq=4, pkt_id=5)
    h = wire.decode_header(data)
    assert (h.count, h.lanes, h.mode) == (0, 0, 0)
    assert wire.lane_table(data, 0).size == 0 and wire.values(data, 0, 0).size == 0


@FAST
@given(msg=st.integers(-2**40, 2**40), seq=st.integers(-2**40, 2**40),
       pkt_id=st.integers(-2**40, 2**40))
def test_encode_header_wraps_msg_seq_and_pkt_id_modulo_2_32(msg, seq, pkt_id):
    buf = bytearray(wire.packet_size(0, 0))
    wire.encode_header(buf, wire.KIND_CONTRIBUTION, wire.DTYPE_INT32, 0, 3, 9, msg, seq, pkt_id,
                       0, 0)
    h = wire.decode_header(buf)
    assert h.msg == msg % 2**32
    assert h.seq == seq % 2**32
    assert h.pkt_id == pkt_id % 2**32


def test_encode_header_at_offset_leaves_other_bytes():
    buf = bytearray(b"\xAA" * 120)
    wire.encode_header(buf, wire.KIND_RESULT, wire.DTYPE_INT32, wire.MODE_SPARSE, 5, 6, 7, 8,
                       9, 1, 2, offset=20)
    assert buf[:20] == b"\xAA" * 20
    assert buf[52:] == b"\xAA" * 68  # the lane table and values are not written
    h = wire.decode_header(bytes(buf[20:20 + wire.packet_size(2, 1)]))
    assert h == wire.Header(wire.KIND_RESULT, wire.DTYPE_INT32, wire.MODE_SPARSE, 5, 6, 7, 8,
                            9, 1, 2)


# ---------------------------------------------------------------- views
def test_lane_table_and_values_view_the_datagram_bytes():
    records = _lanes([(1, 2, 3, 1), (4, 5, -6, 0), (7, 8, 9, 1)])
    vals = np.arange(-5, 5, dtype=np.int32)
    buf = bytearray(wire.encode(wire.KIND_CONTRIBUTION, wire.DTYPE_FLOAT32, 0, 1, 0, 0, 0,
                                records, vals))
    table = wire.lane_table(buf, 3)
    values = wire.values(buf, 3, 10)
    assert table.dtype == wire.LANE and table.shape == (3,)
    assert values.dtype == np.int32 and values.shape == (10,)
    assert table.tolist() == records.tolist()
    assert values.tolist() == vals.tolist()
    # They are views, not copies: writes go to the datagram's bytes and back.
    table["exp"][1] = 1234
    table["nxt"][2] = 0xFFFFFFFF
    values[9] = -77
    assert int.from_bytes(buf[32 + 12 + 8:32 + 12 + 10], "little", signed=True) == 1234
    assert buf[32 + 24 + 4:32 + 24 + 8] == b"\xFF" * 4
    assert int.from_bytes(buf[-4:], "little", signed=True) == -77
    buf[32:36] = (99).to_bytes(4, "little")
    buf[32 + 36:32 + 40] = (-1).to_bytes(4, "little", signed=True)
    assert table["pos"][0] == 99 and values[0] == -1
    # the header is untouched by the views
    assert wire.decode_header(buf).count == 10
    # views of immutable bytes are read-only
    frozen = bytes(buf)
    with pytest.raises(ValueError):
        wire.values(frozen, 3, 10)[0] = 1
    with pytest.raises(ValueError):
        wire.lane_table(frozen, 3)["pos"][0] = 1


def test_views_work_on_memoryview_slices_at_an_offset():
    records = _lanes([(10, 11, 12, 1)])
    data = wire.encode(wire.KIND_RESULT, wire.DTYPE_INT32, 0, 1, 0, 0, 0, records,
                       np.array([41, 42], np.int32))
    buf = bytearray(b"\x00" * 7) + bytearray(data)
    view = memoryview(buf)[7:]
    assert wire.lane_table(view, 1).tolist() == [(10, 11, 12, 1)]
    assert wire.values(view, 1, 2).tolist() == [41, 42]


# ---------------------------------------------------------------- validation
@pytest.mark.parametrize("length", [0, 1, 2, 16, 31])
def test_truncated(length):
    good = wire.encode(wire.KIND_CONTRIBUTION, wire.DTYPE_INT32, 0, 1, 0, 0, 0,
                       _lanes([(0, 0, 0, 0)]), np.arange(4, dtype=np.int32))
    assert _reason(good[:length]) == "truncated"


@pytest.mark.parametrize("magic", [0, 0x534D, 0x4D54, 0xFFFF])
def test_bad_magic(magic):
    assert _reason(_raw_header(magic=magic)) == "bad_magic"


@pytest.mark.parametrize("version", [0, 1, 2, 3, 4, 6, 255])
def test_bad_version(version):
    assert _reason(_raw_header(version=version)) == "bad_version"


@pytest.mark.parametrize("kind", [0, 7, 255])
def test_bad_kind(kind):
    assert _reason(_raw_header(kind=kind)) == "bad_kind"


@pytest.mark.parametrize("dtype", [3, 4, 255])
def test_bad_dtype(dtype):
    assert _reason(_raw_header(dtype=dtype)) == "bad_dtype"


@pytest.mark.parametrize("mode", [wire.MODE_SEED, 5, 6, 7, 8, 255])
def test_bad_mode(mode):
    # a seed round is only valid on a sparse packet; unknown bits are rejected
    assert _reason(_raw_header(mode=mode)) == "bad_mode"


@pytest.mark.parametrize("mode", MODES)
def test_known_modes_are_accepted(mode):
    assert wire.decode_header(_raw_header(mode=mode)).mode == mode


@pytest.mark.parametrize("count,lanes,extra_bytes", [
    (0, 0, 4), (1, 0, 0), (1, 0, 3), (1, 0, 5), (2, 0, 4), (3, 0, 16), (0xFFFF, 0, 0),
    (5, 0, 19),
    # lanes: each record is 12 bytes before the values
    (0, 1, 0), (0, 1, 11), (0, 1, 13), (0, 1, 4), (0, 2, 12), (1, 1, 12), (1, 1, 15),
    (2, 1, 12 + 4), (0, 0xFFFF, 0), (4, 2, 4 * 4), (4, 2, 2 * 12), (0, 3, 4 * 10),
])
def test_length_not_matching_lanes_and_count(count, lanes, extra_bytes):
    assert _reason(_raw_header(count=count, lanes=lanes) + b"\x01" * extra_bytes) == \
        "bad_length"


@pytest.mark.parametrize("count,lanes", [(0, 0), (1, 0), (7, 0), (0, 1), (0, 3), (5, 2),
                                         (256, 1), (3, 9)])
def test_length_matching_lanes_and_count_is_accepted(count, lanes):
    h = wire.decode_header(_raw_header(count=count, lanes=lanes)
                           + b"\x00" * (12 * lanes + 4 * count))
    assert (h.count, h.lanes) == (count, lanes)


def test_lanes_and_count_are_not_interchangeable():
    # 3 lanes = 36 bytes = 9 values: the same length, read two ways
    body = b"\x00" * 36
    assert wire.decode_header(_raw_header(lanes=3) + body).lanes == 3
    assert wire.decode_header(_raw_header(count=9) + body).count == 9
    assert _reason(_raw_header(count=3) + body) == "bad_length"
    assert _reason(_raw_header(lanes=9) + body) == "bad_length"


def test_checks_are_ordered_magic_version_kind_dtype_mode_length():
    bad = dict(version=9, kind=9, dtype=9, mode=9, count=3, lanes=1)
    assert _reason(_raw_header(magic=1, **bad)) == "bad_magic"
    del bad["version"]
    assert _reason(_raw_header(**bad)) == "bad_kind"
    assert _reason(_raw_header(version=9, **bad)) == "bad_version"
    del bad["kind"]
    assert _reason(_raw_header(**bad)) == "bad_dtype"
    del bad["dtype"]
    assert _reason(_raw_header(**bad)) == "bad_mode"
    del bad["mode"]
    assert _reason(_raw_header(**bad)) == "bad_length"


@FAST
@given(data=st.binary(max_size=100))
def test_random_bytes_decode_or_raise_malformed(data):
    try:
        h = wire.decode_header(data)
    except MalformedPacket as exc:
        assert exc.reason in {"truncated", "bad_magic", "bad_version", "bad_kind",
                              "bad_dtype", "bad_mode", "bad_length"}
    else:
        assert len(data) == 32 + 12 * h.lanes + 4 * h.count


@FAST
@given(tail=st.binary(max_size=80), mode=st.sampled_from(MODES), lanes=st.integers(0, 4),
       count=st.integers(0, 12))
def test_valid_prefix_random_tail_decodes_only_at_the_exact_length(tail, mode, lanes, count):
    data = _raw_header(mode=mode, lanes=lanes, count=count) + tail
    if len(tail) == 12 * lanes + 4 * count:
        assert wire.decode_header(data) == wire.Header(
            wire.KIND_CONTRIBUTION, wire.DTYPE_INT32, mode, 0, 1, 0, 0, 0, count, lanes)
    else:
        assert _reason(data) == "bad_length"


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


@pytest.mark.parametrize("mtu, expected", [
    (1500, (352, 352)),      # one block would fill 74% of the frame: one bigger block
    (9000, (2048, 256)),     # eight whole 256-value blocks
    (65535, (16128, 256)),   # loopback: the switch's limit
    (576, (120, 120)),
])
def test_frame_geometry_at_common_mtus(mtu, expected):
    assert wire.frame_geometry(mtu, 16128, 256) == expected


@given(mtu=st.integers(120, 65535), limit_blocks=st.integers(1, 63),
       block=st.sampled_from([1, 16, 64, 256, 1024]))
def test_frame_geometry_fits_one_frame_and_the_limit(mtu, limit_blocks, block):
    limit = limit_blocks * block
    elements, blk = wire.frame_geometry(mtu, limit, block)
    assert 1 <= elements <= limit and elements % blk == 0
    assert wire.packet_size(elements // blk, elements) + wire.IP_UDP_OVERHEAD <= mtu
    if blk == block:  # whole switch blocks: as many as fit, within the limit
        fits = (mtu - wire.IP_UDP_OVERHEAD - wire.HEADER_SIZE) // (wire.LANE_SIZE + 4 * block)
        assert elements == min(fits, limit_blocks) * block
    else:  # a single lane: the frame is nearly full
        assert blk == elements
        assert wire.packet_size(1, elements + wire.VALUE_ALIGN) + wire.IP_UDP_OVERHEAD > mtu \
            or elements + wire.VALUE_ALIGN > limit


def test_frame_geometry_refuses_an_mtu_without_room():
    with pytest.raises(ValueError, match="no room"):
        wire.frame_geometry(60, 16128, 256)
