"""One call of a ``Worker`` on its sockets: ``Worker`` (client.py) takes these
methods from ``CallDriver``.

Its I/O thread hands each queued call to ``_call``, which runs it on the sans-IO
engine (``engine.dense``, ``engine.sparse``, or their C twin, which drives the
socket itself without the GIL), then, only where some rank had an inf or a NaN,
the follow-up exchange.  While a call runs, ``_check_switch`` tells a stopped or
hung switch from slow ranks, and a stall is diagnosed with the switch's help
(``_diagnose``) before the job fails for every rank.
"""

from __future__ import annotations

import errno
import logging
import socket
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from ..buffers import BufferPool
from ..config import SWITCH_SILENCE_S, switch_answer_within
from ..errors import SwitchMLError, SwitchUnreachableError
from ..netutil import drain_error_queue, send_when_room
from ..protocol import StatusReply
from .control import ControlClient
from .engine import compiled, nonfinite
from .engine.dense import Membership
from .engine.sparse import nonzero_blocks
from .rejoin import SwitchLost
from .resume import CallLedger, Kept, Lost

log = logging.getLogger("switchml.worker")

#: Datagrams handled between two looks at the timers and the control connection.
DRAIN_BATCH = 64
#: Seconds the C engine runs a call without the GIL before Python looks again.
IO_SLICE = 0.02


def send_waiting(udp, datagram, address, op) -> int:
    """Send one datagram of the call ``op``; returns the bytes sent (0: lost).

    Where this host's own queue toward the network refuses it (ENOBUFS, reported
    by ``report_local_drops``), the call hears of it once (``send_refused``: its
    window) and it waits for room (``send_when_room``), as stream_io.c does.  A
    full socket buffer, a queue full that long, an ICMP error reported twice, a
    local firewall's drop (EPERM) or no route: lost, and the call's timers
    recover it, as the C engine counts any such error.  A datagram too big for
    the path (EMSGSIZE) raises: no retransmission would get it through.
    """
    told = False

    def refused(waited):
        nonlocal told
        if not told:  # once a datagram
            told = True
            op.send_refused(time.monotonic())

    for attempt in (1, 2):
        try:
            return send_when_room(udp, datagram, address, refused)
        except BlockingIOError:
            return 0
        except OSError as exc:
            if exc.errno == errno.ECONNREFUSED and attempt == 1:
                continue  # an ICMP error, reported once
            if exc.errno == errno.EMSGSIZE:
                raise
            return 0  # the switch is gone (its control connection says so), no room, ...
    return 0


class CallDriver:
    """``Worker``'s calls on its sockets.  What it uses of the worker: the job
    (``job``, ``rank``, ``world_size``, ``switch_address``, ``timeout``), its
    sockets and sans-IO state, the sparse choice's settings, and its calls
    (``_wait``, ``_honour_abort``; ``_resume`` and ``_lost_state`` of rejoin.py)."""

    job: str
    rank: int
    world_size: int
    switch_address: tuple
    timeout: float
    membership: Membership
    recoverable_in_place: bool
    lost: Lost | None
    gso: bool
    _protocol: ControlClient
    _control: socket.socket
    _control_open: bool
    _udp: socket.socket
    _data_address: tuple
    _switch_asked_at: float | None
    _switch_answered_at: float
    _sparse_auto_union: float
    _sparse_auto_min_lanes: int
    _auto_every: int
    _auto_choices: dict
    _wholes: BufferPool
    _kept: Kept | None
    _kept_whole: Any
    _role: str | None

    if TYPE_CHECKING:  # Worker's own, and RejoinMixin's
        def _wait(self, timeout: float, drain_udp: bool = True) -> list: ...
        def _honour_abort(self) -> None: ...
        def _resume(self, lost: Any, call) -> Any: ...
        def _lost_state(self, kept: Kept | None, call, role: str | None) -> Lost: ...

    def _auto_choice(self, src: np.ndarray) -> bool:
        """``sparse="auto"``: measured on the first call of each size and dtype, then
        again every ``SWITCHML_SPARSE_AUTO_EVERY`` calls of it (the same on every
        rank, since every rank makes the same calls), sparing most calls the extra
        round trip of the measurement."""
        key = (src.size, src.dtype.str)
        choice = self._auto_choices.get(key)
        if choice is None or choice[1] <= 0:
            choice = self._auto_choices[key] = [self._sparse_pays(src), self._auto_every]
        choice[1] -= 1
        return choice[0]

    def _sparse_pays(self, src: np.ndarray) -> bool:
        """Whether the sparse path clearly moves fewer bytes, decided alike on every rank.

        One tiny allreduce sums the ranks' non-zero block counts; assuming blocks
        placed independently, the union that comes back down is estimated from
        that.  Links are full duplex, so the busier direction counts: the union
        down (never less than a rank's own blocks up) against the whole tensor.
        Sparse must beat it by a margin (``SWITCHML_SPARSE_AUTO_UNION``, half by
        default) because every round also costs lane tables and per-packet work
        that a byte count does not show.

        Not with packets of fewer than ``SWITCHML_SPARSE_AUTO_MIN_LANES`` blocks: the
        rounds then cost more than the bytes save.  With the C engine, 8 (one
        frame at MTU 9000: there sparse at density 0.1 takes well under half of
        dense's time); fewer, at MTU 1500, is not measured and stays dense.  On
        the Python engine, 32: with fewer its rounds cost what the skipped blocks
        save (docs/protocol.md, "Design rationale").
        """
        b = self.membership.block_elements
        blocks = -(-src.size // b)
        if blocks == 0 or self.membership.lanes < self._sparse_auto_min_lanes:
            return False
        counts = np.array([nonzero_blocks(src.reshape(-1), b).sum()], dtype=np.int32)
        total = int(self._run(counts, np.empty_like(counts), False)[0])
        n = self.world_size
        density = min(1.0, total / (n * blocks))
        union = 1.0 - (1.0 - density) ** n
        return union <= self._sparse_auto_union

    def _call(self, src: np.ndarray, out: np.ndarray, sparse: bool, bits: int) -> None:
        """A caller's call.  Sparse and in place where calls must stay recoverable:
        summed into a spare array, then copied, and that sum kept until the next
        call ends (a rank behind may need it)."""
        whole = None
        if sparse and self.recoverable_in_place and np.may_share_memory(src, out):
            whole = self._wholes.array(out.shape, out.dtype)
            self._run(src, whole[0], sparse, bits)
            np.copyto(out, whole[0])
        else:
            self._run(src, out, sparse, bits)
        previous, self._kept_whole = self._kept_whole, whole
        if previous is not None:
            self._wholes.give(previous[1])

    def _run(self, src: np.ndarray, out: np.ndarray, sparse: bool = False,
             bits: int = 32) -> np.ndarray:
        """One allreduce, then, only where some rank had an inf or a NaN, the
        follow-up exchange that gives those chunks IEEE sums element by element."""
        op = self._run_once(src, out, sparse, bits)
        self._role = None  # a loss in the follow-up leaves no state to settle elsewhere
        chunks = getattr(op, "nonfinite_chunks", None)
        if chunks:
            flat = src.reshape(-1)
            index = nonfinite.positions(chunks, op.chunk_values, flat.size)
            values, codes = nonfinite.split(flat, index)
            value_sums = self._run(values, np.empty_like(values), False, bits)
            code_sums = self._run(codes, np.empty_like(codes), False, 32)
            nonfinite.apply(out.reshape(-1), index, value_sums, code_sums)
        return out

    def _run_once(self, src: np.ndarray, out: np.ndarray, sparse: bool, bits: int,
                  resumable: bool = True):
        """Drive one call to its end; returns its state machine (or, after a rejoin,
        what ``_run`` needs of it).  ``resumable``: False for the exchanges of a
        resumption itself, which a second loss of the switch ends."""
        start = list(self.membership.slot_msgs)
        # The C loop drives a real socket by its descriptor (not a wrapper of one).
        use_c = compiled.enabled() and isinstance(self._udp, socket.socket)
        op = self.membership.allreduce(src, out, time.monotonic(), sparse, compiled=use_c,
                                       wire_bits=bits)
        ledger = None if sparse else CallLedger.of(op, src.reshape(-1), start)
        try:
            self._drive(op, out)
        except SwitchLost as lost:
            if not resumable:
                raise lost.error from None
            return self._resume(lost, (op, ledger, src, out, bits))
        except SwitchMLError:
            # the switch failed the call otherwise (it stopped answering, or the job
            # failed there): the same account, for a caller that settles calls elsewhere
            if resumable and self._role is not None and self.lost is None:
                self.lost = self._lost_state(self._kept, (op, ledger, src, out, bits),
                                             self._role)
            raise
        if resumable:
            # the kept chunks it replaces are no one's (a failed call's account may
            # hold them: then not)
            replaced = self._kept if self.lost is None else None
            self._kept = (Kept.of(ledger, out, op.nonfinite_chunks, replaced=replaced)
                          if ledger is not None else None)
        return op

    def _drive(self, op, out: np.ndarray) -> None:
        """Run the call ``op`` to its end on the sockets."""
        if isinstance(op, compiled.CompiledDenseAllreduce):
            self._run_compiled(op, out)
            return
        udp = self._udp
        dst = self._data_address
        counters = self.membership.counters
        buf = bytearray(65536)
        view = memoryview(buf)

        def flush():
            for d in op.datagrams_to_send():
                counters["bytes_sent"] += send_waiting(udp, d, dst, op)

        flush()
        self._switch_asked_at = None
        while not op.done:
            self._honour_abort()
            self._check_switch(op, time.monotonic())
            received = 0
            for _ in range(DRAIN_BATCH):
                try:
                    n = udp.recv_into(buf)
                except BlockingIOError:
                    break
                except OSError:  # ICMP unreachable: the switch went away; control tells us
                    drain_error_queue(udp)
                    continue
                received += 1
                counters["bytes_received"] += n
                op.receive_datagram(view[:n], time.monotonic())
                flush()
                if op.done:
                    return
            now = time.monotonic()
            timer = op.get_timer()
            if timer is not None and now >= timer:
                op.handle_timer(now)
                if op.error:
                    self._fail_stalled(op)
                flush()
                timer = op.get_timer()
            if received < DRAIN_BATCH:
                wait = timer - time.monotonic() if timer is not None else 1.0
                self._wait(wait, drain_udp=False)

    def _run_compiled(self, op, out: np.ndarray) -> np.ndarray:
        """The call (dense or sparse) on the C engine: it receives, absorbs and sends
        without the GIL (recvmmsg, sendmmsg) and comes back when the control
        connection has news, when the call stalled, or every ``IO_SLICE`` seconds."""
        address = self._data_address
        self._switch_asked_at = None
        while True:
            self._honour_abort()
            self._check_switch(op, time.monotonic())
            control_fd = self._control.fileno() if self._control_open else -1
            status = op.run_io(self._udp, address, control_fd, IO_SLICE, self.gso)
            if status == compiled.IO_DONE:
                return out
            if status == compiled.IO_STALLED:
                self._fail_stalled(op)
            if status == compiled.IO_CONTROL:
                self._wait(0.0, drain_udp=False)  # a failure announced there raises

    def _check_switch(self, op, now: float) -> None:
        """A call without a result for ``SWITCH_SILENCE_S``: ask the switch whether it
        is there (a status query, answered at once by a running switch, whatever the
        ranks do); no answer within ``SWITCH_ANSWER_S`` fails the job as the
        switch's (``SwitchUnreachableError``): a stopped or hung switch keeps its
        connections open, and the call's ``timeout`` is for slow ranks."""
        if not self._control_open:
            return
        asked = self._switch_asked_at
        if asked is None:
            heard = max(op.last_progress, self._switch_answered_at)
            if now - heard >= SWITCH_SILENCE_S:
                self._switch_asked_at = now
                try:
                    self._protocol.query_status(op.pending())
                    self._control.sendall(self._protocol.data_to_send())
                except OSError:  # failed (said on its own), or full (a switch that
                    pass  # reads nothing): the wait for the answer decides either way
            return
        within = switch_answer_within()
        if now - asked < within:
            return
        host, port = self.switch_address
        error = SwitchUnreachableError(
            f"job '{self.job}' rank {self.rank}: the switch at {host}:{port} sent no "
            f"result for {now - op.last_progress:.0f}s and did not answer a status query "
            f"within {within:g}s (stopped or hung?)")
        self._abort(error)  # should it come back, it frees the job's slots
        raise error

    def _fail_stalled(self, op) -> None:
        """No progress for ``timeout``: find out who is missing, fail the job, raise."""
        error = self._diagnose(op)
        if self._control_open:  # a stall this rank saw: fail the job for all
            self._abort(error)
        raise error

    def _abort(self, error: SwitchMLError) -> None:
        """Tell the switch this rank gives up: it fails the job and frees its slots."""
        try:
            self._protocol.abort(error)
            self._control.sendall(self._protocol.data_to_send())
        except OSError as exc:
            log.debug("aborting the job: %s", exc)

    def _diagnose(self, op) -> SwitchMLError:
        """Ask the switch which ranks are missing from the stalled slots; it has as
        long to answer as ``_check_switch`` gives it (counted from a query of that
        check still unanswered), so one bound tells a slow switch from a hung one."""
        within = switch_answer_within()
        asked = self._switch_asked_at
        try:
            self._protocol.query_status(op.pending())
            self._control.sendall(self._protocol.data_to_send())
            deadline = (time.monotonic() if asked is None else asked) + within
            while time.monotonic() < deadline:
                self._honour_abort()  # the abort's error, not the diagnosis's, at once
                for event in self._wait(deadline - time.monotonic()):
                    if isinstance(event, StatusReply):
                        return self._protocol.stall_error(event, self.timeout)
        except SwitchMLError as exc:
            return exc
        except OSError as exc:
            return SwitchUnreachableError(f"switch did not answer a status query: {exc}")
        # no answer: the switch's failure (hung), not ranks' that it could have named
        return SwitchUnreachableError(
            f"job '{self.job}': no progress for {self.timeout:g}s and the switch at "
            f"{self.switch_address[0]}:{self.switch_address[1]} did not answer a status "
            f"query within {within:g}s")
