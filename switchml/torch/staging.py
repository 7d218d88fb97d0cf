"""A tensor's way to the host memory the switchml worker reads, and the sum's way back.

A dense CPU tensor in row-major order is summed in place; any other CPU tensor (a
strided view, channels_last, a 16-bit one widened to float32) in a contiguous copy.
Copies live in buffers reused from call to call (``switchml.buffers``): a steady
state of calls touches no fresh memory.

A CUDA tensor, as NCCL's collectives treat one, never blocks the calling thread on
the GPU: a side stream waits for the caller's current stream (the kernels that
produce the tensor), copies it, widened to float32 if it is 16-bit, into pinned
host memory, and records an event; the worker's thread waits for that event before
it reads the copy.  The sum goes back on the same side stream, and the call's
future records that stream's work, so whoever waits on it (``Work.wait()``, DDP's
reducer, ``Future.wait()``) has its current stream wait for the result instead of
its thread: the allreduce completes on the tensor's stream.

Where a job's ranks all share one host (the local stage, no switch), a
contiguous CUDA tensor moves a segment at a time (``SWITCHML_CUDA_COPIES``).
By default (``direct``) it skips the host copy altogether: the host's shared
memory is registered with CUDA once (``cudaHostRegister``), and each segment
goes by DMA from the tensor into the rank's area of the shared memory, and its
sum from the result area straight back into the tensor (``SegmentCopies``; 16-bit
tensors widened and rounded back on the GPU, AVG divided there), so the host's
cores only sum.  The copies overlap the sums: while the stage sums a segment,
the next one comes in on a second side stream and the last one's sum goes back
on the first; the call ends once its last sum is on its way (its readers wait
on the side stream, which the call's future records), not there.  With
``pipelined`` every
segment's copy into the pinned host copy is enqueued at once, each with an
event, the stage starts on a segment once its event is done, and each
segment's sum goes back as soon as it is copied out (``PipelinedCopies``):
nobody waits for a copy to the device.  ``whole`` keeps one copy each way.
"""

from __future__ import annotations

import contextlib
import logging
import threading

import torch

from ..buffers import BufferPool
from ..config import env

log = logging.getLogger("switchml.torch")

#: Summed as float32 (their values are exact in it) and rounded back once.
WIDENED_DTYPES = (torch.float16, torch.bfloat16)

_side_streams: dict = {}
_side_streams_lock = threading.Lock()

#: Host copies of CPU tensors that cannot be summed in place.
_HOST_BUFFERS = BufferPool(lambda nbytes: torch.empty(nbytes, dtype=torch.uint8))
#: Pinned host copies of CUDA tensors, a pool a device.  A buffer given back may
#: still be read by its call's copy to the device, already enqueued on the device's
#: side stream: the next call's copy into it is enqueued on the same stream, after
#: it, and the worker's thread touches it only once that copy is done.
_pinned_pools: dict = {}


def _pinned_pool(device: torch.device) -> BufferPool:
    with _side_streams_lock:
        pool = _pinned_pools.get(device)
        if pool is None:
            pool = _pinned_pools[device] = BufferPool(
                lambda nbytes: torch.empty(nbytes, dtype=torch.uint8, pin_memory=True))
        return pool


def _side_stream(device: torch.device, inward: bool = False):
    """This process's copy stream for ``device`` (one a device, made on first use),
    or, ``inward``, its second one: a segment's input comes in on it while the
    last one's sum goes back on the first."""
    with _side_streams_lock:
        stream = _side_streams.get((device, inward))
        if stream is None:
            stream = _side_streams[device, inward] = torch.cuda.Stream(device)
        return stream


class HostStaging:
    """A CPU tensor's staging: itself when dense and row-major, else a host copy."""

    devices: list | None = None  # the call's future holds CPU tensors only
    ready = None  # the input is in host memory before the call is queued

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor
        self._buffer = None
        if tensor.dtype in WIDENED_DTYPES or not tensor.is_contiguous():
            dtype = _staged_dtype(tensor.dtype)
            self.host, self._buffer = _HOST_BUFFERS.array(tensor.shape, dtype)
            self.host.copy_(tensor.detach())
        else:
            self.host = tensor.detach()
        #: A flat numpy view of the staged values (0-d scalars included).
        self.array = self.host.reshape(-1).numpy()

    def context(self):
        """Where ``finish`` and the future's result run (nothing to set on a CPU)."""
        return contextlib.nullcontext()

    def finish(self, divisor: int | None) -> None:
        """Divide the sum by ``divisor`` (AVG; integers truncated, as NCCL's average
        does) and put it into the caller's tensor if it was staged in a copy (a 16-bit
        tensor takes the float32 result rounded to nearest, once)."""
        try:
            with writable(self.tensor):
                _divide(self.host, divisor)
                if self._buffer is not None:
                    self.tensor.copy_(self.host)
        finally:
            if self._buffer is not None:
                _HOST_BUFFERS.give(self._buffer)
                self._buffer = None


#: How a CUDA tensor's call moves between the GPU and the host
#: (``SWITCHML_CUDA_COPIES``): the whole tensor each way through a pinned host
#: copy; each segment straight to and from the local stage's shared memory; each
#: segment through the pinned host copy, the next one's copy under way while the
#: stage works on this one.
WHOLE, DIRECT, PIPELINED = "whole", "direct", "pipelined"
COPY_MODES = (WHOLE, DIRECT, PIPELINED)


class CudaStaging:
    """A CUDA tensor's staging, by ``mode``: a pinned host copy made on a side
    stream (``WHOLE``), the same made a segment of ``segment`` elements at a time
    (``PIPELINED``), or none until one is asked for (``DIRECT``, ``ready``).  The
    last two move the call's segments through ``segment_copies``."""

    def __init__(self, tensor: torch.Tensor, mode: str = WHOLE, segment: int = 0):
        self.tensor = tensor
        self.devices = [tensor.device]
        self.mode = mode
        self.segment = segment
        self.stream = _side_stream(tensor.device)
        self.stream.wait_stream(torch.cuda.current_stream(tensor.device))
        dtype = _staged_dtype(tensor.dtype)
        self._pool = _pinned_pool(tensor.device)
        self.host, self._buffer = self._pool.array(tensor.shape, dtype)
        self._copied: torch.cuda.Event | None = None
        #: The events this call took from the pool (one a segment's copy to the
        #: host where ``PIPELINED``), given back when it finishes.
        self._events: list = []
        #: Elements of the tensor whose sum went back already, divided.
        self.sent_upto = 0
        if mode == WHOLE:
            self._copy_to_host()
        elif mode == PIPELINED:
            self._copy_to_host_by_segment()
        # the side stream reads it now and writes it when the sum is back: the caching
        # allocator must not hand its memory out before then, freed or not
        tensor.record_stream(self.stream)
        self.array = self.host.reshape(-1).numpy()

    def _source(self) -> torch.Tensor:
        return _widened(self.tensor.detach())

    def _copy_to_host(self) -> None:
        with _on_stream(self.stream):
            self.host.copy_(self._source(), non_blocking=True)
            self._copied = self.event()
            self._copied.record(self.stream)

    def event(self) -> torch.cuda.Event:
        """An event from the device's pool, back in it when the call finishes."""
        event = _take_events(self.tensor.device, 1)[0]
        self._events.append(event)
        return event

    def _copy_to_host_by_segment(self) -> None:
        with _on_stream(self.stream):
            source, flat = self._source().view(-1), self.host.view(-1)
            self._events = _take_events(self.tensor.device, -(-flat.numel() // self.segment))
            for i, event in enumerate(self._events):
                piece = slice(i * self.segment, (i + 1) * self.segment)
                flat[piece].copy_(source[piece], non_blocking=True)
                event.record(self.stream)
            self._copied = self._events[-1] if self._events else None

    def ready(self) -> None:
        """Block until the host copy holds the tensor's values (the worker's thread;
        a direct staging makes the copy now, for a call that went elsewhere)."""
        if self._copied is None:
            self._copy_to_host()
        assert self._copied is not None
        self._copied.synchronize()

    def segment_copies(self, divisor: int | None) -> SegmentCopies | PipelinedCopies:
        """The call's ``stage.DeviceCopies`` (``DIRECT``) or ``stage.DevicePipeline``
        (``PIPELINED``)."""
        if self.mode == DIRECT:
            return SegmentCopies(self, divisor)
        assert self.mode == PIPELINED
        return PipelinedCopies(self, divisor)

    def context(self):
        """The side stream, current on the calling thread: ``finish`` enqueues on it
        and the call's future records it."""
        return _on_stream(self.stream)

    def finish(self, divisor: int | None) -> None:
        """Enqueue the sum's copy back to the device, divided by ``divisor`` (AVG) and
        rounded to the tensor's dtype there, into the caller's tensor (nothing to do
        where the segments went back already).  Run in ``context()``."""
        try:
            if self.sent_upto < self.tensor.numel():
                with writable(self.tensor):
                    if self.tensor.dtype == self.host.dtype and self.tensor.is_contiguous():
                        self.tensor.copy_(self.host, non_blocking=True)
                        _divide(self.tensor, divisor)
                    else:
                        result = self.host.to(self.tensor.device, non_blocking=True)
                        _divide(result, divisor)
                        self.tensor.copy_(result)
        finally:
            # its copy to the device is enqueued: the next user's copy into it comes after
            self._pool.give(self._buffer)
            if self._events:  # each waited for (the segments, ready(), the copies): done
                _give_events(self.tensor.device, self._events)
                self._events = []


def _staged_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a tensor of ``dtype`` is summed in."""
    return torch.float32 if dtype in WIDENED_DTYPES else dtype


def _widened(values: torch.Tensor) -> torch.Tensor:
    """``values`` as float32 where they are 16-bit (a copy on their device)."""
    return values.float() if values.dtype in WIDENED_DTYPES else values


def _send_back(staging: CudaStaging, host: torch.Tensor, start: int, stop: int,
               divisor: int | None) -> None:
    """Enqueue the sum of elements [start, stop), in ``host``, into the tensor on
    the side stream: divided and rounded to the tensor's dtype on the device."""
    with writable(staging.tensor):
        target = staging.tensor.detach().view(-1)[start:stop]
        if target.dtype != host.dtype or divisor is not None:
            summed = host.to(target.device, non_blocking=True)
            _divide(summed, divisor)
            target.copy_(summed)
        else:
            target.copy_(host, non_blocking=True)


class SegmentCopies:
    """``stage.DeviceCopies`` of a CUDA tensor: each segment by DMA between the
    tensor and the host's shared memory (registered with CUDA), the input on the
    device's in-stream and the sum on the side stream (the two directions run at
    once), each copy's event waited for by the calling thread (the worker's).
    The last segment's copy back is waited for at the stage's next call, after
    this call's end: each copy's event comes from the device's pool, not the
    staging's, and goes back to it once waited for."""

    def __init__(self, staging: CudaStaging, divisor: int | None):
        self.staging = staging
        self.divisor = divisor
        self.in_stream = _side_stream(staging.tensor.device, inward=True)
        # the input is read there: after what the side stream waited for (the
        # caller's kernels) and after the last call's sums went back
        self.in_stream.wait_stream(staging.stream)
        staging.tensor.record_stream(self.in_stream)
        self._started: dict[tuple[str, int], torch.cuda.Event] = {}

    def _record(self, key: tuple[str, int], stream) -> None:
        event = _take_events(self.staging.tensor.device, 1)[0]
        event.record(stream)
        self._started[key] = event

    def _wait(self, key: tuple[str, int]) -> None:
        event = self._started.pop(key)
        event.synchronize()
        _give_events(self.staging.tensor.device, [event])  # done: another copy may take it

    def into_host(self, area, start: int, stop: int) -> None:
        with _on_stream(self.in_stream):
            source = _widened(self.staging.tensor.detach().view(-1)[start:stop])
            torch.from_numpy(area).copy_(source, non_blocking=True)
            self._record(("in", start), self.in_stream)

    def wait_into_host(self, start: int, stop: int) -> None:
        self._wait(("in", start))

    def from_host(self, result, start: int, stop: int) -> None:
        with _on_stream(self.staging.stream):
            _send_back(self.staging, torch.from_numpy(result), start, stop, self.divisor)
            self._record(("out", start), self.staging.stream)
        # enqueued on the stream the call's future records: its readers wait for it
        self.staging.sent_upto = stop

    def wait_from_host(self, start: int, stop: int) -> None:
        self._wait(("out", start))


class PipelinedCopies:
    """``stage.DevicePipeline`` of a CUDA tensor: the staging's copies to the host,
    one a segment, were all enqueued when the call was made; a segment's sum goes
    back as soon as it is in the host copy, on the side stream, nobody waiting."""

    def __init__(self, staging: CudaStaging, divisor: int | None):
        self.staging = staging
        self.divisor = divisor

    def arrive(self, start: int, stop: int) -> None:
        events = self.staging._events
        if events:  # (the copies end in order: the last one that holds stop - 1)
            events[min(len(events) - 1, max(0, stop - 1) // self.staging.segment)].synchronize()

    def depart(self, start: int, stop: int) -> None:
        staging = self.staging
        with _on_stream(staging.stream):
            _send_back(staging, staging.host.view(-1)[start:stop], start, stop, self.divisor)
        staging.sent_upto = stop


#: CUDA events for the calls' copies, a list a device, reused call after call (a
#: new one a call would create and destroy a CUDA event every time).
_event_pools: dict = {}


def _take_events(device: torch.device, count: int) -> list:
    with _side_streams_lock:
        pool = _event_pools.setdefault(device, [])
        taken = [pool.pop() for _ in range(min(count, len(pool)))]
    return taken + [torch.cuda.Event() for _ in range(count - len(taken))]


def _give_events(device: torch.device, events: list) -> None:
    with _side_streams_lock:
        _event_pools.setdefault(device, []).extend(events)


#: Workers whose shared memory is registered with CUDA (by id): True, or False
#: where registering failed (their calls keep the host copy).
_registered: dict[int, bool] = {}


def copy_mode(worker, tensor: torch.Tensor) -> tuple[str, int]:
    """How a call of ``tensor`` on ``worker`` moves to and from the GPU, and in
    segments of how many elements: ``SWITCHML_CUDA_COPIES`` (``direct`` by
    default) where the worker takes device copies (a one-host local stage) and
    the tensor is contiguous; ``WHOLE`` otherwise, or where CUDA would not
    register the shared memory (``direct``: done here, once a worker, undone
    when it closes)."""
    mode = env("CUDA_COPIES", DIRECT)
    if mode not in COPY_MODES:
        raise ValueError(f"SWITCHML_CUDA_COPIES={mode}: use one of {', '.join(COPY_MODES)}")
    if (mode == WHOLE or worker is None or not tensor.is_cuda or not tensor.is_contiguous()
            or not getattr(worker, "takes_device_copies", False)):
        return WHOLE, 0
    if mode == DIRECT and not _register(worker):
        return WHOLE, 0
    return mode, worker.local_segment


def _register(worker) -> bool:
    key = id(worker)
    with _side_streams_lock:
        known = _registered.get(key)
        if known is not None:
            return known
        address, size = worker.shared_memory()
        cudart = torch.cuda.cudart()
        code = cudart.cudaHostRegister(address, size, 1)  # cudaHostRegisterPortable
        _registered[key] = ok = int(code) == 0
    if not ok:
        log.warning("CUDA would not register the local stage's shared memory (%s): CUDA "
                    "tensors go through a host copy", code)
        return False

    def unregister():
        with _side_streams_lock:
            if _registered.pop(key, False):
                torch.cuda.synchronize()  # no copy of ours may still use it
                cudart.cudaHostUnregister(address)

    worker.on_close(unregister)
    return True


@contextlib.contextmanager
def _on_stream(stream):
    with torch.cuda.device(stream.device), torch.cuda.stream(stream):
        yield


@contextlib.contextmanager
def writable(tensor: torch.Tensor):
    """Where a call's result goes into the caller's ``tensor``: on the worker's
    thread or a future's callback, not the caller's, so as the caller could write
    it there.  An inference tensor (made under ``torch.inference_mode()``, which is
    a thread's) is written in inference mode, any other without autograd (a
    ``requires_grad`` leaf takes the result as gloo gives it)."""
    with torch.inference_mode(tensor.is_inference()), torch.no_grad():
        yield


def _divide(values: torch.Tensor, divisor: int | None) -> None:
    if divisor is not None:
        by: int | torch.Tensor = divisor
        if values.is_cuda:
            # a tensor, not a Python number: CUDA divides by a host scalar as a
            # multiplication by its reciprocal, off by an ulp from the CPU's (IEEE) quotient
            by = torch.full((), divisor, dtype=values.dtype, device=values.device)
        values.div_(by, rounding_mode=None if values.is_floating_point() else "trunc")


def stage(tensor: torch.Tensor, mode: str = WHOLE, segment: int = 0
          ) -> HostStaging | CudaStaging:
    """The staging of an allreduce's input, by the tensor's device (a CUDA one's
    ``mode`` and ``segment``: ``copy_mode``)."""
    if tensor.device.type == "cuda":
        return CudaStaging(tensor, mode, segment)
    return HostStaging(tensor)
