"""A TCP-like bulk flow for the simulator: the competitor a job's window meets.

``TcpLikeFlow`` sends segments of ``segment`` bytes from ``("tcp", i)`` to
``("tcp-sink", i)`` through the network's bottleneck, as a bulk TCP sender
does: clocked by cumulative ACKs, a window in segments that starts in slow
start, grows by ``increase`` segments a round trip and falls to ``decrease``
times itself at most once a round trip when a loss shows (three duplicate
ACKs; NewReno's recovery, retransmitting the next hole at each partial ACK,
and a pipe that counts duplicate ACKs as segments that left the network, as
SACK's does), or to one segment on a timeout (go-back-N, the least RTO
Linux's 200 ms).  The defaults are CUBIC's TCP-friendly region (RFC 9438,
section 4.3: 3(1 - 0.7)/(1 + 0.7) = 0.53 segments a round trip, decrease
0.7): the AIMD that CUBIC follows at a cluster's small bandwidth-delay
products, where its cubic curve lies below it.  Reno is ``increase=1,
decrease=0.5``.  Where the bottleneck is the sender's own queue
(``Bottleneck(refuse=True)``), a refused segment waits for room and the
window falls to ``decrease`` times itself at most once a round trip, as
Linux's TCP enters CWR when its qdisc drops a segment.

``run_concurrently(..., flows=[flow])`` drives flows beside the jobs; a flow
has the calls' interface there (``get_timer``, ``handle_timer``,
``receive``), and ``delivered(t0, t1)`` tells the bytes its receiver got in
order between two times.
"""

from __future__ import annotations

import bisect
import math
import struct

#: Linux's least retransmission timeout (TCP_RTO_MIN).
MIN_RTO = 0.2
DUPLICATE_ACKS = 3
_SEQ = struct.Struct("!QQ")  # a segment: (sequence, 0); an ACK: (next expected, echoed)


class TcpLikeFlow:
    """A bulk sender and its receiver on a simulated ``Network``."""

    def __init__(self, network, index: int = 0, *, segment: int = 1500,
                 increase: float = 3 * (1 - 0.7) / (1 + 0.7), decrease: float = 0.7,
                 min_rto: float = MIN_RTO):
        self.network = network
        self.address, self.sink = ("tcp", index), ("tcp-sink", index)
        self.addresses = (self.address, self.sink)
        self.segment, self.increase, self.decrease = segment, increase, decrease
        self.min_rto = min_rto
        # the sender
        self.cwnd, self.ssthresh = 2.0, math.inf
        self.snd_una = self.snd_nxt = 0
        self.dupacks = 0
        self.recover: int | None = None  # in loss recovery until this is acked
        self.sent_at: dict[int, float] = {}
        self.retransmitted: set[int] = set()
        self.srtt: float | None = None
        self.rttvar = 0.0
        self.rto_at: float | None = None
        self.cwr_until = -math.inf  # no second decrease for a refusal before this
        self.started = False
        # the receiver
        self.rcv_nxt = 0
        self.out_of_order: set[int] = set()
        self._progress_times: list[float] = []
        self._progress_bytes: list[int] = []
        self.counters = {"segments": 0, "retransmissions": 0, "timeouts": 0,
                         "fast_recoveries": 0, "refusals": 0}

    # ------------------------------------------------------------ the interface
    def start(self, now: float) -> None:
        self.started = True
        self._send_what_fits(now)

    def get_timer(self) -> float | None:
        return self.rto_at if self.started else None

    def handle_timer(self, now: float) -> None:
        if self.rto_at is None or now < self.rto_at:
            return
        self.counters["timeouts"] += 1
        self.ssthresh = max(self._flight() * self.decrease, 2.0)
        self.cwnd = 1.0
        self.recover, self.dupacks = None, 0
        self.retransmitted.update(range(self.snd_una, self.snd_nxt))
        self.snd_nxt = self.snd_una  # go back N
        self.rto_at = None
        self._send_what_fits(now)

    def receive(self, dst, data: bytes, now: float) -> None:
        first, second = _SEQ.unpack_from(data)
        if dst == self.sink:
            self._on_segment(first, now)
        else:
            self._on_ack(first, second, now)

    def delivered(self, t0: float, t1: float) -> int:
        """Bytes the receiver had in order by ``t1`` less those it had by ``t0``."""
        return self._bytes_by(t1) - self._bytes_by(t0)

    # ---------------------------------------------------------------- receiver
    def _on_segment(self, seq: int, now: float) -> None:
        if seq == self.rcv_nxt:
            self.rcv_nxt += 1
            while self.rcv_nxt in self.out_of_order:
                self.out_of_order.remove(self.rcv_nxt)
                self.rcv_nxt += 1
            self._progress_times.append(now)
            self._progress_bytes.append(self.rcv_nxt * self.segment)
        elif seq > self.rcv_nxt:
            self.out_of_order.add(seq)
        self.network.send(_SEQ.pack(self.rcv_nxt, seq), self.sink, self.address,
                          through_bottleneck=False)

    def _bytes_by(self, t: float) -> int:
        i = bisect.bisect_right(self._progress_times, t)
        return self._progress_bytes[i - 1] if i else 0

    # ------------------------------------------------------------------ sender
    def _flight(self) -> int:
        """Segments in the network: sent, not acked, not shown gone by a duplicate ACK."""
        return max(self.snd_nxt - self.snd_una - self.dupacks, 0)

    def _on_ack(self, ack: int, echoed: int, now: float) -> None:
        if echoed in self.sent_at and echoed not in self.retransmitted:
            self._rtt_sample(now - self.sent_at[echoed])
        if ack > self.snd_una:
            newly = ack - self.snd_una
            for seq in range(self.snd_una, ack):
                self.sent_at.pop(seq, None)
                self.retransmitted.discard(seq)
            self.snd_una, self.dupacks = ack, 0
            self.snd_nxt = max(self.snd_nxt, ack)
            if self.recover is not None:
                if ack >= self.recover:
                    self.recover = None  # recovered: cwnd is ssthresh already
                else:
                    self._transmit(self.snd_una, now)  # a partial ACK: the next hole
            elif self.cwnd < self.ssthresh:
                self.cwnd += newly
            else:
                self.cwnd += self.increase * newly / self.cwnd
            self.rto_at = now + self._rto() if self.snd_una < self.snd_nxt else None
        elif ack == self.snd_una and self.snd_nxt > self.snd_una:
            self.dupacks += 1
            if self.dupacks == DUPLICATE_ACKS and self.recover is None:
                self.counters["fast_recoveries"] += 1
                self._decrease(now)
                self.recover = self.snd_nxt
                self._transmit(self.snd_una, now)
        self._send_what_fits(now)

    def _decrease(self, now: float) -> None:
        self.ssthresh = max(self.cwnd * self.decrease, 2.0)
        self.cwnd = self.ssthresh
        self.cwr_until = now + (self.srtt or 0.0)

    def _rtt_sample(self, rtt: float) -> None:
        if self.srtt is None:
            self.srtt, self.rttvar = rtt, rtt / 2
        else:
            self.rttvar = 0.75 * self.rttvar + 0.25 * abs(self.srtt - rtt)
            self.srtt = 0.875 * self.srtt + 0.125 * rtt

    def _rto(self) -> float:
        if self.srtt is None:
            return 1.0
        return max(self.srtt + 4 * self.rttvar, self.min_rto)

    def _send_what_fits(self, now: float) -> None:
        while self._flight() < int(self.cwnd):
            self._transmit(self.snd_nxt, now)
            self.snd_nxt += 1

    def _transmit(self, seq: int, now: float) -> None:
        if seq in self.sent_at:
            self.retransmitted.add(seq)
            self.counters["retransmissions"] += 1
        self.sent_at[seq] = now
        self.counters["segments"] += 1
        payload = _SEQ.pack(seq, 0).ljust(self.segment, b"\0")
        if self.network.send(payload, self.address, self.sink, through_bottleneck=True):
            self.counters["refusals"] += 1
            if now >= self.cwr_until:
                self._decrease(now)
        if self.rto_at is None:
            self.rto_at = now + self._rto()
