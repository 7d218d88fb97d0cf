"""The worker library behind real sockets: ``Worker(switch, rank, world_size)``.

A worker joins its job over the switch's TCP control port, then one background
thread serves its allreduces in call order: it feeds the sans-IO engine with
datagrams and timer events, and watches the control connection for the failure
of another rank or of the switch.  The control protocol itself is the sans-IO
``control.ControlClient``: this module only moves its bytes and raises its errors.
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import selectors
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import numpy as np

from ..auth import token_from_env
from ..buffers import BufferPool
from ..config import (
    DEFAULT_KEEPALIVE,
    DEFAULT_SPARSE_AUTO_EVERY,
    DEFAULT_SPARSE_AUTO_MIN_LANES,
    DEFAULT_SPARSE_AUTO_MIN_LANES_COMPILED,
    DEFAULT_SPARSE_AUTO_UNION,
    DEFAULT_TIMEOUT,
    auto_worker_threads,
    env,
    local_stage_on,
    parse_address,
    positive_seconds,
    some_seconds,
    switch_addresses,
)
from ..errors import SwitchMLError, SwitchUnreachableError
from ..netutil import (
    LineReader,
    enable_keepalive,
    enlarge_buffers,
    forbid_fragmentation,
    report_local_drops,
    route_link_mbit,
    route_mtu,
    runs_leave_cut,
)
from ..protocol import (
    MAX_NAME,
    MAX_WORKER_THREADS,
    Left,
    StatsQuery,
    StatsReply,
    StatusReply,
    decode_event,
)
from .calls import (
    AllreduceHandle,
    check_call,
    narrow_result,
    refuse_waiting_here,
    serving_calls,
    serving_calls_here,
    widen,
)
from .control import ControlClient, JobFailed
from .driver import CallDriver
from .engine import compiled
from .engine.dense import Membership
from .local.hosts import Hosts, Placement
from .local.worker import LocalStageWorker
from .multi import MultiSwitchWorker
from .rejoin import RejoinMixin, SwitchLost
from .rendezvous import control_events, exchange_through_switch
from .resume import Kept, Lost

__all__ = ["Worker", "AllreduceHandle"]

log = logging.getLogger("switchml.worker")

#: Seconds a leaving rank waits for the switch to take note of its leave.
LEAVE_WAIT_S = 2.0
#: Connections a join tries where the switch closes one without a word.
JOIN_ATTEMPTS = 2


def worker_threads(addresses: list, senders: int = 1) -> int:
    """The I/O threads a rank asks for where its caller names none:
    ``SWITCHML_WORKER_THREADS``, else ``config.auto_worker_threads`` of the link its
    route to the first switch leaves by, shared by ``senders`` (its host's ranks
    under torchrun's ``LOCAL_WORLD_SIZE`` where that says more)."""
    asked = env("WORKER_THREADS", None, int)
    if asked is not None:
        if not 1 <= asked <= MAX_WORKER_THREADS:
            raise ValueError(f"SWITCHML_WORKER_THREADS={asked}: use 1 to {MAX_WORKER_THREADS}")
        return asked
    if not addresses:
        return 1
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    senders = max(senders, int(local) if local.isdigit() else 1)
    return auto_worker_threads(route_link_mbit(addresses[0]), senders)


def _checked(cast, value, name: str):
    """``value`` through ``cast`` (config's checked readers), or a ValueError naming
    ``name`` and what it takes."""
    try:
        return cast(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a {cast.__name__}, not {value!r}") from None


def _timeout(given) -> float:
    """The seconds a call may go without progress: ``given``, else SWITCHML_TIMEOUT,
    else the default; a finite number above 0 (0, a negative or NaN failed deep in
    the sockets, blaming the switch)."""
    if given is None:
        return env("TIMEOUT", DEFAULT_TIMEOUT, positive_seconds)
    return _checked(positive_seconds, given, "timeout")


def fetch_stats(address, timeout: float = 5.0) -> dict:
    """Ask a running switch for its counters over its control port, within
    ``timeout`` seconds in all (a peer that talks but never answers is no
    switch: TimeoutError); a reply without a switch's counters is a ValueError."""
    deadline = time.monotonic() + timeout
    with socket.create_connection(parse_address(address), timeout=timeout) as conn:
        conn.sendall(StatsQuery().encode())
        reader = LineReader()
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no switch's stats from {address} within {timeout:g}s")
            conn.settimeout(left)
            data = conn.recv(65536)
            if not data:
                raise ConnectionError("switch closed the connection")
            for msg in reader.feed(data):
                event = decode_event(msg)  # a malformed one: ValueError
                if isinstance(event, StatsReply):
                    if not isinstance(event.stats, dict) or not {
                            "counters", "jobs", "totals"} <= event.stats.keys():
                        raise ValueError(f"{address} answered stats without a switch's "
                                         f"counters: not a switchml switch of this version")
                    return event.stats


class Worker(RejoinMixin, CallDriver):
    """One rank of a job aggregating through a switch, or through several.

    ``switch`` is "host:port" or (host, port); None reads ``SWITCHML_SWITCH``.
    Several switches ("a:7300,b:7300", a list of addresses, or the same in
    ``SWITCHML_SWITCH``) make one job over all of them: ``Worker(...)`` then
    returns a ``multi.MultiSwitchWorker``, which has this class's API and splits
    each call among one such worker per switch (docs/protocol.md, "One job, K
    switches").
    ``timeout`` bounds, in seconds, the wait for the other ranks to join and any
    stretch of an allreduce without progress; past it the call raises
    ``SwitchMLTimeoutError`` naming the ranks that did not contribute, and the
    job fails for every rank (the switch frees its slots).  A switch that goes
    away (its control connection closes) and is back at its address within
    ``timeout`` (or ``rejoin_within`` seconds, if given) is rejoined, and the call
    in flight completes with the result it would have had (docs/protocol.md, "A
    switch that restarts"; ``counters`` count ``rejoins``); one that is not raises
    ``SwitchUnreachableError``.

    Ranks that share a host combine their arrays in shared memory first, and one
    rank per shard sends the host's partial sum through the switch (a job of one
    member per host): ``Worker(...)`` then returns a ``local.worker.LocalStageWorker``
    with this class's API (docs/protocol.md, "Several ranks on one host").  The
    ranks find out who shares a host at join, through the switch (or ``hosts``,
    the records exchanged already); ``local_stage=False`` (or
    ``SWITCHML_LOCAL_STAGE=0``) sends every rank's array through the switch.
    A job on one host sends nothing through a switch; given ``hosts``, it needs
    none at all (``switch`` may then be None).
    ``link_share``: how many of this host's ranks send through its one link at
    once (the local stage passes its shard count): the job asks the switch for
    that share of a window.

    ``threads``: the I/O threads this rank sends with (None: ``worker_threads``,
    ``SWITCHML_WORKER_THREADS`` or one per 8 Gbit/s of the link).  More than one
    returns a ``multi.MultiSwitchWorker`` whose channels share the switch: each
    thread's part of a call goes through a job of its own there, with its own
    socket and its share of the window.  Every rank of a job sends with the
    least number any rank asks for (the switch tells them at join), and the
    results are bit-identical to one thread's.  ``ask_threads`` is what a
    channel asks for at join (``MultiSwitchWorker`` sets it).

    A job that does not fit in the switch (``max_jobs`` jobs run, or its window of
    ``slots`` does not fit in the free slots) is refused with
    ``LimitExceededError`` naming the limit, unless every rank passes
    ``wait_for_slots``: then the job waits up to that many seconds for another job
    to end (default ``SWITCHML_WAIT_FOR_SLOTS``, 0: do not wait).
    """

    def __new__(cls, switch=None, rank: int = 0, world_size: int = 1, job: str | None = None,
                timeout: float | None = None, *, slots: int | None = None,
                wait_for_slots: float | None = None, local_stage: bool | None = None,
                hosts: Hosts | None = None, link_share: int = 1,
                secret: str | bytes | None = None, rejoin_within: float | None = None,
                threads: int | None = None, ask_threads: int = 1) -> Any:
        # Not an instance of cls, Python runs no __init__ on what this returns: one
        # switch keeps exactly this class; ranks that share hosts, or K switches, get
        # the class that runs them, whose parts are instances of this one.
        job = job if job is not None else env("JOB", "default")
        if not isinstance(job, str):
            raise TypeError(f"a job's name is a str, not {job!r}")
        timeout = _timeout(timeout)
        if rejoin_within is not None:  # (NaN waited for a dead switch forever)
            rejoin_within = _checked(some_seconds, rejoin_within, "rejoin_within")
        if threads is not None and not (isinstance(threads, int)
                                        and 1 <= threads <= MAX_WORKER_THREADS):
            raise ValueError(f"threads must be 1 to {MAX_WORKER_THREADS}, not {threads!r}")
        secret = secret if secret is not None else env("JOB_SECRET", None)
        if world_size > 1 and local_stage_on(local_stage):
            if hosts is None:
                hosts = exchange_through_switch(switch_addresses(switch)[0], job, rank,
                                                world_size, timeout, secret=secret)
            placement = Placement.of(hosts.records, rank)
            for ranks in placement.apart():
                if rank in ranks:
                    log.warning("job %s: ranks %s share this machine's network but cannot "
                                "map one another's memory (another IPC namespace, /dev/shm, "
                                "user or SWITCHML_LOCAL_GROUP): they take the flat path, as "
                                "hosts apart", job, list(ranks))
            if placement.combines:
                # One host is the whole job: no switch needed, unless one is named.
                addresses = (switch_addresses(switch) if placement.hosts > 1
                             or switch is not None or env("SWITCH", None) else [])
                return LocalStageWorker(placement, hosts, addresses, job, timeout, slots=slots,
                                        wait_for_slots=wait_for_slots, channel=cls,
                                        secret=secret, rejoin_within=rejoin_within,
                                        threads=threads)
        addresses = switch_addresses(switch)
        if threads is None:
            threads = worker_threads(addresses, senders=link_share)
        if len(addresses) > 1 or threads > 1:
            return MultiSwitchWorker(addresses, rank, world_size, job, timeout, slots=slots,
                                     wait_for_slots=wait_for_slots, channel=cls,
                                     link_share=link_share, secret=secret,
                                     rejoin_within=rejoin_within, threads=threads)
        return super().__new__(cls)

    def __init__(self, switch=None, rank: int = 0, world_size: int = 1, job: str | None = None,
                 timeout: float | None = None, *, slots: int | None = None,
                 wait_for_slots: float | None = None, local_stage: bool | None = None,
                 hosts: Hosts | None = None, link_share: int = 1,
                 secret: str | bytes | None = None, rejoin_within: float | None = None,
                 threads: int | None = None, ask_threads: int = 1):
        (self.switch_address,) = switch_addresses(switch)  # several: __new__ took them
        self.rank = rank
        self.world_size = world_size
        self.job = job if job is not None else env("JOB", "default")
        if len(self.job) > MAX_NAME:  # the switch would cut it: two jobs could become one
            raise ValueError(f"a job's name is at most {MAX_NAME} characters; this one has "
                             f"{len(self.job)}: {self.job[:40]}...")
        self.timeout = _timeout(timeout)
        self.link_share = link_share
        #: Seconds a switch that went away has to take the job again (``timeout``
        #: unless given: the torch backend, which has gloo to go to, waits less).
        self.rejoin_within = self.timeout if rejoin_within is None else float(rejoin_within)
        #: When this call asked the switch whether it is there (None: not asked),
        #: and when the switch last answered (``_check_switch``).
        self._switch_asked_at: float | None = None
        self._switch_answered_at = 0.0
        self._sparse_auto_union = env("SPARSE_AUTO_UNION", DEFAULT_SPARSE_AUTO_UNION, float)
        # The C sparse engine makes a round cost microseconds: 8-lane packets pay
        # there (MTU 9000); the Python engine's rounds need 32 (docs/protocol.md,
        # "Design rationale").
        self._sparse_auto_min_lanes = env(
            "SPARSE_AUTO_MIN_LANES",
            DEFAULT_SPARSE_AUTO_MIN_LANES_COMPILED if compiled.enabled()
            else DEFAULT_SPARSE_AUTO_MIN_LANES, int)
        self._auto_every = max(1, env("SPARSE_AUTO_EVERY", DEFAULT_SPARSE_AUTO_EVERY, int))
        self._wire_bits = env("WIRE_BITS", 32, int)
        if self._wire_bits not in (16, 32):
            raise ValueError(f"SWITCHML_WIRE_BITS={self._wire_bits}: use 32 or 16")
        self._auto_choices: dict = {}
        self.wait_for_slots = (env("WAIT_FOR_SLOTS", 0.0, some_seconds)
                               if wait_for_slots is None else _checked(
                                   some_seconds, wait_for_slots, "wait_for_slots"))
        self._queue: queue.Queue = queue.Queue()
        self._closed = False
        #: Queueing a call and closing, one at a time: no call lands behind the end.
        self._queueing = threading.Lock()
        self._serving = True  # False once the I/O thread failed: calls fail at once
        self._failure: SwitchMLError | None = None
        #: Set by ``abort`` (any thread); the I/O thread acts on it.
        self._abort_request: SwitchMLError | None = None
        #: Called on the I/O thread with the error when the switch fails the job or
        #: goes away, between calls too (a job over several switches then lets go
        #: of the others at once).
        self.on_failure: Callable[[SwitchMLError], None] | None = None
        self._slots = slots
        self._ask_threads = ask_threads
        self._secret = secret if secret is not None else env("JOB_SECRET", None)
        self._protocol = self._new_protocol()
        # News that follows "ready" in the same read (a rank that left at once) must
        # reach the I/O thread, not be dropped.
        self._early_events: list = []
        self._control, self._udp = self._join(slots)
        self._take_ready()
        #: The last call's last message a slot (their chunks' values), for the ranks
        #: that lack them if the switch restarts before they have them (resume.py).
        self._kept: Kept | None = None
        # Set (torch/failover.py) where a caller recovers calls in place itself once
        # the switch is gone for good: a sparse call, which writes its result as it
        # comes, then sums into a spare array first (kept whole until the next
        # call ends, for ranks that lack it), so ``lost`` describes every array.
        self.recoverable_in_place = False
        # What this rank held when its switch went away for good (``resume.Lost``),
        # for a caller that settles the calls through another path; None where the
        # loss struck a resumption or the follow-up exchange for infs and NaNs.
        self.lost: Lost | None = None
        # Set once the I/O thread has seen the job fail and written ``lost`` (a
        # failure from another thread, ``abort``, reaches it a moment later).
        self.failure_noted = threading.Event()
        self._role: str | None = None  # what the call running is to ``lost``
        self._wholes = BufferPool(keep=2)
        self._kept_whole: tuple[np.ndarray, Any] | None = None
        self._wake_r, self._wake_w = socket.socketpair()
        self._thread = threading.Thread(target=self._serve, name=f"switchml-worker-{rank}",
                                        daemon=True)
        self._thread.start()
        # Leaving (rather than vanishing at exit) keeps the job from failing for the others.
        atexit.register(self.close)

    # -------------------------------------------------------------- public API
    def allreduce(self, array, out=None, sparse=False, bits=None) -> np.ndarray:
        """Sum ``array`` over all ranks; return the sum (in ``out`` if given).

        float32 and int32 arrays travel as they are; float16 ones are summed as
        float32 and rounded to float16 once (``quant.error_bound_float16``).
        ``sparse``: False streams every block (SwitchML); True sends only non-zero
        blocks (OmniReduce); "auto" measures the block density over all ranks and
        takes the path that moves fewer bytes.  Results are bit-identical either way.
        Every rank must pass the same ``sparse`` for the same call.

        ``bits``: 32 (default, or ``SWITCHML_WIRE_BITS``) or 16, the opt-in 16-bit
        wire for float arrays: half the bytes each way, dense, within
        ``quant.error_bound16`` (docs/protocol.md).  ``sparse="auto"`` stays dense
        with it; ``sparse=True`` and int32 arrays refuse it.
        """
        refuse_waiting_here()  # before the call is queued: it would run, unwaited for
        return self.allreduce_async(array, out, sparse, bits).wait()

    def allreduce_async(self, array, out=None, sparse=False, bits=None,
                        ready=None) -> AllreduceHandle:
        """Queue an allreduce; do not touch ``array`` or ``out`` before ``wait()``.

        ``ready``: a callable the worker's thread calls before it first reads
        ``array`` (a C-contiguous float32 or int32 array then), so a caller can queue
        the call while the input is still being written, e.g. copied from a GPU: the
        torch backend passes the copy's CUDA event's ``synchronize``.
        """
        bits = self._wire_bits if bits is None else bits
        src, out, sparse = check_call(array, out, sparse, bits, ready)
        # float16: summed as float32 and rounded back once, the float32 bound plus half
        # a float16 ulp
        src, out, narrow = widen(src, out)
        future: Future = Future()
        with self._queueing:
            if self._closed:
                raise SwitchMLError("this worker is closed")
            if not self._serving:
                raise self._failure or SwitchMLError("this worker's thread ended")
            self._queue.put((src, out, sparse, future, narrow, bits, ready))
        self._wake()
        return AllreduceHandle(future)

    def close(self) -> None:
        """Leave the job (after queued allreduces finish) and release the sockets."""
        with self._queueing:
            if self._closed:
                return
            self._closed = True
            self._queue.put(None)
        atexit.unregister(self.close)
        self._wake()
        if self._thread is threading.current_thread() or serving_calls_here():
            # (a done callback's) joining could wait for a thread that waits for this
            # one (a job over several channels); the thread closes them once it left,
            # and an exit meanwhile waits for that (it would vanish, not leave)
            atexit.register(self._thread.join)
            return
        self._thread.join()
        self._close_sockets()

    def _close_sockets(self) -> None:
        for s in (self._control, self._udp, self._wake_r, self._wake_w):
            s.close()

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def abort(self, error: SwitchMLError) -> None:
        """Give up on the job, from any thread: the call running and every one queued
        raise ``error``, and the switch fails the job for every rank and frees its
        slots.  (A job over several switches aborts its part on the others when one
        fails.)  Within ``driver.IO_SLICE`` of a running call; ``close`` still leaves."""
        self._abort_request = error
        self._wake()

    @property
    def counters(self) -> dict:
        return dict(self.membership.counters)

    # -------------------------------------------------------------- joining
    def _new_protocol(self) -> ControlClient:
        host, port = self.switch_address
        return ControlClient(self.job, self.rank, self.world_size, timeout=self.timeout,
                             wait_for_slots=self.wait_for_slots,
                             where=f"switch at {host}:{port}", secret=self._secret,
                             switch_token=token_from_env())

    def _take_ready(self, previous: Membership | None = None) -> None:
        """Start the membership the switch's ``Ready`` describes (``previous``: the
        one of the session a restarted switch lost, whose RTT and counters go on)."""
        ready = self._protocol.ready
        assert ready is not None
        #: This worker's membership of the job (``dense.Membership``): the wire's
        #: ``session`` id, slots, packet geometry, and what its calls share in call
        #: order (message numbers, window, RTT, ``counters``).
        self.membership = Membership(session=ready.session, token=ready.token, rank=self.rank,
                                     world_size=self.world_size, slot_base=ready.slot_base,
                                     slot_count=ready.slot_count,
                                     packet_elements=ready.packet_elements,
                                     block_elements=ready.block_elements,
                                     progress_timeout=self.timeout,
                                     rtt=previous.rtt if previous is not None else None,
                                     data_threads=ready.data_threads)
        if previous is not None:
            self.membership.counters = previous.counters
        #: The window one link carries (protocol.Ready.link_window): what a job over
        #: several switches splits over them.
        self.link_window = ready.slot_count if ready.link_window is None else ready.link_window
        #: I/O threads every rank of the job sends with (protocol.Ready.threads): a
        #: job over several threads joins its other threads' jobs after this one.
        self.threads = ready.threads
        # An IPv4 address, resolved once: the C loop takes one, and no send needs a lookup.
        self._data_address = (self._switch_ip, ready.data_port)
        #: Whether this worker sends runs of UDP GSO segments: where the switch takes
        #: them (protocol.Ready.gso), or, for an XDP switch, which asks for each
        #: datagram apart, where the runs leave this host cut into frames anyway
        #: (``netutil.runs_leave_cut``: one send a run costs less than one a datagram).
        self.gso = ready.gso or runs_leave_cut(self._udp.getsockname()[0],
                                               self._data_address[0])

    def _join(self, slots, rejoin: bool = False, stop=None):
        host, port = self.switch_address
        where = f"switch at {host}:{port}"
        keepalive = env("KEEPALIVE", DEFAULT_KEEPALIVE, float)
        udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        control: socket.socket | None = None
        try:
            try:  # The address the switch sees us from is the one routing picks toward it.
                udp.connect((host, port))
            except OSError as exc:  # a name that does not resolve (now), no route
                raise SwitchUnreachableError(f"cannot reach the {where}: {exc}") from None
            local_ip, self._switch_ip = udp.getsockname()[0], udp.getpeername()[0]
            udp.close()
            # Packets are sized to one frame of this route (the switch takes the
            # least over the job's ranks); SWITCHML_MTU overrides what the kernel says.
            mtu = env("MTU", None, int) or route_mtu((self._switch_ip, port))
            udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            udp.bind((local_ip, 0))
            rcvbuf = enlarge_buffers(udp)
            forbid_fragmentation(udp)
            report_local_drops(udp)  # a full queue of this host's: the window hears of it
            udp.setblocking(False)
            for attempt in range(JOIN_ATTEMPTS):
                if control is not None:  # the attempt before, closed unheard
                    control.close()
                    control = None
                    self._protocol = self._new_protocol()
                self._protocol.join(udp.getsockname(), time.monotonic(), slots=slots,
                                    rcvbuf=rcvbuf, mtu=mtu, link_share=self.link_share,
                                    rejoin=rejoin, threads=self._ask_threads)
                # Everything ready before the connection opens, the join goes with it:
                # a switch under a flood of connections that never join closes the
                # oldest that have not joined (its lobby), and one that joins at once
                # is not one.
                try:
                    control = socket.create_connection((host, port),
                                                       timeout=min(self.timeout, 10.0))
                    control.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    control.sendall(self._protocol.data_to_send())
                except OSError as exc:
                    raise SwitchUnreachableError(f"cannot reach the {where}: {exc}") from None
                enable_keepalive(control, keepalive)
                try:
                    self._await_ready(control, stop)
                    break
                except SwitchUnreachableError as exc:
                    # Closed before a word: the lobby let the connection go before its
                    # join arrived (a flood from this address, on a busy host).  The
                    # join was never read, so it may go again on a new connection.
                    if (self._protocol.heard or self._protocol.unanswered
                            or attempt + 1 == JOIN_ATTEMPTS):
                        raise
                    log.info("job %s rank %d: %s; joining again", self.job, self.rank, exc)
        except BaseException:
            if control is not None:
                control.close()
            udp.close()
            raise
        assert control is not None
        control.setblocking(False)
        return control, udp

    def _await_ready(self, control, stop=None) -> None:
        """Read the switch's answers until the job is ready; its refusal raises, and
        what ``stop()`` returns (a rejoin's abort)."""
        proto = self._protocol
        for events in control_events(control, proto, lambda: proto.ready is not None, stop):
            for i, event in enumerate(events):
                if proto.ready is event:  # what came with it is the I/O thread's
                    self._early_events = events[i + 1:]
                    return
                if isinstance(event, JobFailed):
                    raise event.error

    # -------------------------------------------------------------- the I/O thread
    def _wake(self) -> None:
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass

    def _serve(self) -> None:
        serving_calls()
        sel = selectors.DefaultSelector()
        sel.register(self._udp, selectors.EVENT_READ)
        sel.register(self._control, selectors.EVENT_READ)
        sel.register(self._wake_r, selectors.EVENT_READ)
        self._sel = sel
        self._control_open = True
        try:
            self._control_events(self._early_events)
        except SwitchMLError:
            self._lost_between_calls()  # the first call raises the failure
        try:
            self._serve_calls()
        except BaseException as exc:  # (a bug) every call queued and to come fails
            self._out_of_step(exc)
            log.exception("job %s rank %d: the worker's thread failed", self.job, self.rank)
            with self._queueing:
                self._serving = False
            while True:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    item[3].set_exception(self._failure)
        finally:
            sel.close()
            if self._closed:  # (closed from a done callback, this thread's own)
                self._close_sockets()
                atexit.unregister(self._thread.join)

    def _serve_calls(self) -> None:
        """The I/O thread's loop: the queued calls in order, the control connection
        between them; until ``close``."""
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                try:
                    self._wait(1.0)
                    self._honour_abort()
                except SwitchLost as lost:
                    self._resume_idle(lost)
                except SwitchMLError:
                    self._lost_between_calls()  # the next call raises the failure
                continue
            if item is None:
                break
            src, out, sparse, future, narrow, bits, ready = item
            try:
                self._honour_abort()
            except SwitchMLError:
                self._lost_between_calls()
            if self._failure is not None:
                future.set_exception(self._failure)
                continue
            try:
                if ready is not None:
                    ready()
                self._role = "before"  # the caller's arrays untouched
                if sparse == "auto":
                    sparse = self._auto_choice(src)
                self._role = "call"
                self._call(src, out, sparse, bits)
            except SwitchMLError as exc:
                self._failure = self._failure or exc
                self.failure_noted.set()
                future.set_exception(exc)
            except BaseException as exc:  # a failed ready() (a device's copy), a bug
                self._out_of_step(exc)
                future.set_exception(exc)
            else:
                future.set_result(narrow_result(narrow, out))
            finally:
                self._role = None
        if self._control_open:
            # Also after a timeout: this rank is alive, and leaving rather than
            # vanishing keeps the switch from blaming it for the others' stall.
            self._leave()

    def _out_of_step(self, exc: BaseException) -> None:
        """A call that failed here otherwise than by the job's or the switch's failure
        (its ``ready()`` raised, a bug) began on the other ranks, or may have: this
        rank's next call would be summed with their this one.  The job fails, for
        every rank, naming this one."""
        error = SwitchMLError(f"job '{self.job}': rank {self.rank}'s call failed there: "
                              f"{exc!r}")
        if self._failure is None:
            self._failure = error
            if self._control_open:
                self._abort(error)
            if self.on_failure is not None:
                self.on_failure(error)
        self.failure_noted.set()

    def _lost_between_calls(self) -> None:
        """The job failed between calls (``_failure``): where calls are recovered
        in place, ``lost`` says so (the last call's ``Kept``, none in flight)."""
        if self.recoverable_in_place and self.lost is None:
            self.lost = self._lost_state(self._kept, None, "before")
        self.failure_noted.set()

    def _honour_abort(self) -> None:
        """Act on ``abort``: fail the job on the switch (once) and raise its error."""
        error = self._abort_request
        if error is None:
            return
        if self._failure is None:
            self._failure = error
            if self._control_open:
                self._abort(error)
        raise self._failure

    def _leave(self) -> None:
        """Tell the switch we are done and wait (briefly) until it has taken note."""
        deadline = time.monotonic() + LEAVE_WAIT_S
        try:
            self._protocol.leave()
            self._control.sendall(self._protocol.data_to_send())
            while time.monotonic() < deadline:
                if any(isinstance(e, Left) for e in self._wait(deadline - time.monotonic())):
                    return
        except (OSError, SwitchMLError, SwitchLost) as exc:
            log.debug("leaving the job: %s", exc)

    def _wait(self, timeout: float, drain_udp: bool = True) -> list:
        """Block until something happens; return control events (failures raise).

        Datagrams that arrive while no allreduce runs are late duplicates: dropped.
        """
        events: list = []
        ready = self._sel.select(max(0.0, timeout))
        if not drain_udp and any(key.fileobj is self._udp for key, _ in ready):
            # Results first: a result that completes the call may sit behind news
            # of the switch going away, and the call did complete.
            return events
        for key, _ in ready:
            if key.fileobj is self._wake_r:
                self._wake_r.recv(4096)
            elif key.fileobj is self._control:
                events += self._read_control()
            elif drain_udp:
                self._drain_stray()
        if any(isinstance(event, StatusReply) for event in events):
            self._switch_asked_at, self._switch_answered_at = None, time.monotonic()
        return events

    def _drain_stray(self) -> None:
        """Results arriving between calls (late retransmissions): count and drop."""
        while True:
            try:
                self._udp.recv(65536)
            except BlockingIOError:
                return
            except OSError:  # an ICMP error queued on the socket
                continue
            self.membership.counters["dropped_stale"] += 1

    def _read_control(self) -> list:
        """Read control events; a failure event or a closed connection raises."""
        try:
            data = self._control.recv(65536)
        except BlockingIOError:
            return []
        except OSError as exc:  # ETIMEDOUT: keepalive probes went unanswered
            log.debug("control connection error: %s", exc)
            events = self._protocol.connection_lost(exc)
        else:
            events = (self._protocol.receive_data(data, time.monotonic()) if data
                      else self._protocol.connection_lost())
        self._control_events(events)
        return events

    def _control_events(self, events: list) -> None:
        """Raise (and record) the job's failure if the switch announced one."""
        for event in events:
            if isinstance(event, JobFailed):
                self._sel.unregister(self._control)
                self._control_open = False
                if event.switch_lost:
                    raise SwitchLost(event.error, time.monotonic())
                self._failure = event.error
                if self.on_failure is not None:
                    self.on_failure(self._failure)
                raise self._failure
