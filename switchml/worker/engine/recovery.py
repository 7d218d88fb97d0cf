"""Loss recovery and congestion control of a worker's stream (times in seconds).

``RttEstimator``: smoothed RTT and the retransmission timeout (RFC 6298).
``CongestionWindow``: how many messages a worker keeps in flight (AIMD).
"""

from __future__ import annotations

import math

#: Results of messages sent after a message still unanswered that make it
#: presumed lost and sent again at once (fast retransmit, stream.py), as TCP's
#: three duplicate ACKs (RFC 5681): slots complete roughly in send order, but
#: not exactly (ranks out of step, a host descheduled between datagrams, the
#: switch's batches), and one or two results overtaking a message is such
#: reordering far more often than a loss; three keeps spurious fast
#: retransmissions rare (each is counted, and its window decrease undone, as a
#: premature timeout's) while recovering a loss within about a round trip
#: instead of a timeout (at least 10 ms).
FAST_RETRANSMIT_THRESHOLD = 3

#: The most results that may overtake a message before it counts as lost, as
#: the reordering a membership learns can raise the threshold above (TCP's
#: reordering metric, RFC 4737's degree: Linux raises its dupthresh the same
#: way).  Aggregation reorders more than a network does: a slot's result comes
#: when its last rank's contribution arrives, and ranks whose windows differ
#: send their ready messages in different orders, so a fixed threshold of 3
#: resends messages that were only overtaken, never lost, and each such copy
#: costs a datagram and a window decrease.  A fast retransmission whose
#: original's result comes back before any round trip could have answered the
#: copy (spurious) raises the threshold past the results that overtook it, up
#: to this bound, half the default window of 32: a loss is then still found by
#: the results of the window's other half, before the tail probe's 2 round trips.
MAX_REORDERING = 16

#: Probes (stream.py): what no timeout need wait for.  A message in flight is
#: sent again once ``TAIL_PROBE_ROUND_TRIPS`` smoothed round trips plus
#: ``TAIL_PROBE_MARGIN`` passed with no result at all since it went out (TCP's
#: tail loss probe, RFC 8985: 2 SRTT): with no result coming, none of a later
#: message will reveal its loss (a call's last messages).  A fast
#: retransmission is probed ``COPY_PROBE_ROUND_TRIPS`` smoothed round trips
#: plus 4 deviations (the RTO's, RFC 6298) plus the margin after it went out,
#: results or not: it is not fast-retransmitted again, and its loss (or its
#: result's, or a peer's copy's) would wait for the timer, 10 ms.  So many
#: round trips because every rank's copy must reach the switch, and the ranks
#: see a loss at different times (their windows, hence their send orders,
#: differ), behind a queue the copies share: a copy probed sooner is most often
#: one merely late, and where the path reorders a fixed number of round trips
#: probes nearly every copy; the deviations scale the wait with that jitter.
#: The margin (0.25 ms, the window's QUEUE_MARGIN) is for ranks out of step.
TAIL_PROBE_ROUND_TRIPS = 2
COPY_PROBE_ROUND_TRIPS = 8
TAIL_PROBE_MARGIN = 0.00025


class RttEstimator:
    """Smoothed RTT, the minimum RTT seen, and the retransmission timeout derived from them.

    ``min_rto`` is 10 ms, the reference's retransmission timer: a LAN round trip
    is tens of microseconds, but on a loaded host a process waits for a core for
    milliseconds, and a timeout below that retransmits packets that were never
    lost (counted as ``spurious_retransmissions``).  ``initial_rto`` (50 ms)
    holds until the first sample.

    A timeout that proves premature (the original's result comes sooner after the
    timer's copy than any round trip) doubles the RTO of the messages sent after
    it too (``kept_backoff``, at most ``MAX_KEPT_BACKOFF`` times), until one of
    them answers in time, as TCP keeps its backed-off RTO until a new sample
    (RFC 6298, 5.5 and 5.7).  Without it the estimate is censored: Karn takes no
    sample from a message that timed out, so the longest round trips never reach
    it, and where they are common the RTO stays below them: messages time out
    again and again where no datagram was lost, each timeout a copy and a
    window decrease.  Only proven premature timeouts: backing off after every
    timeout would slow the recovery of real losses.
    """

    #: The most doublings a timeout leaves on the RTO of later messages.
    MAX_KEPT_BACKOFF = 3

    def __init__(self, initial_rto: float = 0.05, min_rto: float = 0.01, max_rto: float = 1.0):
        self.min_rto = min_rto
        self.max_rto = max_rto
        self.srtt: float | None = None
        self.rttvar = 0.0
        self.min_rtt = math.inf
        self._rto = initial_rto
        self.kept_backoff = 0
        self._kept_since = -math.inf  # when a timeout last raised kept_backoff

    #: What a compiled engine reads (``state``) and writes back (``restore``), by name:
    #: a field the C core keeps too is listed here and read there by this name.
    STATE = ("srtt", "rttvar", "min_rtt", "_rto", "min_rto", "max_rto", "kept_backoff",
             "_kept_since")

    def state(self) -> dict:
        """The estimator's fields by name (``srtt`` None before the first sample)."""
        return {name: getattr(self, name) for name in self.STATE}

    def restore(self, state: dict) -> None:
        """Take back the fields ``state`` names (a compiled engine's export)."""
        for name, value in state.items():
            if name not in self.STATE:
                raise KeyError(f"RttEstimator has no state field {name!r}")
            setattr(self, name, value)

    def add_sample(self, rtt: float, sent_at: float = math.inf) -> None:
        """An unambiguous RTT sample, of a message sent at ``sent_at``."""
        if sent_at >= self._kept_since:  # it had the backed-off RTO, and answered in time
            self.kept_backoff = 0
        if self.srtt is None:
            self.srtt, self.rttvar = rtt, rtt / 2
        else:
            self.rttvar = 0.75 * self.rttvar + 0.25 * abs(self.srtt - rtt)
            self.srtt = 0.875 * self.srtt + 0.125 * rtt
        self.min_rtt = min(self.min_rtt, rtt)
        self._rto = self.srtt + 4 * self.rttvar

    def on_premature_timeout(self, sent_at: float, now: float) -> None:
        """A timeout proved premature (the timer's copy, sent at ``sent_at``, was
        answered at ``now`` sooner than any round trip): later messages wait twice as
        long, once per such event (only a copy sent after the last doubling doubles
        again), until one answers in time."""
        if sent_at >= self._kept_since:
            self.kept_backoff = min(self.kept_backoff + 1, self.MAX_KEPT_BACKOFF)
            self._kept_since = now

    def rto(self, backoff: int = 0) -> float:
        """Timeout for a packet already retransmitted ``backoff`` times."""
        return min(self.max_rto,
                   max(self.min_rto, self._rto) * (2 ** (backoff + self.kept_backoff)))


class CongestionWindow:
    """Messages a worker may keep in flight: AIMD on retransmission timeouts, as ATP,
    with the decrease gated on queueing evidence.

    Why AIMD and not a delay target (Swift): the software switch's round trip is
    dominated by host scheduling (two workers and a switch sharing cores see
    RTTs jump by milliseconds with no queue anywhere), so a delay target would
    read CPU noise as congestion and starve; a lost datagram is a clear signal,
    and AIMD converges to fair shares between jobs sharing a queue without any
    common target to configure.

    * Slow start: ``initial`` messages (a few packets: a new job does not dump
      its whole window into a queue of unknown size), +1 per result, i.e. the
      window doubles every round trip, up to ``ssthresh``, until the first
      loss or a delay signal: a round trip over twice the least one seen plus
      ``DELAY_MARGIN`` (queues are building; the margin keeps scheduling
      noise from ending it).
    * Congestion avoidance: +1/cwnd per result, one message per round trip.
    * A retransmission timeout halves the window, at most once per round trip
      (only a message sent after the last decrease can cause the next one:
      several losses of one window are one congestion event), unless the path
      shows no queue: then the loss was random (a lossy link), the message is
      resent and the window kept (``random_losses``).  Halving on every loss
      would hold the window near its floor on a lossy link with no queue at
      all, where a loss costs only its retransmission.
      Queueing evidence is per round trip: the least RTT sample of a round
      trip (the results that come until one of a message sent after it began)
      over ``QUEUE_FACTOR`` times the least RTT ever seen plus ``QUEUE_MARGIN`` means a standing
      queue that held every packet.  The least, not srtt, the mean or the
      last sample: in an aggregation a loss on another rank's link holds this
      rank's result back by a timeout, and a descheduled host delays some
      results, but neither delays a whole round trip of them, while a queue
      that overflows (a switch port's buffer, shallow: 256 KiB is 2 ms at
      1 Gbit/s) delays everything that got through it.  The least filters the
      noise slow start's single samples need ``DELAY_MARGIN`` (1 ms) for; with
      it, a queue shorter than the least RTT + 1 ms would never be seen.  The
      0.25 ms margin is for ranks out of step (one waits at the switch for
      another's contribution).  A timeout is random when the last round trip
      showed no queue and either ended after the message was sent, or the
      message timed out for the first time.  Otherwise, in particular when no
      round trip ended since a retransmission went out (every result lost, or
      all retransmissions, which give no sample: congestion so heavy that no
      sample survives), or none ever did, it counts as congestion: the window
      still comes down, at most once per round trip, as the RTO backs off.
      What it costs: a queue shorter than that (half the least RTT + 0.25 ms; at
      10 Gbit/s 256 KiB is 0.2 ms) is not seen, and only the silence rule backs
      off its losses.
    * A fast retransmission (stream.py: a message overtaken by the results of
      ``FAST_RETRANSMIT_THRESHOLD`` later ones) is a loss as a timeout is, the
      same ``on_timeout``, with ``retries`` 0: the results that overtook it show
      the path is not silent.  A later timeout of the message counts the
      timer's retransmissions only.
    * A probe (stream.py: a message sent again after round trips without its
      result, see ``TAIL_PROBE_ROUND_TRIPS``) is no loss for the window:
      silence says nothing of a queue.  The timeout that may follow it is one,
      counted as the timer's.
    * A timeout that proves premature (its result comes sooner after the
      retransmission than any round trip) takes its decrease back, as Eifel
      does (RFC 4015): on a loaded host a late result is no sign of a full queue.
    * A datagram this host's own queue toward the network refuses
      (``on_local_refusal``: ENOBUFS, where the host's link is the bottleneck)
      halves the window, at most once per smoothed round trip, as TCP enters
      CWR when its own qdisc drops a segment: nothing was lost (the sender
      waits for room and sends it), but the queue is full.  Where a host's
      uplink is shared with a TCP flow, that queue is the one they share; the
      kernel drops datagrams silently otherwise, and every such loss cost a
      retransmission and a timer (2% of a call's datagrams beside one CUBIC
      flow on the testbed).
    * It grows only while it limits the sender (RFC 7661): a stream of small
      calls that never fills it does not inflate it untested.

    ``cwnd`` is a float; a call keeps ``floor(min(cwnd, width))`` messages in
    flight, at least 1.  The window belongs to the ``Membership``: the next
    allreduce starts where the last one left off.
    """

    #: Seconds of extra round trip that end slow start (see above).
    DELAY_MARGIN = 0.001
    #: Seconds of extra least RTT of a round trip that mean a standing queue.
    QUEUE_MARGIN = 0.00025
    #: A round trip whose least sample is over this many least RTTs (plus the
    #: margin) showed a standing queue.  Not 2: where many ranks send into one
    #: port (16 workers into a switch server at 100 Mbit/s), the least RTT is
    #: already the time that port takes for one contribution from each, 10.7 ms
    #: at 8 KiB, and a full 256 KiB queue (21 ms) never doubles it: every loss
    #: would read as random and the windows never come down.
    QUEUE_FACTOR = 1.5
    #: What ``on_timeout`` did.
    SAME_EVENT, DECREASED, RANDOM_LOSS = 0, 1, 2

    def __init__(self, limit: int, initial: float = 4.0):
        self.limit = max(1, limit)
        self.cwnd = float(min(initial, self.limit))
        self.ssthresh = math.inf
        self._last_decrease = -math.inf  # time of the last halving
        self._undo: tuple | None = None  # (time, cwnd, ssthresh) before the last halving
        # Round trips of RTT samples: when the current one began, its least
        # sample, and when the last one that showed a queue / none ended.
        self._epoch_start = -math.inf
        self._epoch_min = math.inf
        self._queue_at = -math.inf
        self._clear_at = -math.inf

    #: What a compiled engine reads (``state``) and writes back (``restore``), by
    #: name; the margins are the class's settings, read only.
    STATE = ("cwnd", "ssthresh", "_last_decrease", "limit", "_undo", "_epoch_start",
             "_epoch_min", "_queue_at", "_clear_at", "DELAY_MARGIN", "QUEUE_MARGIN")

    def state(self) -> dict:
        """The window's fields by name (``_undo``: None, or (time, cwnd, ssthresh))."""
        return {name: getattr(self, name) for name in self.STATE}

    def restore(self, state: dict) -> None:
        """Take back the fields ``state`` names (a compiled engine's export)."""
        for name, value in state.items():
            if name not in self.STATE or name.isupper():
                raise KeyError(f"CongestionWindow has no writable state field {name!r}")
            setattr(self, name, tuple(value) if name == "_undo" and value is not None
                    else value)

    def allowed(self, width: int) -> int:
        """How many messages a call of ``width`` slots may have in flight."""
        return max(1, min(int(self.cwnd), width))

    def on_rtt_sample(self, rtt: float, min_rtt: float, sent_at: float, now: float) -> None:
        """An unambiguous sample: a message sent at ``sent_at`` answered at ``now``.
        Leave slow start when it says a queue builds up; close the round trip
        when the message was sent after it began."""
        if self.cwnd < self.ssthresh and rtt > 2 * min_rtt + self.DELAY_MARGIN:
            self.ssthresh = self.cwnd
        self._epoch_min = min(self._epoch_min, rtt)
        if sent_at >= self._epoch_start:
            if self._epoch_min > self.QUEUE_FACTOR * min_rtt + self.QUEUE_MARGIN:  # a queue
                self._queue_at = now
            else:
                self._clear_at = now
            self._epoch_start, self._epoch_min = now, math.inf

    def on_result(self, window_limited: bool) -> None:
        if not window_limited:
            return
        if self.cwnd < self.ssthresh:
            self.cwnd += 1.0
        else:
            self.cwnd += 1.0 / self.cwnd
        self.cwnd = min(self.cwnd, float(self.limit))

    def on_timeout(self, sent_at: float, now: float, retries: int = 0) -> int:
        """A message sent at ``sent_at`` (after ``retries`` earlier copies) timed out
        at ``now``: SAME_EVENT (the window was already halved for it), RANDOM_LOSS
        (kept) or DECREASED."""
        if sent_at < self._last_decrease:
            return self.SAME_EVENT  # of the window already halved for: the same congestion event
        if self._clear_at > self._queue_at and (self._clear_at > sent_at or retries == 0):
            return self.RANDOM_LOSS  # the last round trip showed no queue
        self._undo = (now, self.cwnd, self.ssthresh)
        self.ssthresh = max(1.0, self.cwnd / 2)
        self.cwnd = self.ssthresh
        self._last_decrease = now
        return self.DECREASED

    def on_local_refusal(self, now: float, rtt: float) -> bool:
        """This host's queue refused a datagram at ``now``: halve the window unless it
        came down less than ``rtt`` (the smoothed round trip) ago.  Returns whether it
        did.  Not undone: the refusal is certain."""
        if now - self._last_decrease < rtt:
            return False
        self._undo = None
        self.ssthresh = max(1.0, self.cwnd / 2)
        self.cwnd = self.ssthresh
        self._last_decrease = now
        return True

    def undo_decrease(self, decreased_at: float) -> None:
        """The timeout that halved the window at ``decreased_at`` was premature: take
        the halving back, unless a later one came since (then that one stands)."""
        if self._undo is not None and self._undo[0] == decreased_at:
            _, cwnd, ssthresh = self._undo
            self.cwnd, self.ssthresh = max(self.cwnd, cwnd), max(self.ssthresh, ssthresh)
            self._undo = None
