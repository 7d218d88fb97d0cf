r"""Settings from SWITCHML_* environment variables, as NCCL_* configure NCCL.

==========================  =======================================  ==========
variable                    meaning                                  default
==========================  =======================================  ==========
SWITCHML_SWITCH             switch control address, host:port        (none)
                            (one job over several switches:
                            host:port,host:port)
SWITCHML_TIMEOUT            seconds without progress before error    30
SWITCHML_JOB                job name shared by a job's workers       default
SWITCHML_HOST               bind address of a switch this process    127.0.0.1
                            starts (SwitchConfiguration, below)
SWITCHML_PORT               its port (0: any free one)               7300 (CLI),
                                                                     0 (Python)
SWITCHML_SLOTS              slots in the switch's pool (a torch      256
                            job's own switch: slots_per_job x
                            max_jobs unless this is set)
SWITCHML_PACKET_ELEMENTS    the switch's limit on values per packet  16128
                            (a job's packets fit one frame of its
                            path: see SWITCHML_MTU)
SWITCHML_MTU                a worker's path MTU to the switch        the route's
SWITCHML_BLOCK_ELEMENTS     values per block of the sparse path      256
SWITCHML_SLOTS_PER_JOB      slots a job gets (the most its           32
                            adaptive window may use)
SWITCHML_MAX_JOBS           jobs a switch runs at once               64
SWITCHML_SHARED_LINK        1: the switch is a server behind one     0
                            link all its workers share (no
                            programmable switch): a job's window
                            there is its ranks' share of one link's
                            window
SWITCHML_UPSTREAM           a spine switch's host:port: the switch   (none)
                            this process starts is a rack switch
                            whose jobs' partial sums go up to it
SWITCHML_SPARSE             the torch backend's path: true           auto
                            (sparse), false (dense) or auto
                            (``Worker(sparse="auto")``)
SWITCHML_WORKER_GSO         0: the worker's C engine sends one       1
                            datagram a call instead of runs of
                            UDP GSO segments
SWITCHML_XDP_MODE           an XDP switch's attach: auto (the        auto
                            driver's native mode where it has one,
                            else generic) or generic
SWITCHML_WORKER_GRO         0: the worker's C engine receives one    1
                            datagram a call instead of whole runs
                            (UDP_GRO)
SWITCHML_WORKER_THREADS     I/O threads a rank sends its calls       one per
                            with, each with a socket and a share     8 Gbit/s
                            of the job's slots of its own (the job   of link
                            takes the least any rank asks for;       (1 to 8)
                            ``auto_worker_threads``)
SWITCHML_METRICS_PORT       a switch's Prometheus port               (none)
SWITCHML_KEEPALIVE          seconds within which a vanished peer     20
                            of a control connection is noticed
                            (switch and worker)
SWITCHML_JOIN_DEADLINE      seconds a switch gives a control         5
                            connection to join (or ask for stats)
                            before it closes it
SWITCHML_MAX_UNJOINED       control connections a switch holds that  256
                            have not joined; one more closes the
                            oldest
SWITCHML_MAX_UNJOINED\_     ... from one source address; one more    64
  PER_SOURCE                closes that source's oldest
SWITCHML_WAIT_FOR_SLOTS     seconds a worker waits for room          0
SWITCHML_DROP_RATE          a switch's simulated drop probability    0
SWITCHML_SPARSE_AUTO_UNION  ``sparse="auto"`` goes sparse when the   0.5
                            union of non-zero blocks is at most
                            this share of the tensor
SWITCHML_SPARSE_AUTO_MIN\_  ``sparse="auto"`` stays dense when a     8 (C),
  LANES                     packet holds fewer blocks (the rounds     32
                            cost more than the bytes they save)       (Python)
SWITCHML_SPARSE_AUTO_EVERY  ``sparse="auto"`` measures again after   20
                            this many calls of one size and dtype
SWITCHML_WIRE_BITS          16: float allreduces on the 16-bit wire  32
                            (half the bytes; dense; quant's
                            error_bound16)
SWITCHML_PURE_PYTHON        1: the Python data plane and engine      0
                            even where the C ones are built
SWITCHML_DATA_PLANE         a switch's data plane: python, c or      (C when
                            xdp (an XDP program on the interface     built)
                            holding its host address; root)
SWITCHML_SWITCH_THREADS     data threads of a switch's C data        half the
                            plane, each with the slots s where       cores (1
                            s % threads is its index and a socket    to 8)
                            of its own (a core each)
SWITCHML_XDP_CACHE          where the XDP program, built by clang    ~/.cache/
                            on first use, is kept (or under          switchml/xdp
                            $XDG_CACHE_HOME)
SWITCHML_LOCAL_STAGE        0: ranks that share a host each send     1
                            their whole array through the switch
                            (1: they combine in shared memory
                            first, one rank a shard to the switch)
SWITCHML_LOCAL_GROUP        ranks of one host that name different    (none)
                            groups do not combine (never merges
                            ranks of different hosts)
SWITCHML_LOCAL_SEGMENT      bytes the local stage combines, sends    2 MiB a
                            and copies back at a time (alike on      local thread,
                            every rank of a job, or on none)         at most 8 MiB
SWITCHML_CUDA_COPIES        how a one-host job's CUDA tensors move:  direct
                            direct (each segment by DMA straight
                            to and from the local stage's shared
                            memory), pipelined (each through a
                            pinned host copy, overlapped) or whole
                            (one pinned copy each way)
SWITCHML_LOCAL_THREADS      threads a rank of the local stage        the cores
                            copies and sums with (its own and        over the
                            helpers of the C twin)                   host's
                                                                     ranks (1
                                                                     to 4)
SWITCHML_JOB_SECRET         the job's secret: only ranks that know   (none: an
                            it join the job (every rank the same;    open job;
                            never sent)                              torch: a
                                                                     random one)
SWITCHML_SWITCH_TOKEN       the switch's admission token: a switch   (none)
                            with one creates jobs only for workers
                            that prove they know it (switch and
                            worker)
SWITCHML_SWITCH_TOKEN_FILE  a file holding it (``switchml switch     (none)
                            --token-file``)
SWITCHML_FALLBACK           0: a torch job's calls do not fall back  1
                            to gloo when the switch fails or is
                            full (the switch's error is raised)
SWITCHML_RETRY_S            seconds a torch job's workers wait for   5
                            a switch that went away before its
                            calls go to gloo, and between its
                            probes of the switch while on gloo
==========================  =======================================  ==========

A switch's settings are one ``SwitchConfiguration``, whichever way it starts
(``switchml.Switch``, ``SwitchProcess``, the switch a torch job starts,
``switchml switch``): what the caller passes (keyword argument or flag) wins,
then the SWITCHML_* variable, then the default.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass

from .errors import SwitchMLError

DEFAULT_PORT = 7300
DEFAULT_SLOTS = 256
DEFAULT_PACKET_ELEMENTS = 16128  # 63 blocks of 256: the most one UDP datagram holds
DEFAULT_BLOCK_ELEMENTS = 256
DEFAULT_SLOTS_PER_JOB = 32
DEFAULT_MAX_JOBS = 64
#: A switch's data threads by default at most: half the machine's cores.
MAX_AUTO_SWITCH_THREADS = 8


def auto_switch_threads(cores: int | None = None) -> int:
    """The C data plane's data threads where none are asked for: half the
    machine's cores (``os.cpu_count()``), 1 to ``MAX_AUTO_SWITCH_THREADS``.  A
    switch adds and sends back every worker's bytes, K times one worker's, so on
    one host it needs about as many cores as its workers together; the rest are
    theirs and the kernel's.  On a switch server of its own the other half is
    the kernel's, which receives and sends every datagram.  On two or three cores
    that leaves one thread, the serving thread draining the socket itself."""
    cores = os.cpu_count() if cores is None else cores
    return max(1, min(MAX_AUTO_SWITCH_THREADS, (cores or 1) // 2))


#: A worker's I/O threads by default at most.
MAX_AUTO_WORKER_THREADS = 8
#: Link speed one worker I/O thread keeps up with, in Mbit/s: its C engine takes
#: about 0.4 ms of a 2-core AMD EPYC VM's core a MiB of allreduce
#: (``bench/worker_core.py``), some 20 Gbit/s, but about 0.95 ms of a 16-core
#: Xeon VM's, 8.5 Gbit/s; 8 keeps a 10 Gbit/s link full on such cores (two).
WORKER_THREAD_MBIT = 8_000


def auto_worker_threads(link_mbit: int | None, senders: int = 1,
                        cores: int | None = None) -> int:
    """A rank's I/O threads where none are asked for: one per
    ``WORKER_THREAD_MBIT`` of its link (``link_mbit``, the speed its interface
    reports), at most half the cores (``os.cpu_count()``) shared by the
    ``senders`` that send through that link at once (the host's ranks, or its
    shards), and 1 to ``MAX_AUTO_WORKER_THREADS``.  A link that reports no speed
    (loopback) gets one thread: on one host the switch and the kernel need the
    other cores; a veth reports 10 Gbit/s, two threads' worth where the cores
    allow."""
    if not link_mbit:
        return 1
    cores = os.cpu_count() if cores is None else cores
    by_cores = (cores or 1) // (2 * max(1, senders))
    return max(1, min(MAX_AUTO_WORKER_THREADS, by_cores, -(-link_mbit // WORKER_THREAD_MBIT)))


#: A switch's data threads at most (switch/dataplane/fastpath.h FP_MAX_THREADS)
MAX_SWITCH_THREADS = 64
DEFAULT_TIMEOUT = 30.0
#: Seconds within which a control connection's peer that vanished without
#: closing it (host down, cable cut) is noticed, by TCP keepalive probes.
DEFAULT_KEEPALIVE = 20.0
#: Seconds a control connection has to join (or ask for stats) before the
#: switch closes it (switch/lobby.py).
DEFAULT_JOIN_DEADLINE = 5.0
#: Seconds a switch has to answer a worker's join or status query.  A switch
#: answers both at once (a join with who of the job is there so far), a rack
#: switch once its spine did (the rack's connect to it bounded at 5 s): past
#: them nothing that speaks switchml listens at the address, or the switch
#: hangs (stopped, deadlocked), whatever the job's own ``timeout``.
SWITCH_ANSWER_S = 10.0


def switch_answer_within(timeout: float = math.inf) -> float:
    """How long a switch has to answer: ``SWITCH_ANSWER_S``, or a join's
    ``timeout`` if shorter (the job would have given up by then anyway).  A status
    query gets the whole bound: it is asked once a call has waited."""
    return min(timeout, SWITCH_ANSWER_S)


#: Seconds a call may go without a result before its worker asks the switch
#: whether it is still there (a status query, ``SWITCH_ANSWER_S`` to answer):
#: a hung switch fails the call within about their sum, not the ``timeout``
#: meant for slow ranks (a switch that answers leaves the call waiting).
SWITCH_SILENCE_S = 5.0
#: Control connections that have not joined, in all and from one source address.
DEFAULT_MAX_UNJOINED = 256
DEFAULT_MAX_UNJOINED_PER_SOURCE = 64
#: Largest keepalive bound: Linux refuses a TCP_KEEPIDLE above 32767 s.
MAX_KEEPALIVE = 32767
#: Most threads a rank of the local stage copies and sums with by default: one
#: core streams a few GB/s, and four took most of what more would (a 45 MiB copy
#: on a 16-core Xeon VM: 7.5 ms on one, 1.7 on four, 1.1 on eight).
MAX_AUTO_LOCAL_THREADS = 4


def usable_cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def auto_local_threads(ranks: int, cores: int | None = None) -> int:
    """Threads a rank of the local stage copies and sums with where none are asked
    for: the cores this process may run on (``cores``, else ``usable_cores()``)
    shared by the host's ``ranks``, 1 to ``MAX_AUTO_LOCAL_THREADS``."""
    if cores is None:
        cores = usable_cores()
    return max(1, min(MAX_AUTO_LOCAL_THREADS, cores // max(1, ranks)))


#: Segments a host's shared memory holds at once (worker/local/memory.py): one being
#: combined while the one before crosses the switch.
LOCAL_SLOTS = 2
#: Bytes of a local-stage segment (worker/local/stage.py): a call is combined on a host,
#: sent and copied back this much at a time, each piece behind the last.
DEFAULT_LOCAL_SEGMENT = 2 * 2**20
#: sparse="auto" goes sparse when the union of non-zero blocks (what every worker
#: receives) is at most this share of all blocks; see Worker._sparse_pays.
DEFAULT_SPARSE_AUTO_UNION = 0.5
#: ... and measures again after this many calls of the same size and dtype.
DEFAULT_SPARSE_AUTO_EVERY = 20
#: ... and stays dense with fewer blocks than this per packet (Worker._sparse_pays):
#: on the Python engine, and on the C engine.
DEFAULT_SPARSE_AUTO_MIN_LANES = 32
DEFAULT_SPARSE_AUTO_MIN_LANES_COMPILED = 8


def check_keepalive(seconds: float) -> float:
    """``seconds`` as a float if the kernel can take it as a keepalive bound, else ValueError."""
    if not 0 < seconds <= MAX_KEEPALIVE:  # also refuses NaN
        raise ValueError(f"keepalive must be in (0, {MAX_KEEPALIVE}] seconds, got {seconds}")
    return float(seconds)


def pure_python() -> bool:
    """SWITCHML_PURE_PYTHON=1: the Python data plane and engine even where the C
    ones are built."""
    return env("PURE_PYTHON", False, parse_flag)


def env(name: str, default, cast=str, environ=None):
    """Value of SWITCHML_<name>, cast, or ``default`` when unset or empty."""
    raw = (os.environ if environ is None else environ).get("SWITCHML_" + name, "")
    if raw == "":
        return default
    try:
        return cast(raw)
    except ValueError:
        raise ValueError(f"SWITCHML_{name}={raw!r} is not a valid {cast.__name__}") from None


def positive_seconds(text) -> float:
    """``env``'s cast of a time that must pass: a finite number of seconds above 0."""
    value = float(text)
    if not 0.0 < value < math.inf:
        raise ValueError(text)
    return value


def some_seconds(text) -> float:
    """``env``'s cast of a time that may be none: a finite number of seconds, 0 or more."""
    value = float(text)
    if not 0.0 <= value < math.inf:
        raise ValueError(text)
    return value


positive_seconds.__name__ = "finite number of seconds above 0"
some_seconds.__name__ = "finite number of seconds, 0 or more"


def parse_flag(text: str) -> bool:
    """A yes/no setting's text: 1/true/yes/on or 0/false/no/off."""
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{text!r} is not one of 1/0, true/false, yes/no, on/off")


parse_flag.__name__ = "flag (1 or 0)"


def local_stage_on(given: bool | None = None) -> bool:
    """Whether ranks that share a host combine there first: ``given``, else
    SWITCHML_LOCAL_STAGE (on by default)."""
    return env("LOCAL_STAGE", True, parse_flag) if given is None else bool(given)


def _disagree(fastpath: bool, data_plane: str) -> bool:
    """Whether ``fastpath`` (the C data plane or not) contradicts ``data_plane``."""
    return fastpath != (data_plane == "c")


def parse_address(address) -> tuple[str, int]:
    """'host:port' or (host, port) to a (host, port) tuple, with a clear error."""
    host, digits = (address.rpartition(":")[::2] if isinstance(address, str) else ("", ""))
    if isinstance(address, (tuple, list)) and len(address) == 2:
        host, port = str(address[0]), int(address[1])
    elif host and digits.isdigit():
        host, port = host.strip("[]"), int(digits)
    else:
        raise ValueError(f"switch address must be 'host:port' or (host, port), got {address!r}")
    if not 0 <= port <= 65535:  # (the resolver would take it modulo 65536: another switch)
        raise ValueError(f"switch address {address!r}: a port is 0 to 65535")
    return host, port


def _is_pair(address) -> bool:
    """Whether a 2-sequence is one (host, port) rather than two addresses."""
    port = address[1]
    return isinstance(port, int) or (isinstance(port, str) and port.isdigit())


def switch_addresses(switch) -> list[tuple[str, int]]:
    """The switches of a job, in order: ``switch`` as a ``Worker`` takes it.

    One address ("host:port" or (host, port)), several ("a:7300,b:7300", or a list
    of addresses), or None: ``SWITCHML_SWITCH`` (one address or several, commas
    between).  Every rank must name the same switches in the same order: part k
    of every call is summed on switch k.
    """
    if switch is None:
        switch = env("SWITCH", None)
        if switch is None:
            raise SwitchMLError("no switch address: pass one or set SWITCHML_SWITCH=host:port "
                                "(several switches: host:port,host:port)")
    items: list
    if isinstance(switch, str):
        items = [part.strip() for part in switch.split(",")]
        if "" in items:
            raise ValueError(f"switch addresses must be 'host:port,host:port', got {switch!r}")
    elif isinstance(switch, (tuple, list)) and len(switch) == 2 and _is_pair(switch):
        items = [switch]
    elif isinstance(switch, (tuple, list)) and switch:
        items = list(switch)
    else:
        raise ValueError("switch address must be 'host:port', (host, port) or a list of "
                         f"them, got {switch!r}")
    addresses = [parse_address(item) for item in items]
    repeated = {a for a in addresses if addresses.count(a) > 1}
    if repeated:
        # Two parts of one call would join the same job twice on one switch.
        raise ValueError(f"switch addresses repeat {sorted(repeated)}: name each switch once")
    return addresses


#: The switch settings a SWITCHML_* variable gives: field -> (variable, type).
#: SwitchConfiguration.data_plane's values
DATA_PLANES = ("python", "c", "xdp", None)

SWITCH_VARIABLES = {
    "host": ("HOST", str),
    "port": ("PORT", int),
    "slots": ("SLOTS", int),
    "packet_elements": ("PACKET_ELEMENTS", int),
    "block_elements": ("BLOCK_ELEMENTS", int),
    "slots_per_job": ("SLOTS_PER_JOB", int),
    "max_jobs": ("MAX_JOBS", int),
    "drop_rate": ("DROP_RATE", float),
    "metrics_port": ("METRICS_PORT", int),
    "keepalive": ("KEEPALIVE", float),
    "upstream": ("UPSTREAM", str),
    "data_plane": ("DATA_PLANE", str),
    "threads": ("SWITCH_THREADS", int),
    "shared_link": ("SHARED_LINK", parse_flag),
    "token_file": ("SWITCH_TOKEN_FILE", str),
    "join_deadline": ("JOIN_DEADLINE", float),
    "max_unjoined": ("MAX_UNJOINED", int),
    "max_unjoined_per_source": ("MAX_UNJOINED_PER_SOURCE", int),
}


@dataclass(frozen=True)
class SwitchConfiguration:
    """Every setting of a software switch, as aioquic's QuicConfiguration is of a
    connection.  ``from_env`` reads it: arguments first, then SWITCHML_*, then
    these defaults.

    ``slots`` (pool size), ``packet_elements`` (int32 values per packet),
    ``block_elements`` (values per block: the unit of the sparse path; None: 256,
    or one block per packet where 256 does not divide it), ``slots_per_job``
    (window a job gets), ``max_jobs`` (jobs running at once), ``drop_rate`` and
    ``egress_drop_rate`` (simulated drops, ingress and egress; egress defaults
    to ``drop_rate``), ``seed`` (of the drop simulator), ``metrics_port``
    (serve Prometheus metrics over HTTP on this port; 0 picks a free one; needs
    the ``metrics`` extra) and ``metrics_host`` (defaults to ``host``),
    ``keepalive`` (seconds within which a worker whose host vanished without
    closing its control connection is noticed and its job failed),
    ``fastpath`` (run the data plane in C: None does when the extension is
    built and SWITCHML_PURE_PYTHON is not 1; False never does; True requires it),
    ``data_plane`` ("python", "c", "xdp", or None: the ``fastpath`` rule; "xdp"
    runs the dense path in an XDP program attached to the interface holding
    ``host``: it needs Linux, clang, libbpf and CAP_BPF with CAP_NET_ADMIN,
    packets of at most 64 blocks (the default's 63 fit; see switch/xdp/pipeline.py) and
    no ``upstream``; the program passes sparse contributions up to the switch,
    which aggregates them in user space),
    ``threads`` (data threads of the C data plane, at most 64: each owns the
    slots ``s`` with ``s % threads`` equal to its index and drains a socket of
    its own, to which the kernel steers those slots' datagrams, so that a
    switch aggregates with that many cores; 1: the serving thread drains the
    one socket itself, between control messages; None, the default: half
    the machine's cores, 1 to 8 (``auto_switch_threads``), on the C data
    plane, and 1 on the others; the Python and XDP data planes take 1 only),
    ``upstream`` ("host:port" of a spine switch: this switch is then a rack
    switch, whose jobs' partial sums go up to the spine; its data plane runs in
    Python), ``shared_link`` (the switch is a server behind one link that all
    its workers share, where there is no programmable switch: every rank's
    packets reach it through that link's one queue, so a job's window there is
    its ranks' share of one link's, ``ceil(slots_per_job / world_size)``, not
    ``slots_per_job`` each; on a switch with a port per worker, and on
    loopback, it is not), ``token_file`` (a file holding the switch's admission
    token: without proof of it no job can be created; ``SWITCHML_SWITCH_TOKEN``
    gives the token itself; a rack switch relays its workers' proofs to its
    spine, which checks them, so it takes none), ``join_deadline`` (seconds a
    control connection has to join a job or gathering, or to ask for stats,
    before the switch closes it), ``max_unjoined`` and
    ``max_unjoined_per_source`` (control connections that have not joined, in
    all and from one source address: one more closes the oldest, of its source
    or of all; members of jobs are never closed for them: switch/lobby.py).
    """

    host: str = "127.0.0.1"
    port: int = 0
    slots: int = DEFAULT_SLOTS
    packet_elements: int = DEFAULT_PACKET_ELEMENTS
    block_elements: int | None = None
    slots_per_job: int = DEFAULT_SLOTS_PER_JOB
    max_jobs: int = DEFAULT_MAX_JOBS
    drop_rate: float = 0.0
    egress_drop_rate: float | None = None
    seed: int | None = None
    metrics_port: int | None = None
    metrics_host: str | None = None
    keepalive: float = DEFAULT_KEEPALIVE
    fastpath: bool | None = None
    data_plane: str | None = None
    threads: int | None = None
    upstream: str | None = None
    shared_link: bool = False
    token_file: str | None = None
    join_deadline: float = DEFAULT_JOIN_DEADLINE
    max_unjoined: int = DEFAULT_MAX_UNJOINED
    max_unjoined_per_source: int = DEFAULT_MAX_UNJOINED_PER_SOURCE

    def __post_init__(self):
        # Checked here, so that a switch started in a child process (SwitchProcess)
        # fails in its parent, with the parent's traceback.
        for name in ("port", "metrics_port"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= 65535:
                raise ValueError(f"{name} must be 0 to 65535, got {value}")
        for name in ("host", "metrics_host", "upstream", "token_file"):
            # empty: a flag given an unset variable (--token-file "$UNSET"), never
            # what it would mean if left out (a switch open to anyone)
            if getattr(self, name) == "":
                raise ValueError(f"{name} is empty: give it a value, or leave it out")
        if not 0.0 <= self.drop_rate < 1.0:
            raise ValueError(f"drop_rate must be in [0, 1), got {self.drop_rate}")
        if self.slots_per_job < 1:
            raise ValueError(f"slots_per_job must be at least 1, got {self.slots_per_job}")
        if self.max_jobs < 1:
            raise ValueError(f"max_jobs must be at least 1, got {self.max_jobs}")
        check_keepalive(self.keepalive)
        if not 0 < self.join_deadline < float("inf"):  # also refuses NaN
            raise ValueError(f"join_deadline must be a positive number of seconds, got "
                             f"{self.join_deadline}")
        if self.max_unjoined < 1 or self.max_unjoined_per_source < 1:
            raise ValueError(f"max_unjoined and max_unjoined_per_source must be at least 1, "
                             f"got {self.max_unjoined} and {self.max_unjoined_per_source}")
        if self.data_plane not in DATA_PLANES:
            raise ValueError(f"data_plane must be one of {', '.join(DATA_PLANES[:-1])} or None, "
                             f"got {self.data_plane!r}")
        if self.data_plane is not None and self.fastpath is not None and \
                _disagree(self.fastpath, self.data_plane):
            raise ValueError(f"fastpath={self.fastpath} contradicts "
                             f"data_plane={self.data_plane!r}")
        if self.threads is not None and not 1 <= self.threads <= MAX_SWITCH_THREADS:
            raise ValueError(f"threads must be 1 to {MAX_SWITCH_THREADS}, got {self.threads}")
        if self.threads is not None and self.threads > 1:
            other = ("a rack switch's (upstream)" if self.upstream is not None else
                     "the XDP" if self.data_plane == "xdp" else
                     "the Python" if self.data_plane == "python" or self.fastpath is False
                     else None)
            if other:  # XDP spreads over the interface's queues' CPUs by itself
                raise ValueError(f"threads={self.threads} is a setting of the C data plane: "
                                 f"{other} data plane runs with threads=1")
        if self.data_plane == "xdp":
            if self.upstream is not None:
                raise ValueError("a rack switch (upstream) runs its data plane in Python: "
                                 "data_plane='xdp' cannot be kept")
        if self.upstream is not None:
            parse_address(self.upstream)  # 'host:port', or a clear error now
            if self.fastpath:
                raise ValueError("a rack switch (upstream) runs its data plane in Python: "
                                 "fastpath=True cannot be kept")
            if self.token_file is not None:
                raise ValueError("a rack switch (upstream) relays its workers' proofs to its "
                                 "spine, which checks the admission token: give the token "
                                 "file to the spine")

    @classmethod
    def from_env(cls, defaults: dict | None = None, environ=None,
                 **given) -> SwitchConfiguration:
        """The settings ``given`` (a caller's keyword arguments or flags), the rest
        from SWITCHML_* variables (``environ``: os.environ), the rest from
        ``defaults`` (an entry point's own: the CLI's port 7300), the rest from
        the class's.  An unknown setting is a TypeError naming it."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted((given.keys() | (defaults or {}).keys()) - names)
        if unknown:
            raise TypeError(f"unknown switch setting(s): {', '.join(unknown)}; "
                            f"known: {', '.join(sorted(names))}")
        settings = dict(defaults or {})
        for name, (variable, cast) in SWITCH_VARIABLES.items():
            value = env(variable, None, cast, environ)
            if value is not None:
                settings[name] = value
        settings.update(given)
        # fastpath and data_plane both choose the data plane: one the caller
        # gives wins over the other, from the environment or the defaults, where
        # they disagree
        for mine, other in (("fastpath", "data_plane"), ("data_plane", "fastpath")):
            if mine in given and other not in given and settings.get(other) is not None and \
                    _disagree(settings["fastpath"], settings["data_plane"]):
                del settings[other]
        if given.get("upstream") is not None and "data_plane" not in given and \
                "fastpath" not in given:  # a rack switch's data plane is Python's
            settings.pop("data_plane", None)
            settings.pop("fastpath", None)
        return cls(**settings)

    @classmethod
    def given(cls, host: str | None, port: int | None,
              configuration: SwitchConfiguration | None, settings: dict) -> SwitchConfiguration:
        """What ``Switch(host, port, configuration=..., **settings)`` (and
        ``SwitchProcess``) runs with: ``configuration`` with the rest applied, or
        else the rest over SWITCHML_* variables and the defaults (``from_env``)."""
        settings = dict(settings)
        if host is not None:
            settings["host"] = host
        if port is not None:
            settings["port"] = port
        return (configuration.replace(**settings) if configuration is not None
                else cls.from_env(**settings))

    def replace(self, **changes) -> SwitchConfiguration:
        """A copy with ``changes``."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        """The settings as plain values (JSON for a child process's switch)."""
        return dataclasses.asdict(self)
