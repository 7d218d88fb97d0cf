"""One job over K switches: ``Worker("a:7300,b:7300", rank, world_size)``.

A job that outgrows one switch process (one core, one link), or a cluster with
no programmable switch at all, spreads its aggregation over several switches, as
BytePS spreads its sums over servers.  Every rank joins the same job (same name,
same ranks) on every switch, one single-switch worker ("channel") each, with its
own sockets and I/O thread; each call is cut into K contiguous parts, part k
summed on switch k, all parts at once.  The C engine runs without the GIL, so the
K channels run in parallel.

The cuts fall on chunk boundaries: a chunk is what one packet carries and what
one exponent scales (``packet_elements`` values; twice that on the 16-bit wire,
two values a word; the sparse path's packet is ``lanes`` blocks, the same
``packet_elements`` values).  Every chunk is quantised on its own, so part k's
sums are bit for bit those of the same chunks summed on one switch; the
follow-up exchange of chunks with an inf or NaN (``nonfinite.py``) runs within
the part, on its switch, over the same whole chunks.  Hence the switches must
cut the same packets: a job whose switches disagree on ``packet_elements`` or
``block_elements`` is refused at join, naming both.

Parts are as even as whole chunks allow: their sizes differ by at most one
packet, and each worker sends S/K bytes to each switch, S in all.  A call of
fewer chunks than switches uses the first ones only.  ``sparse="auto"`` is
decided per part, by the channel that carries it (the part's own density, a
tiny allreduce on its switch): the results are bit-identical either way.

The parts share the worker's link, so they share one job's window too: each
channel keeps at most ``ceil(slots_per_job / K)`` messages in flight (and no
more than its switch's slots: a switch server behind a link all ranks share
gives a job their share of that link's window, ``SwitchConfiguration.shared_link``).

Threads of one rank are channels too (``Worker(threads=N)``, docs/protocol.md,
"Threads of one rank"): on each switch, the job's own name is thread 0's job,
whose ``Ready`` says how many threads every rank runs (the least any asked
for), and threads 1 on join jobs of their own (``thread_job``), each with its
share of the window from the switch.  A call is then cut over every channel,
K switches times N threads, in that order.

Failures: a part that fails (its switch gone, a stalled or mismatched call)
fails the call, and the worker aborts the job on every other switch at once, so
each frees the job's slots (and the other ranks' parts there fail too, relaying
this rank's error).  The call raises the most telling of its parts' errors,
naming the switch and the part: a mismatch, else an unreachable switch, else the
first in time (a timeout on one switch may only relay another rank's giving up
over a dead switch); every later call raises it again.  A switch that fails the
job or goes away between calls makes the worker let go of the others at once
too.  A job formed again (new workers) on the switches left works.  Where the
caller recovers calls in place (``recoverable_in_place``, the torch backend's
fallback), ``part_states`` says where each switch's parts stopped once the job
failed, each with its channel's ``lost``: a call's part on one switch holds its
sum, its input, or chunks of each, as a call on one switch does.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..config import env
from ..errors import (
    CallMismatchError,
    JoinRefusedError,
    SwitchMLError,
    SwitchMLTimeoutError,
    SwitchUnreachableError,
)
from ..protocol import MAX_NAME
from .calls import AllreduceHandle, check_call, refuse_waiting_here

__all__ = ["MultiSwitchWorker", "PartState", "part_bounds", "thread_job"]

#: Counters of events a switch's restart brings to every thread of a rank on it
#: at once (each thread's channel rejoins, and resumes its part of the call): the
#: rank counts them once a switch.
PER_SWITCH = ("rejoins", "calls_resumed")


def part_bounds(size: int, unit: int, parts: int) -> list[tuple[int, int]]:
    """[start, stop) of each of ``parts`` parts of ``size`` values cut at multiples of
    ``unit``: chunk counts differ by at most one (the first parts take the extra
    chunks; the last non-empty one ends with the array's partial chunk)."""
    chunks = -(-size // unit)
    bounds = []
    first = 0
    for k in range(parts):
        last = first + chunks // parts + (k < chunks % parts)
        bounds.append((min(first * unit, size), min(last * unit, size)))
        first = last
    return bounds


@dataclass
class PartState:
    """Where one channel stopped, once the job failed (``MultiSwitchWorker.part_states``):
    ``call``, the number of this worker's first call whose part on the channel did not
    end (every part of an earlier call did; a call from it on holds its input
    there, but where ``lost`` says otherwise); ``start``, ``stop``: that part's
    elements, if it was queued on the channel (None: the channel was idle); ``lost``:
    the channel's ``Worker.lost``."""

    call: int
    start: int | None
    stop: int | None
    lost: Any


class MultiSwitchWorker:
    """One rank of a job over several switches, with ``client.Worker``'s API.

    ``Worker(addresses, ...)`` makes it; ``channel`` is the single-switch worker
    class, one per address.  What other code reads:

    * ``counters``: the channels' counters summed (packets, bytes, retransmissions
      over all switches), but for the events a switch's restart brings to each
      of its threads at once (``PER_SWITCH``: one a switch); ``channels[k].counters``
      per channel;
    * ``membership``: the first switch's (``packet_elements``, ``block_elements`` and
      ``lanes`` are every switch's, checked at join); ``memberships``: all of them;
    * ``switch_address``: the first switch's; ``switch_addresses``: all, in order
      (each with its threads' channels, in ``channels``, in part order);
    * ``rank``, ``world_size``, ``job``, ``timeout``: as given, the same on every switch.
    """

    #: Called with the error when the job fails on any switch (``Worker.on_failure``).
    on_failure: Callable[[SwitchMLError], None] | None = None

    def __init__(self, addresses, rank: int, world_size: int, job: str | None = None,
                 timeout: float | None = None, *, slots: int | None = None,
                 wait_for_slots: float | None = None, channel, link_share: int = 1,
                 secret: str | bytes | None = None, rejoin_within: float | None = None,
                 threads: int = 1):
        self.switch_addresses: list[tuple[str, int]] = list(addresses)
        self.switch_address = self.switch_addresses[0]
        self.rank = rank
        self.world_size = world_size
        self.channels: list = []
        # each channel's switch and its thread there (0: the job's own name)
        self._channel_at: list[tuple[tuple[str, int], int]] = []

        def join(address, thread, name, ask):
            self._channel_at.append((address, thread))  # (named in its errors)
            joined = channel(address, rank, world_size, name, timeout, slots=slots,
                             wait_for_slots=wait_for_slots, local_stage=False,
                             link_share=link_share, secret=secret,
                             rejoin_within=rejoin_within, threads=1, ask_threads=ask)
            self.channels.append(joined)
            return joined

        try:
            # One after the other, in the order given: each join waits for every rank,
            # so ranks that list the switches in different orders time out at the
            # first difference instead of summing one part with another unseen.
            for k, address in enumerate(self.switch_addresses):
                try:
                    first = join(address, 0, job, threads)
                    # the job's other threads: each a job of its own on the switch, as
                    # many as the switch says every rank runs
                    for thread in range(1, first.threads):
                        join(address, thread, thread_job(first.job, thread), first.threads)
                except SwitchMLTimeoutError as exc:
                    raise renamed(exc, f"{exc} (joining {self._name(len(self.channels))}, "
                                       f"switch {k + 1} of {len(self.switch_addresses)}: "
                                       "every rank must list the same switches in the "
                                       "same order)") from exc
            self._check_geometry()
        except BaseException:
            for joined in self.channels:
                joined.close()  # leaving: the job's slots on it are freed
            raise
        first = self.channels[0]
        self.job = first.job
        self.timeout = first.timeout
        self.wait_for_slots = first.wait_for_slots
        self._wire_bits = env("WIRE_BITS", 32, int)  # checked by the channels
        self._lock = threading.Lock()
        self._failure: SwitchMLError | None = None
        self._closed = False
        self._last_call: _Gather | None = None  # the call queued last (calls end in order)
        self._calls = 0  # calls made, numbered from 0
        self._queued_through = -1  # the last call whose parts went to the channels
        # each channel's parts not ended well: (call number, start, stop), in call order
        self._unfinished: list[list[tuple[int, int, int]]] = [[] for _ in self.channels]
        self._parts_running = 0
        self._parts_idle = threading.Condition(self._lock)
        for k, joined in enumerate(self.channels):
            joined.on_failure = lambda error, k=k: self._switch_failed(error, k)
        self._share_the_window()

    def _share_the_window(self) -> None:
        """Cap each channel's window at its share of one job's: the K parts leave
        through this worker's one link, so together they keep in flight what one
        switch's job would (``slots_per_job``), not K times that.  Uncapped, four
        parts on four switch servers overflow a worker's 256 KiB uplink queue:
        drops and window halvings every call, and a slower call than capped."""
        share = len(self.switch_addresses)  # a switch's threads have their share already
        for joined in self.channels:
            window = joined.membership.window
            window.limit = max(1, min(window.limit, -(-joined.link_window // share)))
            window.cwnd = min(window.cwnd, float(window.limit))

    def _check_geometry(self) -> None:
        """Bit-identical to one switch only if every switch cuts the same chunks."""
        def geometry(k):
            m = self.channels[k].membership
            return m.packet_elements, m.block_elements

        for k in range(1, len(self.channels)):
            if geometry(k) != geometry(0):
                (p0, b0), (pk, bk) = geometry(0), geometry(k)
                raise JoinRefusedError(
                    f"job '{self.channels[0].job}': the switches cut different packets: "
                    f"{self._name(0)} gives packet_elements={p0}, block_elements={b0}, "
                    f"{self._name(k)} packet_elements={pk}, block_elements={bk}; a job over "
                    "several switches needs them alike (start the switches with the same "
                    "--packet-elements and --block-elements, on paths of the same MTU)")

    def _name(self, k: int) -> str:
        """Channel k as errors name it."""
        (host, port), thread = self._channel_at[k]
        return f"the switch at {host}:{port}" + (f" (thread {thread})" if thread else "")

    # -------------------------------------------------------------- public API
    def allreduce(self, array, out=None, sparse=False, bits=None) -> np.ndarray:
        """``client.Worker.allreduce``, over every switch: the same result, bit for bit."""
        refuse_waiting_here()
        return self.allreduce_async(array, out, sparse, bits).wait()

    def allreduce_async(self, array, out=None, sparse=False, bits=None,
                        ready=None) -> AllreduceHandle:
        """``client.Worker.allreduce_async``: part k of the call queued on switch k.

        ``ready`` is called by each channel before it reads its part.  Calls end in
        the order they were queued, as on one switch, though a short call that
        needs fewer switches may have its parts back before an earlier call's: the
        local stage counts a shard's segments done by the last one ended."""
        bits = self._wire_bits if bits is None else bits
        src, out, sparse = check_call(array, out, sparse, bits, ready)
        if self._closed:
            raise SwitchMLError("this worker is closed")
        future: Future = Future()
        with self._lock:
            number, self._calls = self._calls, self._calls + 1
            failure = self._failure
            parts = self.parts(src.size, bits) if failure is None else []
            gather = _Gather(self, future, out, src.size, len(parts), self._last_call, number)
            self._last_call = gather
            if failure is None:
                self._queued_through = number
                for k, start, stop in parts:
                    self._unfinished[k].append((number, start, stop))
                self._parts_running += len(parts)
            else:  # it fails, though after the calls queued before it, as they end
                gather.fail_with(failure)
        if failure is not None:
            gather.parts_done()
            return AllreduceHandle(future)
        flat_src, flat_out = src.reshape(-1), out.reshape(-1)
        if not parts:  # an empty array: nothing to sum, as on one switch
            gather.parts_done()
        for k, start, stop in parts:
            try:
                handle = self.channels[k].allreduce_async(flat_src[start:stop],
                                                          flat_out[start:stop], sparse, bits,
                                                          ready)
            except BaseException as exc:  # refused at once (closed meanwhile): that part
                failed: Future = Future()  # fails as any, and the call with it, never
                failed.set_exception(exc)  # left waiting for a part that never ran
                handle = AllreduceHandle(failed)
            handle.add_done_callback(
                lambda h, k=k, start=start, stop=stop: gather.part_done(h, k, start, stop))
        return AllreduceHandle(future)

    def parts(self, size: int, bits: int | None = None) -> list[tuple[int, int, int]]:
        """The parts (switch k, start, stop) of a call of ``size`` values on ``bits``'
        wire (None: the job's)."""
        bits = self._wire_bits if bits is None else bits
        unit = self.membership.packet_elements * (2 if bits == 16 else 1)
        return [(k, start, stop) for k, (start, stop)
                in enumerate(part_bounds(size, unit, len(self.channels))) if stop > start]

    @property
    def recoverable_in_place(self) -> bool:
        """``Worker.recoverable_in_place``, on every channel."""
        return all(channel.recoverable_in_place for channel in self.channels)

    @recoverable_in_place.setter
    def recoverable_in_place(self, value: bool) -> None:
        for channel in self.channels:
            channel.recoverable_in_place = value

    @property
    def calls_queued(self) -> int:
        """The calls whose parts went to the switches (the later ones failed at once)."""
        return self._queued_through + 1

    def part_states(self, timeout: float) -> list[PartState]:
        """After the job failed: where each channel stopped (``PartState``), once no
        part runs any more and every channel's thread has seen the failure (each
        within its channel's abort); a ``SwitchMLError`` past ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        with self._parts_idle:
            if not self._parts_idle.wait_for(lambda: self._parts_running == 0, timeout):
                raise SwitchMLError(f"job '{self.job}': parts still running {timeout:g}s "
                                    "after the job failed")
        for k, channel in enumerate(self.channels):
            if not channel.failure_noted.wait(max(0.0, deadline - time.monotonic())):
                raise SwitchMLError(f"job '{self.job}': {self._name(k)}'s worker did not "
                                    f"see the job fail within {timeout:g}s")
        with self._parts_idle:
            states = []
            for k, channel in enumerate(self.channels):
                if self._unfinished[k]:
                    number, start, stop = self._unfinished[k][0]
                    states.append(PartState(number, start, stop, channel.lost))
                else:
                    states.append(PartState(self.calls_queued, None, None, channel.lost))
            return states

    def close(self) -> None:
        """Leave the job on every switch (after queued allreduces finish)."""
        if self._closed:
            return
        self._closed = True
        for channel in self.channels:
            channel.close()

    def __enter__(self) -> MultiSwitchWorker:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def counters(self) -> dict:
        """Every channel's counters, summed; of ``PER_SWITCH``'s, each switch's
        most over its threads' channels, summed over the switches."""
        total: dict = {}
        per_switch: dict = {}
        for channel in self.channels:
            for name, value in channel.counters.items():
                if name in PER_SWITCH:
                    key = (channel.switch_address, name)
                    per_switch[key] = max(per_switch.get(key, 0), value)
                else:
                    total[name] = total.get(name, 0) + value
        for (_, name), value in per_switch.items():
            total[name] = total.get(name, 0) + value
        return total

    @property
    def membership(self):
        return self.channels[0].membership

    @property
    def memberships(self) -> list:
        return [channel.membership for channel in self.channels]

    # -------------------------------------------------------------- failures
    def _part_error(self, error: BaseException, k: int, start: int, stop: int,
                    size: int) -> BaseException:
        """``error`` of part k, of the same type, its message naming the switch and
        the part (once: the same error raised again by later calls stays as it is)."""
        if not isinstance(error, SwitchMLError) or getattr(error, "_switchml_part", False):
            return error  # a bug's exception, or named already (an abort's error)
        named = getattr(error, "_switchml_named", None)
        if named is not None:  # the same error raised again by a later call
            return named
        where = self._name(k)
        host, port = self._channel_at[k][0]
        part = (f"part {k + 1} of {len(self.channels)}: elements {start} to {stop - 1} of "
                f"{size}")
        suffix = f" ({part})" if f"{host}:{port}" in str(error) else f" (on {where}, {part})"
        named = renamed(error, f"{error}{suffix}")
        named.__cause__ = error
        named._switchml_part = True  # type: ignore[attr-defined]
        named._switchml_own_part = True  # type: ignore[attr-defined]
        error._switchml_named = named  # type: ignore[attr-defined]
        return named

    def _fail(self, error: SwitchMLError, origin: int) -> None:
        """The job is over: abort it on every switch but the one that failed it (at
        the first failure); later calls raise the most ``telling`` error seen."""
        with self._lock:
            first = self._failure is None
            if first or telling(error) > telling(self._failure):
                self._failure = error
        if first:
            for k, channel in enumerate(self.channels):
                if k != origin:
                    channel.abort(error)
            if self.on_failure is not None:
                self.on_failure(error)

    def abort(self, error: SwitchMLError) -> None:
        """``Worker.abort``, on every switch: the job fails there for every rank."""
        error._switchml_part = True  # type: ignore[attr-defined]  # the caller's, as it is
        self._fail(error, -1)

    def _switch_failed(self, error: SwitchMLError, k: int) -> None:
        """Switch k failed the job or went away, maybe between calls: let go of the
        others now, not at the next call."""
        host, port = self._channel_at[k][0]
        named = renamed(error, str(error) if f"{host}:{port}" in str(error)
                        else f"{error} (on {self._name(k)})")
        named.__cause__ = error
        # (the other switches' parts raise it as it is: it did not happen there)
        named._switchml_part = True  # type: ignore[attr-defined]
        self._fail(named, k)



def thread_job(job: str, thread: int) -> str:
    """The name on the switch of a job's I/O thread ``thread`` (1 on; thread 0 runs
    under the job's own name).  Within the switch's limit on names
    (``protocol.MAX_NAME``), which cuts longer ones: where the suffix would not
    fit, the name's tail is a digest of the whole name, so that every thread's
    name stays its own and the same on every rank."""
    suffix = f"#{thread}"
    if len(job) + len(suffix) <= MAX_NAME:
        return job + suffix
    digest = "~" + hashlib.sha256(job.encode()).hexdigest()[:12]
    return job[:MAX_NAME - len(digest) - len(suffix)] + digest + suffix


def renamed(error: SwitchMLError, message: str) -> SwitchMLError:
    """A copy of ``error`` (its type and attributes: ``missing_ranks``, ``limit``)
    with another message; built without its class's own ``__init__`` arguments."""
    copy = error.__class__.__new__(error.__class__)
    copy.__dict__.update(error.__dict__)
    copy.args = (message,)
    return copy


def telling(error: BaseException | None) -> int:
    """How directly an error names what went wrong; relays of it rank lowest."""
    if isinstance(error, CallMismatchError):
        return 3
    if isinstance(error, SwitchUnreachableError):
        return 2
    return 0 if error is None else 1


def most_telling(errors: list[BaseException]) -> BaseException:
    """The error a failed call raises: the most ``telling``; among equals, the one a
    part raised itself (naming its switch and part) over the copies the other parts
    were aborted with, which may have come first; then the first in time."""
    return max(errors, key=lambda e: (telling(e), getattr(e, "_switchml_own_part", False)))


class _Gather:
    """One call's parts: the call completes when every part has and the call queued
    before it has completed; its error is the ``most_telling`` of its parts'."""

    def __init__(self, worker: MultiSwitchWorker, future: Future, out: np.ndarray, size: int,
                 parts: int, previous: _Gather | None, number: int):
        self._worker = worker
        self._number = number
        self._future = future
        self._out = out
        self._size = size
        self._pending = parts
        self._errors: list[BaseException] = []  # in the order the parts failed
        self._lock = threading.Lock()
        self._previous = previous  # None once it completed
        self._completed = False
        self._follower: _Gather | None = None  # the next call, its parts all back

    def fail_with(self, error: BaseException) -> None:
        """The call fails with ``error`` (made after the job failed: no parts)."""
        self._errors.append(error)

    def part_done(self, handle: AllreduceHandle, k: int, start: int, stop: int) -> None:
        """On part k's channel thread, once its part finished."""
        try:
            handle.wait(0)
            failure = None
        except BaseException as exc:  # the part's error, passed on to the caller
            failure = self._worker._part_error(exc, k, start, stop, self._size)
        with self._lock:
            if failure is not None:
                self._errors.append(failure)
            self._pending -= 1
            last = self._pending == 0
        if isinstance(failure, SwitchMLError):
            self._worker._fail(failure, k)
        if last:
            self.parts_done()
        worker = self._worker
        with worker._parts_idle:
            if failure is None:
                worker._unfinished[k].remove((self._number, start, stop))
            worker._parts_running -= 1
            worker._parts_idle.notify_all()

    def parts_done(self) -> None:
        """Every part is back: complete now, or once the call before has."""
        with self._worker._lock:
            previous = self._previous
            if previous is not None and not previous._completed:
                previous._follower = self  # it completes this call when it does
                return
        gather: _Gather | None = self
        while gather is not None:
            gather._complete()
            with self._worker._lock:
                gather._completed = True
                gather._previous = None
                if self._worker._last_call is gather:  # (it holds the caller's output)
                    self._worker._last_call = None
                follower, gather._follower = gather._follower, None
            gather = follower

    def _complete(self) -> None:
        if self._errors:
            self._future.set_exception(most_telling(self._errors))
        else:
            self._future.set_result(self._out)
