"""Block floating point: scale bits, chunk exponents, quantise / sum / dequantise bounds."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from switchml import quant
from switchml.quant import EXP_NONFINITE, EXP_ZERO

FAST = settings(max_examples=150, derandomize=True, deadline=None)
INT32_MAX = 2**31 - 1
FLT_MAX = float(np.finfo(np.float32).max)
TINY = 2.0**-149  # smallest float32 subnormal


# ---------------------------------------------------------------- helpers
def aggregate(arrays, chunk):
    """What the workers and the switch compute, step by step, with the quant functions.

    Returns (result float32, E per chunk, B, list of quantised int32 arrays).
    """
    n = len(arrays)
    size = arrays[0].size
    B = quant.scale_bits(n)
    exps = np.array([quant.chunk_exponents(a, chunk) for a in arrays]).reshape(n, -1)
    E = exps.max(axis=0) if size else np.zeros(0, np.int16)  # the switch's max
    qs = []
    for a in arrays:
        q = np.empty(size, np.int32)
        scratch = np.empty(chunk, np.float32)
        for c in range(E.size):
            sl = slice(c * chunk, (c + 1) * chunk)
            quant.quantize_into(a[sl], int(E[c]), B, q[sl], scratch)
        qs.append(q)
    total = np.zeros(size, np.int32)
    for q in qs:
        np.add(total, q, out=total)  # int32, wraps like the switch
    result = np.empty(size, np.float32)
    for c in range(E.size):
        sl = slice(c * chunk, (c + 1) * chunk)
        quant.dequantize_into(total[sl], int(E[c]), B, result[sl])
    return result, E, B, qs


def check_no_overflow(qs, B):
    wide = np.zeros(qs[0].size, np.int64)
    for q in qs:
        assert np.all(np.abs(q.astype(np.int64)) <= 2**B)
        wide += q
    assert np.all(np.abs(wide) <= INT32_MAX)


def check_error_bound(arrays, result, E, B, chunk):
    n = len(arrays)
    stacked = np.stack([a.astype(np.float64) for a in arrays])
    for i in range(result.size):
        exact = math.fsum(stacked[:, i])
        e = int(E[i // chunk])
        r = float(result[i])
        if e == EXP_ZERO:
            assert r == 0.0 and exact == 0.0
            continue
        assert math.isfinite(r)
        half_ulp = float(np.spacing(np.float32(abs(r)))) / 2
        bound = n * 2.0 ** (e - B - 1) + half_ulp
        err = abs(r - exact)
        assert err <= bound * (1 + 2**-40), (i, r, exact, err, bound, e, B)


# ---------------------------------------------------------------- scale_bits
@pytest.mark.parametrize("n", range(1, 33))
def test_scale_bits_is_largest_fitting(n):
    B = quant.scale_bits(n)
    assert n * 2**B <= INT32_MAX
    assert n * 2 ** (B + 1) > INT32_MAX


def test_scale_bits_known_values():
    assert quant.scale_bits(1) == 30
    assert quant.scale_bits(2) == 29
    assert quant.scale_bits(3) == 29
    assert quant.scale_bits(4) == 28
    assert quant.scale_bits(8) == 27
    assert quant.scale_bits(16) == 26
    assert quant.scale_bits(32) == 25


@pytest.mark.parametrize("n", [0, -1])
def test_scale_bits_rejects_empty_world(n):
    with pytest.raises(ValueError):
        quant.scale_bits(n)


# ---------------------------------------------------------------- chunk_exponents
def expected_exponent(chunk_values) -> int:
    vals = [float(v) for v in chunk_values]
    if any(not math.isfinite(v) for v in vals):
        return EXP_NONFINITE
    peak = max(abs(v) for v in vals)
    if peak == 0:
        return EXP_ZERO
    e = math.frexp(peak)[1]
    return e


def check_exponents(values, chunk):
    exps = quant.chunk_exponents(values, chunk)
    assert exps.dtype == np.int16
    assert exps.shape == (-(-values.size // chunk),)
    for c, e in enumerate(exps.tolist()):
        piece = values[c * chunk:(c + 1) * chunk]
        assert e == expected_exponent(piece), (c, piece, e)
        if e not in (EXP_ZERO, EXP_NONFINITE):
            peak = float(np.max(np.abs(piece.astype(np.float64))))
            assert 2.0**e > peak >= 2.0 ** (e - 1)


finite_f32 = st.floats(width=32, allow_nan=False, allow_infinity=False, allow_subnormal=True)


@FAST
@given(values=hnp.arrays(np.float32, st.integers(0, 300),
                         elements=st.floats(width=32) | st.sampled_from(
                             [-0.0, np.float32(np.nan) * -1])),
       block=st.integers(1, 40), piece=st.sampled_from([1, 7, 64, 1 << 17]))
def test_block_peaks_is_the_largest_magnitude_of_each_block(values, block, piece):
    # Small pieces make the piecewise loop and its last short piece run on small arrays.
    saved, quant._PEAK_PIECE = quant._PEAK_PIECE, piece
    try:
        peaks = quant.block_peaks(values, block)
    finally:
        quant._PEAK_PIECE = saved
    expected = [np.max(np.abs(values[i:i + block])) for i in range(0, values.size, block)]
    assert peaks.dtype == np.float32
    np.testing.assert_array_equal(peaks, np.array(expected, np.float32))  # NaN where NaN


@FAST
@given(values=hnp.arrays(np.float32, st.integers(0, 60), elements=finite_f32),
       chunk=st.integers(1, 17))
def test_chunk_exponents_bracket_the_peak(values, chunk):
    check_exponents(values, chunk)


@FAST
@given(values=hnp.arrays(np.float32, st.integers(1, 60), elements=finite_f32),
       chunk=st.integers(1, 17),
       specials=st.lists(st.tuples(st.integers(0, 10**6),
                                   st.sampled_from([np.inf, -np.inf, np.nan])),
                         min_size=1, max_size=4))
def test_chunk_exponents_nonfinite(values, chunk, specials):
    values = values.copy()
    for pos, v in specials:
        values[pos % values.size] = v
    check_exponents(values, chunk)
    exps = quant.chunk_exponents(values, chunk)
    for pos, _ in specials:
        assert exps[(pos % values.size) // chunk] == EXP_NONFINITE


@pytest.mark.parametrize("special", [np.inf, -np.inf, np.nan])
@pytest.mark.parametrize("where", ["full", "short_last"])
def test_chunk_exponents_nonfinite_full_and_short_last_chunk(special, where):
    values = np.array([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 0.5, 0.25], np.float32)  # chunks of 3
    idx = 1 if where == "full" else 7
    values[idx] = special
    exps = quant.chunk_exponents(values, 3).tolist()
    if where == "full":
        assert exps == [EXP_NONFINITE, 3, 0]
    else:
        assert exps == [2, 3, EXP_NONFINITE]


def test_chunk_exponents_zero_chunks():
    values = np.array([0, -0.0, 0, 1.0, 0, 0, 0, -0.0], np.float32)
    assert quant.chunk_exponents(values, 3).tolist() == [EXP_ZERO, 1, EXP_ZERO]
    assert quant.chunk_exponents(np.zeros(5, np.float32), 5).tolist() == [EXP_ZERO]
    assert quant.chunk_exponents(np.zeros(0, np.float32), 4).tolist() == []


def test_chunk_exponents_short_last_chunk_values():
    values = np.array([0.75, -3.0, 100.0, -1000.0, 7.0], np.float32)
    # chunks [0.75, -3], [100, -1000], [7]
    assert quant.chunk_exponents(values, 2).tolist() == [2, 10, 3]
    # a single element tail of a negative value
    values = np.array([1.0, 1.0, -5.0], np.float32)
    assert quant.chunk_exponents(values, 2).tolist() == [1, 3]


def test_chunk_exponents_subnormals():
    values = np.array([TINY, -TINY, 3 * TINY, 2.0**-127, 2.0**-130, -2.0**-126],
                      np.float32)
    assert quant.chunk_exponents(values, 1).tolist() == [-148, -148, -147, -126, -129, -125]
    assert quant.chunk_exponents(values, 3).tolist() == [-147, -125]


def test_chunk_exponents_powers_of_two_boundaries():
    for k in (-149, -126, -1, 0, 1, 23, 24, 100, 127):
        p = np.float32(2.0**k)
        below = np.nextafter(p, np.float32(0))
        got = quant.chunk_exponents(np.array([p, below, -p, -below], np.float32), 1).tolist()
        assert got[0] == got[2] == k + 1
        if below != 0:
            assert got[1] == got[3] == k
    assert quant.chunk_exponents(np.array([FLT_MAX], np.float32), 1).tolist() == [128]


# ---------------------------------------------------------------- quantize / dequantize
def test_quantize_special_exponents_write_zeros():
    """Zeros go out for the two special exponents, within quantize's contract.

    The exponent a block is quantised with is the max over workers, hence at least the
    block's own: EXP_ZERO is only ever used for an all-zero block (the docstring's
    round(src * 2**(bits - e)) is then 0), while EXP_NONFINITE blocks may hold anything,
    inf and NaN included, and must send zeros (no NaN may reach the int cast).
    """
    dst = np.full(3, 99, np.int32)
    scratch = np.empty(3, np.float32)
    for src in ([1.0, -2.0, 3.0], [np.inf, np.nan, 1.0], [-np.inf, 0.0, 2.0**100]):
        dst[:] = 99
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # an inf/NaN cast to int32 would warn
            quant.quantize_into(np.array(src, np.float32), EXP_NONFINITE, 30, dst, scratch)
        assert dst.tolist() == [0, 0, 0]
    for B in (25, 30):
        dst[:] = 99
        quant.quantize_into(np.array([0.0, -0.0, 0.0], np.float32), EXP_ZERO, B, dst, scratch)
        assert dst.tolist() == [0, 0, 0]


def test_dequantize_special_exponents():
    out = np.ones(3, np.float32)
    quant.dequantize_into(np.array([5, 6, 7], np.int32), EXP_NONFINITE, 29, out)
    assert np.isnan(out).all()
    quant.dequantize_into(np.array([5, 6, 7], np.int32), EXP_ZERO, 29, out)
    assert out.tolist() == [0.0, 0.0, 0.0]


def test_quantize_scales_by_power_of_two_and_rounds():
    src = np.array([1.0, -1.0, 0.5, 3.0, 0.0], np.float32)
    dst = np.empty(5, np.int32)
    scratch = np.empty(8, np.float32)
    quant.quantize_into(src, 2, 30, dst, scratch)  # scale 2**28
    assert dst.tolist() == [2**28, -(2**28), 2**27, 3 * 2**28, 0]
    # rounding to nearest (ties to even) of the scaled value
    src = np.array([1.25, 1.5, 2.5, -1.75, 1.0], np.float32)
    quant.quantize_into(src, 2, 1, dst, scratch)  # scale 2**-1
    assert dst.tolist() == [1, 1, 1, -1, 0]
    quant.quantize_into(src, 1, 1, dst, scratch)  # scale 1
    assert dst.tolist() == [1, 2, 2, -2, 1]


def test_dequantize_scales_back():
    out = np.empty(3, np.float32)
    quant.dequantize_into(np.array([2**28, -(2**27), 3], np.int32), 2, 30, out)
    assert out.tolist() == [1.0, -0.5, 3 * 2.0**-28]


@settings(max_examples=150, derandomize=True, deadline=None)
@given(bits=st.integers(25, 30), exponent=st.integers(-148, 128),
       q=hnp.arrays(np.int32, st.integers(1, 20)))
def test_dequantize_rounds_once(bits, exponent, q):
    # Every rank's result is the float32 nearest to the exact q * 2**(exponent - bits).
    out = np.empty(q.size, np.float32)
    with np.errstate(over="ignore"):
        quant.dequantize_into(q, exponent, bits, out)
        expected = np.array([math.ldexp(int(v), exponent - bits) for v in q.tolist()],
                            np.float64).astype(np.float32)
    assert np.array_equal(out.view(np.uint32), expected.view(np.uint32))


def test_dequantize_rounds_once_in_the_subnormal_range():
    q = np.array([1, 3, 2**20 + 1, 2**24 + 1, 2**30 + 2**6 + 1, -(2**31), 2**31 - 1], np.int32)
    for shift in (-178, -160, -150, -149, -140, -127, -126, -100, 0, 96, 97):
        out = np.empty(q.size, np.float32)
        with np.errstate(over="ignore"):
            quant.dequantize_into(q, shift + 30, 30, out)
            expected = np.array([math.ldexp(int(v), shift) for v in q.tolist()]) \
                .astype(np.float32)
        assert np.array_equal(out.view(np.uint32), expected.view(np.uint32)), shift


def test_quantize_subnormals_round_trip_exactly():
    src = np.array([TINY, -5 * TINY, 2.0**-127, 0.0], np.float32)
    e = int(quant.chunk_exponents(src, 4)[0])
    for B in (25, 30):
        q = np.empty(4, np.int32)
        quant.quantize_into(src, e, B, q, np.empty(4, np.float32))
        assert np.all(np.abs(q.astype(np.int64)) <= 2**B)
        out = np.empty(4, np.float32)
        quant.dequantize_into(q, e, B, out)
        assert out.tolist() == src.tolist()


def _block_exponent_cases():
    rng = np.random.default_rng(11)
    for size, block in ((10, 3), (9, 3), (1, 4), (16, 16), (17, 16), (40, 7)):
        src = (rng.standard_normal(size) * 2.0 ** rng.integers(-30, 30, size)).astype(np.float32)
        blocks = -(-size // block)
        exps = quant.chunk_exponents(src, block).astype(np.int32)
        exps += rng.integers(0, 3, blocks)  # any exponent at least the block's own
        zero = rng.integers(0, blocks)
        src[zero * block:(zero + 1) * block] = 0
        exps[zero] = EXP_ZERO
        if blocks > 1:
            bad = (zero + 1) % blocks
            src[bad * block] = np.nan
            exps[bad] = EXP_NONFINITE
        yield src, exps.astype(np.int16), block


@pytest.mark.parametrize("bits", [25, 29, 30])
def test_quantize_blocks_uses_one_exponent_per_block(bits):
    for src, exps, block in _block_exponent_cases():
        dst = np.full(src.size, 99, np.int32)
        quant.quantize_blocks(src, exps, bits, dst, np.empty(src.size + 5, np.float32), block)
        for b, e in enumerate(exps.tolist()):
            piece = slice(b * block, (b + 1) * block)
            one = np.empty(src[piece].size, np.int32)
            if e == EXP_NONFINITE:
                assert dst[piece].tolist() == [0] * one.size
                continue
            # each block alone, and the documented formula
            quant.quantize_into(src[piece], e, bits, one, np.empty(one.size, np.float32))
            assert dst[piece].tolist() == one.tolist()
            expected = [round(math.ldexp(float(v), bits - e)) for v in src[piece].tolist()] \
                if e != EXP_ZERO else [0] * one.size
            assert dst[piece].tolist() == expected, (b, e)


@pytest.mark.parametrize("bits", [25, 29, 30])
def test_dequantize_blocks_uses_one_exponent_per_block(bits):
    rng = np.random.default_rng(bits)
    for _, exps, block in _block_exponent_cases():
        exps = exps.copy()
        exps[-1] = -140  # a block in the subnormal range
        size = (len(exps) - 1) * block + int(rng.integers(1, block + 1))
        q = rng.integers(-2**31, 2**31, size, dtype=np.int64).astype(np.int32)
        out = np.full(size, 7.0, np.float32)
        with np.errstate(over="ignore"):
            quant.dequantize_blocks(q, exps, bits, out, block)
        for b, e in enumerate(exps.tolist()):
            piece = slice(b * block, (b + 1) * block)
            got = out[piece]
            if e == EXP_NONFINITE:
                assert np.isnan(got).all()
            elif e == EXP_ZERO:
                assert got.tolist() == [0.0] * got.size
            else:
                expected = np.array([math.ldexp(int(v), e - bits) for v in q[piece].tolist()]) \
                    .astype(np.float32)
                assert np.array_equal(got.view(np.uint32), expected.view(np.uint32)), (b, e)


def test_quantize_blocks_empty_is_a_no_op():
    dst = np.zeros(0, np.int32)
    quant.quantize_blocks(np.zeros(0, np.float32), np.zeros(0, np.int16), 30, dst,
                          np.empty(0, np.float32), 4)
    out = np.zeros(0, np.float32)
    quant.dequantize_blocks(np.zeros(0, np.int32), np.zeros(0, np.int16), 30, out, 4)
    assert dst.size == 0 and out.size == 0


# ---------------------------------------------------------------- sum bound
@st.composite
def worker_arrays(draw, max_n=32, max_len=40):
    n = draw(st.integers(1, max_n))
    length = draw(st.integers(1, max_len))
    arrays = []
    for _ in range(n):
        scale = draw(st.sampled_from([1.0, 1e-3, 1e3, 1e-30, 1e-40, 1e20]))
        a = draw(hnp.arrays(np.float32, length,
                            elements=st.floats(-1e4, 1e4, width=32, allow_subnormal=True)))
        arrays.append((a.astype(np.float64) * scale).astype(np.float32))
    return arrays


@settings(max_examples=120, derandomize=True, deadline=None)
@given(arrays=worker_arrays(), chunk=st.integers(1, 16))
def test_quantised_sum_meets_error_bound(arrays, chunk):
    result, E, B, qs = aggregate(arrays, chunk)
    check_no_overflow(qs, B)
    check_error_bound(arrays, result, E, B, chunk)
    # The library's own per-element bound covers the actual error too.
    bound = quant.error_bound(arrays, chunk)
    exact = np.array([math.fsum(v) for v in zip(*[a.astype(np.float64) for a in arrays])])
    assert np.all(np.abs(result.astype(np.float64) - exact) <= bound * (1 + 2**-40))


@settings(max_examples=60, derandomize=True, deadline=None)
@given(n=st.integers(1, 32), length=st.integers(1, 30), chunk=st.integers(1, 8),
       data=st.data())
def test_quantised_sum_error_bound_wide_range(n, length, chunk, data):
    elements = st.floats(-2.0**119, 2.0**119, width=32, allow_subnormal=True)
    arrays = [data.draw(hnp.arrays(np.float32, length, elements=elements)) for _ in range(n)]
    result, E, B, qs = aggregate(arrays, chunk)
    check_no_overflow(qs, B)
    check_error_bound(arrays, result, E, B, chunk)


@settings(max_examples=100, derandomize=True, deadline=None)
@given(n=st.integers(1, 32), length=st.integers(1, 40), chunk=st.integers(1, 16),
       data=st.data())
def test_integer_valued_floats_are_summed_exactly(n, length, chunk, data):
    B = quant.scale_bits(n)
    # m * 2**s with |m| <= 2**23 and s <= B - 24: float32-exact integers below 2**B.
    element = st.builds(lambda m, s: float(m * 2**s), st.integers(-2**23, 2**23),
                        st.integers(0, B - 24))
    arrays = [np.array(data.draw(st.lists(element, min_size=length, max_size=length)),
                       np.float32) for _ in range(n)]
    result, E, B2, qs = aggregate(arrays, chunk)
    assert B2 == B
    assert np.all(E[E != EXP_ZERO] <= B)
    check_no_overflow(qs, B)
    exact = [sum(int(a[i]) for a in arrays) for i in range(length)]
    # The integer sum is exact; only the final conversion to float32 rounds.
    assert result.tolist() == [float(np.float32(v)) for v in exact]
    small = [i for i, v in enumerate(exact) if abs(v) <= 2**24]
    assert [float(result[i]) for i in small] == [float(exact[i]) for i in small]


def test_small_integers_exact_for_every_world_size():
    for n in range(1, 33):
        arrays = [np.arange(-20, 20, dtype=np.float32) * (r + 1) for r in range(n)]
        result, _, _, _ = aggregate(arrays, 7)
        expected = np.arange(-20, 20, dtype=np.float64) * (n * (n + 1) // 2)
        assert result.tolist() == expected.tolist()


@pytest.mark.filterwarnings("ignore:overflow encountered")
@pytest.mark.parametrize("e", [-148, -140, -126, -20, 0, 1, 24, 31, 100, 127, 128])
@pytest.mark.parametrize("n", [1, 2, 3, 5, 7, 8, 15, 16, 17, 31, 32])
@pytest.mark.parametrize("sign", [1, -1])
def test_worst_case_values_never_overflow(e, n, sign):
    # The largest float32 magnitude with exponent e: every worker quantises to ~2**B.
    peak = np.float32(FLT_MAX) if e == 128 else np.nextafter(np.float32(2.0**e), np.float32(0))
    x = np.array([sign * peak, sign * peak / 2, 0.0, -sign * peak], np.float32)
    arrays = [x.copy() for _ in range(n)]
    assert int(quant.chunk_exponents(x, 4)[0]) == e
    result, E, B, qs = aggregate(arrays, 4)
    assert int(E[0]) == e
    check_no_overflow(qs, B)
    # the quantised value is the scaled peak, rounded: up to 2**B, never more
    assert abs(int(qs[0][0])) == round(math.ldexp(float(peak), B - e))
    if e > -126:  # normal numbers: the worst case really reaches the limit
        assert abs(int(qs[0][0])) >= 2**B - 2 ** (B - 23)
    if n * 2.0**e < FLT_MAX:
        check_error_bound(arrays, result, E, B, 4)
        assert np.sign(result[0]) == sign and np.sign(result[3]) == -sign


@settings(max_examples=80, derandomize=True, deadline=None)
@given(arrays=worker_arrays(), chunk=st.integers(1, 16), cut=st.data())
def test_two_stage_sum_meets_its_error_bound(arrays, chunk, cut):
    """The local stage's sum: each host's ranks summed as the shared-memory stage
    does (memory.reduce_into), the hosts' sums through the quantised switch;
    within ``error_bound_two_stage`` of the exact sum of every rank's array."""
    from switchml.worker.local import memory
    sizes = cut.draw(st.lists(st.integers(1, 4), min_size=1, max_size=4))
    hosts, taken = [], 0
    for size in sizes:
        if taken < len(arrays):
            hosts.append(arrays[taken:taken + size])
            taken += size
    hosts[-1] = hosts[-1] + arrays[taken:]
    partials = []
    for host in hosts:
        partial = np.empty_like(host[0])
        memory.reduce_into(partial, host)
        partials.append(partial)
    result, E, B, qs = aggregate(partials, chunk)
    exact = np.array([math.fsum(v) for v in zip(*[a.astype(np.float64) for a in arrays])])
    bound = quant.error_bound_two_stage(hosts, chunk)
    assert np.all(np.abs(result.astype(np.float64) - exact) <= bound * (1 + 2**-40))
    # and the bound is not vacuous: a small fraction of the largest magnitude a packet
    # holding the element can hold (packets start at shards, wherever they fall)
    peak = np.max([np.abs(a.astype(np.float64)) for a in arrays], axis=0)
    near = np.array([peak[max(0, i - chunk + 1):i + chunk].max() for i in range(peak.size)])
    finite = np.isfinite(bound)
    assert np.all(bound[finite] <= len(arrays) * near[finite] * 2.0**-20 + 1e-44)
