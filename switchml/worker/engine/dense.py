"""The worker's engine, sans-IO: ``Membership`` starts each call of a job's member.

``Membership.allreduce`` makes the state machine of one call: a ``DenseAllreduce``
(SwitchML, here), a ``SparseAllreduce`` (OmniReduce, ``sparse.py``), or their
twins on the C engine (``compiled.py``).  What they share (the membership's
state, ``Stream``'s slots, window and timers) is in ``stream.py``, which none of
them imports back: the modules form no circle.

Dense: tensor chunk ``c`` (``packet_elements`` values) goes through local slot
``c mod W``, W = min(slots, chunks).  int32: message m of slot j carries chunk
``j + m*W``.  float32: message m carries the values of chunk ``j + (m-1)*W``,
quantised with the exponent the switch returned with message m-1, and (in its
first lane record) the local exponent of chunk ``j + m*W``; message 0 only
seeds it.  Message m of slot j has ``pkt_id`` ``m*W + j``.

The engine never reads a clock or touches a socket: callers pass ``now``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ... import wire
from ...quant import (
    EXP_NONFINITE,
    EXP_ZERO,
    chunk_exponents,
    dequantize16_into,
    dequantize_into,
    quantize16_into,
    quantize_into,
)
from .compiled import (
    CompiledDenseAllreduce,
    CompiledSparseAllreduce,
    supports,
    supports_sparse,
)
from .sparse import SparseAllreduce
from .stream import SUPPORTED_DTYPES, MembershipState, Stream, check_arrays

__all__ = ["Membership", "DenseAllreduce", "Stream", "SUPPORTED_DTYPES", "check_arrays"]

#: Exponents of non-zero finite float32 chunks: frexp of the least subnormal
#: (2**-149) is -148, of the largest float32 128.
LEAST_EXPONENT, GREATEST_EXPONENT = -148, 128


def valid_exponent(e: int) -> bool:
    """Whether ``e`` is a chunk exponent some worker could have computed."""
    return LEAST_EXPONENT <= e <= GREATEST_EXPONENT or e in (EXP_ZERO, EXP_NONFINITE)


class Membership(MembershipState):
    """One worker's membership of a job, shared by its allreduces in call order."""

    def allreduce(self, array: np.ndarray, out: np.ndarray, now: float, sparse: bool = False,
                  compiled: bool = False, wire_bits: int = 32):
        """Start an allreduce of ``array`` into ``out``; returns its state machine.

        ``compiled``: the call runs on the C engine (``compiled.py``) when it is
        built; the same datagrams and results either way.  ``wire_bits=16``: a
        dense float32 call on the 16-bit wire (``DenseAllreduce``).
        """
        op: Any  # a Stream or its compiled twin: the same sans-IO API
        if wire_bits not in (16, 32):
            raise ValueError(f"wire_bits must be 32 or 16, not {wire_bits!r}")
        if wire_bits == 16 and (sparse or array.dtype != np.float32):
            raise ValueError("the 16-bit wire carries dense float32 calls only")
        if sparse and compiled and supports_sparse(self):
            op = CompiledSparseAllreduce(self, array, out, self.next_seq, now)
        elif sparse:
            op = SparseAllreduce(self, array, out, self.next_seq, now)
        elif compiled and supports(self):
            op = CompiledDenseAllreduce(self, array, out, self.next_seq, now, wire_bits)
        else:
            op = DenseAllreduce(self, array, out, self.next_seq, now, wire_bits)
        self.next_seq = (self.next_seq + 1) & 0xFFFFFFFF
        return op


class DenseAllreduce(Stream):
    """SwitchML streaming of every chunk of the tensor.

    ``wire_bits=16`` (float32 only): a packet's ``packet_elements`` words carry
    twice as many values, each quantised to ``scale_bits16`` bits and biased to be
    non-negative, two to a word (``quant.quantize16_into``); the switch's 32-bit
    adds sum both halves at once, and no half can carry into the other.  Half the
    bytes each way for the same values; the bound is ``quant.error_bound16``.
    """

    def __init__(self, membership: MembershipState, array: np.ndarray, out: np.ndarray, seq: int,
                 now: float, wire_bits: int = 32):
        self.per_word = 2 if wire_bits == 16 else 1
        k = self.chunk_values = membership.packet_elements * self.per_word  # values a chunk
        self.chunks = -(-array.size // k)
        super().__init__(membership, array, out, seq, now, min(membership.slot_count, self.chunks))
        if self.per_word == 2:
            self.dtype_code = wire.DTYPE_FLOAT16_WIRE
            self._bits = membership.bits16
        else:
            self._bits = membership.bits
        self.local_exp = (chunk_exponents(self.src, k) if self.is_float
                          else np.zeros(0, np.int16))
        self._lag = 1 if self.is_float else 0
        W = self.width
        # Messages per local slot: its chunks, plus the exponent seed for floats.
        self._messages = [(self.chunks - j + W - 1) // W + self._lag for j in range(W)]
        # Per slot: the exponent of the chunk it sends next, from the switch.
        self._global_exp = [EXP_ZERO] * W
        #: Chunks with an inf or NaN on some rank, left as they were in the output
        #: for the follow-up exchange (worker/engine/nonfinite.py).
        self.nonfinite_chunks: list[int] = []
        self._start(now)

    def _chunk_count(self, c: int) -> int:
        """Values in chunk ``c``."""
        k = self.chunk_values
        return 0 if c < 0 else min(k, self.size - c * k)

    def _words(self, values: int) -> int:
        return -(-values // self.per_word)

    def _fill(self, j: int, m: int) -> int:
        s = self.s
        W, k = self.width, self.chunk_values
        lanes = s.lane_views[j]
        lanes[:] = s.blank_lanes
        following = j + m * W
        if self.is_float and following < self.chunks:
            lanes["exp"][0] = self.local_exp[following]
        c = j + (m - self._lag) * W
        count = self._chunk_count(c)
        if count:
            src = self.src[c * k: c * k + count]
            if self.per_word == 2:
                halves = s.value_views[j].view(np.uint16)
                quantize16_into(src, self._global_exp[j], self._bits, halves, s.scratch,
                                s.wide_scratch)
                if count % 2:
                    halves[count] = 0  # the last word's idle half
            elif self.is_float:
                quantize_into(src, self._global_exp[j], s.bits, s.value_views[j][:count],
                              s.scratch)
            else:
                s.value_views[j][:count] = src
        return self._words(count)

    def _result_fits(self, j: int, h: wire.Header, data) -> bool:
        values = self._chunk_count(j + (self._round[j] - self._lag) * self.width)
        if h.count != self._words(values):
            return False
        # The switch returns the max of exponents workers computed: anything else
        # is forged, and would scale by a power of two beyond float range.
        return not self.is_float or valid_exponent(wire.first_lane_exponent(data))

    def _absorb(self, j: int, m: int, h: wire.Header, data) -> None:
        s = self.s
        k = self.chunk_values
        c = j + (m - self._lag) * self.width
        if h.count and self.is_float and self._global_exp[j] == EXP_NONFINITE:
            self.nonfinite_chunks.append(c)  # untouched: the input stays for the follow-up
        elif h.count:
            values = wire.values(data, h.lanes, h.count)
            count = self._chunk_count(c)
            target = self.out[c * k: c * k + count]
            if self.per_word == 2:
                dequantize16_into(values.view(np.uint16)[:count], self._global_exp[j],
                                  self._bits, s.world_size, target, s.wide_scratch)
            elif self.is_float:
                dequantize_into(values, self._global_exp[j], s.bits, target)
            else:
                target[:] = values
        self._global_exp[j] = wire.first_lane_exponent(data)

    def _has_message(self, j: int) -> bool:
        return self._round[j] < self._messages[j]

    def _finish(self) -> None:
        self.nonfinite_chunks.sort()
