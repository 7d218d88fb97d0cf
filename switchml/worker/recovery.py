"""Retransmission timeout from measured round trips (RFC 6298 style, in seconds)."""

from __future__ import annotations


class RttEstimator:
    """Smoothed RTT and the retransmission timeout derived from it."""

    def __init__(self, initial_rto: float = 0.05, min_rto: float = 0.01, max_rto: float = 1.0):
        self.min_rto = min_rto
        self.max_rto = max_rto
        self.srtt: float | None = None
        self.rttvar = 0.0
        self._rto = initial_rto

    def add_sample(self, rtt: float) -> None:
        if self.srtt is None:
            self.srtt, self.rttvar = rtt, rtt / 2
        else:
            self.rttvar = 0.75 * self.rttvar + 0.25 * abs(self.srtt - rtt)
            self.srtt = 0.875 * self.srtt + 0.125 * rtt
        self._rto = self.srtt + 4 * self.rttvar

    def rto(self, backoff: int = 0) -> float:
        """Timeout for a packet already retransmitted ``backoff`` times."""
        return min(self.max_rto, max(self.min_rto, self._rto) * (2 ** backoff))
