"""The worker's half of the control protocol, sans-IO: bytes and times in, events out.

The switch's half is ``switch/control.py``; the messages are ``protocol.py``'s.
A ``ControlClient`` never touches a socket and never reads a clock: the worker
(``client.py``) feeds it what its control connection received (``receive_data``)
or that the connection was lost (``connection_lost``), with the time; sends
what ``data_to_send`` returns; and calls ``handle_timer`` at ``get_timer``.  So
every answer a switch can give, and every way a switch can fail, is tested
without sockets (tests/test_control_client.py).

What it returns are ``protocol`` events (``Joined``, ``Waiting``, ``Ready``,
``Left``, ``StatusReply``) and ``JobFailed``: the job is over for this rank, with
the error the worker raises (``error``):

* joining: refused (``JoinRefusedError``; ``LimitExceededError`` naming the
  limit; ``ProtocolVersionError`` naming both versions; ``AuthenticationError``
  when the switch did not accept the proof of the job's secret or of its
  admission token, or asked for a token this worker does not have;
  ``SecretMismatchError`` when ranks of the job's name wait with another secret
  and none with this one's came within ``other_secret_grace``), ranks missing at the
  join deadline (``SwitchMLTimeoutError`` naming them, and whether a rank with
  another secret was seen), room not found within
  ``wait_for_slots`` (``LimitExceededError``), or the switch gone
  (``SwitchUnreachableError``);
* running: another rank failed the job (``SwitchMLTimeoutError`` naming the
  missing ranks), the ranks disagreed on a call (``CallMismatchError``), or the
  switch went away or sent what is not a control message
  (``SwitchUnreachableError``).

After ``JobFailed`` the client takes no more input: the connection is done.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from .. import auth, protocol
from ..config import SWITCH_SILENCE_S, switch_answer_within
from ..errors import (
    AuthenticationError,
    CallMismatchError,
    JoinRefusedError,
    LimitExceededError,
    ProtocolVersionError,
    SecretMismatchError,
    SwitchMLError,
    SwitchMLTimeoutError,
    SwitchUnreachableError,
)
from ..netutil import LineReader
from ..protocol import (
    PROTOCOL_VERSION,
    UNREACHABLE,
    Challenge,
    Error,
    Failed,
    Gathered,
    Joined,
    OtherSecretSeen,
    OtherSecretWaiting,
    Ready,
    StatusReply,
    Waiting,
)

log = logging.getLogger("switchml.worker")

#: States of a ControlClient.
JOINING, RUNNING, CLOSED = "joining", "running", "closed"
#: Seconds a job's first rank, told that ranks of its name wait with another
#: secret, waits for a rank of its own before it takes its secret for a wrong one:
#: ranks of one job join within moments of one another, and a process that joins
#: first with the name alone must not make the real job's ranks give up.
OTHER_SECRET_GRACE = 1.0


@dataclass(frozen=True)
class JobFailed:
    """The job is over for this rank; ``error`` says why (the worker raises it)."""

    error: SwitchMLError
    #: The switch went away under a running job (its connection closed or failed):
    #: the worker may rejoin a restarted switch (``client.Worker``) rather than fail.
    switch_lost: bool = False


class ControlClient:
    """One rank's control conversation with the switch, from join to leave.

    ``where`` names the switch in errors ("switch at HOST:PORT"); ``timeout`` bounds
    the wait for the other ranks to join, ``wait_for_slots`` the wait for room
    once the job is complete (0: a job that does not fit is refused).
    ``version`` is the protocol version the join claims (a test's stand-in for
    another release).  ``secret``: the job's secret (None: an open job);
    ``switch_token``: the switch's admission token, where it has one
    (``auth.py``).  Neither ever goes on the wire.  ``other_secret_grace``: how
    long the job's first rank, told that ranks of its name wait with another
    secret (``OtherSecretWaiting``), waits for a rank with its own before it
    raises ``SecretMismatchError``.
    """

    def __init__(self, job: str, rank: int, world_size: int, *, timeout: float,
                 wait_for_slots: float = 0.0, where: str = "switch",
                 version: int = PROTOCOL_VERSION, secret: str | bytes | None = None,
                 switch_token: bytes | None = None,
                 other_secret_grace: float = OTHER_SECRET_GRACE):
        self.job = job
        self.other_secret_grace = other_secret_grace
        self._key = auth.JobKey(secret, job) if secret is not None else None
        self._switch_token = switch_token
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout
        self.wait_for_slots = wait_for_slots
        self.where = where
        self.version = version
        self.state = JOINING
        #: The job's session and slots, once every rank joined and it was admitted.
        self.ready: Ready | None = None
        #: Every rank's value, once every rank gathered (``gather``).
        self.gathered: Gathered | None = None
        #: Why the job is over for this rank, once it is.
        self.error: SwitchMLError | None = None
        self._reader = LineReader()
        #: Whether the switch sent anything on this connection (a join the switch
        #: closed unheard was never read: it may be sent again).
        self.heard = False
        #: Whether a message of the protocol came (bytes that are not one, from
        #: something else listening at the address, do not count).
        self._understood = False
        self._outbox = bytearray()
        self._present: tuple[int, ...] = (rank,)
        self._waiting: Waiting | None = None  # while the complete job waits for room
        self._join_deadline: float | None = None
        self._deadline: float | None = None
        #: How long the switch may take to answer the join (or gather) at all, and
        #: until when: a switch answers at once, so silence this long is no slow rank.
        self._answer_within = switch_answer_within(timeout)
        self._answer_by: float | None = None
        #: Once it answered, while the other ranks are awaited: when to ask the
        #: switch whether it is still there (a status query, after
        #: ``SWITCH_SILENCE_S`` without a word), which it then has ``_answer_within``
        #: to answer (``_answer_by`` again): a switch that hangs is no late rank.
        self._ask_at: float | None = None
        #: Whether the join failed for want of any answer in that time (the
        #: connection left open: no lobby closed it, so a retry would wait again).
        self.unanswered = False
        #: Until when this rank, its job's only one so far, waits for another rank
        #: of its own after ``OtherSecretWaiting`` (None: it was not told so).
        self._other_secret_deadline: float | None = None
        #: Whether a rank joined under this job's name with another secret.
        self._other_secret_seen = False

    # ------------------------------------------------------------ what to send
    def join(self, data_addr: tuple[str, int], now: float, *, slots: int | None = None,
             rcvbuf: int = 0, mtu: int | None = None, link_share: int = 1,
             rejoin: bool = False, threads: int = 1) -> None:
        """Ask to join; the other ranks must join within ``timeout`` of ``now``.
        ``link_share``: jobs this rank's link carries at once (``protocol.Join``);
        ``rejoin``: the job ran on a switch at this address that went away;
        ``threads``: the I/O threads this rank would send with."""
        host, port = data_addr
        self._send(protocol.Join(self.job, self.rank, self.world_size, (str(host), int(port)),
                                 slots, rcvbuf, mtu, self.wait_for_slots > 0, self.version,
                                 link_share=link_share, key=self.key, rejoin=rejoin,
                                 threads=threads))
        self._join_deadline = self._deadline = now + self.timeout
        self._answer_by = now + self._answer_within

    def gather(self, value: str, now: float) -> None:
        """Send this rank's ``value`` for the job's allgather (before a join: the
        host records); the other ranks must send theirs within ``timeout``."""
        self._send(protocol.Gather(self.job, self.rank, self.world_size, value,
                                   version=self.version, key=self.key))
        self._join_deadline = self._deadline = now + self.timeout
        self._answer_by = now + self._answer_within

    @property
    def key(self) -> str | None:
        """The job's public key (its identity on the switch), None for an open job."""
        return self._key.public if self._key is not None else None

    def _answer(self, challenge: Challenge) -> list:
        """Prove the request the switch challenged: the job's secret, its token."""
        if challenge.rank != self.rank:
            return self._fail(SwitchUnreachableError(
                f"the {self.where} challenged rank {challenge.rank}, not this rank "
                f"{self.rank}"))
        if challenge.admission and self._switch_token is None:
            return self._fail(AuthenticationError(
                f"job '{self.job}' rank {self.rank}: the {self.where} admits only workers "
                f"that know its admission token: set SWITCHML_SWITCH_TOKEN (or "
                f"SWITCHML_SWITCH_TOKEN_FILE)", "admission"))
        message = auth.transcript(challenge.nonce, self.job, self.rank, self.key)
        admission = (auth.admission_proof(self._switch_token, message)
                     if challenge.admission and self._switch_token is not None else None)
        signature = self._key.sign(message) if self._key is not None else None
        self._send(protocol.Prove(self.rank, signature, admission))
        return []

    def leave(self) -> None:
        """This rank is done (the switch answers ``Left``)."""
        self._send(protocol.Leave())

    def abort(self, error: SwitchMLError) -> None:
        """This rank gives up on the job: the switch fails it for every rank."""
        self._send(protocol.Abort(str(error), tuple(getattr(error, "missing_ranks", ())),
                                  isinstance(error, SwitchUnreachableError),
                                  tuple(getattr(error, "culprits", ()))))

    def query_status(self, pending) -> None:
        """Ask which ranks contributed to ``pending`` (slot, message number) pairs."""
        self._send(protocol.StatusQuery(tuple((int(s), int(m)) for s, m in pending)))

    def data_to_send(self) -> bytes:
        """The bytes to write to the control connection now."""
        out, self._outbox = bytes(self._outbox), bytearray()
        return out

    def _send(self, message: protocol.Request) -> None:
        self._outbox += message.encode()

    # ------------------------------------------------------------ what came in
    def receive_data(self, data: bytes, now: float) -> list:
        """Events in the bytes the control connection delivered (lines may be split
        across reads, or several in one)."""
        if self.state == CLOSED:
            return []
        self.heard = self.heard or bool(data)
        try:
            lines = self._reader.feed(data)
            events = [protocol.decode_event(line) for line in lines]
        except ValueError as exc:  # not JSON lines, or not the events we know the form of
            log.debug("malformed control message: %s", exc)
            return self._fail(SwitchUnreachableError(
                f"the {self.where} sent a malformed control message: {exc}"))
        self._understood = self._understood or bool(events)
        if events and self.state == JOINING:  # the switch is there: ask again after silence
            self._answer_by, self._ask_at = None, now + SWITCH_SILENCE_S
        out: list = []
        for event in events:
            if self.state == CLOSED:
                break
            if event is not None:  # None: news of a newer switch, not for us
                out += self._on_event(event, now)
        return out

    def connection_lost(self, exc: OSError | None = None) -> list:
        """The control connection closed (``exc``: or failed)."""
        if self.state == CLOSED:
            return []
        if self.state == JOINING:
            why = (f"lost the {self.where} while joining: {exc}" if exc is not None
                   else f"the {self.where} closed the connection while joining")
        elif exc is not None:  # ETIMEDOUT: keepalive probes went unanswered
            why = f"the control connection to the {self.where} failed: {exc}"
        else:
            why = (f"the {self.where} closed the control connection "
                   f"(switch stopped or crashed?)")
        running = self.state == RUNNING
        self.state, self.error = CLOSED, SwitchUnreachableError(why)
        return [JobFailed(self.error, switch_lost=running)]

    def get_timer(self) -> float | None:
        """When ``handle_timer`` must run: the join's deadline (or sooner, the end of
        the wait for a rank with this one's secret, or for the switch's first
        answer), None once running."""
        if self.state != JOINING:
            return None
        ask_at = self._ask_at if self._answer_by is None else None
        deadlines = [d for d in (self._deadline, self._other_secret_deadline, self._answer_by,
                                 ask_at) if d is not None]
        return min(deadlines, default=None)

    def handle_timer(self, now: float) -> list:
        """Past the join's deadline: the ranks missing, or the room not found; past the
        wait for a rank with this one's secret: the secret taken for a wrong one."""
        if self.state != JOINING:
            return []
        if self._other_secret_deadline is not None and now >= self._other_secret_deadline:
            return self._fail(SecretMismatchError(
                f"job '{self.job}' rank {self.rank}: ranks of a job named '{self.job}' are "
                f"waiting on the {self.where} with a different secret, and no rank with "
                f"this one's secret joined: give every rank of the job the same secret "
                f"(secret=, SWITCHML_JOB_SECRET), or none to all"))
        if not self._understood and self._answer_by is not None and now >= self._answer_by:
            # not a slow rank of the job: nothing that answers joins, or a hung switch
            self.unanswered = True
            return self._fail(SwitchUnreachableError(
                f"job '{self.job}' rank {self.rank}: the {self.where} did not answer the "
                f"join within {self._answer_within:g}s (is a switchml switch listening "
                f"there, and running?)"))
        if self._answer_by is not None and now >= self._answer_by:
            return self._fail(SwitchUnreachableError(
                f"job '{self.job}' rank {self.rank}: the {self.where} answered the join, "
                f"then did not answer a status query within {self._answer_within:g}s "
                f"(stopped or hung?) while ranks {self._missing()} were awaited"))
        if self._answer_by is None and self._ask_at is not None and now >= self._ask_at:
            self.query_status(())
            self._answer_by = now + self._answer_within
        if self._deadline is None or now < self._deadline:
            return []
        waiting = self._waiting
        if waiting is not None:
            return self._fail(LimitExceededError(
                f"job '{self.job}' waited {self.wait_for_slots:g}s for room in the "
                f"{self.where}: {waiting.message} (limit: {waiting.limit})", waiting.limit))
        missing = self._missing()
        other = ("; a rank joined under this job's name with another secret (or none) "
                 "meanwhile: every rank of a job needs the same secret (secret=, "
                 "SWITCHML_JOB_SECRET)" if self._other_secret_seen else "")
        return self._fail(SwitchMLTimeoutError(
            f"job '{self.job}': ranks {missing} did not join within {self.timeout:g}s"
            f"{other}", missing))

    def _missing(self) -> list[int]:
        return sorted(set(range(self.world_size)) - set(self._present))

    def _on_event(self, event, now: float) -> list:
        if isinstance(event, Failed):
            if event.mismatch:
                return self._fail(CallMismatchError(f"job '{self.job}' failed: {event.reason}"))
            if event.switch_lost:  # a rank gave up on a switch of the job that went away
                return self._fail(SwitchUnreachableError(
                    f"job '{self.job}' failed: {event.reason}"))
            return self._fail(SwitchMLTimeoutError(f"job '{self.job}' failed: {event.reason}",
                                                   event.missing, culprits=event.culprits))
        if self.state == JOINING:
            if isinstance(event, Challenge):
                return self._answer(event)
            if isinstance(event, Gathered):
                self.gathered = event
                self._other_secret_deadline = None
            elif isinstance(event, Ready):
                self.state, self.ready = RUNNING, event
            elif isinstance(event, Joined):  # (again) gathering ranks: the join deadline holds
                self._present, self._waiting = event.present, None
                self._deadline = self._join_deadline
                if len(event.present) > 1:  # a rank with this one's secret: it is right
                    self._other_secret_deadline = None
            elif isinstance(event, OtherSecretWaiting):
                if len(self._present) <= 1:
                    self._other_secret_deadline = now + self.other_secret_grace
            elif isinstance(event, OtherSecretSeen):
                self._other_secret_seen = True
            elif isinstance(event, Waiting):
                if self._waiting is None:
                    self._deadline = now + self.wait_for_slots
                self._waiting = event
                log.info("job '%s' waits for room in the switch: %s", self.job, event.message)
            elif isinstance(event, Error):
                return self._fail(self._refusal(event))
        return [event]

    def _refusal(self, error: Error) -> SwitchMLError:
        if error.version is not None and error.version != self.version:
            return ProtocolVersionError(
                f"the {self.where} speaks control protocol version {error.version} and this "
                f"worker version {self.version}: run the same switchml release on both "
                f"({error.message})", switch_version=error.version, worker_version=self.version)
        if error.reason == UNREACHABLE:
            return SwitchUnreachableError(error.message)
        if error.reason is not None:
            return AuthenticationError(error.message, error.reason)
        if error.limit:
            return LimitExceededError(error.message, error.limit)
        return JoinRefusedError(error.message)

    def _fail(self, error: SwitchMLError) -> list:
        self.state, self.error = CLOSED, error
        return [JobFailed(error)]

    # ------------------------------------------------------------ diagnosis
    def stall_error(self, status: StatusReply, timeout: float) -> SwitchMLTimeoutError:
        """The error of a call without progress for ``timeout`` s, naming the ranks
        whose contributions the switch's stalled slots lack (all, if it cannot tell)."""
        everyone = set(range(self.world_size))
        missing = set()
        for _slot, _number, holds, bitmap in status.slots:
            if holds:
                missing |= {r for r in everyone if not bitmap >> r & 1}
        if not missing:
            missing = everyone
        return SwitchMLTimeoutError(
            f"job '{self.job}': no progress for {timeout:g}s; ranks {sorted(missing)} "
            f"did not contribute", missing)
