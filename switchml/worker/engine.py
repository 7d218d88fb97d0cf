"""The worker's streaming engine, sans-IO: results in, contributions out.

A ``Session`` is a worker's membership of one job (session id, slot range,
packet size, world size); it persists the per-slot message numbers across
allreduces, so that consecutive allreduces keep alternating the shadow-copy sets.
``Session.allreduce`` makes an ``Allreduce``, the state machine of one call:

* tensor chunk ``c`` (``packet_elements`` values) goes through local slot
  ``c mod W``, where W = min(slots, chunks); each slot has one message in flight;
* int32: message m of slot j carries chunk ``j + m*W``;
* float32: message m carries the values of chunk ``j + (m-1)*W``, quantised with
  the exponent the switch returned with message m-1, and the local exponent of
  chunk ``j + m*W`` (message 0 seeds the exponents and carries no values);
* the result of a message frees its slot for the next one (self-clocking);
* each outstanding message has a retransmission deadline with back-off; no
  result for ``progress_timeout`` seconds makes the call fail as stalled.

The engine never reads a clock or touches a socket: callers pass ``now``.
"""

from __future__ import annotations

import numpy as np

from .. import wire
from ..quant import EXP_ZERO, chunk_exponents, dequantize_into, quantize_into, scale_bits
from .recovery import RttEstimator

SUPPORTED_DTYPES = (np.dtype(np.float32), np.dtype(np.int32))


class Session:
    """One worker's membership of a job, shared by its allreduces in call order."""

    def __init__(self, *, session: int, rank: int, world_size: int, slot_base: int,
                 slot_count: int, packet_elements: int, progress_timeout: float = 30.0,
                 rtt: RttEstimator | None = None):
        self.session = session
        self.rank = rank
        self.world_size = world_size
        self.slot_base = slot_base
        self.slot_count = slot_count
        self.packet_elements = packet_elements
        self.progress_timeout = progress_timeout
        self.rtt = rtt or RttEstimator()
        self.bits = scale_bits(world_size)
        self.slot_msgs = [0] * slot_count
        self.next_seq = 0
        size = wire.packet_size(packet_elements)
        self._packets = bytearray(size * slot_count)
        self._packet_views = [memoryview(self._packets)[j * size:(j + 1) * size]
                              for j in range(slot_count)]
        self._scratch = np.empty(packet_elements, dtype=np.float32)
        self.counters = {"results_in": 0, "retransmissions": 0, "dropped_stale": 0,
                         "dropped_malformed": 0, "dropped_foreign": 0}

    def allreduce(self, array: np.ndarray, out: np.ndarray, now: float) -> "Allreduce":
        op = Allreduce(self, array, out, self.next_seq, now)
        self.next_seq = (self.next_seq + 1) & 0xFFFFFFFF
        return op


class Allreduce:
    """State machine of one allreduce on one worker."""

    def __init__(self, session: Session, array: np.ndarray, out: np.ndarray, seq: int,
                 now: float):
        if array.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"switchml sums float32 and int32 arrays, not {array.dtype}")
        self.s = session
        self.seq = seq
        self.src = array.reshape(-1)
        self.out = out.reshape(-1)
        self.is_float = array.dtype == np.float32
        self.dtype_code = wire.DTYPE_FLOAT32 if self.is_float else wire.DTYPE_INT32
        k = session.packet_elements
        self.size = self.src.size
        self.chunks = -(-self.size // k)
        self.width = min(session.slot_count, self.chunks)
        self.local_exp = chunk_exponents(self.src, k) if self.is_float else None
        lag = 1 if self.is_float else 0
        self._lag = lag
        W = self.width
        # Messages per local slot: its chunks, plus the exponent seed for floats.
        self._messages = [(self.chunks - j + W - 1) // W + lag for j in range(W)]
        self._next_m = [0] * W  # message number (within this call) in flight per slot
        self._global_exp = [EXP_ZERO] * W  # exponent for the chunk to be sent next
        self._inflight: list = [None] * W  # datagram of the outstanding message
        self._sent_at = [0.0] * W
        self._deadline = [float("inf")] * W
        self._backoff = [0] * W
        self._outbox: list = []
        self.remaining = W
        self.last_progress = now
        self.error: str | None = None
        for j in range(W):
            self._send_message(j, now)

    # ------------------------------------------------------------ public API
    @property
    def done(self) -> bool:
        return self.remaining == 0

    def datagrams_to_send(self) -> list:
        """Datagrams to send to the switch now; views stay valid until the next result."""
        out, self._outbox = self._outbox, []
        return out

    def get_timer(self) -> float | None:
        """Earliest time at which ``handle_timer`` must run, or None when finished."""
        if self.done or self.error:
            return None
        return min(min(self._deadline), self.last_progress + self.s.progress_timeout)

    def handle_timer(self, now: float) -> None:
        """Retransmit every message whose deadline passed; detect a stalled call."""
        if self.done or self.error:
            return
        if now >= self.last_progress + self.s.progress_timeout:
            self.error = "stalled"
            return
        for j, deadline in enumerate(self._deadline):
            if deadline <= now:
                self._backoff[j] += 1
                self._sent_at[j] = now
                self._deadline[j] = now + self.s.rtt.rto(self._backoff[j])
                self._outbox.append(self._inflight[j])
                self.s.counters["retransmissions"] += 1

    def pending(self) -> list[tuple[int, int]]:
        """(absolute slot, message number) of every message still awaiting its result."""
        s = self.s
        return [(s.slot_base + j, s.slot_msgs[j]) for j in range(self.width)
                if self._inflight[j] is not None]

    def receive_datagram(self, data, now: float) -> None:
        """Take one datagram from the switch; anything not expected is dropped and counted."""
        s = self.s
        try:
            h = wire.decode_header(data)
        except wire.MalformedPacket:
            s.counters["dropped_malformed"] += 1
            return
        j = h.slot - s.slot_base
        if h.kind != wire.KIND_RESULT or h.session != s.session or not 0 <= j < self.width:
            s.counters["dropped_foreign"] += 1
            return
        m = self._next_m[j]
        if (self._inflight[j] is None or h.seq != self.seq or h.msg != s.slot_msgs[j]
                or h.pkt_id != m * self.width + j or h.dtype != self.dtype_code
                or h.count != self._expected_count(j, m)):
            s.counters["dropped_stale"] += 1
            return
        s.counters["results_in"] += 1
        if self._backoff[j] == 0:
            s.rtt.add_sample(now - self._sent_at[j])  # Karn: only unambiguous samples
        self.last_progress = now
        values = np.frombuffer(data, dtype=np.int32, count=h.count, offset=wire.HEADER_SIZE)
        c = j + (m - self._lag) * self.width
        if h.count:
            target = self.out[c * s.packet_elements: c * s.packet_elements + h.count]
            if self.is_float:
                dequantize_into(values, self._global_exp[j], s.bits, target)
            else:
                target[:] = values
        self._global_exp[j] = h.exponent
        s.slot_msgs[j] = (s.slot_msgs[j] + 1) & 0xFFFFFFFF
        self._next_m[j] = m + 1
        self._inflight[j] = None
        self._deadline[j] = float("inf")
        self._backoff[j] = 0
        if m + 1 < self._messages[j]:
            self._send_message(j, now)
        else:
            self.remaining -= 1

    # ------------------------------------------------------------ internals
    def _expected_count(self, j: int, m: int) -> int:
        c = j + (m - self._lag) * self.width
        if c < 0:
            return 0
        return min(self.s.packet_elements, self.size - c * self.s.packet_elements)

    def _send_message(self, j: int, now: float) -> None:
        s = self.s
        m = self._next_m[j]
        W = self.width
        k = s.packet_elements
        count = self._expected_count(j, m)
        exponent = EXP_ZERO
        if self.is_float:
            following = j + m * W
            if following < self.chunks:
                exponent = int(self.local_exp[following])
        buf = s._packet_views[j]
        wire.encode_header(buf, wire.KIND_CONTRIBUTION, self.dtype_code, s.slot_base + j,
                           s.session, s.slot_msgs[j], self.seq, m * W + j, exponent, count)
        if count:
            c = j + (m - self._lag) * W
            src = self.src[c * k: c * k + count]
            dst = np.frombuffer(buf, dtype=np.int32, count=count, offset=wire.HEADER_SIZE)
            if self.is_float:
                quantize_into(src, self._global_exp[j], s.bits, dst, s._scratch)
            else:
                dst[:] = src
        datagram = buf[: wire.packet_size(count)]
        self._inflight[j] = datagram
        self._sent_at[j] = now
        self._deadline[j] = now + s.rtt.rto(0)
        self._outbox.append(datagram)
