"""Buffers made once and handed out again, so that a steady state of calls touches
no fresh memory.

A first touch of a page costs a fault and a zeroing, several times a copy of the
page (on a 16-core VM, 45 MiB into fresh memory took 4.5x as long as into memory
touched before), and an allocator returns large blocks to the kernel when they
are freed, so a call that allocates its staging each time pays that on every
call.  A ``BufferPool`` keeps what calls gave back and hands the smallest one
that fits to the next call, as NCCL and gloo keep their registered buffers.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np

#: Requests below this many bytes are not pooled: the allocator's own free lists
#: serve them from memory it already holds.
POOLED_BYTES = 256 * 1024


class BufferPool:
    """Byte buffers of at least the size asked for, reused once given back.

    ``allocate(nbytes)`` makes a new one: a 1-D array or tensor of ``nbytes``
    bytes (``len`` is its size).  A taken buffer is the caller's until it gives it
    back; the pool keeps at most ``keep`` buffers between calls (the largest), and
    never hands out one more than ``slack`` times the size asked for, so that a
    small call does not hold a large buffer another call needs.
    """

    def __init__(self, allocate: Callable[[int], Any] | None = None, keep: int = 8,
                 slack: float = 2.0):
        self._allocate = allocate or (lambda nbytes: np.empty(nbytes, np.uint8))
        self._free: list = []
        self._lock = threading.Lock()
        self.keep = keep
        self.slack = slack
        #: Buffers made, ever (a steady state makes none).
        self.allocations = 0

    def take(self, nbytes: int):
        """A buffer of at least ``nbytes`` bytes."""
        if nbytes >= POOLED_BYTES:
            with self._lock:
                fits = [i for i, b in enumerate(self._free)
                        if nbytes <= len(b) <= nbytes * self.slack]
                if fits:  # (by index: == on arrays compares their elements)
                    return self._free.pop(min(fits, key=lambda i: len(self._free[i])))
        self.allocations += 1
        return self._allocate(nbytes)

    def give(self, buffer) -> None:
        """Take ``buffer`` back for later calls (the caller no longer touches it)."""
        if len(buffer) < POOLED_BYTES:
            return
        with self._lock:
            self._free.append(buffer)
            if len(self._free) > self.keep:
                self._free.pop(min(range(len(self._free)), key=lambda i: len(self._free[i])))

    def array(self, shape, dtype) -> tuple[Any, Any]:
        """(an uninitialised C-contiguous array of ``shape`` and ``dtype`` in a pooled
        buffer, the buffer to give back when done with it).  A pool of torch buffers
        takes a torch dtype and gives a tensor."""
        if not isinstance(getattr(dtype, "itemsize", None), int):  # (a torch dtype's is)
            dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        buffer = self.take(nbytes)
        return buffer[:nbytes].view(dtype).reshape(shape), buffer
