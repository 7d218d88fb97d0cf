"""Block floating point: float32 chunks as int32 with one power-of-two scale per chunk.

A worker computes for each chunk the smallest exponent ``e`` with ``2**e > max|x|``.
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
carries the exponent ``EXP_NONFINITE`` and comes back as NaN on every worker.
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


def chunk_exponents(values: np.ndarray, chunk: int) -> np.ndarray:
    """Exponent of every ``chunk``-sized piece of a flat float32 array (last may be short)."""
    n = values.size
    chunks = -(-n // chunk)
    peak = np.empty(chunks, dtype=np.float32)
    full = n // chunk
    if full:
        body = values[: full * chunk].reshape(full, chunk)
        np.maximum(body.max(axis=1), -body.min(axis=1), out=peak[:full])
    if full < chunks:
        tail = values[full * chunk:]
        peak[full] = max(tail.max(), -tail.min()) if not np.isnan(tail).any() else np.nan
    return exponents_of_peaks(peak)


def exponents_of_peaks(peak: np.ndarray) -> np.ndarray:
    """Map chunk maxima of |x| (NaN-propagating) to int16 exponents with the two specials."""
    with np.errstate(invalid="ignore"):
        _, exp = np.frexp(peak)
    out = exp.astype(np.int16)
    out[peak == 0] = EXP_ZERO
    out[~np.isfinite(peak)] = EXP_NONFINITE
    return out


def quantize_into(src: np.ndarray, exponent: int, bits: int, dst: np.ndarray,
                  scratch: np.ndarray) -> None:
    """Write round(src * 2**(bits - exponent)) into int32 ``dst`` (same length).

    ``scratch`` is a float32 buffer at least as long as ``src``.
    """
    if exponent in (EXP_ZERO, EXP_NONFINITE):
        dst[:] = 0
        return
    tmp = scratch[: src.size]
    shift = bits - exponent
    if shift <= 127:
        np.multiply(src, np.float32(2.0**shift), out=tmp)
    else:
        # 2**shift is not a float32; ldexp scales just as exactly.
        np.ldexp(src, shift, out=tmp)
    np.rint(tmp, out=tmp)
    np.copyto(dst, tmp, casting="unsafe")


def dequantize_into(src: np.ndarray, exponent: int, bits: int, dst: np.ndarray) -> None:
    """Write the float32 value of an int32 sum ``src`` scaled by 2**(exponent - bits)."""
    if exponent == EXP_NONFINITE:
        dst[:] = np.nan
        return
    if exponent == EXP_ZERO:
        dst[:] = 0
        return
    shift = exponent - bits
    if -126 <= shift <= 96:
        # int32 -> float32 is the single rounding; a power of two that keeps the
        # result normal and finite multiplies exactly.
        np.copyto(dst, src, casting="unsafe")
        np.multiply(dst, np.float32(2.0**shift), out=dst)
    else:
        # int32 * float64 is exact; the cast to float32 is the single rounding.
        np.multiply(src, 2.0**shift, out=dst, casting="unsafe")


def error_bound(inputs: list, chunk: int) -> np.ndarray:
    """Per-element bound on |allreduce result - exact sum| for float32 ``inputs``.

    ``inputs`` are every rank's flat arrays; ``chunk`` is the packet size in values.
    Non-finite chunks get an infinite bound (their result is NaN by design).
    """
    n = len(inputs)
    bits = scale_bits(n)
    exps = np.max([chunk_exponents(np.asarray(a, np.float32).reshape(-1), chunk)
                   for a in inputs], axis=0) if inputs[0].size else np.zeros(0, np.int16)
    exact = np.sum([np.asarray(a, np.float64).reshape(-1) for a in inputs], axis=0)
    per_chunk = np.where(exps == EXP_NONFINITE, np.inf,
                         np.where(exps == EXP_ZERO, 0.0,
                                  n * np.ldexp(1.0, exps.astype(np.int64) - bits - 1)))
    quantisation = np.repeat(per_chunk, chunk)[: exact.size]
    rounding = np.spacing(np.abs(exact + quantisation).astype(np.float32)).astype(np.float64) / 2
    return quantisation + rounding
