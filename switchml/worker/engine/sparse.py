"""Block-sparse allreduce (OmniReduce) on the switch's slots, sans-IO.

The tensor is cut into blocks of ``block_elements``; a block is zero when all its
values are.  There are G = W * lanes *lanes* (W slots, ``lanes`` blocks fused
per packet); lane L owns the column of blocks L, L + G, L + 2G, ...; a block's
*position* is its row in that column.  Row p of slot j's lanes is exactly the
dense path's chunk j + p*W.  Each slot runs rounds, one message in flight, every
worker sending every round so that the shadow-copy argument of the dense path
holds unchanged:

* float32 only, exponent rounds: the slot's chunk exponents but its last
  ``lanes``, as int32 values of a ``MODE_MAX`` message, which the switch maxes
  instead of adding; up to ``packet_elements`` a round, so one round serves a
  slot of that many chunks (a 64 MiB tensor at MTU 9000 has 256 a slot);
* the seed round: each worker reports, per lane, the position of its first
  non-zero block; the switch returns the least position, ``pos``.  For float32
  it also carries the slot's last ``lanes`` chunk exponents, one per lane
  record, which the switch maxes as a dense packet's, so a slot of up to
  ``lanes`` chunks needs no exponent round;
* round r: a worker that has a non-zero block at ``pos`` sends it (quantised with
  its chunk's exponent) and reports its next non-zero position after ``pos``;
  one that has none there sends no values for the lane and reports its next one
  again.  The result carries the sum of the blocks sent, and the next ``pos``.

A lane whose column is exhausted reports the column's length; blocks that are
zero on every worker are never sent.  Results are written dense: each result's
blocks as they come, +0.0 over every block no result wrote once the call is
done, and a chunk whose exponent says inf or NaN is NaN as a whole.  Scaling is the dense
path's, chunk by chunk, so results are bit-identical to it.
"""

from __future__ import annotations

import numpy as np

from ... import wire
from ...quant import (
    EXP_NONFINITE,
    EXP_ZERO,
    block_peaks,
    dequantize_blocks,
    dequantize_factors,
    dequantize_rows,
    exponents_of_peaks,
    ordinary_exponents,
    quantize_blocks,
    quantize_factors,
    quantize_rows,
)
from .stream import MembershipState, Stream


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
    """OmniReduce rounds over ``W`` slots of ``lanes`` lanes each.

    A lane's state is its position; block ``pos * G + lane`` is then both the
    block's index in the tensor and its cell in the flat ``grid`` of local
    non-zero blocks, so a round's lookups are single gathers over the lanes.
    """

    sparse = True

    def __init__(self, membership: MembershipState, array: np.ndarray, out: np.ndarray, seq: int,
                 now: float):
        b, F = membership.block_elements, membership.lanes
        n = array.size
        self.blocks = -(-n // b)
        super().__init__(membership, array, out, seq, now,
                         min(membership.slot_count, -(-self.blocks // F)))
        G = self.width * F
        self.stride = G
        rows = -(-self.blocks // G) if G else 0
        lane = np.arange(G)
        column_length = np.maximum(0, -(-(self.blocks - lane) // G)).astype(np.int64)
        if self.is_float:  # one pass of block maxima: the non-zero mask and chunk exponents
            peaks = block_peaks(self.src, b)
            mask = peaks != 0
            padded = np.zeros(-(-self.blocks // F) * F, np.float32)
            padded[: self.blocks] = peaks
            chunk_exp = exponents_of_peaks(padded.reshape(-1, F).max(axis=1))
        else:
            mask = nonzero_blocks(self.src, b)
        # Rows 0..rows-1 hold the tensor's blocks; the rows after them are past
        # every column's end, so a lane at its column's length finds no block.
        grid = np.zeros((rows + 2) * G, dtype=bool)
        grid[: self.blocks] = mask
        self._grid = grid
        # Cell p*G + L of next_nonzero: the first position >= p of lane L holding a
        # local non-zero block, or the column's length when none is left.
        rows_of = grid.reshape(rows + 2, G)
        candidates = np.where(rows_of, np.arange(rows + 2)[:, None], column_length[None, :])
        next_nonzero = np.minimum.accumulate(candidates[::-1], axis=0)[::-1].reshape(-1)
        self._next_nonzero = next_nonzero
        self._next_after = next_nonzero[G:]  # cell p*G + L: the first position > p
        self._lanes_of = [lane[j * F:(j + 1) * F] for j in range(self.width)]
        self._column_length_of = [column_length[j * F:(j + 1) * F] for j in range(self.width)]
        self._pos = [np.zeros(F, np.int64) for _ in range(self.width)]
        self._cells = [np.zeros(F, np.int64) for _ in range(self.width)]  # of the round in flight
        self._live = [True] * self.width
        self._present = np.zeros(0, np.int64)  # flagged lanes of the result being taken
        self._records = np.zeros(0, wire.LANE)  # its lane table, decoded by _result_fits
        self._full_blocks = n // b
        # Row p of slot j's lanes is exactly dense chunk j + p*W (block i is in
        # chunk i // F): its exponent scales those blocks, as in the dense path.
        # Exponent rounds gather the chunks' exponents from the switch.
        k = membership.packet_elements
        self.chunks = -(-n // k)
        self._local_chunk_exp = chunk_exp if self.is_float else np.zeros(0, np.int16)
        self._chunk_exp = np.full(self.chunks, EXP_ZERO, np.int16)
        # Per block, its chunk's scale factors, filled in by the exponent rounds;
        # a slot whose chunks are all ordinary scales with one gather a round.
        self._quant_factor = np.empty(self.chunks * F, np.float32)
        self._dequant_factor = np.empty(self.chunks * F, np.float32)
        self._ordinary = [True] * self.width
        self._written = np.zeros(self.blocks, bool)  # blocks of the output already final
        self.nonfinite_chunks: list[int] = []  # see DenseAllreduce
        self.chunk_values = k
        self._slot_chunks = [len(range(j, self.chunks, self.width)) for j in range(self.width)]
        # The seed carries a slot's last F chunk exponents in its lane records;
        # exponent rounds before it carry the others, k a round, in values.
        self._seed_first = [max(0, c - F) for c in self._slot_chunks]
        self._exp_rounds = [-(-first // k) if self.is_float else 0 for first in self._seed_first]
        self._start(now)

    def _mode(self, j: int) -> int:
        r, seed = self._round[j], self._exp_rounds[j]
        if r < seed:
            return wire.MODE_MAX  # an exponent round: values the switch maxes
        return wire.MODE_SPARSE | (wire.MODE_SEED if r == seed else 0)

    def _exp_round_chunks(self, j: int, m: int) -> np.ndarray:
        """The chunks whose exponents round ``m`` of slot ``j`` (an exponent round,
        or the seed) carries."""
        k, first = self.s.packet_elements, self._seed_first[j]
        if m == self._exp_rounds[j]:
            rows = np.arange(first, self._slot_chunks[j])
        else:
            rows = np.arange(m * k, min((m + 1) * k, first))
        return j + rows * self.width

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
        b = s.block_elements
        lanes = self._lanes_of[j]
        records = s.lane_views[j]
        seed = self._exp_rounds[j]
        if m <= seed:
            # Data rounds rewrite all but "exp": they carry the seed's, which the
            # switch maxes and the workers ignore.
            records[:] = s.blank_lanes
            chunks = self._exp_round_chunks(j, m) if self.is_float else np.zeros(0, np.int64)
            if m < seed:  # local exponents as values
                s.value_views[j][: len(chunks)] = self._local_chunk_exp[chunks]
                return len(chunks)
            records["exp"][: len(chunks)] = self._local_chunk_exp[chunks]
            records["pos"] = wire.POS_END
            records["nxt"] = self._next_nonzero[lanes]
            return 0
        pos = self._pos[j]
        cells = self._cells[j]
        np.multiply(pos, self.stride, out=cells)
        cells += lanes  # the blocks at the lanes' positions: pos * G + lane
        has = self._grid[cells]
        records["pos"] = pos
        records["nxt"] = self._next_after[cells]
        records["flag"] = has
        sending = np.nonzero(has)[0]
        if not len(sending):
            return 0
        index = cells[sending]
        count = len(sending) * b
        dst = s.value_views[j][:count]
        if self.is_float:
            # Stage the floats in the packet itself; quantising in place is safe
            # because both quantisers read all of src into scratch before writing dst.
            staged = dst.view(np.float32).reshape(-1, b)
            self._read_blocks(index, staged)
            if self._ordinary[j]:
                quantize_rows(staged, self._quant_factor[index], dst, s.scratch)
            else:
                quantize_blocks(staged.reshape(-1), self._chunk_exp[index // s.lanes], s.bits,
                                dst, s.scratch, b)
        else:
            self._read_blocks(index, dst.reshape(-1, b))
        s.counters["sparse_blocks_sent"] += len(sending)
        return count

    def _result_fits(self, j: int, h: wire.Header, data) -> bool:
        records = self._records = wire.lane_table(data, h.lanes)
        if self._round[j] < self._exp_rounds[j]:  # the maxed exponents, as sent
            return h.count == len(self._exp_round_chunks(j, self._round[j]))
        present = np.nonzero(records["flag"] & wire.FLAG_BLOCK)[0]
        if h.count != len(present) * self.s.block_elements:
            return False
        if self._round[j] == self._exp_rounds[j]:
            return h.count == 0
        # The contribution in flight is still in the slot's packet buffer.
        pos, nxt = records["pos"], records["nxt"]
        if not (pos == self.s.lane_views[j]["pos"]).all():
            return False
        # An honest switch moves every live lane on (each rank reports a next
        # position past this one, or the column's end) and flags no block past a
        # column's end: a result that does not (a member's lie, a forgery) would
        # hold the call in place forever, or write past the tensor.
        length = self._column_length_of[j]
        live = pos < length
        if (nxt[live] <= pos[live]).any() or (nxt[~live] < length[~live]).any() \
                or not live[present].all():
            return False
        self._present = present
        return True

    def _absorb(self, j: int, m: int, h: wire.Header, data) -> None:
        s = self.s
        b = s.block_elements
        records = self._records
        seed = self._exp_rounds[j]
        if m <= seed and self.is_float:
            chunks = self._exp_round_chunks(j, m)
            exps = (wire.values(data, h.lanes, h.count).astype(np.int16) if m < seed
                    else records["exp"][: len(chunks)])
            self._chunk_exp[chunks] = exps
            F = s.lanes
            self._quant_factor.reshape(-1, F)[chunks] = quantize_factors(exps, s.bits)[:, None]
            self._dequant_factor.reshape(-1, F)[chunks] = dequantize_factors(exps, s.bits)[:, None]
            self._ordinary[j] = self._ordinary[j] and bool(ordinary_exponents(exps, s.bits).all())
            self._fill_nonfinite_chunks(chunks)
        if m < seed:
            return
        present = self._present
        if m > seed and len(present):
            s.counters["sparse_blocks_received"] += len(present)
            index = self._cells[j][present]
            sums = wire.values(data, h.lanes, h.count)
            if self.nonfinite_chunks:  # blocks of chunks left for the follow-up: skip them
                keep = self._chunk_exp[index // s.lanes] != EXP_NONFINITE
                if not keep.all():
                    rows = sums.reshape(-1, b)[keep].reshape(-1)
                    present, index, sums = present[keep], index[keep], rows
        if m > seed and len(present):
            if self.is_float:
                blocks = np.empty((len(present), b), np.float32)
                if self._ordinary[j]:
                    dequantize_rows(sums.reshape(-1, b), self._dequant_factor[index], blocks)
                else:
                    dequantize_blocks(sums, self._chunk_exp[index // s.lanes], s.bits,
                                      blocks.reshape(-1), b)
            else:
                blocks = sums.reshape(-1, b)
            self._write_blocks(index, blocks)
            self._written[index] = True
        # A position past the column's end would index past the grid: clamp it.
        column_length = self._column_length_of[j]
        np.minimum(records["nxt"], column_length, out=self._pos[j])
        self._live[j] = bool((self._pos[j] < column_length).any())

    def _fill_nonfinite_chunks(self, chunks: np.ndarray) -> None:
        """A chunk with inf or NaN on some rank is left as it was, as in the dense
        path, for the follow-up exchange (worker/engine/nonfinite.py)."""
        F = self.s.lanes
        for c in chunks[self._chunk_exp[chunks] == EXP_NONFINITE]:
            self.nonfinite_chunks.append(int(c))
            self._written[c * F:(c + 1) * F] = True

    def _has_message(self, j: int) -> bool:
        if self._round[j] <= self._exp_rounds[j]:
            return True  # exponent rounds and the seed always run
        return self._live[j]

    def _finish(self) -> None:
        # Blocks no result wrote are zero on every worker: their sum is +0.0 (the
        # input may hold -0.0 when it is the output).  Written last, not first,
        # so that the union's blocks are written once.
        self._zero_blocks(np.flatnonzero(~self._written))
        self.nonfinite_chunks.sort()
