"""Block floating point: float32 as int32 with one power-of-two scale per chunk.

A chunk is one packet's worth of values (``packet_elements``).  A worker
computes for each chunk the smallest exponent ``e`` with ``2**e > max|x|``.
The switch takes the largest ``E`` over all workers, and every worker scales its
chunk by ``2**(B - E)`` where ``B`` is the largest integer with
``n * 2**B <= 2**31 - 1``.  Then ``|q| <= 2**B`` for every worker's quantised value
and the n contributions cannot overflow an int32 sum, whatever the inputs.

Because the scale is a power of two, scaling is exact; the only error is the
rounding of each worker's value to a multiple of ``2**(E - B)`` (at most half of
that per worker) and the final rounding of the exact integer sum to float32:

    |result - exact_sum| <= n * 2**(E - B - 1)  +  half an ulp of the float32 result

Values that are multiples of ``2**(E - B)`` (for instance integers when
``E <= B``) are summed exactly.  A chunk containing inf or NaN on any worker
carries the exponent ``EXP_NONFINITE``; its finite values are scaled as if the
specials were 0, and the specials are summed element by element in a follow-up
exchange (worker/engine/nonfinite.py), so every element gets IEEE's sum.

The sparse path sends single blocks, from many chunks in one packet; it scales
each with its chunk's exponent through ``quantize_blocks``, whose arithmetic is
that of ``quantize_into``, so sparse and dense results agree bit for bit.
"""

from __future__ import annotations

import numpy as np

#: Exponent of a chunk whose values are all zero.
EXP_ZERO = -32768
#: Exponent of a chunk holding an inf or a NaN.
EXP_NONFINITE = 32767


def scale_bits(world_size: int) -> int:
    """Largest B such that world_size contributions of magnitude 2**B fit in int32."""
    if world_size < 1:
        raise ValueError("world_size must be at least 1")
    return ((2**31 - 1) // world_size).bit_length() - 1


def scale_bits16(world_size: int) -> int:
    """The 16-bit wire's B: world_size contributions, each biased to 0 .. 2**(B+1),
    sum to at most 65535, so two of them share a 32-bit word without a carry
    crossing from one half into the other."""
    if world_size < 1:
        raise ValueError("world_size must be at least 1")
    if world_size > 16383:
        raise ValueError("the 16-bit wire holds at most 16383 contributions")
    return (65535 // world_size).bit_length() - 2


def quantize16_into(src: np.ndarray, exponent: int, bits: int, dst: np.ndarray,
                    scratch: np.ndarray, wide: np.ndarray) -> None:
    """uint16 ``dst`` = round(src * 2**(bits - exponent)) + 2**bits: the 16-bit wire.

    ``bits`` is ``scale_bits16(n)``; the rounding is ``quantize_into``'s, then the
    bias makes every value non-negative (0 .. 2**(bits+1)).  ``wide``: int32
    scratch as long as ``src``.
    """
    if src.size == 0:
        return
    q = wide[: src.size]
    quantize_into(src, exponent, bits, q, scratch)
    q += 1 << bits
    np.copyto(dst[: src.size], q, casting="unsafe")


def dequantize16_into(src: np.ndarray, exponent: int, bits: int, world_size: int,
                      dst: np.ndarray, wide: np.ndarray) -> None:
    """float32 ``dst`` from the uint16 sums ``src`` of ``world_size`` biased values."""
    if src.size == 0:
        return
    q = wide[: src.size]
    np.copyto(q, src, casting="unsafe")
    q -= world_size << bits
    dequantize_into(q, exponent, bits, dst)


def error_bound16(inputs: list, chunk: int) -> np.ndarray:
    """``error_bound`` of the 16-bit wire: chunks of ``chunk`` values (two a word)."""
    return _bound(inputs, chunk, scale_bits16(len(inputs)))


#: Values per piece of ``block_peaks``: big enough to amortise the calls, small
#: enough that the piece stays in cache between its two passes.
_PEAK_PIECE = 1 << 17


def block_peaks(values: np.ndarray, block: int) -> np.ndarray:
    """max|x| of every ``block``-sized piece of a flat float32 array (NaN propagates).

    Works on the bits: with the sign cleared, a float32's bit pattern as an int32
    grows with its magnitude, and every NaN pattern lies above inf's.  An integer
    max per block is cheaper than a float max and min (which must mind NaN), and
    piece by piece it needs no array-sized temporary.
    """
    n = values.size
    blocks = -(-n // block)
    peak = np.empty(blocks, dtype=np.int32)
    full = n // block
    bits = values.view(np.int32)
    rows = max(1, _PEAK_PIECE // block)
    scratch = np.empty(min(full, rows) * block, dtype=np.int32)
    for first in range(0, full, rows):
        last = min(first + rows, full)
        piece = scratch[: (last - first) * block]
        np.bitwise_and(bits[first * block: last * block], 0x7FFFFFFF, out=piece)
        piece.reshape(-1, block).max(axis=1, out=peak[first:last])
    if full < blocks:
        peak[full] = int((bits[full * block:] & 0x7FFFFFFF).max())
    return peak.view(np.float32)


def chunk_exponents(values: np.ndarray, chunk: int) -> np.ndarray:
    """Exponent of every ``chunk``-sized piece of a flat float32 array (last may be short)."""
    return exponents_of_peaks(block_peaks(values, chunk))


def exponents_of_peaks(peak: np.ndarray) -> np.ndarray:
    """Map chunk maxima of |x| (NaN-propagating) to int16 exponents with the two specials."""
    with np.errstate(invalid="ignore"):
        _, exp = np.frexp(peak)
    out = exp.astype(np.int16)
    out[peak == 0] = EXP_ZERO
    out[~np.isfinite(peak)] = EXP_NONFINITE
    return out


_POWER_TABLES: dict = {}


def _powers(exponents: np.ndarray, bits: int, sign: int) -> np.ndarray:
    """float32 2**(sign * (bits - e)) per exponent, clipped to float32's normal range.

    A lookup in a table of all 65536 int16 exponents, made once per (bits, sign):
    the per-packet cost is one ``take``.
    """
    table = _POWER_TABLES.get((bits, sign))
    if table is None:
        e = np.arange(65536, dtype=np.uint16).view(np.int16).astype(np.int64)
        table = np.ldexp(np.float32(1), np.clip(sign * (bits - e), -126, 127)).astype(np.float32)
        if sign < 0:
            table[EXP_NONFINITE] = 0  # such a block becomes NaN anyway: no overflow on the way
        _POWER_TABLES[(bits, sign)] = table
    return table.take(exponents.view(np.uint16))


def _scale_blocks(src: np.ndarray, powers: np.ndarray, block: int, out: np.ndarray,
                  uniform: bool) -> None:
    """out = src * powers[b] for every block b (one scalar multiply when all are equal)."""
    if uniform:
        np.multiply(src, powers[0], out=out)
        return
    full = src.size // block
    if full:
        np.multiply(src[: full * block].reshape(full, block), powers[:full, None],
                    out=out[: full * block].reshape(full, block))
    if src.size > full * block:
        np.multiply(src[full * block:], powers[full], out=out[full * block:])


def quantize_blocks(src: np.ndarray, exponents: np.ndarray, bits: int, dst: np.ndarray,
                    scratch: np.ndarray, block: int) -> None:
    """int32 ``dst`` = round(src * 2**(bits - e)) with one exponent e per ``block`` values.

    ``src`` is flat float32 (its last block may be short), ``exponents`` has one
    entry per block, ``scratch`` is float32 at least as long as ``src``.
    """
    n = src.size
    if n == 0:
        return
    tmp = scratch[:n]
    exps = exponents[: -(-n // block)]
    low, high = int(exps.min()), int(exps.max())
    # A power of two scales exactly; an all-zero block's clipped factor meets zeros.
    _scale_blocks(src, _powers(exps, bits, 1), block, tmp, low == high)
    if low < bits - 127:  # blocks of tiny values: 2**(bits - e) is not a float32
        for b in np.flatnonzero((exps < bits - 127) & (exps != EXP_ZERO)):
            piece = slice(b * block, (b + 1) * block)
            np.ldexp(src[piece], bits - int(exps[b]), out=tmp[piece])
    np.rint(tmp, out=tmp)
    if high == EXP_NONFINITE:
        for b in np.flatnonzero(exps == EXP_NONFINITE):
            tmp[b * block:(b + 1) * block] = 0  # its inf/NaN must not reach the int cast
    np.copyto(dst, tmp, casting="unsafe")


def dequantize_blocks(src: np.ndarray, exponents: np.ndarray, bits: int, dst: np.ndarray,
                      block: int) -> None:
    """float32 ``dst`` = int32 sums ``src`` scaled by 2**(e - bits), one e per block.

    The int32 -> float32 conversion is the only rounding: a non-zero sum is at
    least 1, so a float32 power of two keeps the result normal and scales it
    exactly; blocks whose 2**(e - bits) is below float32's range are computed in
    float64.  A non-finite block becomes NaN, an all-zero one 0.
    """
    n = src.size
    if n == 0:
        return
    exps = exponents[: -(-n // block)]
    low, high = int(exps.min()), int(exps.max())
    np.copyto(dst, src, casting="unsafe")
    # A non-finite block's sums are 0 and its factor 0: nothing overflows on the way.
    _scale_blocks(dst, _powers(exps, bits, -1), block, dst, low == high)
    if low >= bits - 126 and high != EXP_NONFINITE:
        return
    zero = exps == EXP_ZERO
    if zero.any():  # many in sparse data: one vectorised write, not a loop
        full = n // block
        dst[: full * block].reshape(full, block)[zero[:full]] = 0
        if n > full * block and zero[full]:
            dst[full * block:] = 0
    for b in np.flatnonzero(((exps < bits - 126) & ~zero) | (exps == EXP_NONFINITE)):
        piece = slice(b * block, (b + 1) * block)
        if exps[b] == EXP_NONFINITE:
            dst[piece] = np.nan
        else:
            np.multiply(src[piece], 2.0 ** (int(exps[b]) - bits), out=dst[piece], casting="unsafe")


def ordinary_exponents(exponents: np.ndarray, bits: int) -> np.ndarray:
    """Whether each chunk exponent scales both ways by a normal float32 power of two.

    Such chunks (all-zero ones included) take ``quantize_rows`` and
    ``dequantize_rows``; the others (tiny values, inf or NaN) need the special
    cases of ``quantize_blocks`` and ``dequantize_blocks``.
    """
    e = exponents.astype(np.int32)
    return ((e >= bits - 126) | (e == EXP_ZERO)) & (e != EXP_NONFINITE)


def quantize_factors(exponents: np.ndarray, bits: int) -> np.ndarray:
    """float32 2**(bits - e) per exponent: what ``quantize_rows`` multiplies by."""
    return _powers(exponents, bits, 1)


def dequantize_factors(exponents: np.ndarray, bits: int) -> np.ndarray:
    """float32 2**(e - bits) per exponent: what ``dequantize_rows`` multiplies by."""
    return _powers(exponents, bits, -1)


def quantize_rows(src: np.ndarray, factors: np.ndarray, dst: np.ndarray,
                  scratch: np.ndarray) -> None:
    """int32 ``dst`` = round(row * factor) for the rows of 2-D float32 ``src``.

    For rows of ordinary exponents only (``ordinary_exponents``): then this is
    ``quantize_blocks``' arithmetic without its checks, bit for bit.
    """
    tmp = scratch[: src.size].reshape(src.shape)
    np.multiply(src, factors[:, None], out=tmp)
    np.rint(tmp, out=tmp)
    np.copyto(dst.reshape(src.shape), tmp, casting="unsafe")


def dequantize_rows(src: np.ndarray, factors: np.ndarray, dst: np.ndarray) -> None:
    """float32 2-D ``dst`` = int32 rows of ``src`` * factor; ordinary exponents only."""
    np.copyto(dst, src, casting="unsafe")
    np.multiply(dst, factors[:, None], out=dst)


def quantize_into(src: np.ndarray, exponent: int, bits: int, dst: np.ndarray,
                  scratch: np.ndarray) -> None:
    """int32 ``dst`` = round(src * 2**(bits - exponent)): one exponent for all of ``src``.

    The same arithmetic as ``quantize_blocks``, so the two agree bit for bit.
    """
    if src.size == 0:
        return
    if exponent in (EXP_ZERO, EXP_NONFINITE):
        dst[:] = 0
        return
    tmp = scratch[: src.size]
    shift = bits - exponent
    if shift <= 127:
        np.multiply(src, np.float32(2.0**shift), out=tmp)
    else:  # 2**shift is not a float32; ldexp scales just as exactly
        np.ldexp(src, shift, out=tmp)
    np.rint(tmp, out=tmp)
    np.copyto(dst, tmp, casting="unsafe")


def dequantize_into(src: np.ndarray, exponent: int, bits: int, dst: np.ndarray) -> None:
    """float32 ``dst`` = int32 sums ``src`` * 2**(exponent - bits); see ``dequantize_blocks``."""
    if src.size == 0:
        return
    if exponent == EXP_NONFINITE:
        dst[:] = np.nan
        return
    if exponent == EXP_ZERO:
        dst[:] = 0
        return
    shift = exponent - bits
    if shift >= -126:
        np.copyto(dst, src, casting="unsafe")
        np.multiply(dst, np.float32(2.0**shift), out=dst)
    else:
        np.multiply(src, 2.0**shift, out=dst, casting="unsafe")


def error_bound(inputs: list, chunk: int) -> np.ndarray:
    """Per-element bound on |allreduce result - exact sum| for float32 ``inputs``.

    ``inputs`` are every rank's flat arrays; ``chunk`` is the packet size in values.
    A chunk's scale comes from its finite values (an inf or NaN is summed apart,
    worker/engine/nonfinite.py); where the exact sum is itself inf or NaN the result is
    exactly it, and the bound is infinite.
    """
    return _bound(inputs, chunk, scale_bits(len(inputs)))


def _sliding_max(values: np.ndarray, width: int) -> np.ndarray:
    """Per element, the max of ``values`` within ``width - 1`` places either side:
    the most any ``width``-long piece holding that element can have, wherever the
    pieces are cut."""
    ahead = values.copy()
    span = 1
    while span < width:  # ahead[i] = max(values[i : i + span]), span doubling
        step = min(span, width - span)
        np.maximum(ahead[:-step], ahead[step:], out=ahead[:-step])
        span += step
    behind = ahead.copy()
    span = 1
    while span < width:  # behind[i] = max(ahead[i - span + 1 : i + 1])
        step = min(span, width - span)
        np.maximum(behind[step:], behind[:-step], out=behind[step:])
        span += step
    return behind


def _bound(inputs: list, chunk: int, bits: int, any_cut: bool = False) -> np.ndarray:
    n = len(inputs)
    flat = [np.asarray(a, np.float32).reshape(-1) for a in inputs]
    finite = [np.where(np.isfinite(a), a, np.float32(0)) for a in flat]
    with np.errstate(invalid="ignore"):
        exact = np.sum([a.astype(np.float64) for a in flat], axis=0)
    if not flat[0].size:
        exps = np.zeros(0, np.int16)
    elif any_cut:  # the chunks may start anywhere: each element's widest neighbourhood
        exps = _sliding_max(np.max([chunk_exponents(a, 1) for a in finite], axis=0), chunk)
    else:
        exps = np.max([chunk_exponents(a, chunk) for a in finite], axis=0)
    per_chunk = np.where(exps == EXP_NONFINITE, np.inf,
                         np.where(exps == EXP_ZERO, 0.0,
                                  n * np.ldexp(1.0, exps.astype(np.int64) - bits - 1)))
    quantisation = per_chunk if any_cut else np.repeat(per_chunk, chunk)[: exact.size]
    reach = np.abs(exact) + quantisation  # the most the result's magnitude can be
    # Where the quantised sum may reach float32's overflow threshold the result
    # may be inf, as IEEE rounding of that sum gives: no finite bound there.
    overflow = reach >= 2.0**128 - 2.0**103
    with np.errstate(over="ignore", invalid="ignore"):
        rounding = np.spacing(reach.astype(np.float32)).astype(np.float64) / 2
    return np.where(overflow | ~np.isfinite(exact), np.inf, quantisation + rounding)


def error_bound_two_stage(hosts: list, chunk: int, wire_bits: int = 32) -> np.ndarray:
    """``error_bound`` for a job whose hosts combine their ranks first (the local
    stage): ``hosts`` holds each host's ranks' float32 arrays.  Each host's sum is
    taken in float64 and rounded to float32 once (at most half its ulp, plus
    float64's own rounding, (k-1)·2**-53 of the sum of magnitudes), and the
    switch then sums the hosts' partial sums within ``error_bound`` of their
    exact sum (``error_bound16`` with ``wire_bits=16``, whose packets carry
    ``chunk`` = twice ``packet_elements`` values), for packets cut at the
    shards' starts rather than the array's (so each element's bound takes the
    largest exponent within ``chunk - 1`` places of it); the two add up, against
    the exact sum of every rank's input."""
    partials, local = [], []
    for arrays in hosts:
        wide = [np.asarray(a, np.float32).reshape(-1).astype(np.float64) for a in arrays]
        with np.errstate(over="ignore", invalid="ignore"):
            exact = np.sum(wide, axis=0)
            partial = exact.astype(np.float32)
            magnitude = np.sum(np.abs(wide), axis=0)
            half_ulp = np.spacing(np.abs(partial)).astype(np.float64) / 2
        partials.append(partial)
        local.append(np.where(np.isfinite(partial), half_ulp
                              + (len(wide) - 1) * 2.0**-53 * magnitude, np.inf))
    scale = scale_bits16 if wire_bits == 16 else scale_bits
    switch = _bound(partials, chunk, scale(len(partials)), any_cut=True)
    return np.where(np.isfinite(switch), switch + np.sum(local, axis=0), np.inf)


def error_bound_float16(inputs: list, chunk: int, wire_bits: int = 32) -> np.ndarray:
    """``error_bound`` for float16 inputs: they are summed as float32 (exactly
    widened) and the float32 result is rounded to float16 once, which adds at most
    half a float16 ulp of it; past float16's range the result is +-inf.
    ``wire_bits=16``: ``chunk`` values a packet on the 16-bit wire."""
    wide = [np.asarray(a, np.float32) for a in inputs]
    bound = (error_bound16 if wire_bits == 16 else error_bound)(wide, chunk)
    exact = np.sum([a.reshape(-1).astype(np.float64) for a in wide], axis=0)
    with np.errstate(over="ignore", invalid="ignore"):
        reach = (np.abs(exact) + bound).astype(np.float16)
        rounding = np.spacing(reach).astype(np.float64) / 2
    # past float16's range (or an inf or NaN input) no finite bound holds: inf,
    # as error_bound gives, where the spacing of inf would make it NaN
    return np.where(np.isfinite(reach), bound + rounding, np.inf)
