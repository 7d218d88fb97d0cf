"""Resuming a job's calls on a restarted switch, sans-IO (docs/protocol.md,
"A switch that restarts").

A switch that dies takes its slots with it: what its ranks know is what they
absorbed.  On a slot, a rank sends message m+1 only once it has message m's
result, and message m+1's result needs every rank's message m+1: so on each slot
the ranks' message numbers (``MembershipState.slot_msgs``) differ by at most one.
The ranks ahead on a slot hold the result of the one message the others lack;
no rank holds a result beyond it.  After the rejoin, two exchanges on the new
session settle it, and the call goes on from what everyone has:

1. ``positions``: each rank's message number on each of the old session's slots,
   as counts per residue mod 4 (a number and its successor, even across the
   wrap of 32 bits, are two neighbouring residues): which slots some ranks are
   ahead on, and how many ranks are;
2. ``transfer``: for each such slot, the ahead ranks contribute the exact bits of
   the chunk that message carried (high and low 16 bits as two int32 words, and
   a flag for a chunk held back as non-finite), the others zeros.  The sum over
   the ahead ranks, divided by their number, is those bits exactly: every rank
   that absorbed a result holds the same bits.

Then every rank holds the same chunks of its call, and the rest (what no rank
absorbed, whose inputs are intact also in place) is summed again from the
inputs, chunk boundaries kept: the same exponents, quantisation and integer
sums, so the same bits.  A rank ahead may have returned from the call (its
last messages' results); it keeps a copy of the chunks of those last messages,
one a slot (``Kept``), until the next call.

``settle`` runs both exchanges through any int32 sum over the ranks: the new
session's, or, when no switch comes back, the torch backend's gloo group
(torch/failover.py), which then sums the rest from the inputs itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ..errors import SwitchMLError

__all__ = ["CallLedger", "Kept", "Lost", "positions", "ahead_slots", "transfer",
           "take_transfer", "settle", "ResumeError"]

WRAP = 1 << 32
#: Residue classes of message numbers that ``positions`` counts.
CLASSES = 4


class ResumeError(SwitchMLError):
    """The ranks' states after a switch restart do not fit together (a sparse call
    in flight, or positions no run of the protocol gives): the call is not resumed."""


@dataclass
class CallLedger:
    """Which message of which slot carried which chunk of one dense call.

    ``start``: the membership's message numbers of the call's slots when it began;
    ``lag``: 1 for float calls (message 0 of a slot only seeds the exponent).
    """

    size: int
    chunk_values: int
    width: int
    lag: int
    start: list[int]

    @classmethod
    def of(cls, op, src: np.ndarray, start) -> CallLedger:
        """The ledger of dense call ``op`` of ``src``, begun at message numbers ``start``."""
        return cls(src.size, op.chunk_values, op.width, 1 if src.dtype == np.float32 else 0,
                   list(start[:op.width]))

    @property
    def chunks(self) -> int:
        return -(-self.size // self.chunk_values)

    def messages(self, j: int) -> int:
        """Messages slot ``j`` carries in this call."""
        return (self.chunks - j + self.width - 1) // self.width + self.lag

    def round_of(self, j: int, number: int) -> int | None:
        """The call's round of message ``number`` on slot ``j``; None: not this call's."""
        if j >= self.width:
            return None
        m = (number - self.start[j]) % WRAP
        return m if m < self.messages(j) else None

    def chunk(self, j: int, m: int) -> int | None:
        """The chunk round ``m`` of slot ``j`` carries (None: an exponent seed)."""
        return j + (m - self.lag) * self.width if m >= self.lag else None

    def span(self, c: int) -> slice:
        k = self.chunk_values
        return slice(c * k, min((c + 1) * k, self.size))

    def remaining(self, slot_msgs) -> list[int]:
        """Chunks whose results no rank has, given every rank's message numbers
        ``slot_msgs`` (the same on every rank by now), in order."""
        left: list[int] = []
        for j in range(self.width):
            rounds = (slot_msgs[j] - self.start[j]) % WRAP
            if rounds > self.messages(j):
                raise ResumeError(f"slot {j} is {rounds} messages into a call of "
                                  f"{self.messages(j)}")
            first = max(rounds, self.lag) - self.lag
            left += range(j + first * self.width, self.chunks, self.width)
        return sorted(left)


@dataclass
class Kept:
    """A finished call's last message a slot: their chunks' values (what a rank
    ahead gives the others when the switch dies before they all have them)."""

    ledger: CallLedger
    values: dict[int, np.ndarray] = field(default_factory=dict)
    nonfinite: set[int] = field(default_factory=set)
    #: The values side by side (``values`` are views of it).
    storage: np.ndarray | None = None

    @classmethod
    def of(cls, ledger: CallLedger, out: np.ndarray, nonfinite,
           replaced: Kept | None = None) -> Kept:
        """The last chunks of the call that wrote ``out``; in the storage of
        ``replaced`` (the call before's, no longer needed) where it fits, so that a
        steady state of calls allocates none."""
        flat = out.reshape(-1)
        chunks = [c for c in (ledger.chunk(j, ledger.messages(j) - 1)
                              for j in range(ledger.width)) if c is not None]
        pieces = [flat[ledger.span(c)] for c in chunks]
        need = sum(piece.size for piece in pieces)
        spare = replaced.storage if replaced is not None else None
        storage = (spare if spare is not None and spare.dtype == flat.dtype
                   and need <= spare.size <= 2 * need else np.empty(need, flat.dtype))
        kept = cls(ledger, nonfinite=set(nonfinite), storage=storage)
        at = 0
        for c, piece in zip(chunks, pieces):
            kept.values[c] = storage[at:at + piece.size]
            np.copyto(kept.values[c], piece)
            at += piece.size
        return kept


def positions(slot_msgs, unable: bool) -> np.ndarray:
    """This rank's contribution to the first exchange: per slot a one-hot of its
    message number mod 4, then 1 if it cannot resume (a sparse call)."""
    out = np.zeros(len(slot_msgs) * CLASSES + 1, np.int32)
    for j, n in enumerate(slot_msgs):
        out[j * CLASSES + n % CLASSES] = 1
    out[-1] = int(unable)
    return out


def ahead_slots(sums: np.ndarray, world_size: int) -> dict[int, tuple[int, int]]:
    """From the summed ``positions``: {slot: (residue of the ranks ahead, how many)}
    for each slot the ranks are not level on."""
    if sums[-1]:
        raise ResumeError(f"{int(sums[-1])} rank(s) had a sparse call in flight")
    out = {}
    for j in range(len(sums) // CLASSES):
        counts = sums[j * CLASSES:(j + 1) * CLASSES]
        present = [c for c in range(CLASSES) if counts[c]]
        if sum(int(v) for v in counts) != world_size or len(present) > 2:
            raise ResumeError(f"slot {j}: message numbers {counts.tolist()} by residue")
        if len(present) == 2:
            low, high = present
            if high == low + 1:
                ahead = high
            elif (low, high) == (0, CLASSES - 1):
                ahead = 0
            else:
                raise ResumeError(f"slot {j}: message numbers two apart")
            out[j] = (ahead, int(counts[ahead]))
    return out


def _holding(slot_msgs, j: int, residue: int, current: CallLedger | None,
             kept: Kept | None) -> tuple[bool, CallLedger, int | None]:
    """About the message slot ``j`` lacks on some ranks: whether this rank is
    ahead, the ledger of the call the message belongs to, the chunk it carried
    (None: an exponent seed)."""
    mine = slot_msgs[j]
    ahead = mine % CLASSES == residue
    number = (mine - 1) % WRAP if ahead else mine
    ledgers = ([current] if current else []) + ([kept.ledger] if ahead and kept else [])
    for ledger in ledgers:
        m = ledger.round_of(j, number)
        if m is not None and (ledger is current or m == ledger.messages(j) - 1):
            return ahead, ledger, ledger.chunk(j, m)
    raise ResumeError(f"slot {j}: message {number} is in no call this rank knows")


def transfer(slot_msgs, behind: dict, current: CallLedger | None, out: np.ndarray | None,
             current_nonfinite, kept: Kept | None) -> np.ndarray:
    """This rank's contribution to the second exchange: per slot in ``behind``
    (``ahead_slots``), a flag word and the chunk's bits as high then low halves
    (the ranks ahead), or zeros of that length (the others)."""
    parts = []
    for j in sorted(behind):
        ahead, ledger, c = _holding(slot_msgs, j, behind[j][0], current, kept)
        if c is None:
            continue  # an exponent seed: no chunk, no words
        span = ledger.span(c)
        n = span.stop - span.start
        words = np.zeros(1 + 2 * n, np.int32)
        if ahead:
            if ledger is current:
                assert out is not None
                bits = out.reshape(-1)[span].view(np.uint32)
                nonfinite = c in current_nonfinite
            else:
                assert kept is not None
                bits = kept.values[c].view(np.uint32)
                nonfinite = c in kept.nonfinite
            words[0] = int(nonfinite)
            words[1:1 + n] = (bits >> 16).astype(np.int32)
            words[1 + n:] = (bits & 0xFFFF).astype(np.int32)
        parts.append(words)
    return np.concatenate(parts) if parts else np.zeros(0, np.int32)


def take_transfer(sums: np.ndarray, slot_msgs: list, behind: dict,
                  current: CallLedger | None, out: np.ndarray | None, nonfinite: set,
                  kept: Kept | None) -> None:
    """Apply the summed second exchange: the ranks behind write the chunks they
    lacked into ``out`` (or add them to ``nonfinite``); every rank's
    ``slot_msgs`` then stand where the ranks ahead were."""
    at = 0
    for j in sorted(behind):
        residue, count = behind[j]
        ahead, ledger, c = _holding(slot_msgs, j, residue, current, kept)
        if not ahead:
            slot_msgs[j] = (slot_msgs[j] + 1) % WRAP
        if c is None:
            continue
        span = ledger.span(c)
        n = span.stop - span.start
        words = sums[at:at + 1 + 2 * n].astype(np.int64)
        at += 1 + 2 * n
        if ahead:
            continue
        if words[0] // count:
            nonfinite.add(c)
            continue
        high = (words[1:1 + n] // count).astype(np.uint32)
        low = (words[1 + n:] // count).astype(np.uint32)
        assert out is not None
        out.reshape(-1)[span] = ((high << 16) | low).view(out.dtype)
    if at != len(sums):
        raise ResumeError(f"the second exchange has {len(sums)} words, not {at}")


@dataclass
class Lost:
    """What a rank holds of its job when the switch went away: its message numbers
    on the old session's slots, the last call's ``Kept``, and the call in flight
    (``ledger``, ``out`` and its held-back ``nonfinite`` chunks; no ledger: none in
    flight, or a sparse one, ``sparse``), and ``in_call``.  ``whole``: the last call's whole sum,
    where that call was sparse and summed apart from its caller's array."""

    numbers: list[int]
    kept: Kept | None
    ledger: CallLedger | None = None
    out: np.ndarray | None = None
    nonfinite: set[int] = field(default_factory=set)
    sparse: bool = False
    whole: np.ndarray | None = None
    #: whether the call in flight is the caller's own (not a measurement before it,
    #: whose arrays are the worker's: the caller's are then untouched)
    in_call: bool = False


def settle(lost: Lost, exchange: Callable[[np.ndarray], np.ndarray], world_size: int,
           unable: bool) -> tuple[int, list[int]]:
    """Both exchanges, through ``exchange`` (an int32 sum over every rank): every
    rank then holds the chunks any rank held.  Returns the number of slots where
    ranks were a message apart and the chunks of the call in flight that no rank
    has (their inputs intact, in order).  ``unable``: this rank cannot take part
    (every rank then raises ``ResumeError``)."""
    sums = exchange(positions(lost.numbers, unable))
    behind = ahead_slots(sums, world_size)
    if behind:
        mine = transfer(lost.numbers, behind, lost.ledger, lost.out, lost.nonfinite, lost.kept)
        sums = exchange(mine) if mine.size else mine
        take_transfer(sums, lost.numbers, behind, lost.ledger, lost.out, lost.nonfinite,
                      lost.kept)
    left = lost.ledger.remaining(lost.numbers) if lost.ledger is not None else []
    return len(behind), left
