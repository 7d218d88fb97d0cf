"""A group's switched allreduces: through the switch, and through gloo while it is gone.

``SwitchPath`` runs the calls the switch sums for the torch backend and for
``HookState``.  On the switch, a call is queued on the worker as before, in
place: a call the switch fails half-way holds, part by part, either its sum or
the rank's input, and the worker says which: a worker of one rank a host by
chunks (``Worker.lost``, the state a switch restart resumes from,
worker/resume.py), a job over several switches by chunks of each switch's part
(``MultiSwitchWorker.part_states``), ranks combined on their hosts by
local-stage segments (``LocalStageWorker.copied_segments``).  So nothing is
added twice and nothing is lost, and the success path costs no pass over the
tensor but, where ranks combine on several hosts, a copy of each call's last
two segments (below).

When a call fails because of the switch (``switch_failure``: unreachable,
killed mid-call, restarted without the job, or full), that call and every later
one go, in call order, to a thread of their own that sums them through a gloo
group kept for this purpose (no other call uses it, so its collectives match
on every rank):

* **agreement**: the ranks first exchange the index of the call each saw fail.
  Every rank fails, since the switch failed them all, but not at the same call:
  a rank may be ahead (it received the last results of call m before the switch
  died, its peers did not).  Then settle.py: each part's sum goes from a rank
  that holds it to those that lack it, and gloo sums from the inputs the parts
  that no rank holds.  A rank ahead gives what it kept of the calls it ended:
  one rank a host, the chunks of call m's last messages (one call ahead at
  most; several switches: on each, one part ahead at most); ranks combined on
  hosts, their last two segments (a host's ranks copy out segment s - 2 before
  they combine segment s, so no host lacks more).  With several switches or
  hosts, every call from the earliest first failure to the last any rank
  queued is settled so on every rank.  Where call m was sparse, the rank ahead
  broadcasts call m's whole switch sum, kept from that call.  Either way every
  call has one result on every rank;
* **gloo**: every later call is summed by gloo on the untouched staging (the
  float32 copy of a 16-bit tensor, as on the switch), then divided (AVG) and
  put back exactly as a switch result is;
* **coming back**: a thread probes the switch's control port every
  ``SWITCHML_RETRY_S`` seconds; at each call on gloo the ranks exchange what
  their probes saw (one small gloo allreduce) and, when every rank reached the
  switch, all join it again as a new job (the same secret) and, when every join
  succeeded, the calls not yet begun go to the switch, in order.  Returns that
  fail are tried less often the longer they take (``FAILED_RETURNS_SHARE``).

With ``SWITCHML_FALLBACK=0`` none of this runs: calls are summed in place as
before and a failure's error reaches the caller.  A failure that is not the
switch's (a rank gone, ranks that disagree) is an error either way.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from ..buffers import BufferPool
from ..config import parse_flag, switch_addresses
from ..errors import LimitExceededError, SwitchMLError, SwitchUnreachableError
from ..worker.client import fetch_stats
from .settle import (
    KEPT_SEGMENTS,
    PartsPlan,
    Ranks,
    settle_parts,
    settle_resumed,
    settle_segments,
)
from .staging import WHOLE, CudaStaging, copy_mode, stage

log = logging.getLogger("switchml.torch")

#: Seconds a job over several switches waits, past its timeout, for its parts
#: still running to end once it failed (they end within their abort).
PARTS_GRACE_S = 10.0
#: Seconds between two probes of a switch that went away (SWITCHML_RETRY_S).
DEFAULT_RETRY_S = 5.0
#: Seconds a probe waits for the switch's control port to accept, and then for
#: each read of its answer.
PROBE_TIMEOUT = 1.0
#: The share of its time on gloo a job spends at most in returns that fail: a
#: switch may answer its probe and still fail the join slowly (a rack switch
#: whose spine hangs gives it 7 s), and every rank's calls wait for the join.
#: After a failed return that took t seconds, the next waits 4t (at least
#: ``retry_s``); a quick refusal (a full switch) is tried again as often as before.
FAILED_RETURNS_SHARE = 0.2


def switch_failure(error: BaseException) -> bool:
    """Whether ``error`` is the switch's, not the job's: the switch unreachable, gone
    mid-call or restarted (its control connection closed), or full."""
    return isinstance(error, (SwitchUnreachableError, LimitExceededError))


def fallback_on(value: str | None) -> bool:
    """``SWITCHML_FALLBACK``'s value: on unless 0/false/no/off."""
    return True if value is None else parse_flag(value)


class Failed:
    """The value a settled future holds for a call that failed: its error."""

    def __init__(self, error: BaseException):
        self.error = error


def raise_failure(settled: torch.futures.Future):
    """``then`` callback: the call's result, or its error raised, so the future it
    completes carries a C++ error that the DDP reducer and ``wait()`` raise.

    (``Future.set_exception`` stores the exception as the future's *value*: Python
    raises it on ``wait()``, C++ does not know; DDP's reducer, reading that value as
    the bucket's tensors, indexed an empty list: SIGSEGV.)
    """
    outcome = settled.value()
    if isinstance(outcome, Failed):
        raise outcome.error
    return outcome


class Call:
    """One switched allreduce: the tensor's staging, how to finish it, its futures.

    ``settled`` gets the caller's value (``value()``) or a ``Failed``; ``future``
    follows it and fails with a real C++ error where it failed.
    """

    def __init__(self, tensor: torch.Tensor, divisor: int | None, sparse, bits: int | None,
                 value: Callable[[], Any], copies: tuple[str, int] = (WHOLE, 0)):
        self.staging = stage(tensor, *copies)
        self.divisor = divisor
        self.sparse = sparse
        self.bits = bits
        self.value = value
        devices: Any = self.staging.devices  # CUDA ones: the future records their streams
        self.settled: torch.futures.Future = torch.futures.Future(devices=devices)
        self.future = self.settled.then(raise_failure)

    def finish(self) -> None:
        """Settle the call with its sum, which the staging holds."""
        try:
            with self.staging.context():
                self.staging.finish(self.divisor)
                self.settled.set_result(self.value())
        except BaseException as exc:
            self.fail(exc)

    def fail(self, error: BaseException) -> None:
        if not self.settled.done():
            self.settled.set_result(Failed(error))


class SwitchPath:
    """The switched calls of one group, on its worker or, while the switch is gone,
    on ``gloo`` (a gloo group of the same ranks that nothing else uses).

    ``join(generation)`` joins the job on the switch (generation 0 first, then one
    more a return) and returns its worker; ``probe_addresses`` are the switch
    addresses to probe (None: no switch to come back to).  ``counters``:
    ``calls_on_gloo``, ``fallbacks`` (times the group left the switch),
    ``returns`` (times it came back) and ``calls_settled`` (calls the switch left
    half-summed, ended from what the ranks held, their rest through gloo).
    """

    def __init__(self, gloo, rank: int, size: int, join: Callable[[int], Any], *,
                 enabled: bool, retry_s: float, address, name: str):
        self._gloo = gloo
        self._ranks = Ranks(gloo, rank, size)
        self.rank, self.size = rank, size
        self._join = join
        self.enabled = enabled
        self.retry_s = retry_s
        self._probe_addresses = switch_addresses(address) if address else []
        self.name = name
        self.counters = {"calls_on_gloo": 0, "fallbacks": 0, "returns": 0, "calls_settled": 0}
        self._lock = threading.Condition()
        self._issued = 0  # calls numbered in call order, the same on every rank
        #: The call submitted last (a barrier waits for it: calls end in call order).
        self.last_call: Call | None = None
        self._direct = True  # calls go straight to the worker
        self._pending: dict[int, Call] = {}  # call index -> a call for the recovery thread
        self._next = 0  # the recovery thread's next call
        self._first_failed: int | None = None  # this rank's first failed call, not agreed yet
        # how this group's worker's calls fail safely, all in place: "resume" (the
        # worker's ``lost``), "parts" (several switches: each one's ``lost``),
        # "segments" (a local stage's segments), "none" (nothing to fall back from)
        self._mode = "none"
        self._worker_base = 0  # the index of the worker's first call
        self._plan: PartsPlan | None = None  # what is left of the calls ("parts")
        self._segment = 0  # a local stage's segment, in elements ("segments")
        #: the last segments' sums of ended calls: (call index, segment, sum,
        #: its pooled buffer, the call's elements)
        self._kept_segments: list[tuple[int, int, np.ndarray, Any, int]] = []
        # calls up to this index are settled part by part (after a failure)
        self._settle_through: int | None = None
        # the buffers of kept segments, one size: reused every call
        self._spares = BufferPool(keep=KEPT_SEGMENTS + 1)
        self._broken: BaseException | None = None
        self._closed = False
        self._thread: threading.Thread | None = None
        self._reachable = threading.Event()
        self._return_after = 0.0  # no return tried before (a failed one's pause)
        self._generation = 0
        self.worker: Any = None
        error: SwitchMLError | None = None
        try:
            self.worker = self._adopt(join(0))
            joined = 0
        except SwitchMLError as exc:
            if not enabled:
                raise
            joined, error = (1 if switch_failure(exc) else 2), exc
        if enabled:
            # every rank's outcome: any switch failure sends all to gloo (a rank whose
            # peer could not reach the switch timed out waiting for it)
            outcomes = self._allgather(joined)
            if max(outcomes) > 0:
                if 1 not in outcomes:
                    if self.worker is not None:
                        self.worker.close()
                    raise error if error is not None else SwitchMLError(
                        f"{name}: ranks {[r for r, o in enumerate(outcomes) if o]} could "
                        "not join the job on the switch")
                cause = error if error is not None else "a peer could not join it"
                if self.worker is not None:
                    self.worker.close()
                    self.worker = None
                self._leave_switch(0, cause, agreed=True)

    def _adopt(self, worker):
        """``worker``, told to keep its calls recoverable in place where it can;
        how its calls fail safely (``_mode``)."""
        if not self.enabled:
            self._mode = "none"
        elif hasattr(worker, "part_states"):
            worker.recoverable_in_place = True
            self._mode = "parts"
        elif hasattr(worker, "recoverable_in_place"):
            worker.recoverable_in_place = True
            self._mode = "resume"
        elif hasattr(worker, "copied_segments"):
            self._segment = worker.segment_elements or 0
            self._mode = "segments" if self._segment else "none"  # one host: no switch
        return worker

    # ------------------------------------------------------------ the caller's side
    def submit(self, call: Call) -> None:
        """Run ``call`` (the caller's thread, in call order).  A call the worker
        refuses at once (its arguments) fails and takes no number: the numbers
        are those a failover settles, one after the other."""
        with self._lock:
            index = self._issued
            if self._broken is not None:
                call.fail(self._broken)
                return
            if self._direct:
                try:
                    self._on_switch(index, call)
                except BaseException as exc:  # refused by the worker: the caller's error
                    call.fail(exc)
                    raise
            else:
                self._pending[index] = call
                self._lock.notify_all()
            self._issued += 1
            self.last_call = call

    def copy_mode(self, tensor: torch.Tensor) -> tuple[str, int]:
        """How a call of ``tensor`` made now moves between its GPU and the worker
        (``staging.copy_mode``)."""
        return copy_mode(self.worker, tensor) if self._direct else (WHOLE, 0)

    def _on_switch(self, index: int, call: Call) -> None:
        """Queue ``call`` on the worker (its I/O thread finishes it)."""
        staging = call.staging
        if isinstance(staging, CudaStaging) and staging.mode != WHOLE:
            handle = self.worker.allreduce_async(
                staging.array, out=staging.array, sparse=call.sparse, bits=call.bits,
                copies=staging.segment_copies(call.divisor))
        else:
            handle = self.worker.allreduce_async(staging.array, out=staging.array,
                                                 sparse=call.sparse, bits=call.bits,
                                                 ready=staging.ready)
        handle.add_done_callback(lambda h: self._switch_done(index, call, h))

    def _switch_done(self, index: int, call: Call, handle) -> None:
        try:
            handle.wait()
        except BaseException as exc:
            failover = self.enabled and isinstance(exc, SwitchMLError) and switch_failure(exc)
            with self._lock:
                if self._broken is not None:  # the recovery gave up: no one takes it
                    call.fail(self._broken)
                elif failover:
                    if self._direct:
                        self._leave_switch(index, exc, agreed=False)
                    self._pending[index] = call
                elif self._direct:
                    call.fail(exc)  # the job's error, not the switch's: the caller's
                else:  # behind a failover, which settles calls in order: this one
                    self._break(exc, call)  # cannot be, nor any after it
                self._lock.notify_all()
            return
        if self._mode == "segments":
            self._keep_segments(index, call)
        call.finish()

    # ------------------------------------------------------------ leaving and coming back
    def _leave_switch(self, index: int, cause, agreed: bool) -> None:
        """Calls from ``index`` on go to the recovery thread (the lock held or at init)."""
        self._direct = False
        self._next = index
        self._first_failed = None if agreed else index
        self.counters["fallbacks"] += 1
        log.warning("%s: the switch path failed (%s); calls go through gloo until the "
                    "switch is back (SWITCHML_FALLBACK=0 makes this an error)", self.name, cause)
        self._reachable.clear()
        if self._thread is None:
            self._thread = threading.Thread(target=self._recover, daemon=True,
                                            name=f"switchml-fallback-{self.rank}")
            self._thread.start()
            if self._probe_addresses:
                threading.Thread(target=self._probe, daemon=True,
                                 name=f"switchml-probe-{self.rank}").start()

    def _probe(self) -> None:
        """Every ``retry_s``: whether every switch answers on its control port (while
        on gloo).  An answer, not an accepted connection: the kernel accepts for a
        stopped or hung switch too, and a join there would hold the calls up."""
        while not self._closed:
            time.sleep(self.retry_s)
            if self._direct or self._reachable.is_set():
                continue
            try:
                for address in self._probe_addresses:
                    fetch_stats(address, timeout=PROBE_TIMEOUT)
            except (OSError, ValueError):
                continue
            self._reachable.set()

    def _recover(self) -> None:
        """The recovery thread: the calls off the switch, in call order."""
        while True:
            with self._lock:
                while not self._closed and self._broken is None and (
                        self._direct or self._next not in self._pending):
                    self._lock.wait()
                if self._closed or self._broken is not None:
                    return
                index = self._next
                call = self._pending.pop(index)
                first, self._first_failed = self._first_failed, None
            try:
                if first is not None:
                    settled = self._agree(first, call)
                elif self._settle_through is not None and index <= self._settle_through:
                    settled = (self._settle_parts(index, call) if self._mode == "parts"
                               else self._settle_segments(index, call, copied=0))
                else:
                    settled = False
                if settled:
                    self._next += 1
                    continue
                if self._come_back(call):
                    continue
                self._on_gloo(call)
            except BaseException as exc:  # a peer gone, gloo failed: every call fails
                with self._lock:
                    self._break(exc, call)
                return
            self._next += 1

    def _break(self, error: BaseException, call: Call | None = None) -> None:
        """No call of the group can go on (the lock held): ``call`` and every one
        waiting fail with ``error``, and so does any later one."""
        self._broken = error
        for waiting in ([call] if call is not None else []) + list(self._pending.values()):
            waiting.fail(error)
        self._pending.clear()
        self._lock.notify_all()

    def _agree(self, first: int, call: Call) -> bool:
        """Settle with the other ranks where each left the switch; True when ``call``
        was settled here (its sum complete), False when gloo is to sum it whole."""
        if self._mode == "segments":
            return self._agree_segments(first, call)
        if self._mode == "parts":
            return self._agree_parts(first, call)
        lost = getattr(self.worker, "lost", None)
        lost_twice = int(lost is None)  # the worker kept no account of the call
        mine = [first, lost_twice, int(lost is not None and lost.sparse and lost.in_call),
                int(lost is not None and lost.whole is not None)]
        rows = self._ranks.rows(mine)
        firsts = [row[0] for row in rows]
        behind = min(firsts)
        if max(firsts) - behind > 1:
            raise SwitchMLError(f"{self.name}: ranks left the switch at calls {firsts}")
        if any(row[1] for row in rows):
            raise SwitchMLError(
                f"{self.name}: ranks {[r for r, row in enumerate(rows) if row[1]]} lost the "
                f"switch in the middle of call {behind} where their worker kept no account "
                "of what the call held (lost again while resuming it, or in the follow-up "
                "exchange for infinities and NaNs): the call cannot be settled")
        ahead = [r for r, f in enumerate(firsts) if f > behind]
        # call `behind` summed apart from its array: sparse
        if lost is None or (any(rows[r][3] for r in ahead) if ahead
                            else any(row[2] for row in rows)):
            return self._agree_whole(first, behind, ahead, call)
        summed = settle_resumed(self._ranks, self.name, first, behind, bool(ahead), lost,
                                self._values(call))
        if summed is None:
            return False
        self._settled(call, summed)
        return True

    def _agree_whole(self, first: int, behind: int, ahead: list[int], call: Call) -> bool:
        """Every call's array intact but call ``behind``'s on the ranks ahead, who
        kept its whole sum: the first of them broadcasts it to the others."""
        if not ahead:
            return False
        source = ahead[0]
        if first > behind:  # this rank has call `behind`'s sum; a peer does not
            whole = self._whole_sum(behind)
            # (ranks that kept it too take the source's copy into a spare one)
            sent = whole if self.rank == source else whole.copy()
            self._ranks.broadcast(sent, source)
            return False
        self._ranks.broadcast(self._values(call), source)
        call.finish()
        return True

    def _whole_sum(self, index: int) -> np.ndarray:
        """The whole sum of call ``index``, the last this rank finished."""
        lost = getattr(self.worker, "lost", None)
        if lost is not None and lost.whole is not None:
            return lost.whole
        raise SwitchMLError(f"{self.name}: call {index}'s sum was not kept here")

    # ------------------------------------------------------------ several switches' calls
    def _agree_parts(self, first: int, call: Call) -> bool:
        """Each switch's parts settled as one switch's calls are (settle.settle_parts);
        every call from the earliest first failure to the last any rank queued is
        then summed part by part on every rank, in order."""
        base = self._worker_base
        states = [replace(st, call=base + st.call) for st in
                  self.worker.part_states((self.worker.timeout or 0) + PARTS_GRACE_S)]

        def array_of(index: int) -> np.ndarray:
            if index == first:
                return self._values(call)
            with self._lock:
                pending = self._pending.get(index)
            if pending is None:
                raise SwitchMLError(f"{self.name}: call {index} is not here to settle")
            return self._values(pending)

        self._plan = settle_parts(self._ranks, self.name, first,
                                  base + self.worker.calls_queued - 1, states, array_of)
        self._settle_through = self._plan.through
        return self._settle_parts(first, call)

    def _settle_parts(self, index: int, call: Call) -> bool:
        """Call ``index`` after the plan: gloo sums what no rank holds of it."""
        plan = self._plan
        assert plan is not None
        flat = self._values(call)
        spans = plan.spans(index, self.worker.parts(flat.size, call.bits))
        if spans and index < max(plan.firsts):
            raise SwitchMLError(f"{self.name}: call {index}, which some rank ended, has "
                                "parts that no rank holds")
        if spans:
            self._ranks.sum_parts(flat, spans)
        whole = sum(s.stop - s.start for s in spans) == flat.size
        self._settled(call, bool(spans), part=not whole)
        return True

    # ------------------------------------------------------------ a local stage's calls
    def _keep_segments(self, index: int, call: Call) -> None:
        """Copies of the last segments' sums of call ``index``, which just ended on
        the switch, for ranks of other hosts that may lack them if it dies now."""
        g = self._segment
        flat = call.staging.array.reshape(-1)
        count = -(-flat.size // g)
        for t in range(max(0, count - KEPT_SEGMENTS), count):
            part = flat[t * g:(t + 1) * g]
            buffer = self._spares.take(g * flat.itemsize)
            values = buffer[:part.nbytes].view(part.dtype)
            np.copyto(values, part)
            with self._lock:
                self._kept_segments.append((index, t, values, buffer, flat.size))
                while len(self._kept_segments) > KEPT_SEGMENTS:
                    self._spares.give(self._kept_segments.pop(0)[3])

    def _agree_segments(self, first: int, call: Call) -> bool:
        """The ranks' first failed calls; every call from the earliest to the latest
        is settled segment by segment on every rank, in order (a rank that ended
        some of them gives what it kept of them)."""
        firsts = self._allgather(first)
        self._settle_through = max(firsts)
        for index in range(min(firsts), first):
            self._settle_segments(index, None, copied=None)
        return self._settle_segments(first, call,
                                     copied=self.worker.copied_segments(call.staging.array))

    def _settle_segments(self, index: int, call: Call | None, copied: int | None) -> bool:
        """Call ``index`` settled segment by segment (settle.py): True when ``call``,
        this rank's (None: it ended here), holds its sum now."""
        kept = [(t, values, size) for i, t, values, _, size in self._kept_segments
                if i == index]
        summed = settle_segments(
            self._ranks, self.name, index, self._segment,
            self._values(call) if call is not None else None, copied or 0,
            {t: values for t, values, _ in kept}, kept[0][2] if kept else -1)
        if call is None:
            return False
        self._settled(call, summed, part=bool(copied))
        return True

    @staticmethod
    def _values(call: Call) -> np.ndarray:
        """``call``'s host values, flat, for a settlement to read or write: its copy
        from the GPU (a CUDA tensor's, on a side stream) waited for first, which a
        call the worker never began has not been."""
        if call.staging.ready is not None:
            call.staging.ready()
        return call.staging.array.reshape(-1)

    def _settled(self, call: Call, summed: bool, part: bool = True) -> None:
        """``call`` holds its sum after a settlement: counted, and finished."""
        if summed:
            self.counters["calls_on_gloo"] += 1
        if part:
            self.counters["calls_settled"] += 1
        call.finish()

    def _on_gloo(self, call: Call) -> None:
        staging = call.staging
        if staging.ready is not None:
            staging.ready()
        self._ranks.sum(staging.array)
        self.counters["calls_on_gloo"] += 1
        call.finish()

    def _come_back(self, call: Call) -> bool:
        """At this call's boundary: back on the switch if every rank reached it and
        every rank joined it again; True when ``call`` went there."""
        ready = self._reachable.is_set() and time.monotonic() >= self._return_after
        if not self._probe_addresses or self._ranks.minimum(int(ready)) == 0:
            return False
        self._reachable.clear()
        self._generation += 1
        worker = None
        started = time.monotonic()
        try:
            worker = self._adopt(self._join(self._generation))
        except SwitchMLError as exc:
            log.info("%s: joining the switch again failed: %s", self.name, exc)
        if self._ranks.minimum(int(worker is not None)) == 0:
            if worker is not None:
                worker.close()
            took = time.monotonic() - started
            pause = max(self.retry_s, took * (1 - FAILED_RETURNS_SHARE) / FAILED_RETURNS_SHARE)
            self._return_after = time.monotonic() + pause
            if pause > self.retry_s:
                log.info("%s: the failed return took %.1fs: the next in %.0fs at the "
                         "earliest", self.name, took, pause)
            return False
        assert worker is not None
        with self._lock:
            # every call issued so far is this one or waits here (the failed ones
            # reach the pending set in call order): they start on the switch, in order
            while any(i not in self._pending for i in range(self._next + 1, self._issued)):
                if self._closed or self._broken is not None:
                    worker.close()
                    raise self._broken or SwitchMLError(f"{self.name}: closed")
                self._lock.wait(0.01)
            old, self.worker = self.worker, worker
            first, self._worker_base = self._next, self._next
            self.counters["returns"] += 1
            log.warning("%s: back on the switch after %d calls on gloo", self.name,
                        self.counters["calls_on_gloo"])
            calls = [(first, call)] + [(index, self._pending.pop(index))
                                       for index in range(first + 1, self._issued)]
            # on the switch before they are queued there: a worker that fails them at
            # once (gone again) sends them back through _leave_switch, in order
            self._next, self._direct = self._issued, True
            for index, queued in calls:
                self._on_switch(index, queued)
        if old is not None:
            old.close()
        return True

    def _allgather(self, value: int) -> list[int]:
        """Every rank's ``value``, through the gloo group."""
        return [row[0] for row in self._ranks.rows([value])]

    def close(self) -> None:
        """Leave the switch; calls still waiting for the recovery fail (closed)."""
        with self._lock:
            self._closed = True
            self._break(self._broken or SwitchMLError(
                f"{self.name}: closed before this call was summed"))
        if self.worker is not None:
            self.worker.close()
