"""A worker whose switch restarts under its job: the rejoin, and the call in
flight resumed on the new session (docs/protocol.md, "A switch that restarts").

``Worker`` (client.py) takes these methods from ``RejoinMixin``: its I/O
thread raises ``SwitchLost`` where the switch closed a running job's control
connection, and calls ``_resume`` (in a call) or ``_resume_idle`` (between
calls), which join the job again at the switch's address and settle the call
through resume.py's exchanges on the new session.  Nothing here runs unless a
switch went away; resume.py holds the sans-IO half.
"""

from __future__ import annotations

import logging
import selectors
import socket
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import SwitchMLError, SwitchUnreachableError
from .control import ControlClient
from .engine.dense import Membership
from .resume import Kept, Lost, ResumeError, settle

log = logging.getLogger("switchml.worker")

#: Seconds between tries to reach a switch that went away, at first and at most
#: (doubling): a restart is back within a second or so, and a switch that is not
#: is tried about once a second until the worker's timeout.
REJOIN_FIRST_DELAY, REJOIN_MAX_DELAY = 0.05, 1.0


class SwitchLost(Exception):
    """The switch closed the control connection of a running job (``at``: when this
    rank saw it): the I/O thread tries to rejoin a restarted switch at its address
    within the timeout (``RejoinMixin._resume``), and raises ``error`` if none comes."""

    def __init__(self, error: SwitchMLError, at: float):
        super().__init__(str(error))
        self.error = error
        self.at = at


class Resumed:
    """A call finished after a rejoin (``RejoinMixin._resume``): what ``_run`` reads of
    a call's state machine."""

    def __init__(self, nonfinite_chunks: list[int], chunk_values: int):
        self.nonfinite_chunks = nonfinite_chunks
        self.chunk_values = chunk_values


class RejoinMixin:
    """``Worker``'s rejoin of a restarted switch.  What it uses of the worker: the
    job (``job``, ``rank``, ``world_size``, ``switch_address``, ``rejoin_within``),
    its sockets and selector, its sans-IO state (``membership``, ``_protocol``) and
    its calls (``_join``, ``_run_once``, ``_take_ready``, ``_control_events``)."""

    job: str
    rank: int
    world_size: int
    switch_address: tuple
    rejoin_within: float
    membership: Membership
    lost: Lost | None
    on_failure: Any
    failure_noted: Any
    _protocol: ControlClient
    _control: socket.socket
    _udp: socket.socket
    _sel: selectors.BaseSelector
    _slots: Any
    _kept: Kept | None
    _kept_whole: Any
    _role: str | None
    _failure: SwitchMLError | None
    _abort_request: SwitchMLError | None
    _closed: bool
    _control_open: bool
    _early_events: list

    if TYPE_CHECKING:  # Worker's own (_run_once: driver.CallDriver's)
        def _new_protocol(self) -> Any: ...
        def _join(self, slots, rejoin: bool = False, stop=None) -> Any: ...
        def _take_ready(self, previous=None) -> None: ...
        def _control_events(self, events: list) -> None: ...
        def _run_once(self, src, out, sparse, bits, resumable: bool = True) -> Any: ...

    def _resume_idle(self, lost: SwitchLost) -> None:
        """The switch went away between calls: rejoin and settle what the ranks
        still in the last call lack (an error is the next call's)."""
        self._role = "before"
        try:
            self._resume(lost, None)
        except SwitchMLError as exc:
            self._failure = self._failure or exc
            self.failure_noted.set()  # (``lost`` written where it could be)

    def _resume(self, lost: SwitchLost, call):
        """Rejoin a restarted switch and finish ``call`` (op, ledger, src, out, bits;
        None between calls) as it would have ended: resume.py's two exchanges make
        every rank hold what any held, then what none held is summed again."""
        try:
            return self._resume_call(lost, call)
        except SwitchMLError as exc:
            self._failure = self._failure or exc
            if self.on_failure is not None:
                self.on_failure(exc)
            raise

    def _resume_call(self, lost: SwitchLost, call):
        old = self.membership
        kept, self._kept = self._kept, None
        role, self._role = self._role, None
        state = self._lost_state(kept, call, role)
        op: Any = None
        src: Any = None
        bits = 32
        if call is not None:
            op, _, src, _, bits = call
        try:
            self._rejoin(lost, idle=call is None)
            m = self.membership
            if (m.packet_elements, m.block_elements) != (old.packet_elements,
                                                         old.block_elements):
                raise SwitchUnreachableError(
                    f"{lost.error}; the switch there now gives packets of "
                    f"{m.packet_elements} values (blocks of {m.block_elements}), the job ran "
                    f"with {old.packet_elements} ({old.block_elements}): its calls cannot go on")
        except SwitchMLError:
            if role is not None:
                self.lost = state
            raise
        ledger, out, nonfinite = state.ledger, state.out, state.nonfinite
        try:
            settled, left = settle(state, self._exchange, self.world_size, state.sparse)
        except ResumeError as exc:
            raise SwitchUnreachableError(
                f"{lost.error}; rejoined the switch there, but the call in flight cannot "
                f"go on: {exc}") from None
        log.info("job %s rank %d: resumed on the new session: %d slot(s) where ranks were "
                 "a message apart, %d chunk(s) of the call to sum again", self.job, self.rank,
                 settled, len(left))
        if call is None:
            return None
        assert ledger is not None and out is not None  # a sparse call in flight raised above
        self.membership.counters["calls_resumed"] += 1
        if len(left) == ledger.chunks and left:
            return self._run_once(src, out, False, bits)  # none of it was summed
        if left:
            flat_src, flat_out = src.reshape(-1), out.reshape(-1)
            spans = [ledger.span(c) for c in left]
            part = np.concatenate([flat_src[s] for s in spans])
            part_out = part.copy()  # flagged (inf, NaN) chunks: left as they were, as in place
            sub = self._run_once(part, part_out, False, bits)
            at = 0
            for span in spans:
                n = span.stop - span.start
                flat_out[span] = part_out[at:at + n]
                at += n
            nonfinite |= {left[i] for i in sub.nonfinite_chunks}
        return Resumed(sorted(nonfinite), ledger.chunk_values)

    def _lost_state(self, kept: Kept | None, call, role: str | None) -> Lost:
        """What this rank holds as the switch goes: its message numbers, ``kept``, the
        call in flight (op, ledger, src, out, bits; None: none) and ``role``'s."""
        state = Lost(list(self.membership.slot_msgs), kept,
                     whole=self._kept_whole[0] if self._kept_whole is not None else None,
                     in_call=role == "call")
        if call is not None:
            op, state.ledger, _, state.out, _ = call
            state.sparse = state.ledger is None
            if state.ledger is not None:
                state.nonfinite = set(op.nonfinite_chunks)
        return state

    def _exchange(self, values: np.ndarray) -> np.ndarray:
        """One int32 sum over the ranks on the new session, for a resumption."""
        out = np.empty_like(values)
        self._run_once(values, out, False, 32, resumable=False)
        return out

    def _rejoin(self, lost: SwitchLost, idle: bool = False) -> None:
        """Join the job again at the switch's address, trying until ``timeout`` after
        the switch went away; past it, the loss's error (what it was without
        rejoining).  A rank missing from the new job is named as at any join.
        ``idle``: between calls, where a worker being closed stops trying at once
        (its job's switch stopping as the job ends is no restart to wait for)."""
        deadline = lost.at + self.rejoin_within
        try:
            self._sel.unregister(self._udp)
        except (KeyError, ValueError):
            pass
        self._control.close()
        self._udp.close()
        delay = REJOIN_FIRST_DELAY
        host, port = self.switch_address
        log.warning("job %s rank %d: %s; rejoining within %gs", self.job, self.rank,
                    lost.error, self.rejoin_within)
        while True:
            if self._abort_request is not None:
                raise self._abort_request
            self._protocol = self._new_protocol()
            try:
                # (an abort, a part failed on another switch, ends the wait for
                # the other ranks there at once, not at the join's deadline)
                self._control, self._udp = self._join(self._slots, rejoin=True,
                                                      stop=lambda: self._abort_request)
                break
            except SwitchUnreachableError:
                now = time.monotonic()
                if now >= deadline:
                    raise SwitchUnreachableError(
                        f"{lost.error}; no switch took the job again at {host}:{port} "
                        f"within {self.rejoin_within:g}s") from None
                until = now + min(delay, deadline - now)
                while time.monotonic() < until:
                    if idle and self._closed:
                        raise SwitchUnreachableError(
                            f"{lost.error}; the worker was closed while rejoining") from None
                    time.sleep(min(0.02, max(0.0, until - time.monotonic())))
                delay = min(2 * delay, REJOIN_MAX_DELAY)
        self._take_ready(self.membership)
        self.membership.counters["rejoins"] += 1
        self._sel.register(self._udp, selectors.EVENT_READ)
        self._sel.register(self._control, selectors.EVENT_READ)
        self._control_open = True
        log.warning("job %s rank %d: rejoined the switch at %s:%d", self.job, self.rank,
                    host, port)
        try:
            self._control_events(self._early_events)
        except SwitchLost as again:  # gone again at once: not tried twice
            raise again.error from None
