"""Block-sparse allreduce (OmniReduce) on the switch's slots, sans-IO.

The tensor is cut into blocks of ``block_elements``; a block is zero when all its
values are.  There are G = W * lanes *lanes* (W slots, ``lanes`` blocks fused
per packet); lane L owns the column of blocks L, L + G, L + 2G, ...; a block's
*position* is its row in that column.  Row p of slot j's lanes is exactly the
dense path's chunk j + p*W.  Each slot runs rounds, one message in flight, every
worker sending every round so that the shadow-copy argument of the dense path
holds unchanged:

* float32 only, exponent rounds: the slot's chunk exponents, one per lane record,
  maxed by the switch as in the dense path (a dense message without values);
* the seed round: each worker reports, per lane, the position of its first
  non-zero block; the switch returns the least position, ``pos``;
* round r: a worker that has a non-zero block at ``pos`` sends it (quantised with
  its chunk's exponent) and reports its next non-zero position after ``pos``;
  one that has none there sends no values for the lane and reports its next one
  again.  The result carries the sum of the blocks sent, and the next ``pos``.

A lane whose column is exhausted reports the column's length; blocks that are
zero on every worker are never sent.  Results are written dense: the output
starts as zeros (or is the input itself, whose zero blocks are the sum), and a
chunk whose exponent says inf or NaN is NaN as a whole.  Scaling is the dense
path's, chunk by chunk, so results are bit-identical to it.
"""

from __future__ import annotations

import numpy as np

from .. import wire
from ..quant import (EXP_NONFINITE, EXP_ZERO, block_peaks, dequantize_blocks, exponents_of_peaks,
                     quantize_blocks)
from .engine import Session, Stream


def nonzero_blocks(values: np.ndarray, block: int) -> np.ndarray:
    """Boolean mask of the blocks of a flat array holding any non-zero (NaN counts).

    Max and min per block: no temporary the size of the array.
    """
    if values.dtype == np.float32:
        return block_peaks(values, block) != 0  # NaN != 0
    n = values.size
    full = n // block
    mask = np.empty(-(-n // block), dtype=bool)
    if full:
        body = values[: full * block].reshape(full, block)
        np.logical_or(body.max(axis=1) != 0, body.min(axis=1) != 0, out=mask[:full])
    if full < len(mask):
        mask[full] = bool(np.any(values[full * block:] != 0))
    return mask


class SparseAllreduce(Stream):
    """OmniReduce rounds over ``W`` slots of ``lanes`` lanes each."""

    def __init__(self, session: Session, array: np.ndarray, out: np.ndarray, seq: int,
                 now: float):
        b, F = session.block_elements, session.lanes
        n = array.size
        self.blocks = -(-n // b)
        super().__init__(session, array, out, seq, now,
                         min(session.slot_count, -(-self.blocks // F)))
        G = self.width * F
        self.stride = G
        rows = -(-self.blocks // G) if G else 0
        lane = np.arange(G)
        self.column_length = np.maximum(0, -(-(self.blocks - lane) // G)).astype(np.int64)
        if self.is_float:  # one pass of block maxima: the non-zero mask and chunk exponents
            peaks = block_peaks(self.src, b)
            mask = peaks != 0
            padded = np.zeros(-(-self.blocks // F) * F, np.float32)
            padded[: self.blocks] = peaks
            chunk_exp = exponents_of_peaks(padded.reshape(-1, F).max(axis=1))
        else:
            mask = nonzero_blocks(self.src, b)
        grid = np.zeros((rows + 1) * G, dtype=bool)
        grid[: self.blocks] = mask
        grid = grid.reshape(rows + 1, G)
        # next_nonzero[p, L]: first position >= p of lane L holding a local non-zero
        # block, or the column length when none is left.
        candidates = np.where(grid, np.arange(rows + 1)[:, None], self.column_length[None, :])
        self.next_nonzero = np.minimum.accumulate(candidates[::-1], axis=0)[::-1]
        self.grid = grid
        self._lanes_of = [lane[j * F:(j + 1) * F] for j in range(self.width)]
        self._pos = np.full((self.width, F), wire.POS_END, dtype=np.int64)
        self._full_blocks = n // b
        # Row p of slot j's lanes is exactly dense chunk j + p*W: its exponent
        # scales those blocks, as in the dense path.  Exponent rounds gather them.
        k = session.packet_elements
        self.chunks = -(-n // k)
        self._local_chunk_exp = chunk_exp if self.is_float else None
        self._slot_chunks = [len(range(j, self.chunks, self.width)) for j in range(self.width)]
        self._exp_rounds = [-(-c // F) if self.is_float else 0 for c in self._slot_chunks]
        self._slot_exp = [np.full(c, EXP_ZERO, np.int16) for c in self._slot_chunks]
        if np.may_share_memory(self.src, self.out):
            # In place, local zero blocks stand for the sum unless someone sends one;
            # write them as +0.0 as the dense path would (the input may hold -0.0).
            self._zero_blocks(np.flatnonzero(~mask))
        else:
            self.out[:] = 0
        for j in range(self.width):
            self._send(j, now)

    def _mode(self, j: int) -> int:
        r, seed = self._round[j], self._exp_rounds[j]
        if r < seed:
            return 0  # an exponent round travels as a dense message without values
        return wire.MODE_SPARSE | (wire.MODE_SEED if r == seed else 0)

    def _read_blocks(self, index: np.ndarray, dst: np.ndarray) -> None:
        """Copy blocks ``index`` of the input into rows of ``dst`` (tail zero-padded)."""
        b = self.s.block_elements
        body = self.src[: self._full_blocks * b].reshape(-1, b)
        if self._full_blocks == self.blocks or index.max() < self._full_blocks:
            np.take(body, index, axis=0, out=dst)  # no short last block among them
            return
        full = index < self._full_blocks
        dst[full] = body[index[full]]
        for row in np.flatnonzero(~full):  # the short last block
            tail = self.src[self._full_blocks * b:]
            dst[row, : tail.size] = tail
            dst[row, tail.size:] = 0

    def _zero_blocks(self, index: np.ndarray) -> None:
        """Write +0.0 (or 0) over blocks ``index`` of the output."""
        b = self.s.block_elements
        full = index < self._full_blocks
        self.out[: self._full_blocks * b].reshape(-1, b)[index[full]] = 0
        if not full.all():
            self.out[self._full_blocks * b:] = 0

    def _write_blocks(self, index: np.ndarray, blocks: np.ndarray) -> None:
        """Write rows of ``blocks`` over blocks ``index`` of the output (tail cut short)."""
        b = self.s.block_elements
        body = self.out[: self._full_blocks * b].reshape(-1, b)
        if self._full_blocks == self.blocks or index.max() < self._full_blocks:
            body[index] = blocks  # no short last block among them
            return
        full = index < self._full_blocks
        body[index[full]] = blocks[full]
        for row in np.flatnonzero(~full):
            tail = self.out[self._full_blocks * b:]
            tail[:] = blocks[row, : tail.size]

    # ------------------------------------------------------------ messages
    def _fill(self, j: int, m: int) -> int:
        s = self.s
        b, F = s.block_elements, s.lanes
        lanes = self._lanes_of[j]
        records = s.lane_views[j]
        records[:] = s.blank_lanes
        seed = self._exp_rounds[j]
        if m < seed:  # local exponents of this slot's chunks m*F .. m*F+F-1
            rows = np.arange(m * F, min((m + 1) * F, self._slot_chunks[j]))
            records["exp"][: len(rows)] = self._local_chunk_exp[j + rows * self.width]
            return 0
        if m == seed:
            records["pos"] = wire.POS_END
            records["nxt"] = self.next_nonzero[0, lanes]
            return 0
        pos = self._pos[j]
        active = pos < self.column_length[lanes]
        last = self.grid.shape[0] - 1
        at = np.minimum(pos, last)
        has = active & self.grid[at, lanes]
        records["pos"] = pos
        records["nxt"] = np.where(has, self.next_nonzero[np.minimum(at + 1, last), lanes],
                                  self.next_nonzero[at, lanes])
        records["flag"] = has
        sending = np.flatnonzero(has)
        count = len(sending) * b
        if count:
            index = lanes[sending] + pos[sending] * self.stride
            dst = s.value_views[j][:count]
            if self.is_float:
                # Stage the floats in the packet itself; quantising in place is safe
                # because quantize_blocks reads all of src before writing dst.
                staged = dst.view(np.float32)
                self._read_blocks(index, staged.reshape(-1, b))
                quantize_blocks(staged, self._slot_exp[j][pos[sending]], s.bits, dst,
                                s.scratch, b)
            else:
                self._read_blocks(index, dst.reshape(-1, b))
            s.counters["sparse_blocks_sent"] += len(sending)
        return count

    def _result_fits(self, j: int, h: wire.Header, data) -> bool:
        records = wire.lane_table(data, h.lanes)
        present = records["flag"] & wire.FLAG_BLOCK
        if h.count != int(np.count_nonzero(present)) * self.s.block_elements:
            return False
        if self._round[j] <= self._exp_rounds[j]:
            return h.count == 0
        return bool(np.array_equal(records["pos"], self._pos[j].astype(np.uint32)))

    def _absorb(self, j: int, m: int, h: wire.Header, data) -> None:
        s = self.s
        b, F = s.block_elements, s.lanes
        records = wire.lane_table(data, h.lanes)
        seed = self._exp_rounds[j]
        if m < seed:
            rows = np.arange(m * F, min((m + 1) * F, self._slot_chunks[j]))
            self._slot_exp[j][rows] = records["exp"][: len(rows)]
            self._fill_nonfinite_chunks(j, rows)
            return
        present = np.flatnonzero(records["flag"] & wire.FLAG_BLOCK)
        if len(present):
            lanes = self._lanes_of[j][present]
            pos = self._pos[j][present]
            sums = wire.values(data, h.lanes, h.count).reshape(-1, b)
            if self.is_float:
                blocks = np.empty((len(present), b), np.float32)
                dequantize_blocks(sums.reshape(-1), self._slot_exp[j][pos], s.bits,
                                  blocks.reshape(-1), b)
            else:
                blocks = sums
            self._write_blocks(lanes + pos * self.stride, blocks)
            s.counters["sparse_blocks_received"] += len(present)
        self._pos[j] = records["nxt"]

    def _fill_nonfinite_chunks(self, j: int, rows: np.ndarray) -> None:
        """A chunk with inf or NaN anywhere is NaN as a whole, as in the dense path."""
        k = self.s.packet_elements
        for row in rows[self._slot_exp[j][rows] == EXP_NONFINITE]:
            c = j + int(row) * self.width
            self.out[c * k:(c + 1) * k] = np.nan

    def _has_message(self, j: int) -> bool:
        if self._round[j] <= self._exp_rounds[j]:
            return True  # exponent rounds and the seed always run
        return bool(np.any(self._pos[j] < self.column_length[self._lanes_of[j]]))
