"""Exceptions raised by switchml; every failure a user can see is one of these."""

from __future__ import annotations


class SwitchMLError(Exception):
    """Base class of every switchml error."""


class SwitchMLTimeoutError(SwitchMLError, TimeoutError):
    """Ranks of the job did not contribute (or join) in time, or left it.

    ``missing_ranks`` lists the ranks that did not contribute; it may be empty when
    the switch could not tell (for instance because it is unreachable).
    ``culprits``: where this job serves another (a local stage's shard job, whose
    ranks are hosts), the ranks of that one that caused the failure, as the rank
    that gave up named them.
    """

    def __init__(self, message: str, missing_ranks=(), *, culprits=()):
        super().__init__(message)
        self.missing_ranks = sorted(missing_ranks)
        self.culprits = sorted(culprits)


class CallMismatchError(SwitchMLError, ValueError):
    """Ranks of the job disagree on a call: element count, dtype, sparse mode, or
    which call comes next.  The switch saw it in their first packets and failed the
    job; the message names what each side asked for.  Every rank gets it."""


class JoinRefusedError(SwitchMLError):
    """The switch refused to admit this worker to the job; the message says why."""


class LimitExceededError(JoinRefusedError):
    """The job does not fit within one of the switch's limits; ``limit`` names which.

    ``limit`` is one of ``"max_workers"`` (the contribution bitmap's width),
    ``"max_jobs"`` (jobs the switch runs at once) or ``"slots"`` (the job's window
    does not fit in the free part of the slot pool).  Raised at join, or after
    ``wait_for_slots`` seconds when the worker asked to wait for room.
    """

    def __init__(self, message: str, limit: str):
        super().__init__(message)
        self.limit = limit


class MetricsUnavailableError(SwitchMLError, ImportError):
    """Prometheus metrics were asked for but prometheus-client is not installed."""


class DataPlaneUnavailableError(SwitchMLError, RuntimeError):
    """The data plane asked for (``data_plane="xdp"``) cannot run on this host: the
    message says what is missing."""


class SwitchUnreachableError(SwitchMLError, ConnectionError):
    """The switch could not be reached, or closed its connection during the job."""


class ProtocolVersionError(JoinRefusedError):
    """The switch speaks another version of the control protocol than this worker:
    the message names both (``switch_version``, ``worker_version``)."""

    def __init__(self, message: str, switch_version: int, worker_version: int):
        super().__init__(message)
        self.switch_version = switch_version
        self.worker_version = worker_version


class AuthenticationError(JoinRefusedError):
    """The switch refused a join or gather that could not prove what it must:
    the job's secret (``reason`` ``"authentication"``) or the switch's admission
    token (``reason`` ``"admission"``).  The message names the job and the rank,
    never a secret or a token."""

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason


class SecretMismatchError(AuthenticationError):
    """Ranks of a job of this name wait on the switch with another secret (or
    none), and no rank with this one's secret joined it within a second or so:
    the secret given to this rank is, most likely, not the one its job's other
    ranks have (``reason`` ``"secret_mismatch"``).  A job is its name and its
    secret, so without this the rank would wait out its whole timeout in a job
    of its own."""

    def __init__(self, message: str):
        super().__init__(message, "secret_mismatch")


class AuthUnavailableError(SwitchMLError, ImportError):
    """A job secret or an admission token was given, but the ``cryptography``
    package that signs and checks them is not installed (the ``auth`` extra:
    ``pip install 'cryptography>=42'``)."""
