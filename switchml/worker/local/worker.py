"""A rank of a job whose hosts run several ranks: ``Worker(...)`` returns one of
these when ranks share a host (``local/hosts.py``), with ``Worker``'s API.

At construction the host's ranks map one segment of shared memory
(``memory.Segment``: its first rank creates it, the last to attach unlinks
its name), and the rank that owns a shard joins that shard's switch job, one
member per host (``hosts.shard_job``), asking for its share of the link's
window.  A thread serves the calls in order: it runs the local stage's steps
(``stage.LocalStage``), sleeping in ``memory.wait_for`` without the GIL, and
queues each shard on the switch worker, whose completion publishes it.  Where
the host has cores to spare, each copy and sum is cut over several threads
(``local_threads``).

Failures are errors, never hangs, and every rank of the job raises one that
names the rank at fault:

* a peer's process ends (its pidfd, watched in every wait and between calls),
  a peer closes its worker while the others wait for it, or a wait sees no
  progress for ``timeout``: the rank that notices records the failure in the
  segment (the first one recorded wins, so the whole host raises the same
  error) and its owners abort their switch jobs, which fails those jobs on
  every other host;
* a switch job fails (a host gone, a stall, ranks that disagree, the switch
  gone): its owner records that, named in the job's ranks (rank h of a shard
  job is host h, whose ranks the message lists), and the host raises it.
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import select
import threading
import time
from concurrent.futures import Future

import numpy as np

from ...config import MAX_AUTO_LOCAL_THREADS, auto_local_threads, env
from ...errors import (
    CallMismatchError,
    LimitExceededError,
    SwitchMLError,
    SwitchMLTimeoutError,
    SwitchUnreachableError,
)
from ..calls import (
    AllreduceHandle,
    check_call,
    narrow_result,
    refuse_waiting_here,
    serving_calls,
    serving_calls_here,
    widen,
)
from ..multi import renamed
from . import memory
from .hosts import Hosts, Placement, shard_job
from .memory import (
    ATTACHED,
    EXITED,
    FAILED,
    LEFT,
    R_COPIED_IN,
    R_COPIED_OUT,
    R_PID,
    R_REDUCED,
    R_STATE,
    REACHED,
    SLOTS,
    TIMED_OUT,
    Layout,
    Segment,
)
from .stage import DeviceCopies, DevicePipeline, Launch, LocalStage, Wait, call_kind

__all__ = ["LocalStageWorker", "SLOTS", "local_threads"]

log = logging.getLogger("switchml.worker")

#: Seconds between looks at the peers' processes while no call runs.
IDLE_WATCH = 0.25
#: Extra seconds a wait for a shard's sum allows beyond ``timeout``: the switch
#: worker names a stalled switch job within its own timeout, and its error,
#: which says which host is missing, should come first.
SWITCH_GRACE = 5.0
_CODES = ((CallMismatchError, memory.FAILED_MISMATCH),
          (SwitchUnreachableError, memory.FAILED_UNREACHABLE),
          (SwitchMLTimeoutError, memory.FAILED_TIMEOUT),
          (LimitExceededError, memory.FAILED_LIMIT))
#: ``LimitExceededError.limit`` recorded as the failure's rank (FAILED_LIMIT).
_LIMITS = ("max_workers", "max_jobs", "slots")
_STEPS = {R_COPIED_IN: "copy its array in", R_REDUCED: "sum its shard",
          R_COPIED_OUT: "copy the sum out", R_STATE: "attach to the host's shared memory"}


def local_threads(ranks: int) -> int:
    """Threads a rank's copies and sums are cut over: ``SWITCHML_LOCAL_THREADS``,
    else ``config.auto_local_threads`` of the host's ``ranks``."""
    asked = env("LOCAL_THREADS", None, int)
    if asked is None:
        return auto_local_threads(ranks)
    if not 1 <= asked <= 32:
        raise ValueError(f"SWITCHML_LOCAL_THREADS={asked}: use 1 to 32 "
                         f"(default: the cores over the host's ranks, at most "
                         f"{MAX_AUTO_LOCAL_THREADS})")
    return asked


class LocalStageWorker:
    """One rank of a job whose ranks combine on their hosts first.

    What other code reads, as of ``Worker``: ``rank``, ``world_size``, ``job``,
    ``timeout``, ``counters`` (the switch worker's, and ``local_calls``), and
    ``placement`` (who shares which host).  ``switch`` is this rank's switch
    worker (None when it owns no shard or the job has one host).
    """

    def __init__(self, placement: Placement, hosts: Hosts, addresses, job: str, timeout: float,
                 *, slots: int | None = None, wait_for_slots: float | None = None,
                 channel=None, secret: str | bytes | None = None,
                 rejoin_within: float | None = None, threads: int | None = None):
        self._wire_bits = env("WIRE_BITS", 32, int)  # (checked here, as client.Worker does)
        if self._wire_bits not in (16, 32):
            raise ValueError(f"SWITCHML_WIRE_BITS={self._wire_bits}: use 32 or 16")
        self._secret = secret  # the job's: each shard job derives its key from it
        # the shard job's worker's (client.Worker)
        self._rejoin_within = rejoin_within
        self._threads = threads
        self.placement = placement
        self.rank = placement.rank
        self.world_size = len(placement.records)
        self.job = job
        self.timeout = timeout
        self.switch_addresses = list(addresses or [])
        self.switch_address = self.switch_addresses[0] if self.switch_addresses else None
        self._peers = placement.peers
        self._index = placement.index
        self._closed = False
        self._close_callbacks: list = []
        self._local_calls = 0
        self._switch_aborted = False  # for the host's recorded failure (_host_failure)
        leader = self._peers[0]
        self._segment_name = memory.segment_name(placement.records[leader].pid, hosts.nonce,
                                                 placement.group)
        self._pidfds = self._watch_peers()
        self._segment: Segment | None = None
        self.switch = None
        try:
            self._segment = self._attach()
            switched = placement.hosts > 1
            self.stage = LocalStage(self._segment.buf, self._segment.layout, self._index,
                                    switched=switched, peers=self._peers,
                                    threads=local_threads(len(self._peers)))
            if switched and placement.shard is not None:
                self.switch = self._join_shard(channel, slots, wait_for_slots)
        except BaseException as exc:
            if self._segment is not None:
                self._fail(exc if isinstance(exc, SwitchMLError)
                           else SwitchMLError(f"rank {self.rank} could not start: {exc}"),
                           self.rank)
            self._release()
            raise
        self._queue: queue.Queue = queue.Queue()
        # One call runs at a time, in call order: queued calls on the serving thread,
        # and a blocking call with nothing queued before it on the caller's own
        # thread (two thread hand-offs fewer: what a small call's latency is made of).
        self._order = threading.Lock()  # guards _pending
        self._pending = 0  # calls queued and not yet done
        self._running = threading.Lock()  # held by the call that runs
        self._leave_when_served = False  # close's, on a thread that serves calls
        #: A queued call whose last copy-out the next call does: (future, narrow, out).
        self._deferred: tuple | None = None
        self._thread = threading.Thread(target=self._serve, name=f"switchml-local-{self.rank}",
                                        daemon=True)
        self._thread.start()
        log.info("job %s: rank %d combines with ranks %s on its host (%s)", job, self.rank,
                 list(self._peers), placement.describe())

    # ------------------------------------------------------------------ joining
    def _watch_peers(self) -> list[int]:
        """A pidfd per peer whose process is not this one (-1: nothing to watch)."""
        fds = []
        for r in self._peers:
            pid = self.placement.records[r].pid
            if pid == os.getpid():
                fds.append(-1)
                continue
            try:
                fds.append(os.pidfd_open(pid))
            except ProcessLookupError:
                for fd in fds:
                    if fd >= 0:
                        os.close(fd)
                if r == self._peers[0]:  # the creator: no one else may remove its segment
                    memory.unlink_segment(self._segment_name)
                raise SwitchMLTimeoutError(
                    f"job '{self.job}': rank {r} (process {pid}) on this host exited before "
                    f"its ranks could combine", [r]) from None
        return fds

    def _attach(self) -> Segment:
        """Create (the host's first rank) or map the host's segment, count this rank
        in, unlink the name once every rank is in, and wait for them all."""
        p = self.placement
        layout = Layout(len(self._peers), p.shards, SLOTS, p.segment)
        name = self._segment_name
        if self._index == 0:
            segment = Segment.create(name, layout)
        else:
            segment = self._open(name, self._peers[0])
        try:
            mine = layout.record(self._index, 0)
            segment.view(mine + R_PID, 1, np.uint64)[0] = os.getpid()
            memory.publish(segment.buf, mine + R_STATE, ATTACHED)
            if memory.attach(segment.buf) == layout.ranks:
                segment.unlink()  # every rank mapped it: nothing named outlives the job
            self._segment = segment
            self._wait(Wait(R_STATE, tuple(range(layout.ranks)), ATTACHED))
        except BaseException:
            segment.unlink()
            raise
        # every rank is in: the name goes, though the last to count itself in died
        # before it removed it
        segment.unlink()
        return segment

    def _open(self, name: str, leader: int) -> Segment:
        deadline = time.monotonic() + self.timeout
        pause = 0.0005
        poll = select.poll()
        if self._pidfds[0] >= 0:
            poll.register(self._pidfds[0], select.POLLIN)
        while True:
            segment = Segment.open(name)
            if segment is not None:
                break
            if poll.poll(0):
                memory.unlink_segment(name)  # (a file the creator left whole or half made)
                raise SwitchMLTimeoutError(
                    f"job '{self.job}': rank {leader}, which creates its host's shared memory, "
                    f"exited before it did", [leader])
            if time.monotonic() > deadline:
                raise SwitchMLTimeoutError(
                    f"job '{self.job}': rank {leader} did not create its host's shared memory "
                    f"within {self.timeout:g}s", [leader])
            time.sleep(pause)
            pause = min(2 * pause, 0.01)
        layout, p = segment.layout, self.placement
        if (layout.ranks, layout.shards, layout.segment) != (len(self._peers), p.shards,
                                                             p.segment):
            segment.close()
            raise SwitchMLError(f"job '{self.job}': the host's shared memory {name} was made "
                                f"for another job ({layout.ranks} ranks, {layout.shards} "
                                f"shards, segments of {layout.segment})")
        return segment

    def _join_shard(self, channel, slots, wait_for_slots):
        """This rank's switch job: its shard of every host, one member a host."""
        p = self.placement
        assert p.shard is not None
        try:
            worker = channel(self.switch_addresses, p.group, p.hosts,
                             job=shard_job(self.job, p.shard), timeout=self.timeout,
                             slots=slots, wait_for_slots=wait_for_slots, local_stage=False,
                             link_share=p.shards, secret=self._secret,
                             rejoin_within=self._rejoin_within, threads=self._threads)
        except SwitchMLError as exc:
            raise self._in_job_ranks(exc) from exc
        worker.on_failure = lambda error: self._fail(self._in_job_ranks(error), -1)
        return worker

    # ------------------------------------------------------------------ public API
    def allreduce(self, array, out=None, sparse=False, bits=None) -> np.ndarray:
        """``Worker.allreduce``: the sum over every rank of every host."""
        refuse_waiting_here()
        with self._order:
            inline = self._pending == 0 and not self._closed
            if inline:
                self._running.acquire()  # before a call queued after this one can start
        if not inline:
            return self.allreduce_async(array, out, sparse, bits).wait()
        try:
            bits = self._wire_bits if bits is None else bits
            src, out, sparse = check_call(array, out, sparse, bits, None)
            src, out, narrow = widen(src, out)
            self._run(src.reshape(-1), out.reshape(-1), sparse, bits)
            self.stage.forget_output(out.reshape(-1))
            return narrow_result(narrow, out)
        finally:
            self._running.release()

    def allreduce_async(self, array, out=None, sparse=False, bits=None,
                        ready=None, copies: DeviceCopies | DevicePipeline | None = None,
                        ) -> AllreduceHandle:
        """``Worker.allreduce_async``, served in call order by this rank's thread.

        ``copies`` (where ``takes_device_copies`` says so): the call's input and
        output live on a device, and each segment moves between it and the
        host's shared memory through ``copies``: a ``stage.DeviceCopies``
        straight (``array`` then only gives the call's size and dtype, and is
        neither read nor written), a ``stage.DevicePipeline`` through ``array``
        and ``out``, segment by segment (``local_segment`` elements)."""
        bits = self._wire_bits if bits is None else bits
        src, out, sparse = check_call(array, out, sparse, bits, ready)
        src, out, narrow = widen(src, out)
        if self._closed:
            raise SwitchMLError("this worker is closed")
        if copies is not None and (not self.takes_device_copies or narrow is not None):
            raise ValueError("arrays on a device move segment by segment only on a job of "
                             "one host, in float32 and int32 calls")
        future: Future = Future()
        with self._order:
            self._pending += 1
            self._queue.put((src, out, sparse, bits, ready, narrow, future, copies))
        return AllreduceHandle(future)

    @property
    def takes_device_copies(self) -> bool:
        """Whether a device's data may move segment by segment
        (``allreduce_async(copies=...)``): on a job of one host, whose calls never
        fall back on a host copy of their input."""
        return self.placement.hosts == 1 and self._segment is not None

    @property
    def local_segment(self) -> int:
        """Elements of the local stage's segments (every rank of the job alike)."""
        return self.placement.segment

    def shared_memory(self) -> tuple[int, int]:
        """(address, bytes) of this rank's mapping of the host's shared memory: for a
        device to register (``on_close`` undoes it before the mapping goes)."""
        assert self._segment is not None
        buf = self._segment.buf
        return buf.ctypes.data, buf.nbytes

    def on_close(self, callback) -> None:
        """Call ``callback()`` when this worker closes, before the shared memory is
        unmapped."""
        self._close_callbacks.append(callback)

    def close(self) -> None:
        """Finish the queued calls, leave the host's shared memory and the switch job."""
        # On a thread that serves calls (a done callback's, this worker's own): this
        # thread leaves once it reads the end, as joining could wait for itself.
        here = self._thread is threading.current_thread() or serving_calls_here()
        with self._order:  # no blocking call starts on another thread after this
            if self._closed:
                return
            self._closed = True
            self._leave_when_served = here
            self._queue.put(None)
        if here:  # an exit meanwhile waits for the thread to leave (it would vanish)
            atexit.register(self._thread.join)
            return
        self._thread.join()
        with self._running:  # a blocking call that runs on another thread ends first
            self._leave()

    def _leave(self) -> None:
        """Say this rank left the host's shared memory, and let it and the switch go."""
        if self._segment is not None:
            memory.publish(self._segment.buf, self.stage.record(self._index, R_STATE), LEFT)
        self._release()

    def __enter__(self) -> LocalStageWorker:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def abort(self, error: SwitchMLError) -> None:
        """Give up on the job from any thread: every rank of it raises ``error``.
        Once closed with no call left to run, there is no job of this rank's to give
        up: nothing happens."""
        with self._order:
            if self._closed and self._pending == 0:
                return
        self._fail(error, self.rank)

    @property
    def counters(self) -> dict:
        counters = dict(self.switch.counters) if self.switch is not None else {}
        counters["local_calls"] = self._local_calls
        return counters

    @property
    def segment_elements(self) -> int | None:
        """Elements of the local stage's segments where its calls cross a switch (a
        call that fails there holds the sum in its first ``copied_segments``
        segments, its input in the rest); None on a job of one host."""
        return self.placement.segment if self.placement.hosts > 1 else None

    def copied_segments(self, array: np.ndarray) -> int:
        """Segments of ``array`` (the output of a call begun and not ended) that
        hold the sum; 0 for a call that never began."""
        return self.stage.copied_out.get(array.reshape(-1).ctypes.data, 0)

    @property
    def membership(self):
        return self.switch.membership if self.switch is not None else None

    # ------------------------------------------------------------------ the calls
    def _serve(self) -> None:
        serving_calls()
        while True:
            try:
                item = self._queue.get(timeout=IDLE_WATCH)
            except queue.Empty:
                self._watch()
                continue
            if item is None:
                if self._leave_when_served:  # (closed from this thread, by a callback)
                    self._leave()
                    atexit.unregister(self._thread.join)
                return
            src, out, sparse, bits, ready, narrow, future, copies = item
            try:
                with self._running:
                    if ready is not None:
                        self._ready(ready)
                    # another call queued behind this one takes over its last copy-out
                    self._run(src.reshape(-1), out.reshape(-1), sparse, bits,
                              more=lambda: self._pending > 1, copies=copies)
            except BaseException as exc:  # a SwitchMLError, or a bug surfaced to the caller
                if self._deferred is not None:  # the call before it never finished either
                    self.stage.forget_deferred()
                    self._settle(self._deferred[0], error=exc)
                    self._deferred = None
                self._settle(future, error=exc)
                continue
            if self.stage.deferred:
                self._deferred = (future, narrow, out)
            else:
                self.stage.forget_output(out.reshape(-1))
                self._settle(future, result=narrow_result(narrow, out))

    def _ready(self, ready) -> None:
        """The caller's ``ready()`` before a queued call; where it raises, the call
        never begins here while the host's other ranks begin it: the host fails
        (its ranks would otherwise pair this rank's next call with their this one)."""
        try:
            ready()
        except BaseException as exc:
            self._fail(SwitchMLError(f"job '{self.job}': rank {self.rank}'s call could not "
                                     f"begin: {exc!r}"), self.rank)
            raise

    def _settle(self, future: Future, result=None, error: BaseException | None = None) -> None:
        """A queued call's end: counted out before its caller hears of it (the
        caller's next call may then run on its own thread)."""
        with self._order:
            self._pending -= 1
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def _run(self, src: np.ndarray, out: np.ndarray, sparse, bits: int, more=None,
             copies: DeviceCopies | DevicePipeline | None = None) -> None:
        """One call's steps, driven to their end (``LocalStage.allreduce``'s ``more``
        and ``copies``)."""
        failure = self._host_failure()
        if failure is not None:
            raise failure
        self._local_calls += 1
        steps = self.stage.allreduce(src, out, call_kind(src.dtype, sparse, bits), more,
                                     copies)
        try:
            for step in steps:
                if isinstance(step, Wait):
                    self._wait(step)
                elif isinstance(step, Launch):
                    self._launch(step, sparse, bits)
                else:  # Finished: the call before this one is whole
                    assert self._deferred is not None
                    future, narrow, previous = self._deferred
                    self._deferred = None
                    self.stage.forget_output(previous.reshape(-1))
                    self._settle(future, result=narrow_result(narrow, previous))
        except CallMismatchError as exc:
            raise self._fail(exc, self.rank) from None
        except SwitchMLError as exc:  # recorded (a wait's), or the switch worker's own
            raise self._fail(exc, -1) from None
        except BaseException as exc:  # a device's copy failed, or a bug: this rank is out
            self._fail(SwitchMLError(f"job '{self.job}': rank {self.rank}'s call failed: "
                                     f"{exc!r}"), self.rank)  # of step with its host: fail it
            raise

    def _launch(self, step: Launch, sparse, bits: int) -> None:
        assert self.switch is not None
        buf, record = self.stage.buf, self.stage.record(self._index, R_REDUCED)

        def done(handle):
            try:
                handle.wait(0)
            except SwitchMLError as exc:
                self._fail(self._in_job_ranks(exc), -1)
            except BaseException as exc:  # a bug: fail the host rather than hang it
                self._fail(SwitchMLError(f"rank {self.rank}'s shard failed: {exc!r}"), -1)
            else:
                memory.publish(buf, record, step.segment + 1)

        try:
            handle = self.switch.allreduce_async(step.shard, out=step.shard, sparse=sparse,
                                                 bits=bits)
        except SwitchMLError as exc:  # its job failed already: told in this job's ranks
            raise self._fail(self._in_job_ranks(exc), -1) from None
        handle.add_done_callback(done)

    def _wait(self, step: Wait) -> None:
        """Sleep until ``step`` holds; an error naming the rank at fault otherwise."""
        buf = self._segment.buf  # type: ignore[union-attr]
        layout = self._segment.layout  # type: ignore[union-attr]
        records = [layout.record(j, 0) for j in step.ranks]
        timeout = self.timeout
        if step.field == R_REDUCED and self.placement.hosts > 1:
            timeout += SWITCH_GRACE
        status, i = memory.wait_for(buf, records, step.field, step.target, timeout,
                                      self._pidfds)
        if status == REACHED:
            return
        if status == FAILED:
            raise self._host_failure()  # type: ignore[misc]
        call = f"allreduce #{self.stage.calls}" if step.field != R_STATE else "joining"
        if status == EXITED:
            culprit = self._peers[i]
            error = self._died(culprit, f" during {call}")
        elif status == TIMED_OUT:
            culprit = self._peers[step.ranks[i]]
            error = SwitchMLTimeoutError(
                f"job '{self.job}': no progress for {timeout:g}s in {call}: rank {culprit} "
                f"did not {_STEPS[step.field]}", [culprit])
        else:  # CLOSED
            culprit = self._peers[step.ranks[i]]
            error = SwitchMLTimeoutError(
                f"job '{self.job}': rank {culprit} closed its worker while rank {self.rank} "
                f"waited for it in {call}", [culprit])
        raise self._fail(error, culprit)

    def _watch(self) -> None:
        """Between calls: a peer whose process ended fails the job now, not at the
        next call, so the other hosts learn it too; one that closed its worker
        first ended normally (a later call names it as closed).  A failure another
        rank of the host recorded: this rank's switch job is aborted for it."""
        if self._segment is None or self._host_failure() is not None:
            return
        poll = select.poll()
        for fd in self._pidfds:
            if fd >= 0:
                poll.register(fd, select.POLLIN)
        for fd, _ in poll.poll(0):
            i = self._pidfds.index(fd)
            state = self._segment.view(self.stage.record(i, R_STATE), 1, np.uint64)[0]
            if state == LEFT:
                os.close(fd)
                self._pidfds[i] = -1  # gone after its close: no death to report
                continue
            self._fail(self._died(self._peers[i]), self._peers[i])
            return

    def _died(self, culprit: int, when: str = "") -> SwitchMLTimeoutError:
        """The error of a peer whose process ended (``when``: during what)."""
        return SwitchMLTimeoutError(
            f"job '{self.job}': rank {culprit} died (process "
            f"{self.placement.records[culprit].pid} ended){when}; rank {self.rank} shares "
            "its host", [culprit])

    # ------------------------------------------------------------------ failures
    def _fail(self, error: SwitchMLError, culprit: int) -> SwitchMLError:
        """Record ``error`` as the host's failure unless one is recorded already, abort
        this rank's switch job, and return the host's failure (the first one)."""
        if culprit < 0 and getattr(error, "missing_ranks", None):
            culprit = error.missing_ranks[0]  # type: ignore[attr-defined]
        if isinstance(error, LimitExceededError):  # a switch full at a rejoin: the switch's
            culprit = _LIMITS.index(error.limit) if error.limit in _LIMITS else -1
        if self._segment is not None and self._segment.buf is not None:  # (not closed)
            code = next((c for t, c in _CODES if isinstance(error, t)), memory.FAILED_OTHER)
            memory.fail(self._segment.buf, code, culprit, str(error).encode()[:256])
            error = self._failure() or error
        if self.switch is not None:
            self._switch_aborted = True
            self.switch.abort(self._in_shard_ranks(error))
        return error

    def _host_failure(self) -> SwitchMLError | None:
        """The host's recorded failure, if any, with this rank's switch job aborted
        for it (once): a rank that sends no shard may have recorded it, and the
        other hosts hear of it only from the switch jobs."""
        failure = self._failure()
        if failure is not None and self.switch is not None and not self._switch_aborted:
            self._switch_aborted = True
            self.switch.abort(self._in_shard_ranks(failure))
        return failure

    @staticmethod
    def _in_shard_ranks(error: SwitchMLError) -> SwitchMLError:
        """``error`` (of this job's ranks) as this rank's switch job gives it up: the
        ranks it blames are no ranks of that job (whose ranks are hosts), but its
        culprits, which the switch passes on to the other hosts."""
        if not isinstance(error, SwitchMLTimeoutError):
            return error
        return SwitchMLTimeoutError(str(error), culprits=error.missing_ranks)

    def _failure(self) -> SwitchMLError | None:
        """The host's recorded failure, as the error every rank of it raises."""
        if self._segment is None:
            return None
        recorded = memory.read_failure(self._segment.buf)
        if recorded is None:
            return None
        code, culprit, reason = recorded
        if code == memory.FAILED_MISMATCH:
            return CallMismatchError(reason)
        if code == memory.FAILED_UNREACHABLE:
            return SwitchUnreachableError(reason)
        if code == memory.FAILED_TIMEOUT:
            return SwitchMLTimeoutError(reason, [culprit] if culprit >= 0 else [])
        if code == memory.FAILED_LIMIT:
            return LimitExceededError(reason, _LIMITS[culprit] if 0 <= culprit < len(_LIMITS)
                                      else "slots")
        return SwitchMLError(reason)

    def _in_job_ranks(self, error: SwitchMLError) -> SwitchMLError:
        """An error of this rank's switch job, whose rank h is the rank that sends
        this shard from host h, told in the job's ranks."""
        p = self.placement
        assert p.shard is not None
        senders = p.shard_members(p.shard)
        hosts = getattr(error, "missing_ranks", None) or []
        # a host that gave up names the ranks of this job it gave up for; else the
        # switch names hosts, each by its rank that sends this shard
        missing = list(getattr(error, "culprits", None) or
                       [senders[h] for h in hosts if 0 <= h < len(senders)])
        where = ", ".join(f"{h} is rank {r}" for h, r in enumerate(senders))
        blame = (f"rank{'s' if len(missing) > 1 else ''} "
                 f"{', '.join(map(str, missing))} failed: " if missing else "")
        message = (f"job '{self.job}': {blame}{error} (shard {p.shard} of the job crosses the "
                   f"switch as job '{shard_job(self.job, p.shard)}', one rank a host: its rank "
                   f"{where})")
        if isinstance(error, SwitchMLTimeoutError):
            return SwitchMLTimeoutError(message, missing)
        return renamed(error, message)

    def _release(self) -> None:
        for callback in self._close_callbacks:
            try:
                callback()
            except Exception:  # noqa: BLE001 - the mapping goes anyway
                log.exception("rank %d: a callback at close failed", self.rank)
        self._close_callbacks = []
        if self.switch is not None:
            self.switch.close()
        if self._segment is not None:
            self._segment.close()
        for fd in self._pidfds:
            if fd >= 0:
                os.close(fd)
        self._pidfds = []
