"""PyTorch integration: ``import switchml.torch`` registers the "switchml" backend.

    import switchml.torch
    torch.distributed.init_process_group("switchml")      # torchrun's env:// as usual

allreduce SUM and AVG of float32, int32, float16 and bfloat16 tensors go through
the switch (16-bit ones summed as float32 and rounded back once, so within the
float32 bound plus half a 16-bit ulp of the result; CUDA tensors through pinned
host memory on a side stream, the call completing on the tensor's stream as
NCCL's do: staging.py); every other collective, op and dtype goes to
an inner gloo group, which is registered as this group's backend for its devices,
so any torch code runs unchanged.  The switch is ``SWITCHML_SWITCH`` when set;
otherwise the first group's rank 0 starts one in a child process, publishes its
address through the store, and every later group (``new_group``) of the job uses
the same switch, a job of its own on it.  Ranks that share a host combine there
first (the local stage: they find one another through the store); a job whose
ranks all share one host needs, and starts, no switch.  ``SWITCHML_SPARSE``
(false, true or auto: the default) picks the dense or sparse path.

Every job is authenticated: rank 0 makes a secret (``SWITCHML_JOB_SECRET`` when
set, else a random one) and hands it to the other ranks through the store (the
hook: through its process group), so that no process outside the job can join
it on the switch (docs/protocol.md, "Authenticated jobs").

A switch that fails (unreachable, killed or restarted mid-call, full) does not
end the job: the switched calls go on through a gloo group and come back to the
switch when it returns (failover.py; ``SWITCHML_FALLBACK=0`` raises instead).

``allreduce_hook`` is a DDP communication hook for users who keep their gloo or
nccl group for everything else.
"""

import logging
import secrets
import threading
from typing import Any

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from .. import auth
from ..config import SwitchConfiguration, env, local_stage_on, positive_seconds
from ..errors import SwitchMLError
from ..switch.process import SwitchProcess
from ..worker.client import Worker
from ..worker.local.hosts import HostRecord, Hosts, Placement, host_record
from .failover import DEFAULT_RETRY_S, Call, Failed, SwitchPath, fallback_on
from .staging import writable

log = logging.getLogger("switchml.torch")

__all__ = ["ProcessGroupSwitchML", "HookState", "allreduce_hook", "sparse_mode"]

_SWITCHED_DTYPES = (torch.float32, torch.int32, torch.float16, torch.bfloat16)
#: Devices whose tensors the group takes: CUDA ones are staged through pinned host
#: memory on a side stream (staging.py).
_DEVICES = ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)


def sparse_mode():
    """The configured path: False, True or "auto" (``SWITCHML_SPARSE``)."""
    value = env("SPARSE", "auto").lower()
    if value in ("auto",):
        return "auto"
    if value in ("1", "true", "yes", "sparse"):
        return True
    if value in ("0", "false", "no", "dense"):
        return False
    raise SwitchMLError(f"SWITCHML_SPARSE={value!r}: use true, false or auto")


def _embedded_switch() -> SwitchProcess:
    """A switch of this job's own, in a child process (not competing for our GIL);
    its settings as any switch's (SwitchConfiguration: SWITCHML_* or the defaults)."""
    return SwitchProcess().start()


#: Seconds the job's own switch waits, as its rank shuts down, for the job's other
#: ranks to leave it.
JOB_SWITCH_DRAIN_S = 3.0


class _JobSwitch:
    """The one switch of a job without ``SWITCHML_SWITCH``, shared by all its groups.

    The first switchml group's rank 0 starts it (a child process with room for
    ``max_jobs`` groups at ``slots_per_job`` slots each; pages of slots no group
    uses are never touched) and publishes its address through the group's store;
    every rank remembers the address it read, so the rank 0 of any later group
    (``new_group``, whichever global rank it is) publishes the same switch.  When a
    process's last switchml group shuts down it forgets the address, and stops the
    switch if it runs it (its exit stops it too); a later ``init_process_group``
    starts a new one.
    """

    def __init__(self):
        self.address: str | None = None  # the job's switch, while this process has groups
        self.process: SwitchProcess | None = None  # the switch, when this process runs it
        self.groups = 0  # this process's live groups on it

    @staticmethod
    def configuration() -> SwitchConfiguration:
        """Its settings, as any switch's (SWITCHML_* or the defaults), but for the pool:
        without SWITCHML_SLOTS, room for ``max_jobs`` groups of ``slots_per_job``."""
        settings = SwitchConfiguration.from_env()
        return SwitchConfiguration.from_env(
            defaults={"slots": settings.slots_per_job * settings.max_jobs})

    def publish(self) -> str:
        """The address a new group's rank 0 publishes: the job's switch, started if none."""
        if self.address is None:
            self.process = SwitchProcess(configuration=self.configuration()).start()
            assert self.process.address is not None
            self.address = "%s:%d" % self.process.address
        return self.address

    def joined(self, address: str) -> None:
        self.address = address
        self.groups += 1

    def left(self) -> None:
        self.groups -= 1
        if self.groups <= 0:
            process, self.process, self.address, self.groups = self.process, None, None, 0
            if process is not None:
                # the other ranks shut down a moment later: they leave, not lose it
                process.stop(drain=JOB_SWITCH_DRAIN_S)


_JOB_SWITCH = _JobSwitch()


def _exchange_hosts(store, rank: int, size: int) -> Hosts | None:
    """Every rank's host record through ``store`` (who shares a host: the local
    stage), or None where the local stage is off or the job has one rank."""
    if size < 2 or not local_stage_on():
        return None
    store.set(f"switchml/host/{rank}", host_record().encode())
    if rank == 0:
        store.set("switchml/nonce", secrets.token_hex(8))
    records = tuple(HostRecord.decode(store.get(f"switchml/host/{r}").decode())
                    for r in range(size))
    return Hosts(records, store.get("switchml/nonce").decode())


def _one_host(hosts: Hosts | None) -> bool:
    """Whether the job's ranks all share one host's memory: it needs no switch."""
    return hosts is not None and Placement.of(hosts.records, 0).hosts == 1


def _job_secret() -> str:
    """A new job's secret: ``SWITCHML_JOB_SECRET``, or a random one; "" (an open
    job, said in a warning) where the ``cryptography`` package is missing."""
    configured = env("JOB_SECRET", None)
    if configured is not None:
        return configured
    secret = auth.new_secret_if_available()
    if secret is None:
        log.warning("this job is open to anyone who learns its name: authenticated jobs "
                    "need the 'cryptography' package (the 'auth' extra: "
                    "pip install 'cryptography>=42')")
        return ""
    return secret


def _fallback_settings(address) -> tuple[bool, float]:
    """(whether calls fall back to gloo, seconds between probes of a switch that went
    away): ``SWITCHML_FALLBACK`` (on) and ``SWITCHML_RETRY_S``; never without a switch."""
    return (address is not None and fallback_on(env("FALLBACK", None)),
            env("RETRY_S", DEFAULT_RETRY_S, positive_seconds))


def _rejoin_within(fallback: bool, retry_s: float) -> float | None:
    """How long a worker waits for its switch to come back before its call fails:
    with fallback, ``retry_s`` (a restart that quick is rejoined where the call
    stood; a longer one costs gloo's calls, not the group's whole timeout); without,
    the worker's timeout (None)."""
    return retry_s if fallback else None


def _connect(store, rank: int, size: int, timeout: float):
    """Join a job named through ``store``: (its address, a function that joins it on
    the switch, generation 0 first, whether it is on the job's shared switch).
    With ``SWITCHML_SWITCH`` unset, every group of the job shares one switch
    (``_JobSwitch``), started only when the job spans hosts: on one host the local
    stage is the whole allreduce.  A later generation is the same job joined again
    (its own name on the switch, the same secret)."""
    configured = env("SWITCH", None)
    hosts = _exchange_hosts(store, rank, size)
    alone = configured is None and _one_host(hosts)
    if rank == 0:
        store.set("switchml/address", configured if configured is not None
                  else "" if alone else _JOB_SWITCH.publish())
        store.set("switchml/job", "torch-" + secrets.token_hex(6))
        store.set("switchml/secret", _job_secret())
    address = store.get("switchml/address").decode() or None
    job = store.get("switchml/job").decode()
    secret = store.get("switchml/secret").decode() or None
    shared = configured is None and not alone
    if shared:
        assert address is not None
        _JOB_SWITCH.joined(address)

    def join(generation: int, rejoin_within: float | None = None) -> Worker:
        return Worker(address, rank, size, job=job if not generation else f"{job}~{generation}",
                      timeout=timeout, hosts=hosts, secret=secret, rejoin_within=rejoin_within)

    return address, job, join, shared


def _until_done(future: torch.futures.Future, timeout, what: str) -> None:
    """Until ``future`` is done (its error not raised), or ``timeout`` (a timedelta;
    0 or None: none) passes: then a RuntimeError naming ``what``, as gloo's
    ``wait`` raises."""
    ended = threading.Event()
    future.add_done_callback(lambda _: ended.set())
    if not ended.wait(timeout.total_seconds() if timeout else None):
        raise RuntimeError(f"switchml: {what} did not complete within "
                           f"{timeout.total_seconds():g}s (Work.wait's timeout)")


class _SwitchWork(dist._Work):
    """A torch Work over a switchml call: ``wait()`` raises what the call raised.

    (A Work made by ``_create_work_from_future`` returns True from ``wait()`` even
    when its future failed, which would hide a dead rank from the script.)
    ``settled``: the future the call settles (``failover.Call``), whose value is
    ``Failed`` where it failed: ``wait()`` raises that error itself (its own type,
    SwitchUnreachableError say), where the public future's C++ error is a RuntimeError.
    """

    def __init__(self, future: torch.futures.Future, settled: torch.futures.Future | None = None):
        super().__init__()
        self._future = future
        self._settled = settled

    def wait(self, timeout=None) -> bool:
        """Until the call ends (its error raised), or ``timeout`` (a timedelta; 0 or
        None: none) passes: then a RuntimeError, as gloo's ``wait`` raises."""
        _until_done(self._future, timeout, "the collective")
        if self._settled is not None:
            outcome = self._settled.wait()
            if isinstance(outcome, Failed):
                raise outcome.error
        self._future.wait()  # raises the call's exception
        return True

    def is_completed(self) -> bool:
        return self._future.done()

    def get_future(self) -> torch.futures.Future:
        return self._future

    def result(self) -> list:
        """The call's tensors, once it completed (``wait``)."""
        self.wait()
        return self._future.value()


class _CopiedBack(dist._Work):
    """A gloo Work whose results are copied into the caller's tensors once it is
    done: ``copies``, (caller's tensor, the contiguous copy gloo wrote) pairs.
    (Some of gloo's Works have no future: the copy is made in ``wait``.)"""

    def __init__(self, work, copies: list):
        super().__init__()
        self._work = work
        self._copies = copies
        self._lock = threading.Lock()

    def _copy_back(self) -> None:
        with self._lock:
            copies, self._copies = self._copies, []
        for original, copy in copies:
            with writable(original):  # (a future's thread: as the caller could write it)
                original.copy_(copy)

    def wait(self, timeout=None) -> bool:
        done = self._work.wait(timeout) if timeout else self._work.wait()
        self._copy_back()
        return done

    def is_completed(self) -> bool:
        return self._work.is_completed()

    def get_future(self) -> torch.futures.Future:
        def copied(fut):
            fut.value()  # raises gloo's error
            self._copy_back()
            return fut.value()

        return self._work.get_future().then(copied)


class _AfterCall(dist._Work):
    """A gloo Work that counts as done only once ``future`` (an earlier call's) is:
    ``wait()`` waits for both (the call's own error is its Work's to raise)."""

    def __init__(self, future: torch.futures.Future, work):
        super().__init__()
        self._future = future
        self._work = work

    def wait(self, timeout=None) -> bool:
        _until_done(self._future, timeout, "the barrier's earlier allreduce")
        return self._work.wait(timeout) if timeout else self._work.wait()

    def is_completed(self) -> bool:
        return self._future.done() and self._work.is_completed()


class _AllWorks(dist._Work):
    """One Work over several gloo Works (some of gloo's have no future to combine)."""

    def __init__(self, works: list):
        super().__init__()
        self._works = works

    def wait(self, timeout=None) -> bool:
        for work in self._works:
            if timeout:
                work.wait(timeout)  # raises a failed one's error, or at the timeout
            else:
                work.wait()
        return True

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self._works)


def _to_gloo(name: str, tensor_args: int, options):
    """A collective that runs on the group's inner gloo, with default options if none.

    gloo takes a tensor as its first numel() elements of storage: a strided tensor
    that is not contiguous (a slice's view) would be read and written wrong, with
    no error.  Each goes as a contiguous copy, and the copies of the first
    argument (the output, or the tensor itself) are copied back once the call is
    done; an output whose elements share memory (an expand()ed view) cannot hold
    a result and is refused."""

    def collective(self, *args, opts=None):
        tensors, rest = args[:tensor_args], args[tensor_args:]
        if rest:
            opts = rest[0]
        copies: list = []
        tensors = tuple(_contiguous(arg, copies if i == 0 else None, name)
                        for i, arg in enumerate(tensors))
        work = getattr(self._gloo, name)(*tensors, opts if opts is not None else options())
        return _CopiedBack(work, copies) if copies else work

    collective.__name__ = name
    return collective


def _contiguous(arg, copies: list | None, name: str):
    """``arg`` (a tensor, or lists of them) with each strided tensor that is not
    contiguous as a contiguous copy; ``copies``: where (original, copy) pairs go
    for the caller to copy back (None: an input, read only)."""
    if isinstance(arg, (list, tuple)):
        return type(arg)(_contiguous(a, copies, name) for a in arg)
    if not isinstance(arg, torch.Tensor) or arg.layout != torch.strided or arg.is_contiguous():
        return arg
    if copies is None:
        return arg.detach().contiguous()
    if any(stride == 0 and size > 1 for stride, size in zip(arg.stride(), arg.shape)):
        raise ValueError(f"switchml: {name}'s tensor of shape {tuple(arg.shape)} has elements "
                         f"that share memory (an expand()ed view): it cannot hold the result; "
                         f"pass a tensor of its own (.clone())")
    copy = arg.detach().contiguous()
    copies.append((arg, copy))
    return copy


def _to_gloo_pairwise(name: str, options):
    """A coalesced collective over (output, input) pairs, one gloo ``name`` call a pair
    (gloo has no Python binding of the coalesced forms), as one Work."""

    def collective(self, outputs, inputs, opts=None):
        opts = opts if opts is not None else options()
        return _AllWorks([getattr(self._gloo, name)(out, inp, opts)
                          for out, inp in zip(outputs, inputs)])

    collective.__name__ = name
    return collective


class ProcessGroupSwitchML(dist.ProcessGroup):
    """The "switchml" process group: allreduce through the switch, the rest via gloo."""

    def __init__(self, store, rank: int, size: int, timeout):
        super().__init__(rank, size)  # type: ignore[call-arg]  # torch's Python-subclass form
        seconds = timeout.total_seconds() if hasattr(timeout, "total_seconds") else float(timeout)
        # The group's timeout (init_process_group(timeout=...)), unless SWITCHML_TIMEOUT
        # asks for a shorter wait before naming a silent rank or switch.
        seconds = env("TIMEOUT", seconds, positive_seconds)
        # Any: torch's stubs lack the collectives the C++ class has
        self._gloo: Any = dist.ProcessGroupGloo(dist.PrefixStore("switchml-gloo", store), rank,
                                                size, timeout)
        # C++ helpers (DDP's parameter check, for one) look the backend of a device up
        # directly; gloo also serves CUDA tensors for the collectives we delegate.
        for device in _DEVICES:
            self._register_backend(torch.device(device), dist.ProcessGroup.BackendType.GLOO,
                                   self._gloo)
        address, job, join, self._on_job_switch = _connect(
            dist.PrefixStore("switchml", store), rank, size, seconds)
        enabled, retry_s = _fallback_settings(address)
        try:
            # calls off the switch: a gloo group of their own, so that its collectives
            # come in the same order on every rank
            self._fallback = dist.ProcessGroupGloo(
                dist.PrefixStore("switchml-fallback", store), rank, size,
                timeout) if enabled else None
            self._path = SwitchPath(self._fallback, rank, size,
                                    lambda generation: join(generation, _rejoin_within(
                                        enabled, retry_s)), enabled=enabled,
                                    retry_s=retry_s, address=address, name=f"job {job}")
        except BaseException:
            if self._on_job_switch:
                _JOB_SWITCH.left()
            raise
        self._sparse = sparse_mode()

    @property
    def _worker(self):
        """The worker on the switch (None while the group's calls go through gloo)."""
        return self._path.worker

    @property
    def counters(self) -> dict:
        """Calls served by gloo (``calls_on_gloo``), times the group left the switch
        (``fallbacks``) and came back (``returns``), and the worker's counters."""
        worker = self._path.worker
        return {**(worker.counters if worker is not None else {}), **self._path.counters}

    def getBackendName(self) -> str:
        return "switchml"

    def _switched(self, tensors, opts) -> bool:
        """Whether the switch sums this call; anything else goes to gloo as it is."""
        return len(tensors) == 1 and tensors[0].numel() > 0 and \
            self._switched_kind(tensors[0], opts)

    @staticmethod
    def _switched_kind(t, opts) -> bool:
        """Whether the switch sums tensors of ``t``'s device, dtype, layout and op."""
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        return (t.device.type in _DEVICES and t.dtype in _SWITCHED_DTYPES
                and t.layout == torch.strided
                # ==, not `in`: RedOpType == ReduceOp is False the other way round
                and (op == dist.ReduceOp.SUM or op == dist.ReduceOp.AVG))

    def allreduce(self, tensors, opts=None):  # type: ignore[override]  # the trampoline's form
        if opts is None:
            opts = dist.AllreduceOptions()
        if len(tensors) == 1 and tensors[0].numel() == 0 and self._switched_kind(tensors[0], opts):
            # nothing to sum: as a call of values would, whatever the dtype (gloo
            # refuses an integer AVG, which the switch takes)
            done: torch.futures.Future = torch.futures.Future()
            done.set_result(tensors)
            return _SwitchWork(done)
        if not self._switched(tensors, opts):
            if (len(tensors) == 1 and tensors[0].layout == torch.strided
                    and not tensors[0].is_contiguous()):
                return self._gloo_on_a_copy(tensors, opts)
            # detached views share the storage: gloo's in-place AVG would refuse a
            # requires_grad leaf, which a sum through the switch takes.  Not a sparse
            # tensor: gloo writes its sum (new indices and values) into the tensor
            # object it is given, which a detached alias would keep to itself.
            return self._gloo.allreduce([t.detach() if t.layout == torch.strided else t
                                         for t in tensors], opts)
        divisor = self.size() if opts.reduceOp == dist.ReduceOp.AVG else None
        call = Call(tensors[0], divisor, self._sparse, None, lambda: tensors,
                    copies=self._path.copy_mode(tensors[0]))
        self._path.submit(call)
        return _SwitchWork(call.future, call.settled)

    def _gloo_on_a_copy(self, tensors, opts):
        """gloo's allreduce of a non-contiguous tensor, on a contiguous copy: gloo itself
        sums the tensor's first numel() elements of storage (wrong values, no error)."""
        t = tensors[0]
        staged = t.detach().contiguous()
        work = self._gloo.allreduce([staged], opts)

        def result(fut):
            fut.value()  # raises gloo's error
            with writable(t):  # (gloo's thread: as the caller could write it)
                t.copy_(staged)
            return tensors

        return _SwitchWork(work.get_future().then(result))

    # Everything else: gloo, called explicitly.  Every collective torch's Python
    # trampoline (PyProcessGroup) would otherwise run itself must be here: without
    # a Python method it calls gloo holding the GIL, and gloo's worker, freeing a
    # finished Work whose tensors Python owns, waits for the GIL while holding the
    # queue lock that call needs: a deadlock (FSDP2's full_tensor(), 1 run in 12).
    def barrier(self, opts=None):
        """gloo's barrier, after this rank's allreduces through the switch: a barrier
        waits for the work its group was given before it (gloo's does), so that an
        async allreduce's tensor holds its sum once the barrier is passed."""
        work = self._gloo.barrier(opts if opts is not None else c10d.BarrierOptions())
        last = self._path.last_call
        if last is None or last.future.done():
            return work
        return _AfterCall(last.future, work)

    broadcast = _to_gloo("broadcast", 1, c10d.BroadcastOptions)
    allgather = _to_gloo("allgather", 2, c10d.AllgatherOptions)
    _allgather_base = _to_gloo("_allgather_base", 2, c10d.AllgatherOptions)
    reduce = _to_gloo("reduce", 1, c10d.ReduceOptions)
    reduce_scatter = _to_gloo("reduce_scatter", 2, c10d.ReduceScatterOptions)
    alltoall = _to_gloo("alltoall", 2, c10d.AllToAllOptions)
    gather = _to_gloo("gather", 2, c10d.GatherOptions)
    scatter = _to_gloo("scatter", 2, c10d.ScatterOptions)
    _reduce_scatter_base = _to_gloo("_reduce_scatter_base", 2, c10d.ReduceScatterOptions)
    allreduce_coalesced = _to_gloo("allreduce_coalesced", 1, c10d.AllreduceCoalescedOptions)
    allgather_coalesced = _to_gloo("allgather_coalesced", 2, c10d.AllgatherOptions)
    all_gather_single_coalesced = _to_gloo_pairwise("_allgather_base", c10d.AllgatherOptions)
    reduce_scatter_single_coalesced = _to_gloo_pairwise("_reduce_scatter_base",
                                                        c10d.ReduceScatterOptions)

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes,
                          opts=None):
        return self._gloo.alltoall_base(output, input, output_split_sizes, input_split_sizes,
                                        opts if opts is not None else c10d.AllToAllOptions())

    def send(self, tensors, dst, tag=0):
        return self._gloo.send(tensors, dst, tag)

    def recv(self, tensors, src, tag=0):
        return self._gloo.recv(tensors, src, tag)

    def shutdown(self) -> None:
        self._path.close()
        # torch's own ProcessGroup.shutdown would end the registered gloo backend;
        # this override replaces it, so it ends both of its gloo groups itself
        _shut_down(self._gloo, self._fallback)
        if self._on_job_switch:
            self._on_job_switch = False
            _JOB_SWITCH.left()


def _shut_down(*groups) -> None:
    """End inner gloo groups (None: none made), never failing the caller's own end
    (a torch without ``shutdown``)."""
    for group in groups:
        try:
            if group is not None:
                group.shutdown()
        except (AttributeError, RuntimeError) as exc:
            log.debug("shutting down an inner gloo group: %s", exc)


def _create(store, rank, size, timeout):
    return ProcessGroupSwitchML(store, rank, size, timeout)


dist.Backend.register_backend("switchml", _create, devices=list(_DEVICES))


class HookState:
    """State of ``allreduce_hook``: a switchml worker joined alongside ``process_group``.

    Uses ``SWITCHML_SWITCH`` when set, otherwise rank 0 starts an embedded switch;
    the address travels over ``process_group`` (the default group if None).  The
    state may be built before ``init_process_group`` (PyTorch Lightning does, as
    torch's ``PowerSGDState`` allows): it then joins on DDP's first bucket.
    ``bits=16`` puts the gradients on the 16-bit wire (half the bytes; dense).
    ``secret``: the job's secret (the same on every rank); None: rank 0's
    ``SWITCHML_JOB_SECRET``, else a random one, broadcast over the group.
    """

    def __init__(self, process_group=None, sparse="auto", timeout: float | None = None,
                 bits: int | None = None, secret: str | None = None):
        self.process_group = process_group
        self._secret = secret
        self.sparse = sparse
        #: 16: the gradients on the 16-bit wire (None: SWITCHML_WIRE_BITS, else 32)
        self.bits = bits
        self.timeout = timeout
        self.switch: SwitchProcess | None = None
        self.world_size: int | None = None
        self._path: SwitchPath | None = None
        self._fallback: Any = None  # the gloo group of the calls off the switch
        if dist.is_initialized():
            self.joined()

    @property
    def worker(self) -> Worker | None:
        """The worker on the switch (None before joining and while calls go via gloo)."""
        return self._path.worker if self._path is not None else None

    @property
    def counters(self) -> dict:
        """Calls served by gloo (``calls_on_gloo``), times the hook left the switch
        (``fallbacks``) and came back (``returns``), and the worker's counters."""
        if self._path is None:
            return {}
        worker = self._path.worker
        return {**(worker.counters if worker is not None else {}), **self._path.counters}

    def joined(self) -> Worker | None:
        """The worker, joining the job first if this state has not joined yet (None
        while the calls go through gloo)."""
        self._joined_path()
        return self.worker

    def _joined_path(self) -> SwitchPath:
        if self._path is None:
            self._join()
        assert self._path is not None
        return self._path

    def _join(self) -> None:
        group = self.process_group
        if not dist.is_initialized():
            raise SwitchMLError("HookState joins through torch.distributed: call "
                                "init_process_group before DDP's first backward pass")
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        hosts = None
        if size > 1 and local_stage_on():
            records: list = [None] * size
            dist.all_gather_object(records, host_record().encode(), group=group)
            hosts = Hosts(tuple(map(HostRecord.decode, records)), "")
        address = env("SWITCH", None)
        box: list = [None, None, None, None]
        if rank == 0:
            if address is None and not _one_host(hosts):
                self.switch = _embedded_switch()
                assert self.switch.address is not None
                address = "%s:%d" % self.switch.address
            box = [address, "ddp-hook-" + secrets.token_hex(6), secrets.token_hex(8),
                   self._secret if self._secret is not None else _job_secret()]
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group else 0,
                                   group=group)
        if hosts is not None:
            hosts = Hosts(hosts.records, box[2])
        # Each rank's own secret where one was given: a broadcast one is only rank 0's.
        secret = self._secret if self._secret is not None else box[3] or None

        enabled, retry_s = _fallback_settings(box[0])

        def join(generation: int) -> Worker:
            return Worker(box[0], rank, size, timeout=self.timeout, hosts=hosts, secret=secret,
                          job=box[1] if not generation else f"{box[1]}~{generation}",
                          rejoin_within=_rejoin_within(enabled, retry_s))

        # calls off the switch: a gloo group of this hook's own (its collectives in the
        # same order on every rank), met through the job's store under the job's name
        self._fallback = dist.ProcessGroupGloo(
            dist.PrefixStore(f"switchml-fallback/{box[1]}",
                             dist.distributed_c10d._get_default_store()),
            rank, size, dist.default_pg_timeout) if enabled else None
        self._path = SwitchPath(self._fallback, rank, size, join, enabled=enabled,
                                retry_s=retry_s, address=box[0], name=f"job {box[1]}")
        self.world_size = size

    def close(self) -> None:
        """Leave the switch, end the fallback's gloo group, stop an embedded switch."""
        if self._path is not None:
            self._path.close()
        _shut_down(self._fallback)
        self._fallback = None
        if self.switch is not None:
            self.switch.stop()


def allreduce_hook(state: HookState, bucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: average the bucket through the switch (dense, sparse or auto);
    a bucket the switch does not sum (float64, sparse gradients) as torch's own
    hook does, over ``state.process_group``."""
    buffer = bucket.buffer()
    if not ProcessGroupSwitchML._switched_kind(buffer, None) or buffer.numel() == 0:
        return default_hooks.allreduce_hook(state.process_group, bucket)
    path = state._joined_path()
    call = Call(buffer, state.world_size, state.sparse, state.bits, lambda: buffer,
                copies=path.copy_mode(buffer))
    path.submit(call)
    return call.future
