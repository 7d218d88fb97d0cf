"""The switch's file descriptors: its limit raised at start, its configuration checked
against it.

Every control connection is a descriptor, and most hosts start a process with a
soft ``RLIMIT_NOFILE`` of 1024 however high the hard limit is.  A switch takes
the hard limit at start (any process may raise its soft limit that far), and
refuses a configuration whose jobs could need more descriptors than that: the
members of ``max_jobs`` jobs of ``max_workers`` ranks each (a rack switch's
jobs two more for their spine), ``max_unjoined`` connections waiting to join,
the data threads' sockets and a reserve for the rest (listener, data socket,
selector, metrics, the interpreter's own files).  A switch that would run out
mid-flight, refusing members' connections, stops at start instead, naming both
numbers.
"""

from __future__ import annotations

import logging

from ..config import SwitchConfiguration, auto_switch_threads
from .dataplane.pipeline import MAX_WORKERS

try:
    import resource
except ImportError:  # not POSIX: nothing to raise, nothing to check against
    resource = None  # type: ignore[assignment]

log = logging.getLogger("switchml.switch")

#: Descriptors kept for what is not a job's: sockets, selector, metrics, the interpreter's.
RESERVED_DESCRIPTORS = 64
#: Where the kernel's ceiling on a process's descriptors is (an unlimited hard limit's).
NR_OPEN = "/proc/sys/fs/nr_open"


def descriptors_needed(config: SwitchConfiguration) -> int:
    """The most descriptors a switch of ``config`` may hold at once (module docstring).
    A running job needs one slot at least, so the pool bounds the jobs too."""
    jobs = min(config.max_jobs, config.slots)
    per_job = MAX_WORKERS + (2 if config.upstream is not None else 0)
    return RESERVED_DESCRIPTORS + _threads(config) + config.max_unjoined + jobs * per_job


def _threads(config: SwitchConfiguration) -> int:
    """Its data threads' sockets at most (the default's, half the cores, at most
    ``MAX_AUTO_SWITCH_THREADS``, where the data plane is not known yet)."""
    return config.threads if config.threads is not None else auto_switch_threads()


def raise_limit() -> int | None:
    """Raise the soft RLIMIT_NOFILE to the hard limit; the limit now (None: no limits
    here).  An unlimited hard limit is the kernel's ceiling (``fs.nr_open``)."""
    if resource is None:
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard
    if hard == resource.RLIM_INFINITY:
        try:
            with open(NR_OPEN) as f:
                target = int(f.read())
        except (OSError, ValueError):
            target = 1 << 20
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:  # a sandbox that forbids it: keep the soft one
            log.warning("could not raise the descriptor limit from %d to %d: %s",
                        soft, target, exc)
    return None if soft == resource.RLIM_INFINITY else soft


def check_fits(config: SwitchConfiguration, limit: int | None) -> None:
    """Refuse ``config`` (ValueError naming both numbers) when its jobs could
    need more descriptors than ``limit``."""
    needed = descriptors_needed(config)
    if limit is None or needed <= limit:
        return
    per_job = MAX_WORKERS + (2 if config.upstream is not None else 0)
    room = (limit - RESERVED_DESCRIPTORS - _threads(config) - config.max_unjoined) // per_job
    fix = (f"lower --max-jobs to {room}" if room >= 1 else
           "lower --max-unjoined")
    raise ValueError(
        f"the switch may need {needed} file descriptors ({min(config.max_jobs, config.slots)} "
        f"jobs of up to {MAX_WORKERS} workers, {config.max_unjoined} connections waiting to "
        f"join, {RESERVED_DESCRIPTORS + _threads(config)} of its own), more than its limit of "
        f"{limit} (RLIMIT_NOFILE, raised to the hard limit): raise the hard limit "
        f"(ulimit -Hn, systemd LimitNOFILE=) or {fix}")
