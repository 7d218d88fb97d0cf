"""The control protocol's messages: one typed class each, and its version.

Control messages travel as JSON objects, one per line, over the switch's TCP
control port (docs/protocol.md, "Joining").  A worker's requests carry ``"op"``
(``Gather``, ``Join``, ``Prove``, ``Leave``, ``Abort``, ``StatusQuery``,
``StatsQuery``; a rack switch's ``RackJoin``); the switch's answers carry
``"event"`` (``Challenge``, ``Gathered``, ``Joined``, ``Ready``, ``Waiting``,
``OtherSecretWaiting``, ``OtherSecretSeen``, ``Error``, ``Failed``, ``Left``,
``StatusReply``, ``StatsReply``; to a rack switch, ``RackReady``).  Every field name and
every check of a field lives here, so that the switch's controller
(``switch/control.py``), the worker's client (``worker/control.py``) and the CLI
build and read the same messages.  Data packets are another format
(``wire.py``).

``to_dict`` gives the JSON object, ``encode`` the line; ``decode_request`` and
``decode_event`` read one back, checking every field: a peer is never trusted
with a type or a range.

A ``Join`` carries ``version``; a switch that speaks another version refuses it
with an ``Error`` naming both (and its own in ``version``).  A join without one
is taken as version 1, what clients sent before the field existed.

A join or gather of an authenticated job carries the job's public ``key``
(``auth.py``); the switch answers it, and any request where the switch has an
admission token, with a ``Challenge``, and takes the request once its ``Prove``
checks out.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from . import wire
from .auth import ADMISSION_HEX, KEY_HEX, SIGNATURE_HEX
from .netutil import encode_line, is_ipv4

#: Version of the control protocol this code speaks (``Join.version``).
PROTOCOL_VERSION = 2  # 2: Challenge and Prove, job keys, per-rank data tokens
#: Longest job name, abort reason and error message kept, in characters.
MAX_NAME = 200
#: Smallest MTU a worker may report: IPv4's minimum.
MIN_MTU = 68
#: Most rows a status query asks for; the rest are ignored.
MAX_STATUS_ROWS = 4096
#: Most I/O threads a rank sends one job's calls with (``Join.threads``).
MAX_WORKER_THREADS = 64
#: Most data threads a switch says it answers with (``Ready.data_threads``).
MAX_DATA_THREADS = 64
#: ``Error.reason`` of a request that needed a switch which could not be reached
#: (a rack switch's spine): the worker's ``SwitchUnreachableError``.
UNREACHABLE = "unreachable"
#: Most ranks a gather takes (ranks, not hosts: the switch's 32 members of a job
#: are hosts once the ranks of a host combine).
MAX_GATHER_RANKS = 4096


class BadRequest(ValueError):
    """A control message with a missing or invalid field."""


class UnknownMessage(BadRequest):
    """Not a control request at all: not a JSON object, or an ``op`` nobody knows."""


class VersionMismatch(BadRequest):
    """A join in a protocol version this code does not speak; names both."""

    def __init__(self, theirs):
        self.theirs = theirs
        super().__init__(f"protocol version {theirs!r} unsupported: this switch speaks "
                         f"version {PROTOCOL_VERSION}; run the same switchml on the "
                         f"switch and the workers"[:MAX_NAME])


class MalformedMessage(ValueError):
    """An answer from the switch with a missing or mistyped field."""


def _integer(msg: dict, key: str, low: int, high: int, default=None) -> int:
    """Field ``key`` as an int in [low, high]; JSON floats, NaN and Infinity refused."""
    value = msg.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"{key} must be an integer, got {value!r}"[:MAX_NAME])
    if not low <= value <= high:
        raise BadRequest(f"{key} {value} is outside {low}..{high}"[:MAX_NAME])
    return value


def _hex(msg: dict, key: str, length: int) -> str | None:
    """Field ``key`` as ``length`` lower-case hex digits, or None when absent."""
    value = msg.get(key)
    if value is None:
        return None
    if (not isinstance(value, str) or len(value) != length
            or value.strip("0123456789abcdef")):
        raise BadRequest(f"{key} must be {length} hex digits"[:MAX_NAME])
    return value


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class Message:
    """A control message: ``to_dict`` is its JSON object, ``encode`` its line."""

    #: "op" for requests, "event" for answers; and the value it takes.
    kind: ClassVar[str]
    name: ClassVar[str]

    def fields(self) -> dict:
        """The message's own fields, as they go on the wire."""
        return {}

    def to_dict(self) -> dict:
        return {self.kind: self.name, **self.fields()}

    def encode(self) -> bytes:
        return encode_line(self.to_dict())


# ---------------------------------------------------------------- requests (worker -> switch)
class Request(Message):
    kind = "op"


@dataclass(frozen=True)
class Join(Request):
    """A rank asks to join its job: where its data socket is and what its path allows."""

    name = "join"
    job: str
    rank: int
    world_size: int
    data_addr: tuple[str, int]
    slots: int | None = None      # the window it asks for; None: the switch's slots_per_job
    rcvbuf: int = 0               # its data socket's receive buffer, bytes (0: unknown)
    mtu: int | None = None        # MTU of its route to the switch (None: unknown)
    wait: bool = False            # wait for room rather than be refused
    version: int = PROTOCOL_VERSION
    #: Jobs whose packets the rank's link carries at once (the local stage's shards,
    #: one job each): the job's window is the link's over this.
    link_share: int = 1
    #: The job's public key (``auth.JobKey.public``): its identity on the switch.
    #: None: an open job, joined by name alone.
    key: str | None = None
    #: The rank's job ran on a switch at this address that went away (a restarted
    #: switch counts the job as rejoined; it is otherwise a join like any other).
    rejoin: bool = False
    #: I/O threads the rank would send with, each a job of its own on the switch
    #: (``multi.py``): the job takes the least any rank asks for (``Ready.threads``).
    threads: int = 1

    def fields(self) -> dict:
        out = {"version": self.version, "job": self.job, "rank": self.rank,
               "world_size": self.world_size, "data_addr": list(self.data_addr),
               "slots": self.slots, "rcvbuf": self.rcvbuf, "mtu": self.mtu, "wait": self.wait}
        if self.link_share != 1:
            out["link_share"] = self.link_share
        if self.key is not None:
            out["key"] = self.key
        if self.rejoin:
            out["rejoin"] = True
        if self.threads != 1:
            out["threads"] = self.threads
        return out

    @classmethod
    def from_dict(cls, msg: dict) -> Join:
        """The checks a switch makes of a join; BadRequest (or VersionMismatch) names
        the first field that fails."""
        if msg.get("version", 1) != PROTOCOL_VERSION:
            raise VersionMismatch(msg.get("version", 1))
        if not {"job", "rank", "world_size", "data_addr"} <= msg.keys():
            raise BadRequest("join needs job, rank, world_size and data_addr")
        job = str(msg["job"])[:MAX_NAME]
        world = _integer(msg, "world_size", 1, 2**31)
        rank = _integer(msg, "rank", 0, 2**31)
        addr = msg["data_addr"]
        if not (isinstance(addr, list) and len(addr) == 2 and is_ipv4(addr[0])):
            raise BadRequest("data_addr must be [IPv4 address, port]")
        address = (addr[0], _integer({"port": addr[1]}, "port", 1, 65535))
        slots = _integer(msg, "slots", 1, 2**31) if msg.get("slots") is not None else None
        rcvbuf = _integer(msg, "rcvbuf", 0, 2**62) if msg.get("rcvbuf") is not None else 0
        mtu = _integer(msg, "mtu", MIN_MTU, 1 << 20) if msg.get("mtu") is not None else None
        share = _integer(msg, "link_share", 1, MAX_GATHER_RANKS, 1)
        return cls(job, rank, world, address, slots, rcvbuf, mtu, msg.get("wait") is True,
                   link_share=share, key=_hex(msg, "key", KEY_HEX),
                   rejoin=msg.get("rejoin") is True,
                   threads=_integer(msg, "threads", 1, MAX_WORKER_THREADS, 1))


@dataclass(frozen=True)
class RackJoin(Join):
    """A rack switch relays one of its workers' joins to the spine (docs/protocol.md,
    "Two levels"): ``data_addr`` is the rack's own address in the spine's job, the
    same for every rank it relays on one connection; ``mtu`` the least of the
    worker's path and the rack's path to the spine; ``rack`` the rack switch's
    own "host:port", which names it in errors."""

    name = "rack_join"
    rack: str = ""

    def fields(self) -> dict:
        return {**super().fields(), "rack": self.rack}

    @classmethod
    def from_dict(cls, msg: dict) -> RackJoin:
        join = Join.from_dict(msg)
        return cls(join.job, join.rank, join.world_size, join.data_addr, join.slots,
                   join.rcvbuf, join.mtu, join.wait, link_share=join.link_share,
                   key=join.key, rack=str(msg.get("rack", ""))[:MAX_NAME])


@dataclass(frozen=True)
class Leave(Request):
    """The rank is done with the job (its slots are freed once every rank left)."""

    name = "leave"


@dataclass(frozen=True)
class Abort(Request):
    """The rank gave up (no progress within its timeout): the job fails for all."""

    name = "abort"
    reason: str = "no progress"
    missing: tuple[int, ...] = ()  # the ranks it saw missing
    #: it gave up because a switch went away (one of a job over several): the
    #: others learn a switch failure, not a stall
    switch_lost: bool = False
    #: Ranks of the job this one serves that caused it (a local stage's shard job,
    #: whose ranks are hosts, gives up because a rank of its host died): passed
    #: on to the other ranks in ``Failed.culprits``.
    culprits: tuple[int, ...] = ()
    #: A rack switch's: ranks behind it disagreed on a call (``reason`` says how):
    #: the others learn a mismatch (``Failed.mismatch``), not a stall.
    mismatch: bool = False

    def fields(self) -> dict:
        out: dict = {"reason": self.reason, "missing": list(self.missing)}
        if self.switch_lost:
            out["switch_lost"] = True
        if self.culprits:
            out["culprits"] = list(self.culprits)
        if self.mismatch:
            out["mismatch"] = True
        return out

    @classmethod
    def from_dict(cls, msg: dict) -> Abort:
        """Lenient: a gone rank's last word is never refused; what is not a rank is
        left out (the controller also drops ranks outside the job)."""
        return cls(str(msg.get("reason", "no progress"))[:MAX_NAME], _ranks_in(msg, "missing"),
                   msg.get("switch_lost") is True, _ranks_in(msg, "culprits"),
                   msg.get("mismatch") is True)


def _ranks_in(msg: dict, key: str) -> tuple[int, ...]:
    """The integers of list ``msg[key]`` (none where it is no list)."""
    said = msg.get(key)
    return tuple(r for r in (said if isinstance(said, list) else []) if _is_int(r))


@dataclass(frozen=True)
class StatusQuery(Request):
    """Which ranks contributed to these (slot, message number) pairs: a stalled
    rank's question before it names the missing ranks."""

    name = "status"
    slots: tuple[tuple[int, int], ...] = ()

    def fields(self) -> dict:
        return {"slots": [list(pair) for pair in self.slots]}

    @classmethod
    def from_dict(cls, msg: dict) -> StatusQuery:
        """Lenient: rows that are not [slot, number] in range are left out."""
        asked = msg.get("slots")
        rows = []
        for item in (asked if isinstance(asked, list) else [])[:MAX_STATUS_ROWS]:
            if (isinstance(item, list) and len(item) == 2 and all(map(_is_int, item))
                    and 0 <= item[1] <= 0xFFFFFFFF):
                rows.append((item[0], item[1]))
        return cls(tuple(rows))


@dataclass(frozen=True)
class Gather(Request):
    """A rank's ``value`` for an allgather among its job's ranks: the switch answers
    every rank with ``Gathered`` once all ``world_size`` sent theirs (the ranks
    exchange their host records this way before they join: worker/local/hosts.py).
    Nothing of it stays on the switch once answered."""

    name = "gather"
    job: str
    rank: int
    world_size: int
    value: str
    version: int = PROTOCOL_VERSION
    key: str | None = None  # as Join.key

    def fields(self) -> dict:
        out = {"version": self.version, "job": self.job, "rank": self.rank,
               "world_size": self.world_size, "value": self.value}
        if self.key is not None:
            out["key"] = self.key
        return out

    @classmethod
    def from_dict(cls, msg: dict) -> Gather:
        if msg.get("version", 1) != PROTOCOL_VERSION:
            raise VersionMismatch(msg.get("version", 1))
        value = msg.get("value")
        if not isinstance(value, str) or len(value) > MAX_NAME:
            raise BadRequest(f"value must be text of at most {MAX_NAME} characters")
        world = _integer(msg, "world_size", 1, MAX_GATHER_RANKS)
        rank = _integer(msg, "rank", 0, world - 1)
        return cls(str(msg.get("job", ""))[:MAX_NAME], rank, world, value,
                   key=_hex(msg, "key", KEY_HEX))


@dataclass(frozen=True)
class Prove(Request):
    """A rank's answer to a ``Challenge``: the job key's ``signature`` and the
    switch token's ``admission`` proof over ``auth.transcript`` (each where asked)."""

    name = "prove"
    rank: int
    signature: str | None = None
    admission: str | None = None

    def fields(self) -> dict:
        out: dict = {"rank": self.rank}
        if self.signature is not None:
            out["signature"] = self.signature
        if self.admission is not None:
            out["admission"] = self.admission
        return out

    @classmethod
    def from_dict(cls, msg: dict) -> Prove:
        return cls(_integer(msg, "rank", 0, 2**31), _hex(msg, "signature", SIGNATURE_HEX),
                   _hex(msg, "admission", ADMISSION_HEX))


@dataclass(frozen=True)
class StatsQuery(Request):
    """The switch's counters (``switchml stats``)."""

    name = "stats"


REQUESTS: dict[str, Any] = {"join": Join, "rack_join": RackJoin, "prove": Prove, "leave": Leave,
                            "abort": Abort, "status": StatusQuery, "stats": StatsQuery,
                            "gather": Gather}


def decode_request(msg) -> Request:
    """A decoded JSON line as a request; UnknownMessage, BadRequest or VersionMismatch."""
    op = msg.get("op") if isinstance(msg, dict) else None
    cls = REQUESTS.get(op) if isinstance(op, str) else None
    if cls is None:
        raise UnknownMessage(f"unknown control message {op!r}"[:MAX_NAME])
    from_dict = getattr(cls, "from_dict", None)
    return from_dict(msg) if from_dict else cls()


# ---------------------------------------------------------------- events (switch -> worker)
class Event(Message):
    kind = "event"


@dataclass(frozen=True)
class Joined(Event):
    """Who of the job is present so far (while ranks are missing)."""

    name = "joined"
    job: str
    present: tuple[int, ...]

    def fields(self) -> dict:
        return {"job": self.job, "present": list(self.present)}


@dataclass(frozen=True)
class Ready(Event):
    """Every rank joined and the job fits: its session, slots and packet geometry."""

    name = "ready"
    session: int
    slot_base: int
    slot_count: int
    packet_elements: int
    block_elements: int
    data_port: int
    #: The window one link carries (the job's request); ``slot_count`` is its
    #: ranks' share of it on a switch behind a link they share
    #: (``SwitchConfiguration.shared_link``).  A job over several switches
    #: splits this over its links (``multi.py``).  None: ``slot_count`` (a rack
    #: switch's, an older switch's).
    link_window: int | None = field(default=None, kw_only=True)
    #: This rank's data-plane token: what its datagrams to the switch carry in the
    #: header's session field (results carry ``session``), so that no other
    #: member, and no spoofed source address, passes as this rank.  Each rank
    #: gets its own over its own connection.  0: ``session`` (an older switch's).
    token: int = field(default=0, kw_only=True)
    #: Whether the switch takes runs of UDP GSO segments: False where a run could
    #: reach its data plane whole (the XDP program sees a sender's run before the
    #: kernel cuts it), so the workers send each datagram apart.
    gso: bool = field(default=True, kw_only=True)
    #: I/O threads every rank of the job sends with: the least its ranks asked for
    #: (``Join.threads``); ``slot_count`` and ``link_window`` are one thread's
    #: share.  1: one (a rack switch's, an older switch's).
    threads: int = field(default=1, kw_only=True)
    #: The switch's data threads: thread ``slot % data_threads`` answers a slot's
    #: datagrams, in the order they came, and another thread's results may
    #: overtake them by any number (a thread waits for a core), so a worker counts
    #: overtaking results within a thread's slots only.  1: one (a Python, XDP or
    #: rack switch's, an older switch's).
    data_threads: int = field(default=1, kw_only=True)

    def fields(self) -> dict:
        out = {"session": self.session, "slot_base": self.slot_base,
               "slot_count": self.slot_count, "packet_elements": self.packet_elements,
               "block_elements": self.block_elements, "data_port": self.data_port,
               "token": self.token}
        if self.link_window is not None:
            out["link_window"] = self.link_window
        if not self.gso:
            out["gso"] = False
        if self.threads != 1:
            out["threads"] = self.threads
        if self.data_threads != 1:
            out["data_threads"] = self.data_threads
        return out


@dataclass(frozen=True)
class RackReady(Ready):
    """``Ready`` for a rack switch: the spine's job, in which the rack is member
    ``member`` of ``members`` (its partial sums go to the spine's slots) for the
    job's ranks ``ranks``, which the rack checks are the ones it has."""

    name = "rack_ready"
    member: int
    members: int
    ranks: tuple[int, ...] = ()

    def fields(self) -> dict:
        return {**super().fields(), "member": self.member, "members": self.members,
                "ranks": list(self.ranks)}


@dataclass(frozen=True)
class Challenge(Event):
    """The switch asks rank ``rank`` to prove its request (``Prove``): a fresh
    ``nonce``; ``admission``: whether the switch's admission token must be proven."""

    name = "challenge"
    nonce: str
    rank: int
    admission: bool = False

    def fields(self) -> dict:
        return {"nonce": self.nonce, "rank": self.rank, "admission": self.admission}


@dataclass(frozen=True)
class Waiting(Event):
    """The job is complete but waits for room (every rank asked to wait)."""

    name = "waiting"
    job: str
    limit: str
    message: str

    def fields(self) -> dict:
        return {"job": self.job, "limit": self.limit, "message": self.message}


@dataclass(frozen=True)
class OtherSecretWaiting(Event):
    """To the first rank of a job: ranks of a job of the same name and world size,
    none of them this rank's, gather on the switch under another key (another
    secret, or none).  The two may be one job whose ranks were given different
    secrets; the rank gives up (``SecretMismatchError``) unless a rank with its
    own secret joins it soon.  Nothing about the other job but that."""

    name = "other_secret_waiting"
    job: str

    def fields(self) -> dict:
        return {"job": self.job}


@dataclass(frozen=True)
class OtherSecretSeen(Event):
    """To a gathering job's ranks: a rank joined a job of the same name under
    another key (another secret, or none); their timeout error says so."""

    name = "other_secret_seen"
    job: str

    def fields(self) -> dict:
        return {"job": self.job}


@dataclass(frozen=True)
class Error(Event):
    """A refused or unknown request; ``limit`` names the limit a join hit, ``version``
    the switch's protocol version when the join's was another."""

    name = "error"
    message: str
    limit: str | None = None
    version: int | None = None
    #: "authentication" or "admission": the request's proof failed; UNREACHABLE: a
    #: switch the request needs (a rack switch's spine) could not be reached.
    reason: str | None = None
    #: The rank whose request (a join, a proof) was refused, where the refusal is
    #: that rank's alone: a rack switch, whose ranks share its connection to the
    #: spine, refuses that rank and keeps the others.  None: the whole request's.
    rank: int | None = None

    def fields(self) -> dict:
        out: dict = {"message": self.message}
        if self.limit is not None:
            out["limit"] = self.limit
        if self.version is not None:
            out["version"] = self.version
        if self.reason is not None:
            out["reason"] = self.reason
        if self.rank is not None:
            out["rank"] = self.rank
        return out


@dataclass(frozen=True)
class Failed(Event):
    """The running job failed: ``missing`` ranks, why, and whether ranks disagreed on a
    call (``mismatch``) rather than went away, or a rank gave up because a switch
    went away (``switch_lost``)."""

    name = "failed"
    missing: tuple[int, ...]
    reason: str
    mismatch: bool = False
    switch_lost: bool = False
    #: ``Abort.culprits`` of the rank that gave up: ranks of the job its job serves.
    culprits: tuple[int, ...] = ()

    def fields(self) -> dict:
        out: dict = {"missing": list(self.missing), "reason": self.reason}
        if self.mismatch:
            out["mismatch"] = True
        if self.switch_lost:
            out["switch_lost"] = True
        if self.culprits:
            out["culprits"] = list(self.culprits)
        return out


@dataclass(frozen=True)
class Gathered(Event):
    """Every rank's ``Gather`` value, by rank, and a random ``nonce`` that names this
    gathering (the same for every rank)."""

    name = "gathered"
    job: str
    values: tuple[str, ...]
    nonce: str

    def fields(self) -> dict:
        return {"job": self.job, "values": list(self.values), "nonce": self.nonce}


@dataclass(frozen=True)
class Left(Event):
    """The switch took note of a ``Leave``."""

    name = "left"


@dataclass(frozen=True)
class StatusReply(Event):
    """Rows [slot, number, holds, bitmap]: whether the slot holds that message's
    partial sum, and which ranks' contributions it has."""

    name = "status"
    slots: tuple[tuple[int, int, bool, int], ...] = ()

    def fields(self) -> dict:
        return {"slots": [list(row) for row in self.slots]}


@dataclass(frozen=True)
class StatsReply(Event):
    """The switch's counters, as ``Switch.stats()`` gives them."""

    name = "stats"
    stats: dict = field(default_factory=dict)

    def fields(self) -> dict:
        return {"stats": self.stats}


def _field(msg: dict, key: str, check, what: str, default: Any = ...):
    value = msg.get(key, default)
    if value is ... or not check(value):
        raise MalformedMessage(f"'{msg.get('event')}' needs {key} ({what}), got {value!r}"
                               [:MAX_NAME])
    return value


def _ints(value) -> bool:
    return isinstance(value, list) and all(map(_is_int, value))


def _text(value) -> bool:
    return isinstance(value, str)


def _is_u32(value) -> bool:
    return _is_int(value) and 0 <= value < 1 << 32


def _geometry(msg: dict) -> tuple[int, int, int, int, int, int]:
    """A ready's (session, slot_base, slot_count, packet_elements, block_elements,
    data_port), each in the range the wire's header fields and a datagram hold: a
    switch's out of range (none, or a foreign peer) would make calls return
    untouched arrays or fail deep in the engine."""
    session = _field(msg, "session", lambda v: _is_u32(v) and v > 0, "an integer 1 to 2**32-1")
    base = _field(msg, "slot_base", lambda v: _is_int(v) and 0 <= v < 1 << 16,
                  "an integer 0 to 65535")
    count = _field(msg, "slot_count", lambda v: _is_int(v) and 1 <= v <= (1 << 16) - base,
                   f"an integer 1 to {(1 << 16) - base}")
    block = _field(msg, "block_elements", lambda v: _is_int(v) and v >= 1, "an integer from 1")
    packet = _field(msg, "packet_elements", lambda v: _is_int(v) and v % block == 0
                    and 1 <= v <= wire.max_packet_elements(block),
                    f"whole blocks of {block}, at most {wire.max_packet_elements(block)}")
    port = _field(msg, "data_port", lambda v: _is_int(v) and 1 <= v <= 65535,
                  "a port 1 to 65535")
    return session, base, count, packet, block, port


def decode_event(msg) -> Event | None:
    """A decoded JSON line from the switch as an event; None for an event this code
    does not know (a newer switch's news), MalformedMessage for a known one with
    a missing or mistyped field, or for a line that is not an event at all."""
    if not isinstance(msg, dict) or not isinstance(msg.get("event"), str):
        raise MalformedMessage(f"not a control event: {msg!r}"[:MAX_NAME])
    name = msg["event"]
    if name == "joined":
        return Joined(str(msg.get("job", "")), tuple(_field(msg, "present", _ints, "ranks")))
    if name == "ready":
        return Ready(*_geometry(msg), link_window=_field(
            msg, "link_window", lambda v: v is None or (_is_int(v) and v >= 1),
            "an integer from 1", None),
            token=_field(msg, "token", _is_u32, "an integer 0 to 2**32-1", 0),
            gso=_field(msg, "gso", lambda v: isinstance(v, bool), "true or false", True),
            threads=_field(msg, "threads",
                           lambda v: _is_int(v) and 1 <= v <= MAX_WORKER_THREADS,
                           f"an integer 1 to {MAX_WORKER_THREADS}", 1),
            data_threads=_field(msg, "data_threads",
                                lambda v: _is_int(v) and 1 <= v <= MAX_DATA_THREADS,
                                f"an integer 1 to {MAX_DATA_THREADS}", 1))
    if name == "rack_ready":
        members = _field(msg, "members", lambda v: _is_int(v) and v >= 1, "an integer from 1")
        member = _field(msg, "member", lambda v: _is_int(v) and 0 <= v < members,
                        f"an integer 0 to {members - 1}")
        return RackReady(*_geometry(msg), member, members,
                         tuple(_field(msg, "ranks", _ints, "ranks")),
                         token=_field(msg, "token", _is_u32, "an integer 0 to 2**32-1", 0))
    if name == "waiting":
        return Waiting(str(msg.get("job", "")), str(msg.get("limit")),
                       _field(msg, "message", _text, "text"))
    if name == "error":
        limit, version, reason = msg.get("limit"), msg.get("version"), msg.get("reason")
        rank = msg.get("rank")
        return Error(_field(msg, "message", _text, "text"),
                     limit if isinstance(limit, str) and limit else None,
                     version if _is_int(version) else None,
                     reason if isinstance(reason, str) and reason else None,
                     rank if isinstance(rank, int) and _is_int(rank) and rank >= 0 else None)
    if name == "challenge":
        return Challenge(_field(msg, "nonce", _text, "text"),
                         _field(msg, "rank", _is_int, "an integer"),
                         msg.get("admission") is True)
    if name == "failed":
        return Failed(tuple(_field(msg, "missing", _ints, "ranks", [])),
                      str(msg.get("reason", "")), msg.get("mismatch") is True,
                      msg.get("switch_lost") is True,
                      tuple(_field(msg, "culprits", _ints, "ranks", [])))
    if name == "left":
        return Left()
    if name == "other_secret_waiting":
        return OtherSecretWaiting(str(msg.get("job", "")))
    if name == "other_secret_seen":
        return OtherSecretSeen(str(msg.get("job", "")))
    if name == "gathered":
        values = _field(msg, "values", lambda v: isinstance(v, list) and all(map(_text, v)),
                        "texts")
        return Gathered(str(msg.get("job", "")), tuple(values),
                        _field(msg, "nonce", _text, "text"))
    if name == "status":
        rows = _field(msg, "slots", lambda v: isinstance(v, list) and all(
            isinstance(r, list) and len(r) == 4 and isinstance(r[2], (bool, int))
            and all(map(_is_int, (r[0], r[1], r[3]))) for r in v),
            "rows [slot, number, holds, bitmap]")
        return StatusReply(tuple((s, n, bool(h), b) for s, n, h, b in rows))
    if name == "stats":
        return StatsReply(_field(msg, "stats", lambda v: isinstance(v, dict), "an object"))
    return None
