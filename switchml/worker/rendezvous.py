"""The exchange of host records at join, through the switch's control port.

Every rank of a job sends its ``HostRecord`` to the switch in a ``Gather``; the
switch answers every rank with all of them once the last one came (and drops
them).  Launchers differ in what they tell a process (torchrun's LOCAL_RANK,
srun's SLURM_*, mpirun's OMPI_*, nothing at all for plain processes), so the
ranks find out for themselves, and every rank gets the same list.  The torch
backend exchanges through its store instead (switchml/torch).
"""

from __future__ import annotations

import socket
import time

from ..auth import token_from_env
from ..config import DEFAULT_KEEPALIVE, env
from ..errors import SwitchMLError, SwitchUnreachableError
from ..netutil import enable_keepalive
from .control import ControlClient, JobFailed
from .local.hosts import HostRecord, Hosts, host_record

__all__ = ["exchange_through_switch", "control_events"]


#: Seconds between looks at ``control_events``'s ``stop`` while nothing comes.
STOP_LOOK_S = 0.02


def control_events(conn, client: ControlClient, done, stop=None):
    """Feed what ``conn`` brings to ``client`` (its timers too) until ``done()``:
    each read's events, as a batch; the client's error raises, and so does what
    ``stop()`` returns (looked at every ``STOP_LOOK_S``; None: go on)."""
    while not done():
        if client.error is not None:
            raise client.error
        if stop is not None and (reason := stop()) is not None:
            raise reason
        answer = client.data_to_send()  # a challenge's proof
        if answer:
            try:
                conn.sendall(answer)
            except OSError as exc:
                yield client.connection_lost(exc)
                continue
        timer = client.get_timer()
        left = timer - time.monotonic() if timer is not None else 1.0
        if left <= 0:
            yield client.handle_timer(time.monotonic())
            continue
        conn.settimeout(left if stop is None else min(left, STOP_LOOK_S))
        try:
            data = conn.recv(65536)
        except TimeoutError:
            continue
        except OSError as exc:
            yield client.connection_lost(exc)
        else:
            yield (client.receive_data(data, time.monotonic()) if data
                   else client.connection_lost())


def exchange_through_switch(address: tuple[str, int], job: str, rank: int, world_size: int,
                            timeout: float, record: HostRecord | None = None, *,
                            secret: str | bytes | None = None) -> Hosts:
    """Every rank's record, through the switch at ``address``: ``Hosts``.  The ranks
    missing after ``timeout`` seconds are named (``SwitchMLTimeoutError``).
    ``secret``: the job's (``auth.py``)."""
    host, port = address
    where = f"switch at {host}:{port}"
    record = host_record() if record is None else record
    client = ControlClient(job, rank, world_size, timeout=timeout, where=where, secret=secret,
                           switch_token=token_from_env())
    try:
        conn = socket.create_connection((host, port), timeout=min(timeout, 10.0))
    except OSError as exc:
        raise SwitchUnreachableError(f"cannot reach the {where}: {exc}") from None
    with conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        client.gather(record.encode(), time.monotonic())
        conn.sendall(client.data_to_send())  # at once: the switch's lobby (lobby.py)
        enable_keepalive(conn, env("KEEPALIVE", DEFAULT_KEEPALIVE, float))
        for events in control_events(conn, client, lambda: client.gathered is not None):
            for event in events:
                if isinstance(event, JobFailed):
                    raise event.error
    gathered = client.gathered
    assert gathered is not None  # control_events ends only then, or raises
    try:
        records = tuple(HostRecord.decode(value) for value in gathered.values)
    except ValueError as exc:
        raise SwitchMLError(f"job '{job}': a rank sent a host record this release cannot "
                            f"read ({exc}): run the same switchml on every rank") from None
    if len(records) != world_size:
        raise SwitchMLError(f"job '{job}': the {where} returned {len(records)} host records "
                            f"for {world_size} ranks")
    return Hosts(records, gathered.nonce)
