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
  stage's segments (``LocalStageWorker.copied_segments``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ..errors import SwitchMLError
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


def settle_resumed(ranks: Ranks, name: str, first: int, behind: int, ahead: bool,
                   lost: Lost, flat: np.ndarray) -> bool | None:
    """Call ``first`` of this rank (``flat``, in place) after its worker lost the
    switch (``lost``), the earliest first failed call of any rank being ``behind``
    (``ahead``: some rank's is ``behind + 1``).  None: nothing of it was summed
    anywhere, gloo is to sum it whole; else it holds its sum, and True says gloo
    summed some of it."""
    def exchange(values: np.ndarray) -> np.ndarray:
        summed = values.copy()
        ranks.sum(summed)
        return summed

    try:
        _, left = settle(lost, exchange, ranks.size, unable=False)
    except ResumeError as exc:
        raise SwitchMLError(f"{name}: the calls the switch left cannot be settled: "
                            f"{exc}") from None
    ledger = lost.ledger if lost.in_call else None
    spans: list[slice] | None = None  # None: the array untouched, gloo sums it whole
    if ledger is not None:
        chunks = sorted(set(left) | lost.nonfinite)
        if len(chunks) < ledger.chunks:
            spans = [ledger.span(c) for c in chunks]
    # what each rank does next, the same wherever ranks stand at the same call
    rows = ranks.rows([first, -1 if spans is None else sum(s.stop - s.start for s in spans)])
    if ahead and (any(row[1] != 0 for row in rows if row[0] == behind)
                  or any(row[1] != -1 for row in rows if row[0] > behind)):
        # the ranks behind end call `behind` here, those ahead sum their call whole
        raise SwitchMLError(f"{name}: call {behind}'s sum is on no rank whole after the "
                            f"switch went away ({rows})")
    if len({tuple(row) for row in rows if row[0] == first}) > 1:
        raise SwitchMLError(f"{name}: ranks at call {first} disagree on what is left of "
                            f"it: {rows}")
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
