"""What every allreduce of a worker shares, sans-IO: results in, contributions out.

``MembershipState`` is a worker's membership of one job (session id, slot range,
packet and block sizes, world size); it persists the per-slot message numbers
across allreduces, so that consecutive allreduces keep alternating the
shadow-copy sets, and the congestion window and RTT estimate, so that the next
allreduce starts at the rate the last one found.  ``dense.Membership`` adds the
method that starts a call: a ``DenseAllreduce`` (SwitchML, ``dense.py``) or a
``SparseAllreduce`` (OmniReduce, ``sparse.py``).  Both share ``Stream``: at
most one message per slot, the result of a message makes the slot's next one
ready, ready messages go out in ``pkt_id`` order while fewer than the congestion
window (``recovery.CongestionWindow``) are in flight, and the lowest unfinished
message is always in flight (every rank sends the same messages in the same
order, so no rank can wait on another forever).  A retransmission deadline per
outstanding message with back-off; no result for ``progress_timeout`` seconds
makes the call fail as stalled.

This module is the bottom of the engine: ``engine``, ``sparse`` and ``compiled``
import it and it imports none of them, so that ``dense.Membership`` can start any
kind of call without an import circle.

Fast retransmit: a slot's result comes when every rank's contribution reached
the switch, and slots complete roughly in the order their messages went out, so
a message still unanswered when the results of ``Membership.reordering`` messages
sent after it (later (re)transmissions, counted by a send number) have come was
probably lost (its datagram, a peer's, or its result; the threshold is
``FAST_RETRANSMIT_THRESHOLD`` at first, and a fast retransmission that proves
spurious raises it past the reordering it saw, up to ``MAX_REORDERING``): it is sent
again at once, whole, instead of after its timeout, at most once per
timeout (not again until its result comes or its timer fires).  A switch of
several data threads (``Membership.data_threads``) answers each thread's slots
in order, but one thread's results overtake another's by any number while that
one waits for a core: only results of the same thread's slots count, where the
call has another slot of that thread (else nothing would ever reveal a loss
before the timeout: every thread's results count for such a slot).  The window
takes it as a loss like a timeout (``CongestionWindow.on_timeout``, judged as a
first timeout: the results that overtook it show the path answers).

Probes (``recovery.TAIL_PROBE_ROUND_TRIPS``, ``COPY_PROBE_ROUND_TRIPS``): what
no later result can reveal is sent again after a few round trips rather than
the timeout (at least 10 ms): a message once no result at all came for 2
smoothed round trips (+0.25 ms) since it went out (the call's last messages:
TCP's tail loss probe), and a fast retransmission 8 round trips and 4
deviations (+0.25 ms) after it went out (its loss, or its result's, or a
peer's copy's).  A probe is not a loss for the window (silence is no evidence
of a queue); each transmission is probed at most once, and the timer stays.
Tail probes fill the window's room and, past it, go one at a time
(``Stream._probe_room``).

What a retransmission sends: a tail probe's is the message's probe, its header
alone (``wire.KIND_PROBE``), a timer's its query (``wire.KIND_QUERY``), the
same header: a set waits for every rank, so when one rank's contribution is
lost every rank times out, and whole copies from the ranks the switch already
holds would only crowd the port that dropped it (16 ranks into a switch server:
15 useless packets a loss).  The switch answers either with a resend
(``wire.KIND_RESEND``) when it lacks this rank's contribution, which then goes
whole at once (one more round trip for the rank whose datagram was lost).  When
the set is complete it answers a probe with the result, and a query with a
done (``wire.KIND_DONE``): its result left before the done on the same path,
so a done that finds the message still waiting means the result was lost, and
the message goes whole (answered with the stored result).  A tail probe comes
after silence, where a lost result is likely and its round trip counts; the
timer fires after the RTO, which where round trips vary widely (16 ranks on two
cores into switch servers) is mostly a late result, not a lost one: a done
costs it 32 bytes where the result cost a second copy queued behind the first.
A fast retransmission goes whole: results of later messages show the path
delivers, losses are few and not a full queue's, and the round trip counts.

The engine never reads a clock or touches a socket: callers pass ``now``.
"""

from __future__ import annotations

import bisect
import collections
import heapq

import numpy as np

from ... import wire
from ...quant import (
    EXP_ZERO,
    scale_bits,
    scale_bits16,
)
from .recovery import (
    COPY_PROBE_ROUND_TRIPS,
    FAST_RETRANSMIT_THRESHOLD,
    MAX_REORDERING,
    TAIL_PROBE_MARGIN,
    TAIL_PROBE_ROUND_TRIPS,
    CongestionWindow,
    RttEstimator,
)

#: How a message's latest transmission went out (``Stream._copy``).
SENT, FAST, PROBE = 0, 1, 2

SUPPORTED_DTYPES = (np.dtype(np.float32), np.dtype(np.int32))

def check_arrays(array: np.ndarray, out: np.ndarray) -> None:
    """Raise unless ``array`` is of a summed dtype and ``out`` is it or apart from it."""
    if array.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"switchml sums float32 and int32 arrays, not {array.dtype}")
    check_apart(array, out)


def check_apart(array: np.ndarray, out: np.ndarray) -> None:
    """Raise unless ``out`` is ``array`` itself or does not overlap it."""
    src, dst = array.reshape(-1), out.reshape(-1)
    if np.may_share_memory(src, dst) and not (
            src.ctypes.data == dst.ctypes.data and src.size == dst.size):
        raise ValueError("out must be the input itself or not overlap it")


class MembershipState:
    """One worker's membership of a job: what its calls share, in call order (slots,
    message numbers, window, RTT, packet buffers, counters).  ``dense.Membership``
    adds the method that starts a call."""

    def __init__(self, *, session: int, rank: int, world_size: int, slot_base: int,
                 slot_count: int, packet_elements: int, block_elements: int | None = None,
                 progress_timeout: float = 30.0, rtt: RttEstimator | None = None,
                 window: CongestionWindow | None = None, token: int = 0,
                 data_threads: int = 1):
        self.session = session
        #: What this rank's datagrams carry as session (``protocol.Ready.token``),
        #: the switch's proof of who sent them; 0: ``session``.
        self.token = token or session
        self.rank = rank
        self.world_size = world_size
        self.slot_base = slot_base
        self.slot_count = slot_count
        self.packet_elements = packet_elements
        self.block_elements = block_elements or packet_elements
        self.lanes = packet_elements // self.block_elements
        self.progress_timeout = progress_timeout
        self.rtt = rtt or RttEstimator()
        self.window = window or CongestionWindow(slot_count)
        #: Results that may overtake a message before it is fast-retransmitted:
        #: FAST_RETRANSMIT_THRESHOLD, raised by the reordering a spurious fast
        #: retransmission shows, up to MAX_REORDERING (recovery.py says why).
        self.reordering = FAST_RETRANSMIT_THRESHOLD
        #: The switch's data threads (``protocol.Ready.data_threads``): slot ``s``'s
        #: results come in order with those of the slots ``s'`` of the same
        #: ``s' % data_threads`` only, so fast retransmit counts within those
        #: (where a call has two of them: ``Stream._group``).
        self.data_threads = data_threads
        self.bits = scale_bits(world_size)
        self.bits16 = scale_bits16(world_size)
        self.slot_msgs = [0] * slot_count
        self.next_seq = 0
        size = wire.packet_size(self.lanes, packet_elements)
        self._packets = bytearray(size * slot_count)
        self.packet_views = [memoryview(self._packets)[j * size:(j + 1) * size]
                             for j in range(slot_count)]
        self.lane_views = [wire.lane_table(v, self.lanes) for v in self.packet_views]
        self.value_views = [wire.values(v, self.lanes, packet_elements) for v in self.packet_views]
        self.scratch = np.empty(2 * packet_elements, dtype=np.float32)
        self.wide_scratch = np.empty(2 * packet_elements, dtype=np.int32)  # the 16-bit wire
        self.blank_lanes = np.zeros(self.lanes, dtype=wire.LANE)
        self.blank_lanes["exp"] = EXP_ZERO
        self.counters = {"results_in": 0, "retransmissions": 0, "fast_retransmissions": 0,
                         "probe_retransmissions": 0, "resends": 0, "results_lost": 0,
                         "spurious_retransmissions": 0,
                         "window_decreases": 0, "random_losses": 0, "dropped_stale": 0,
                         "dropped_malformed": 0, "dropped_foreign": 0,
                         "sparse_blocks_sent": 0, "sparse_blocks_received": 0,
                         "bytes_sent": 0, "bytes_received": 0, "local_refusals": 0,
                         "rejoins": 0, "calls_resumed": 0}


class Stream:
    """What dense and sparse calls share: slots, the window, timers, result matching."""

    mode = 0
    sparse = False

    def __init__(self, membership: MembershipState, array: np.ndarray, out: np.ndarray, seq: int,
                 now: float, width: int):
        check_arrays(array, out)
        self.s = membership
        self.seq = seq
        self.src = array.reshape(-1)
        self.out = out.reshape(-1)
        self.is_float = array.dtype == np.float32
        self.dtype_code = wire.DTYPE_FLOAT32 if self.is_float else wire.DTYPE_INT32
        self.size = self.src.size
        self.call = wire.call_id(self.size, self.sparse)
        self.width = width
        self._round = [0] * width  # message number (within this call) per slot
        self._inflight: list = [None] * width
        self._sent_at = [0.0] * width
        self._deadline = [float("inf")] * width
        self._backoff = [0] * width
        # A message sent and still awaiting its result is in flight until its
        # deadline passes; then it is presumed lost and waits, like a slot's next
        # message, for room in the window to be sent again.
        self._lost = [False] * width
        # When a slot's timeout halved the window (None: it did not), so that a
        # premature timeout can take its decrease back.
        self._decreased_at: list = [None] * width
        # (pkt_id, slot) of the messages ready to go (lowest first), and of those
        # in flight; entries that no longer hold are skipped when met.
        self._ready: list = []
        self._inflight_ids: list = []
        self.inflight_count = 0
        # Fast retransmit: every (re)transmission takes the next send number;
        # (send number, slot) of the messages that may still be fast-retransmitted
        # (sent, or resent by the timer, and not fast-retransmitted since), and the
        # MAX_REORDERING greatest send numbers whose results came, least first,
        # each per group (``_group``: the slot's switch data thread, or ``_every``,
        # every thread's results, for a slot alone of its thread in the call).  A
        # message in flight has had results of as many messages sent after it as
        # there are results with a greater send number (those were sent after it,
        # so they came after it went out).
        self._sends = 0
        self._send_no = [0] * width
        # Per slot: the send number of the transmission a fast retransmission
        # followed, to measure the reordering if the copy proves spurious.
        self._overtaken_send_no = [0] * width
        # Per slot: fast retransmissions of its message; the window judges a
        # timeout by the timer's retransmissions only (they are the silence).
        self._fast_copies = [0] * width
        # Per slot: how its latest transmission went out (SENT: first sent or
        # resent by the timer, FAST: fast retransmission, PROBE: tail loss probe),
        # for when it is probed (``_probe_at``).
        self._copy = [SENT] * width
        threads = membership.data_threads
        thread = [(membership.slot_base + j) % threads for j in range(width)]
        slots_of = collections.Counter(thread)
        self._every = threads if threads > 1 else 0
        self._group = [t if threads > 1 and slots_of[t] > 1 else self._every
                       for t in thread]
        self._by_send: list = [[] for _ in range(self._every + 1)]
        self._latest_results: list = [[] for _ in range(self._every + 1)]
        self._outbox: list = []
        self._outbox_slots: list = []  # the slot of each datagram in the outbox
        self.remaining = width
        self.last_progress = now
        self.error: str | None = None

    # ------------------------------------------------------------ public API
    @property
    def done(self) -> bool:
        return self.remaining == 0

    def datagrams_to_send(self) -> list:
        """Datagrams to send to the switch now; views stay valid until the next result."""
        out, self._outbox, self._outbox_slots = self._outbox, [], []
        return out

    def _enqueue(self, j: int, datagram) -> None:
        """Queue slot j's datagram; it supersedes one of slot j still waiting to leave.

        Both are views of slot j's one packet buffer, which now holds the newer
        message: a caller that takes several events before sending (the C loop
        takes a batch of results) would otherwise send the new bytes twice, once
        under the old length (a retransmission whose original's result came in
        the same batch).
        """
        if j in self._outbox_slots:
            keep = [i for i, slot in enumerate(self._outbox_slots) if slot != j]
            self._outbox = [self._outbox[i] for i in keep]
            self._outbox_slots = [self._outbox_slots[i] for i in keep]
        self._outbox.append(datagram)
        self._outbox_slots.append(j)

    def _enqueue_probe(self, j: int, kind: int) -> None:
        """Queue the probe or query of slot j's message in flight (a retransmission
        as its header alone) unless the message itself waits to leave."""
        if j not in self._outbox_slots:
            self._outbox.append(wire.probe_of(self._inflight[j], kind))
            self._outbox_slots.append(j)

    def get_timer(self) -> float | None:
        """Earliest time at which ``handle_timer`` must run, or None when finished."""
        if self.done or self.error:
            return None
        timer = min(min(self._deadline), self.last_progress + self.s.progress_timeout)
        return min(timer, self._first_probe_at(self._probe_room() > 0))

    def handle_timer(self, now: float) -> None:
        """Presume lost every message whose deadline passed and resend what the
        window allows, lowest first; detect a stalled call."""
        if self.done or self.error:
            return
        if now >= self.last_progress + self.s.progress_timeout:
            self.error = "stalled"
            return
        expired = False
        for j, deadline in enumerate(self._deadline):
            if deadline <= now:
                self._judge_loss(j, now, self._backoff[j] - self._fast_copies[j])
                self._lost[j] = True
                self.inflight_count -= 1
                self._deadline[j] = float("inf")
                heapq.heappush(self._ready, (self._round[j] * self.width + j, j))
                expired = True
        if expired:
            self._send_ready(now)
        room = self._probe_room()
        for j in range(self.width):
            if (room > 0 or self._copy[j] == FAST) and self._probe_at(j) <= now:
                room -= self._copy[j] == SENT
                self._probe(j, now)

    def send_refused(self, now: float) -> None:
        """This host's own queue toward the network refused a datagram at ``now``
        (ENOBUFS): the sender waits for room and sends it again; the window takes
        it as a full queue (``CongestionWindow.on_local_refusal``)."""
        s = self.s
        s.counters["local_refusals"] += 1
        rtt = s.rtt.srtt if s.rtt.srtt is not None else s.rtt.rto()
        if s.window.on_local_refusal(now, rtt):
            s.counters["window_decreases"] += 1

    def _names_in_flight(self, j: int, h: wire.Header) -> bool:
        """Whether ``h`` (a result or a probe's answer) is about the message slot j
        has in flight: this call, the slot's message number and packet."""
        return (self._inflight[j] is not None and h.seq == self.seq
                and h.msg == self.s.slot_msgs[j]
                and h.pkt_id == self._round[j] * self.width + j)

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
        if (h.kind not in (wire.KIND_RESULT, wire.KIND_RESEND, wire.KIND_DONE)
                or h.session != s.session or not 0 <= j < self.width):
            s.counters["dropped_foreign"] += 1
            return
        if h.kind != wire.KIND_RESULT:  # a probe's answer
            if not self._names_in_flight(j, h) or h.count or h.lanes:
                s.counters["dropped_stale"] += 1  # e.g. the result came before the done
                return
            # The switch lacks this message (resend), or its result went out before
            # this done and never came: either way the message goes whole, which a
            # complete set answers with its stored result.
            self._enqueue(j, self._inflight[j])
            s.counters["resends" if h.kind == wire.KIND_RESEND else "results_lost"] += 1
            return
        if (not self._names_in_flight(j, h) or h.dtype != self.dtype_code
                or h.mode != self._mode(j) or h.lanes != s.lanes
                or not self._result_fits(j, h, data)):
            s.counters["dropped_stale"] += 1
            return
        m = self._round[j]
        s.counters["results_in"] += 1
        rtt = s.rtt
        answered = self._send_no[j]  # the latest transmission's, unless proven otherwise
        if self._backoff[j] == 0:
            if not self._lost[j]:  # Karn: only unambiguous samples
                rtt.add_sample(now - self._sent_at[j], self._sent_at[j])
                s.window.on_rtt_sample(now - self._sent_at[j], rtt.min_rtt, self._sent_at[j], now)
        elif not self._lost[j] and rtt.srtt is not None and now - self._sent_at[j] < rtt.min_rtt:
            # Sooner after the retransmission than any round trip: the answer to
            # an earlier copy, so the timeout (or the fast retransmission) came
            # too early.  (Before any round trip is measured nothing tells.)
            s.counters["spurious_retransmissions"] += 1
            if self._copy[j] == FAST:
                self._learn_reordering(j)
                answered = self._overtaken_send_no[j]  # the original's result
            elif self._copy[j] == SENT:  # the timer's copy: the RTO was too short
                rtt.on_premature_timeout(self._sent_at[j], now)
            if self._decreased_at[j] is not None:
                s.window.undo_decrease(self._decreased_at[j])
        self._note_result(j, answered)
        s.window.on_result(self.inflight_count >= s.window.allowed(self.width))
        self.last_progress = now
        self._absorb(j, m, h, data)
        s.slot_msgs[j] = (s.slot_msgs[j] + 1) & 0xFFFFFFFF
        self._round[j] = m + 1
        self._inflight[j] = None
        if self._lost[j]:
            self._lost[j] = False  # its entry in _ready no longer holds
        else:
            self.inflight_count -= 1
        self._deadline[j] = float("inf")
        self._backoff[j] = 0
        self._fast_copies[j] = 0
        self._copy[j] = SENT
        self._decreased_at[j] = None
        if self._has_message(j):
            heapq.heappush(self._ready, (self._round[j] * self.width + j, j))
            self._send_ready(now)
        else:
            self.remaining -= 1
            if self.remaining == 0:
                self._finish()
                return
            self._send_ready(now)
        self._fast_retransmit(j, now)

    # ------------------------------------------------------------ fast retransmit
    def _note_result(self, j: int, send_no: int) -> None:
        """Keep the MAX_REORDERING greatest send numbers answered, of slot j's group
        and of every thread's."""
        self._note_in(self._group[j], send_no)
        if self._group[j] != self._every:
            self._note_in(self._every, send_no)

    def _note_in(self, group: int, send_no: int) -> None:
        latest = self._latest_results[group]
        if len(latest) < MAX_REORDERING:
            bisect.insort(latest, send_no)
        elif send_no > latest[0]:
            del latest[0]
            bisect.insort(latest, send_no)

    def _learn_reordering(self, j: int) -> None:
        """Message j's fast retransmission was spurious: its original's result came
        after the results of as many later sends as are answered above it.  Let
        that many (and one more) overtake a message before it counts as lost."""
        latest = self._latest_results[self._group[j]]
        overtaken_by = len(latest) - bisect.bisect_right(latest, self._overtaken_send_no[j])
        self.s.reordering = min(MAX_REORDERING, max(self.s.reordering, overtaken_by + 1))

    def _fast_retransmit(self, answered: int, now: float) -> None:
        """Resend, lowest send number first, every message in flight that results of
        ``Membership.reordering`` messages sent after it (of its group) have
        overtaken: of slot ``answered``'s group (whose result just came), then of
        the slots alone of their thread."""
        self._fast_retransmit_group(self._group[answered], now)
        if self._group[answered] != self._every:
            self._fast_retransmit_group(self._every, now)

    def _fast_retransmit_group(self, group: int, now: float) -> None:
        latest = self._latest_results[group]
        if len(latest) < self.s.reordering:
            return
        bound = latest[-self.s.reordering]
        candidates = self._by_send[group]
        while candidates:
            send_no, j = candidates[0]
            if (self._inflight[j] is None or self._lost[j] or self._send_no[j] != send_no):
                heapq.heappop(candidates)  # answered, presumed lost, or sent again
                continue
            if send_no >= bound:
                return
            heapq.heappop(candidates)
            self._fast_resend(j, now)

    def _judge_loss(self, j: int, now: float, retries: int) -> None:
        """Tell the window message j was lost (``retries``: the timer's resends of it
        so far); count what it made of it, and keep when it halved, for an undo."""
        outcome = self.s.window.on_timeout(self._sent_at[j], now, retries)
        if outcome == CongestionWindow.DECREASED:
            self.s.counters["window_decreases"] += 1
            self._decreased_at[j] = now
        elif outcome == CongestionWindow.RANDOM_LOSS:
            self.s.counters["random_losses"] += 1

    def _fast_resend(self, j: int, now: float) -> None:
        """Send message j again at once: a loss for the window, as a timeout is."""
        s = self.s
        # As a first timeout (retries 0): the silence rule (no round trip since a
        # retransmission went out) does not apply, the results that overtook
        # this message show the path answers; only a queue halves the window.
        # (With the copy's back-off count, random loss would halve the window as
        # if it were congestion, and fast retransmit would cost more than the
        # timeouts it saves.)
        self._judge_loss(j, now, 0)
        # The timer restarts with the timeout it had, not backed off (the path
        # answers: this copy was lost), plus a smoothed round trip: the copy
        # is not overdue before its own round trip, and where the least RTO is
        # no more than a round trip, the timer would fire just before the answer
        # and send a copy that is not needed.  The back-off count still grows: the result is
        # ambiguous (Karn) and may prove the retransmission spurious.
        self._deadline[j] = now + s.rtt.rto(self._backoff[j]) + (s.rtt.srtt or 0.0)
        self._backoff[j] += 1
        self._fast_copies[j] += 1
        self._copy[j] = FAST
        self._sent_at[j] = now
        self._sends += 1
        self._overtaken_send_no[j] = self._send_no[j]
        self._send_no[j] = self._sends  # not a candidate again until its timer fires
        self._enqueue(j, self._inflight[j])  # whole: see the module docstring
        s.counters["retransmissions"] += 1
        s.counters["fast_retransmissions"] += 1

    # ------------------------------------------------------------ tail loss probe
    def _probe_delays(self) -> tuple[float, float] | None:
        """How long after it a message is probed: (a fast retransmission's copy,
        after its sending; any other, after its latest transmission or the
        latest result, whichever came last); None before a round trip is known."""
        srtt = self.s.rtt.srtt
        if srtt is None:
            return None
        return (COPY_PROBE_ROUND_TRIPS * srtt + 4 * self.s.rtt.rttvar + TAIL_PROBE_MARGIN,
                TAIL_PROBE_ROUND_TRIPS * srtt + TAIL_PROBE_MARGIN)

    def _probe_at(self, j: int) -> float:
        """When message j is probed: a probe time after its latest transmission or
        the latest result, whichever came last (inf: it is not probed)."""
        delays = self._probe_delays()
        copy = self._copy[j]
        if delays is None or self._inflight[j] is None or self._lost[j] or copy == PROBE:
            return float("inf")
        if copy == FAST:
            return self._sent_at[j] + delays[0]
        return max(self._sent_at[j], self.last_progress) + delays[1]

    def _first_probe_at(self, tail_room: bool) -> float:
        """The least ``_probe_at(j)`` of the messages that may be probed now: the
        copies of fast retransmissions, and the others where ``tail_room``.  In
        one pass, for ``get_timer``, which the event loop asks at every event:
        a constant added to the least time is the least of the sums, exactly.
        (stream.c's get_timer calls probe_at a slot: a call costs nothing there.)"""
        delays = self._probe_delays()
        if delays is None:
            return float("inf")
        copies = tails = float("inf")  # the least sent_at of each kind
        for j in range(self.width):
            if self._inflight[j] is None or self._lost[j]:
                continue
            copy = self._copy[j]
            if copy == FAST:
                copies = min(copies, self._sent_at[j])
            elif copy != PROBE and tail_room:
                tails = min(tails, self._sent_at[j])
        return min(copies + delays[0], max(tails, self.last_progress) + delays[1])

    def _probe_room(self) -> int:
        """How many more tail probes may go out: a probe is one more datagram in
        flight, so probes fill the window's room (its own, not capped by the call's
        width), and past it one probe at a time may be unanswered (TCP's tail loss
        probe, RFC 8985).  Probing every message of a full window after two round
        trips of silence would double the load of a congested port, where silence
        means a queue, not a loss, and many ranks into one port collapse."""
        probes = sum(1 for j in range(self.width) if self._copy[j] == PROBE
                     and self._inflight[j] is not None and not self._lost[j])
        window = self.s.window
        return max(window.allowed(window.limit) - self.inflight_count, 1) - probes

    def _probe(self, j: int, now: float) -> None:
        """Send message j again: no result for a probe time, so none will reveal
        its loss (the call's last messages).  Not a loss for the window (nothing
        says one happened); its timer stays."""
        s = self.s
        self._backoff[j] += 1  # the result is ambiguous (Karn)
        self._fast_copies[j] += 1  # the window judges timeouts by the timer's copies
        self._copy[j] = PROBE
        self._sent_at[j] = now
        self._number_send(j)
        self._enqueue_probe(j, wire.KIND_PROBE)
        s.counters["retransmissions"] += 1
        s.counters["probe_retransmissions"] += 1

    def _number_send(self, j: int) -> None:
        self._sends += 1
        self._send_no[j] = self._sends
        heapq.heappush(self._by_send[self._group[j]], (self._sends, j))

    # ------------------------------------------------------------ the window
    def _start(self, now: float) -> None:
        """Make every slot's first message ready and send what the window allows."""
        self._ready = [(j, j) for j in range(self.width)]  # pkt_id of message 0 is j
        self._send_ready(now)

    def _current(self, pkt_id: int, j: int) -> bool:
        """Whether ``pkt_id`` is still the message slot ``j`` is working on."""
        return self._round[j] * self.width + j == pkt_id

    def _lowest_in_flight(self) -> int | None:
        """pkt_id of the lowest message in flight (None when none is)."""
        ids = self._inflight_ids
        while ids:
            pkt_id, j = ids[0]
            if self._inflight[j] is not None and not self._lost[j] and self._current(pkt_id, j):
                return pkt_id
            heapq.heappop(ids)  # its result came, or it was presumed lost
        return None

    def _send_ready(self, now: float) -> None:
        """Send ready messages, lowest pkt_id first, while the window has room.

        Past the window, the lowest ready message still goes out when it is the
        lowest unfinished one (lower than all in flight): without it in flight
        every rank could be waiting for messages that wait for it.
        """
        ready = self._ready
        allowed = self.s.window.allowed(self.width)
        while ready:
            pkt_id, j = ready[0]
            if not self._current(pkt_id, j) or (self._inflight[j] is not None
                                                and not self._lost[j]):
                heapq.heappop(ready)  # a lost message whose result came after all
                continue
            if self.inflight_count >= allowed:
                lowest = self._lowest_in_flight()
                if lowest is not None and lowest < pkt_id:
                    return
            heapq.heappop(ready)
            heapq.heappush(self._inflight_ids, (pkt_id, j))
            if self._lost[j]:
                self._resend(j, now)
            else:
                self._send(j, now)

    def _resend(self, j: int, now: float) -> None:
        """Send a message presumed lost again (its query), with a longer timeout."""
        self._lost[j] = False
        self._copy[j] = SENT
        self._backoff[j] += 1
        self.inflight_count += 1
        self._sent_at[j] = now
        self._deadline[j] = now + self.s.rtt.rto(self._backoff[j])
        self._number_send(j)
        self._enqueue_probe(j, wire.KIND_QUERY)
        self.s.counters["retransmissions"] += 1

    # ------------------------------------------------------------ for subclasses
    def _mode(self, j: int) -> int:
        return self.mode

    def _send(self, j: int, now: float) -> None:
        s = self.s
        count = self._fill(j, self._round[j])
        wire.encode_header(s.packet_views[j], wire.KIND_CONTRIBUTION, self.dtype_code,
                           self._mode(j), s.slot_base + j, s.token, s.slot_msgs[j], self.seq,
                           self._round[j] * self.width + j, count, s.lanes, call=self.call)
        datagram = s.packet_views[j][: wire.packet_size(s.lanes, count)]
        self._inflight[j] = datagram
        self.inflight_count += 1
        self._sent_at[j] = now
        self._deadline[j] = now + s.rtt.rto(0)
        self._number_send(j)
        self._enqueue(j, datagram)

    def _fill(self, j: int, m: int) -> int:
        """Write lane records and values of message m of slot j; return the value count."""
        raise NotImplementedError

    def _result_fits(self, j: int, h: wire.Header, data) -> bool:
        raise NotImplementedError

    def _absorb(self, j: int, m: int, h: wire.Header, data) -> None:
        """Take the result of message m of slot j into the output."""
        raise NotImplementedError

    def _has_message(self, j: int) -> bool:
        """Whether slot j has a message left to send (after its latest result)."""
        raise NotImplementedError

    def _finish(self) -> None:
        """Complete the output once every slot is done."""
