"""Inf and NaN element by element: the follow-up exchange of flagged chunks.

A chunk holding an inf or a NaN on any rank carries the exponent
``EXP_NONFINITE``; every rank learns it from the switch, as it learns every
chunk's exponent.  The engines leave such a chunk of the output as it was (the
input, for an in-place call) and list it (``nonfinite_chunks``).  Then every
rank, all alike, runs two more allreduces over the flagged chunks only, and
none at all when there are none:

* their values with every inf and NaN replaced by 0, on the call's own wire:
  each finite element gets the block-floating-point sum it would have without
  them (the chunks keep their boundaries, hence their exponents);
* a code per element (int32): +inf counts 1, -inf 256, NaN both.  The summed
  codes say, per element, what IEEE addition gives: NaN where a NaN or both
  infinities came, +inf or -inf where only one sign did.

A switch can do this: it only adds integers, and it needs no memory for it.
"""

from __future__ import annotations

import numpy as np

PLUS_INF, MINUS_INF = 1, 256


def positions(chunks, chunk: int, size: int) -> np.ndarray:
    """Indices of the elements of ``chunks`` (sorted) in a flat array of ``size``."""
    return np.concatenate([np.arange(c * chunk, min((c + 1) * chunk, size)) for c in chunks])


def split(src: np.ndarray, index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(finite values, codes) of ``src`` at ``index``: what this rank contributes."""
    values = src[index].astype(np.float32)
    codes = (np.isposinf(values) * PLUS_INF + np.isneginf(values) * MINUS_INF
             + np.isnan(values) * (PLUS_INF + MINUS_INF)).astype(np.int32)
    values[~np.isfinite(values)] = 0
    return values, codes


def apply(out: np.ndarray, index: np.ndarray, value_sums: np.ndarray,
          code_sums: np.ndarray) -> None:
    """Write the flagged elements of the result: the finite sums, then inf and NaN."""
    out[index] = value_sums
    plus, minus = (code_sums % MINUS_INF) > 0, (code_sums // MINUS_INF) > 0
    out[index[plus & minus]] = np.nan
    out[index[plus & ~minus]] = np.inf
    out[index[minus & ~plus]] = -np.inf
