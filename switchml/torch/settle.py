"""Settling through gloo the calls a switch left half-summed in place (failover.py).

A call summed in place holds, part by part, either its sum or the rank's input;
which parts, the worker says.  After the switch failed, every rank runs the same
steps here, in the same order, so that the collectives of the group's own gloo
group match: each part's sum goes from a rank that holds it to those that do
not, and gloo sums from the inputs the parts that no rank holds.

* ``settle_resumed``: a worker of one rank a host, whose parts are its chunks
  (``Worker.lost``; resume.py's two exchanges, through gloo instead of a new
  session of the switch);
* ``settle_segments``: ranks combined on their hosts, whose parts are the local
  stage's segments (``LocalStageWorker.copied_segments``);
* ``settle_parts``: a job over several switches, whose parts are a call's parts
  on each switch, each switch's settled as ``settle_resumed`` settles one's
  (``MultiSwitchWorker.part_states``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ..errors import SwitchMLError
from ..worker.multi import PartState
from ..worker.resume import Lost, ResumeError, settle

#: Local-stage segments whose sums a rank keeps after a call ends: a host behind
#: can lack at most the last two (a host's ranks copy out segment s - 2 before
#: they combine segment s, and no call ends anywhere before every host combined
#: its last segment).
KEPT_SEGMENTS = 2
#: A segment of a call on one rank: its input intact, its sum held, or neither (a
#: call the rank had ended, of which it did not keep that segment).
INPUT, SUM, NEITHER = 0, 1, 2


class Ranks:
    """The collectives of a gloo group of ``size`` ranks that nothing else uses."""

    def __init__(self, gloo, rank: int, size: int):
        self.gloo, self.rank, self.size = gloo, rank, size

    def rows(self, values: list[int]) -> list[list[int]]:
        """Every rank's ``values`` (the same length on each)."""
        mine = torch.tensor(values, dtype=torch.int64)
        everyone = [torch.zeros(len(values), dtype=torch.int64) for _ in range(self.size)]
        self.gloo.allgather([everyone], [mine]).wait()
        return [t.tolist() for t in everyone]

    def minimum(self, value: int) -> int:
        mine = torch.tensor([value], dtype=torch.int64)
        opts = dist.AllreduceOptions()
        minimum: Any = dist.ReduceOp.MIN  # (torch's stubs type the member apart)
        opts.reduceOp = minimum
        self.gloo.allreduce([mine], opts).wait()
        return int(mine.item())

    def sum(self, array: np.ndarray) -> None:
        """``array`` summed over the ranks, in place."""
        self.gloo.allreduce([torch.from_numpy(array)]).wait()

    def broadcast(self, array: np.ndarray, source: int) -> None:
        self.gloo.broadcast(torch.from_numpy(array), source).wait()

    def sum_parts(self, flat: np.ndarray, spans: list[slice]) -> None:
        """The parts ``spans`` of ``flat`` summed over the ranks, in place."""
        if sum(s.stop - s.start for s in spans) == flat.size:
            self.sum(flat)
            return
        part = np.concatenate([flat[s] for s in spans])
        self.sum(part)
        at = 0
        for s in spans:
            flat[s] = part[at:at + s.stop - s.start]
            at += s.stop - s.start


def _held_from_peers(ranks: Ranks, lost: Lost, at: int, behind: int, ahead: bool,
                     what: str) -> list[slice] | None:
    """resume.py's two exchanges, through gloo: the chunks any rank holds of the
    call in flight (this rank's call ``at``; ``what``: call ``behind``, the
    earliest, in words) then held by every rank; the spans of it that gloo is to
    sum (no rank held them, or an inf or NaN held them back), None: all of it (its
    array untouched, or none in flight).  The same on every rank at the same call,
    and where some are ``ahead`` (at ``behind + 1``), nothing left behind and
    nothing summed ahead, or every rank raises."""
    def exchange(values: np.ndarray) -> np.ndarray:
        summed = values.copy()
        ranks.sum(summed)
        return summed

    try:
        _, left = settle(lost, exchange, ranks.size, unable=False)
    except ResumeError as exc:
        raise SwitchMLError(f"{what} cannot be settled: {exc}") from None
    ledger = lost.ledger if lost.in_call else None
    spans: list[slice] | None = None
    if ledger is not None:
        chunks = sorted(set(left) | lost.nonfinite)
        if len(chunks) < ledger.chunks:
            spans = [ledger.span(c) for c in chunks]
    # what each rank does next, the same wherever ranks stand at the same call
    rows = ranks.rows([at, -1 if spans is None else sum(s.stop - s.start for s in spans)])
    if ahead and (any(row[1] != 0 for row in rows if row[0] == behind)
                  or any(row[1] != -1 for row in rows if row[0] > behind)):
        # the ranks behind end call `behind` here, those ahead sum their call whole
        raise SwitchMLError(f"{what} is on no rank whole after the switch went away "
                            f"({rows})")
    if len({tuple(row) for row in rows if row[0] == at}) > 1:
        raise SwitchMLError(f"ranks at call {at} disagree on what is left of {what}: "
                            f"{rows}")
    return spans


def settle_resumed(ranks: Ranks, name: str, first: int, behind: int, ahead: bool,
                   lost: Lost, flat: np.ndarray) -> bool | None:
    """Call ``first`` of this rank (``flat``, in place) after its worker lost the
    switch (``lost``), the earliest first failed call of any rank being ``behind``
    (``ahead``: some rank's is ``behind + 1``).  None: nothing of it was summed
    anywhere, gloo is to sum it whole; else it holds its sum, and True says gloo
    summed some of it."""
    spans = _held_from_peers(ranks, lost, first, behind, ahead, f"{name}: call {behind}")
    if spans is None:
        return None
    if spans:
        ranks.sum_parts(flat, spans)
    return bool(spans)


def settle_segments(ranks: Ranks, name: str, index: int, segment: int,
                    flat: np.ndarray | None, copied: int, kept: dict,
                    kept_size: int) -> bool:
    """Call ``index`` after a local stage's failure, on every rank alike: each
    segment's sum goes from a rank that holds it to those that do not, and gloo
    sums the segments no rank holds from the inputs.  ``flat``: this rank's call,
    in place, whose first ``copied`` segments hold the sum (None: the call ended
    here, and only ``kept``, {segment: its sum}, is left of it, of a call of
    ``kept_size`` elements, -1 if none).  Returns whether gloo summed some."""
    if flat is not None:
        n, dtype = flat.size, flat.dtype
    else:
        n = kept_size
        dtype = next(iter(kept.values())).dtype if kept else np.dtype(np.float32)
    known = ranks.rows([n, int(dtype == np.int32)])
    n = max(row[0] for row in known)
    if n < 0 or len({tuple(row) for row in known if row[0] != -1}) > 1:
        raise SwitchMLError(f"{name}: after the switch went away the ranks hold call "
                            f"{index} as (elements, int32) {known}")
    dtype = np.dtype(np.int32 if max(row[1] for row in known) else np.float32)
    units = -(-n // segment)
    if flat is None:
        mine = [SUM if t in kept else NEITHER for t in range(units)]
    else:
        mine = [SUM if t < copied else INPUT for t in range(units)]
    states = ranks.rows(mine) if units else [[] for _ in range(ranks.size)]
    summed: list[slice] = []
    for t in range(units):
        span = slice(t * segment, min(n, (t + 1) * segment))
        column = [states[r][t] for r in range(ranks.size)]
        if SUM not in column:
            if NEITHER in column:
                raise SwitchMLError(f"{name}: segment {t} of call {index} is summed "
                                    "nowhere and its inputs are gone")
            summed.append(span)
        elif column.count(SUM) < ranks.size:
            source = column.index(SUM)
            if flat is not None:
                place = flat[span]
            elif ranks.rank == source:
                place = kept[t]
            else:
                place = np.empty(span.stop - span.start, dtype)
            ranks.broadcast(place, source)
    if summed and flat is not None:  # (no rank ended the call: all have their inputs)
        ranks.sum_parts(flat, summed)
    return bool(summed)


@dataclass
class PartsPlan:
    """What is left to sum of the calls a job over several switches failed, after
    ``settle_parts``: on switch k, the parts of calls before ``behind[k]`` hold
    their sums on every rank; that call's part does too where ``filled[k]``, else
    gloo sums its spans ``left[k]`` (from the part's start; None: all of it); the
    parts of later calls hold their inputs on every rank.  ``firsts``: each rank's
    first failed call; ``through``: the last call any rank queued on the switches."""

    behind: list[int]
    filled: list[bool]
    left: list[list[slice] | None]
    firsts: list[int]
    through: int

    def spans(self, index: int, parts: list[tuple[int, int, int]]) -> list[slice]:
        """What gloo sums of call ``index``, whose parts are ``parts`` (k, start, stop)."""
        spans: list[slice] = []
        for k, start, stop in parts:
            if index < self.behind[k] or (index == self.behind[k] and self.filled[k]):
                continue
            left = self.left[k] if index == self.behind[k] else None
            if left is None:
                spans.append(slice(start, stop))
            else:
                spans += [slice(start + s.start, start + s.stop) for s in left]
        return spans


#: ``settle_parts``' flags of a switch's state on a rank
_LOST, _SPARSE, _WHOLE, _INT32 = 1, 2, 4, 8


def settle_parts(ranks: Ranks, name: str, first: int, through: int,
                 states: list[PartState], array_of) -> PartsPlan:
    """A job over several switches, after it failed (every rank alike, at its first
    failed call ``first``; ``through``: the last call it queued there): on each
    switch, the ranks a part ahead give the part's last messages (a sparse part:
    its whole sum) to those that lack them, as on one switch; ``states``: this
    rank's ``PartState``s, their calls numbered as ``first``; ``array_of(i)``: call
    i's array (flat), for the calls this rank has not ended.  Returns the plan of
    what gloo sums of each call."""
    mine = [first, through]
    for st in states:
        lost = st.lost
        state = 0
        if lost is not None:
            int32 = any(a is not None and a.dtype == np.int32 for a in (lost.whole, lost.out))
            state = (_LOST | (_SPARSE if lost.in_call and lost.sparse else 0)
                     | (_WHOLE if lost.whole is not None else 0) | (_INT32 if int32 else 0))
        size = st.stop - st.start if st.start is not None and st.stop is not None else -1
        mine += [st.call, state, size]
    rows = ranks.rows(mine)
    firsts = [row[0] for row in rows]
    plan = PartsPlan([], [], [], firsts, max(row[1] for row in rows))
    for k, st in enumerate(states):
        calls = [row[2 + 3 * k] for row in rows]
        flags = [row[3 + 3 * k] for row in rows]
        sizes = [row[4 + 3 * k] for row in rows]
        behind = min(calls)
        ahead = [r for r, c in enumerate(calls) if c > behind]
        if not all(f & _LOST for f in flags):
            raise SwitchMLError(
                f"{name}: ranks {[r for r, f in enumerate(flags) if not f & _LOST]} kept no "
                f"account of what their part on switch {k + 1} held (lost again while "
                "resuming it, or in the follow-up exchange for infinities and NaNs): the "
                "calls cannot be settled")
        plan.behind.append(behind)
        plan.filled.append(bool(ahead))
        wholes = [r for r in ahead if flags[r] & _WHOLE]
        if ahead and wholes:  # the part summed apart from its array: its whole sum
            dtype = np.dtype(np.int32 if any(f & _INT32 for f in flags) else np.float32)
            _broadcast_whole(ranks, st, behind, wholes[0], max(sizes), dtype, array_of)
            plan.left.append(None)
        elif not ahead and any(f & _SPARSE for f in flags):
            plan.left.append(None)  # summed apart: every rank's array holds its input
        else:
            plan.left.append(_held_from_peers(  # as settle_resumed settles a call
                ranks, st.lost, st.call, behind, bool(ahead),
                f"{name}: the part on switch {k + 1} of call {behind}"))
    return plan


def _broadcast_whole(ranks: Ranks, st: PartState, behind: int, source: int, size: int,
                     dtype: np.dtype, array_of) -> None:
    """Part ``behind``'s whole sum (``size`` values of ``dtype``), from ``source`` (a
    rank ahead that kept it) to every rank: into the part's array where it holds
    the input."""
    if st.call == behind:
        assert st.start is not None and st.stop is not None
        place = array_of(behind)[st.start:st.stop]
    elif ranks.rank == source:
        place = st.lost.whole
    else:
        place = np.empty(size, dtype)
    ranks.broadcast(place, source)
