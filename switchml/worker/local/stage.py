"""The local stage, sans-IO: a host's ranks combine their arrays in shared memory,
one rank per shard sends the host's partial sum through the switch, and every
rank copies the total back (docs/protocol.md, "Several ranks on one host").

A call is cut into segments of ``Layout.segment`` elements, and each segment
into ``Layout.shards`` shards at multiples of ``SHARD_ALIGN``.  For every
segment, in order, each rank of the host:

1. waits until the segment's slot is free (every rank copied out what it held,
   ``slots`` segments ago), copies its input into its area of the slot (an
   owner skips its own shard, which it reads from its input) and publishes
   ``copied_in``; at a call's first segment, it checks that every rank of the
   host makes the same call;
2. if it owns shard s: once every rank copied in, sums shard s of every area
   into the slot's result (``reduce_into``: float32 in float64, rounded once;
   int32 modulo 2**32), then either publishes ``reduced`` (one host) or
   ``Launch``es it through the switch (its host's partial sum against the other
   hosts'), whose completion publishes ``reduced``;
3. copies the previous segment's result out, once every owner reduced it,
   and publishes ``copied_out``.

So while shard s of segment t crosses the network, segment t+1 is summed and
queued behind it, and segment t-1 copied out: the switch always has the next
call waiting (measured on the testbed: 64 MiB as 16 calls queued back to back
took as long as one call).  Where a device copies the segments in and out
(``DeviceCopies``, a host that is the whole job), the copies of segment t+1 in
and of segment t-1 out run while segment t is summed.

A rank's calls are generators: they yield ``Wait`` (a counter of some ranks
must reach a target; the driver sleeps on the segment's futex, or a test's
scheduler runs another rank) and ``Launch`` (a shard to send; the driver
queues it on the rank's switch worker and publishes ``reduced`` when it is
back), and do the copies and sums themselves.  The real driver is
``worker.py``; tests/test_local.py runs hosts of ranks under a seeded
scheduler that interleaves them every way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

from ...errors import CallMismatchError
from ..multi import part_bounds
from . import memory
from .memory import R_CALL, R_COPIED_IN, R_COPIED_OUT, R_ELEMENTS, R_KIND, R_REDUCED, Layout

__all__ = ["LocalStage", "Wait", "Launch", "Finished", "DeviceCopies", "DevicePipeline",
           "SHARD_ALIGN",
           "call_kind", "describe_kind"]

#: Shards start at multiples of this many elements (4 KiB: whole pages, whole
#: sparse blocks), so every host cuts a segment the same way.
SHARD_ALIGN = 1024
_DTYPES = {np.dtype(np.float32): 1, np.dtype(np.int32): 2}
_SPARSE = {False: 0, True: 1, "auto": 2}


def call_kind(dtype, sparse, bits: int) -> int:
    """What a call asks for, as one number every rank of a host must agree on."""
    return _DTYPES[np.dtype(dtype)] | _SPARSE[sparse] << 8 | bits << 16


def describe_kind(elements: int, kind: int) -> str:
    dtype = {v: k.name for k, v in _DTYPES.items()}.get(kind & 0xFF, "?")
    sparse = {v: k for k, v in _SPARSE.items()}.get(kind >> 8 & 0xFF, "?")
    mode = {False: "dense", True: "sparse", "auto": "sparse='auto'"}.get(sparse, "?")
    return f"{elements} {dtype} elements, {mode}, {kind >> 16}-bit wire"


@runtime_checkable
class DeviceCopies(Protocol):
    """A call whose input and output live on a device (a GPU), straight to and
    from the shared memory: how each segment comes into the rank's area and its
    sum goes back.  A copy is started and later waited for, so that it runs
    beside the stage's other work: the next segment's input comes in and the
    last one's sum goes back while this one is summed.  The call's host arrays
    are not touched.  A call ends once its last segment's sum is on its way
    back, not there: whoever reads the output waits on the device (as NCCL's
    and gloo's calls do), and the stage waits for that copy at its next call,
    before the slot it reads from is used again."""

    def into_host(self, area: np.ndarray, start: int, stop: int) -> None:
        """Start ``area`` = elements [start, stop) of the input."""

    def wait_into_host(self, start: int, stop: int) -> None:
        """Return once the copy into the host that ``into_host`` started for
        [start, stop) is done."""

    def from_host(self, result: np.ndarray, start: int, stop: int) -> None:
        """Start elements [start, stop) of the output = ``result`` (which stays
        as it is until ``wait_from_host``): from then on the output's readers
        find that sum there."""

    def wait_from_host(self, start: int, stop: int) -> None:
        """Return once the copy that ``from_host`` started for [start, stop) is
        done."""


@runtime_checkable
class DevicePipeline(Protocol):
    """A call whose input and output live on a device, through host copies
    (``src`` and ``out``) that the device fills and empties a segment at a time,
    while the stage works on the segments before and after."""

    def arrive(self, start: int, stop: int) -> None:
        """Return once elements [start, stop) of ``src`` hold the input."""

    def depart(self, start: int, stop: int) -> None:
        """Elements [start, stop) of ``out`` hold the sum: send them on (the host
        copy stays as it is until the call has ended)."""


@dataclass(frozen=True)
class Wait:
    """Resume once ``field`` of each rank (local index) in ``ranks`` is ``target`` or more."""

    field: int
    ranks: tuple[int, ...]
    target: int


@dataclass(frozen=True)
class Launch:
    """Send ``shard`` (a view of the slot's result, this rank's shard of segment
    ``segment``) through the switch, in place; publish ``reduced`` = segment + 1
    once its sum is back."""

    segment: int
    shard: np.ndarray


@dataclass(frozen=True)
class Finished:
    """The call before this one (number ``call``) copied its last segment out: its
    result is whole.  A call whose successor is already waiting leaves its last
    copy-out to that successor, after the successor's first segment is on its way,
    so that the switch goes from one call to the next without a gap."""

    call: int


class LocalStage:
    """One rank's part of its host's local stage, over the segment's buffer ``buf``
    (a uint8 array: the whole mapping) laid out as ``layout``.

    ``index``: the rank's place among the host's ranks; ``switched``: whether the
    shards go through the switch (other hosts) or the host is the whole job;
    ``peers``: the job's ranks of the host, by index (for messages);
    ``threads``: how many threads each copy and sum is cut over.  The rank owns
    shard ``index`` when ``index < layout.shards``.
    """

    def __init__(self, buf: np.ndarray, layout: Layout, index: int, *, switched: bool,
                 peers: tuple[int, ...] | None = None, threads: int = 1):
        self.buf = buf
        #: Threads each copy and sum is cut over (``memory``'s C twin).
        self.threads = threads
        self.layout = layout
        self.index = index
        self.switched = switched
        self.peers = peers if peers is not None else tuple(range(layout.ranks))
        self.shard = index if index < layout.shards else None
        self.everyone = tuple(range(layout.ranks))
        self.owners = tuple(range(layout.shards))
        #: Segments this host went through (every counter's base for the next call).
        self.segments = 0
        #: Calls made so far (the next call is number calls + 1).
        self.calls = 0
        #: The previous call's last copy-out, when it was left to this call:
        #: (its output, its index of the segment, segment, length, call number).
        self._tail: tuple | None = None
        #: Segments copied out so far, by the address of the output of each call
        #: begun and not yet forgotten (``forget_output``): the first that many
        #: segments of that output hold the sum, the rest still the input (in place).
        self.copied_out: dict[int, int] = {}
        #: Device copies under way (``DeviceCopies``): the segment whose input is
        #: coming into this rank's area, and the one whose sum is going back.
        self._coming: int | None = None
        self._going: int | None = None
        #: The last call's last copy back to its device, started and not yet
        #: waited for: (its copies, start, stop, segment).
        self._landing: tuple | None = None

    # ------------------------------------------------------------------ helpers
    def record(self, index: int, field: int) -> int:
        return self.layout.record(index, field)

    def _counter(self, index: int, field: int) -> int:
        return int(self.buf[self.record(index, field):][:8].view(np.uint64)[0])

    def _publish(self, field: int, value: int) -> None:
        memory.publish(self.buf, self.record(self.index, field), value)

    def _area(self, slot: int, index: int, count: int, dtype) -> np.ndarray:
        offset = self.layout.input_offset(slot, index)
        return self.buf[offset:offset + count * 4].view(dtype)

    def _result(self, slot: int, count: int, dtype) -> np.ndarray:
        offset = self.layout.result_offset(slot)
        return self.buf[offset:offset + count * 4].view(dtype)

    def shard_bounds(self, length: int) -> list[tuple[int, int]]:
        """[start, stop) of each shard of a segment of ``length`` elements."""
        return part_bounds(length, SHARD_ALIGN, self.layout.shards)

    # ------------------------------------------------------------------ a call
    def allreduce(self, src: np.ndarray, out: np.ndarray, kind: int, more=None,
                  copies: DeviceCopies | DevicePipeline | None = None):
        """The call's steps (a generator of ``Wait``, ``Launch`` and ``Finished``):
        ``out`` = the sum over every host's ranks of ``src`` (flat float32 or int32
        arrays; ``out`` may be ``src``).  ``kind`` is ``call_kind`` of the call.
        With ``copies``, the input is on a device and so is the output: a
        ``DeviceCopies`` brings each segment into this rank's area and takes
        its sum back, and ``src`` and ``out`` (host arrays of the call's size)
        are not touched; a ``DevicePipeline`` fills ``src`` and empties ``out``
        segment by segment.

        ``more()``, asked at the call's last segment: whether another call waits
        behind this one; if so this call ends before its last copy-out, which the
        next call does (``Finished`` says when), and ``finish()`` does it when no
        call comes."""
        layout = self.layout
        n, g = src.size, layout.segment
        count = max(1, -(-n // g))
        self._land()  # before any slot is used again (by this rank or a peer)
        base = self.segments
        self.calls += 1
        call = self.calls
        if self._tail is not None and np.may_share_memory(self._tail[0], src):
            yield from self.finish()  # this call reads what the last one writes
        self.copied_out[out.ctypes.data] = 0
        # What this rank asks for, read by its peers once it copied in the first
        # segment: the call's number 0 while its size and kind change (a peer still
        # checking the call before sees them change under it: _check_calls).
        for field, value in ((R_CALL, 0), (R_ELEMENTS, n), (R_KIND, kind), (R_CALL, call)):
            self.buf[self.record(self.index, field):][:8].view(np.uint64)[0] = value
        for t in range(count):
            segment = base + t
            if segment >= layout.slots:  # the slot's last segment copied out by all
                yield Wait(R_COPIED_OUT, self.everyone, segment - layout.slots + 1)
            yield from self._combine(src, t, segment, n, call, kind, copies, count)
            if t:
                yield from self._copy_out(out, t - 1, segment - 1, n, copies)
            else:
                yield from self.finish()  # the last call's tail, behind this first segment
        self.segments = base + count
        if more is not None and more():
            self._tail = (out, count - 1, base + count - 1, n, call, copies)
            return
        yield from self._copy_out(out, count - 1, base + count - 1, n, copies, last=True)

    def _land(self) -> None:
        """Wait for the last call's last copy back to its device, and say the
        slot it read from is free."""
        if self._landing is None:
            return
        copies, start, stop, segment = self._landing
        self._landing = None
        copies.wait_from_host(start, stop)
        self._publish(R_COPIED_OUT, segment + 1)

    @property
    def deferred(self) -> bool:
        """Whether the last call left its last copy-out to the next one."""
        return self._tail is not None

    def forget_output(self, out: np.ndarray) -> None:
        """The call that wrote ``out`` ended: its count of segments copied out goes."""
        self.copied_out.pop(out.ctypes.data, None)

    def forget_deferred(self) -> None:
        """The job failed: the last call's copy-out will not happen."""
        self._tail = None
        self._coming = self._going = None
        self._landing = None

    def finish(self):
        """The steps of the last call's deferred copy-out (none if there is none)."""
        if self._tail is None:
            return
        out, t, segment, n, call, copies = self._tail
        self._tail = None
        yield from self._copy_out(out, t, segment, n, copies)
        yield Finished(call)

    def _combine(self, src, t: int, segment: int, n: int, call: int, kind: int,
                 copies: DeviceCopies | DevicePipeline | None, count: int):
        """Steps 1 and 2 for segment ``segment`` (the call's ``t``-th of ``count``)."""
        g = self.layout.segment
        slot = segment % self.layout.slots
        start, stop = t * g, min(n, (t + 1) * g)
        length = stop - start
        bounds = self.shard_bounds(length)
        mine = bounds[self.shard] if self.shard is not None else (0, 0)
        area = self._area(slot, self.index, length, src.dtype)
        direct = isinstance(copies, DeviceCopies)
        if isinstance(copies, DeviceCopies):  # the whole segment: its owner sums it here too
            if self._coming != segment:
                copies.into_host(area, start, stop)
            self._coming = None
            copies.wait_into_host(start, stop)
        else:  # (an owner reads its own shard from its input: no need to copy it in)
            if copies is not None:
                copies.arrive(start, stop)
            memory.copy_into(area[:mine[0]], src[start:start + mine[0]], self.threads)
            memory.copy_into(area[mine[1]:], src[start + mine[1]:stop], self.threads)
        self._publish(R_COPIED_IN, segment + 1)
        if t == 0 or self.shard is not None:
            yield Wait(R_COPIED_IN, self.everyone, segment + 1)
        if t == 0:
            self._check_calls(call, n, kind)
        if isinstance(copies, DeviceCopies) and not self.switched:
            yield from self._overlap(copies, t, segment, n, count, src.dtype)
        if self.shard is None:
            return
        lo, hi = mine
        result = self._result(slot, length, src.dtype)[lo:hi]
        if hi > lo:
            memory.reduce_into(result, [
                src[start + lo:start + hi] if j == self.index and not direct
                else self._area(slot, j, length, src.dtype)[lo:hi]
                for j in self.everyone], self.threads)
        if self.switched and hi > lo:
            yield Launch(segment, result)
            return
        if self.switched and segment:
            # An empty shard (a call's short tail) is done at once, but its counter
            # says "every segment up to here": the ones still crossing the switch first.
            yield Wait(R_REDUCED, (self.index,), segment)
        self._publish(R_REDUCED, segment + 1)

    def _overlap(self, copies: DeviceCopies, t: int, segment: int, n: int, count: int,
                 dtype):
        """Start the device copies that run while segment ``segment`` is summed: the
        next segment's input into this rank's area, and the last one's sum back.
        On a host that is the whole job, the owners' sums of a segment end
        before they copy the next one in: the waits here are met already."""
        g, slots = self.layout.segment, self.layout.slots
        if t + 1 < count:
            coming = segment + 1
            if coming >= slots:  # this rank's area there: read by the owners' sums of
                yield Wait(R_REDUCED, self.owners, coming - slots + 1)  # coming - slots
            start, stop = (t + 1) * g, min(n, (t + 2) * g)
            copies.into_host(self._area(coming % slots, self.index, stop - start, dtype),
                             start, stop)
            self._coming = coming
        if t:
            going = segment - 1
            yield Wait(R_REDUCED, self.owners, going + 1)
            start, stop = (t - 1) * g, t * g
            copies.from_host(self._result(going % slots, stop - start, dtype), start, stop)
            self._going = going

    def _copy_out(self, out, t: int, segment: int, n: int,
                  copies: DeviceCopies | DevicePipeline | None, last: bool = False):
        """Step 3 for segment ``segment`` (the call's ``t``-th; ``last``: the
        call ends with it, and a device copy back is left to land)."""
        g = self.layout.segment
        start, stop = t * g, min(n, (t + 1) * g)
        yield Wait(R_REDUCED, self.owners, segment + 1)
        result = self._result(segment % self.layout.slots, stop - start, out.dtype)
        if isinstance(copies, DeviceCopies):
            if self._going != segment:
                copies.from_host(result, start, stop)
            self._going = None
            if last:
                self.copied_out[out.ctypes.data] = t + 1
                self._landing = (copies, start, stop, segment)
                return
            copies.wait_from_host(start, stop)  # the slot's result may change after this
        else:
            memory.copy_into(out[start:stop], result, self.threads)
            if copies is not None:
                copies.depart(start, stop)
        self.copied_out[out.ctypes.data] = t + 1
        self._publish(R_COPIED_OUT, segment + 1)

    def _check_calls(self, call: int, n: int, kind: int) -> None:
        """Every rank of the host makes call ``call`` alike, or CallMismatchError.
        A peer already past this call checked it against this rank's."""
        mine = (n, kind)
        for j in self.everyone:
            if self._counter(j, R_CALL) != call:
                continue
            theirs = (self._counter(j, R_ELEMENTS), self._counter(j, R_KIND))
            # read again: a peer that moved on to its next call meanwhile (a shard's
            # owner, done with this one) may have changed them under this look
            if self._counter(j, R_CALL) != call:
                continue
            if theirs != mine:
                raise CallMismatchError(
                    f"ranks of one host disagree on allreduce #{call}: rank "
                    f"{self.peers[self.index]} asked for {describe_kind(*mine)}, rank "
                    f"{self.peers[j]} for {describe_kind(*theirs)}; every rank must make "
                    "the same calls in the same order")
