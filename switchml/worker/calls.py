"""What a worker's caller hands in and gets back: checked arguments, a handle.

Shared by ``client.Worker`` (one switch) and ``multi.MultiSwitchWorker`` (one
job over several switches), so that both accept and refuse the same calls
before anything is queued.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future

import numpy as np

from ..buffers import BufferPool
from ..errors import SwitchMLError
from .engine.stream import SUPPORTED_DTYPES, check_apart

#: The float32 copies float16 calls are summed in, reused from call to call.
_WIDE = BufferPool()


#: Marks the threads that serve a worker's calls (``serving_calls``).
_here = threading.local()


def serving_calls() -> None:
    """Mark this thread as one that serves a worker's calls and runs its handles'
    done callbacks: a wait for a call here would wait for the thread itself."""
    _here.serves_calls = True


def serving_calls_here() -> bool:
    """Whether this thread serves a worker's calls (``serving_calls``)."""
    return getattr(_here, "serves_calls", False)


def refuse_waiting_here() -> None:
    """A SwitchMLError on a thread that serves calls (a done callback's): the call
    waited for could never end, and the worker's other calls and its close with it."""
    if serving_calls_here():
        raise SwitchMLError("a call cannot be waited for on a worker's own thread (a done "
                            "callback runs there): it would wait for itself; queue it with "
                            "allreduce_async and wait for it elsewhere")


class AllreduceHandle:
    """What ``allreduce_async`` returns: ``wait()`` gives the result or raises."""

    def __init__(self, future: Future):
        self._future = future

    def wait(self, timeout: float | None = None) -> np.ndarray:
        if not self._future.done():
            refuse_waiting_here()
        return self._future.result(timeout)

    def done(self) -> bool:
        return self._future.done()

    def add_done_callback(self, fn) -> None:
        """Call ``fn(handle)`` when the allreduce finishes: on the worker's I/O thread,
        or at once on this one where it has.  ``fn`` may queue calls, not wait for
        them."""
        self._future.add_done_callback(lambda _: fn(self))


def check_call(array, out, sparse, bits: int, ready) -> tuple[np.ndarray, np.ndarray, object]:
    """An allreduce's arguments checked: (a C-contiguous input, its output, ``sparse``).

    ``bits`` is the wire already resolved (16 or 32); a 16-bit call is dense, so
    ``sparse`` comes back False for it.  Raises ValueError or TypeError for a call
    no rank could run.
    """
    if sparse not in (False, True, "auto"):
        raise ValueError(f"sparse must be False, True or 'auto', not {sparse!r}")
    if bits not in (16, 32):
        raise ValueError(f"bits must be 32 or 16, not {bits!r}")
    src = np.asarray(array)
    if ready is not None and (src.dtype not in SUPPORTED_DTYPES
                              or not src.flags.c_contiguous):
        # (the copies below would read the array before it is ready)
        raise ValueError("allreduce_async(ready=...) takes a C-contiguous float32 or "
                         f"int32 array, not a {'' if src.flags.c_contiguous else 'strided '}"
                         f"{src.dtype} one")
    if not src.flags.c_contiguous:
        # (not np.ascontiguousarray: it turns a 0-d array, a scalar loss, into 1-d)
        src = src.copy(order="C")
    if src.dtype not in SUPPORTED_DTYPES and src.dtype != np.float16:
        raise TypeError(f"switchml sums float32, float16 and int32 arrays, not {src.dtype}")
    if out is None:
        out = np.empty_like(src)
    elif (not isinstance(out, np.ndarray) or out.shape != src.shape or out.dtype != src.dtype
          or not out.flags.c_contiguous):
        raise ValueError(f"out must be a C-contiguous array of the input's shape {src.shape} "
                         f"and dtype {src.dtype}")
    elif not out.flags.writeable:
        raise ValueError("out is read-only: the sum cannot be written there")
    else:  # on the caller's thread: the I/O thread's refusal failed the job for all
        check_apart(src, out)
    if bits == 16:
        if src.dtype == np.int32:
            raise ValueError("the 16-bit wire carries float arrays, not int32")
        if sparse is True:
            raise ValueError("the 16-bit wire is dense: pass sparse=False or 'auto'")
        sparse = False
    return src, out, sparse


class Narrowing:
    """A float16 call's way back: the caller's float16 output, and the pooled
    buffer its float32 input and sum live in until the result is rounded."""

    def __init__(self, out: np.ndarray, buffer):
        self.out = out
        self.buffer = buffer


def widen(src: np.ndarray, out: np.ndarray):
    """(input, output, ``narrow``) of a call as the engines run it: a float16 call is
    summed as float32 (float16 values are exact in it) into a float32 output, both
    in a buffer reused from call to call, and ``narrow`` (a ``Narrowing``) leads to
    the caller's float16 output (None for other calls)."""
    if src.dtype != np.float16:
        return src, out, None
    both, buffer = _WIDE.array((2,) + src.shape, np.float32)
    np.copyto(both[0], src)
    return both[0], both[1], Narrowing(out, buffer)


def narrow_result(narrow: Narrowing | None, out: np.ndarray) -> np.ndarray:
    """The result the caller gets: ``out``, or for a float16 call the float32 sum
    rounded to float16 once into the caller's output (past float16's range: inf)."""
    if narrow is None:
        return out
    with np.errstate(over="ignore"):
        np.copyto(narrow.out, out, casting="same_kind")
    _WIDE.give(narrow.buffer)
    return narrow.out
