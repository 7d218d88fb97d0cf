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
"""

from __future__ import annotations

import contextlib
import threading

import torch

from ..buffers import BufferPool

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


def _side_stream(device: torch.device):
    """This process's copy stream for ``device`` (one a device, made on first use)."""
    with _side_streams_lock:
        stream = _side_streams.get(device)
        if stream is None:
            stream = _side_streams[device] = torch.cuda.Stream(device)
        return stream


class HostStaging:
    """A CPU tensor's staging: itself when dense and row-major, else a host copy."""

    devices: list | None = None  # the call's future holds CPU tensors only
    ready = None  # the input is in host memory before the call is queued

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor
        self._buffer = None
        if tensor.dtype in WIDENED_DTYPES or not tensor.is_contiguous():
            dtype = torch.float32 if tensor.dtype in WIDENED_DTYPES else tensor.dtype
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
        _divide(self.host, divisor)
        if self._buffer is not None:
            with torch.no_grad():  # a requires_grad leaf takes the result as gloo gives it
                self.tensor.copy_(self.host)
            _HOST_BUFFERS.give(self._buffer)
            self._buffer = None


class CudaStaging:
    """A CUDA tensor's staging: a pinned host copy made on a side stream."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor
        self.devices = [tensor.device]
        self.stream = _side_stream(tensor.device)
        self.stream.wait_stream(torch.cuda.current_stream(tensor.device))
        with torch.cuda.stream(self.stream):
            source = tensor.detach()
            if source.dtype in WIDENED_DTYPES:
                source = source.float()
            self._pool = _pinned_pool(tensor.device)
            self.host, self._buffer = self._pool.array(source.shape, source.dtype)
            self.host.copy_(source, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record(self.stream)
        # the side stream reads it now and writes it when the sum is back: the caching
        # allocator must not hand its memory out before then, freed or not
        tensor.record_stream(self.stream)
        self.array = self.host.reshape(-1).numpy()

    def ready(self) -> None:
        """Block until the host copy holds the tensor's values (the worker's thread)."""
        self._copied.synchronize()

    def context(self):
        """The side stream, current on the calling thread: ``finish`` enqueues on it
        and the call's future records it."""
        return _on_stream(self.stream)

    def finish(self, divisor: int | None) -> None:
        """Enqueue the sum's copy back to the device, divided by ``divisor`` (AVG) and
        rounded to the tensor's dtype there, into the caller's tensor.  Run in
        ``context()``."""
        with torch.no_grad():
            if self.tensor.dtype == self.host.dtype and self.tensor.is_contiguous():
                self.tensor.copy_(self.host, non_blocking=True)
                _divide(self.tensor, divisor)
            else:
                result = self.host.to(self.tensor.device, non_blocking=True)
                _divide(result, divisor)
                self.tensor.copy_(result)
        # its copy to the device is enqueued: the next user's copy into it comes after
        self._pool.give(self._buffer)


@contextlib.contextmanager
def _on_stream(stream):
    with torch.cuda.device(stream.device), torch.cuda.stream(stream):
        yield


def _divide(values: torch.Tensor, divisor: int | None) -> None:
    if divisor is not None:
        by: int | torch.Tensor = divisor
        if values.is_cuda:
            # a tensor, not a Python number: CUDA divides by a host scalar as a
            # multiplication by its reciprocal, off by an ulp from the CPU's (IEEE) quotient
            by = torch.full((), divisor, dtype=values.dtype, device=values.device)
        values.div_(by, rounding_mode=None if values.is_floating_point() else "trunc")


def stage(tensor: torch.Tensor) -> HostStaging | CudaStaging:
    """The staging of an allreduce's input, by the tensor's device."""
    if tensor.device.type == "cuda":
        return CudaStaging(tensor)
    return HostStaging(tensor)
