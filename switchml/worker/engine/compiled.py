"""The allreduce on the compiled engine (``_fastengine.c``), when it is built.

``CompiledDenseAllreduce`` has ``DenseAllreduce``'s sans-IO API and produces the
same datagrams, results and counters (tests/test_fastengine.py);
``CompiledSparseAllreduce`` is ``SparseAllreduce`` the same way, on the same C
stream machinery in its sparse mode (``sparse.c``, tests/test_fastsparse.py).
``run_io`` drives either on a socket without the GIL.  The Membership's state that
lives across calls (message numbers, RTT estimate, window, counters) is handed
to the C core at the start and written back when the call ends (done or
stalled) and whenever ``run_io`` returns, so the Python and the C engine can
take turns on one membership.

``SWITCHML_PURE_PYTHON=1`` makes the worker use the Python engine only.
"""

from __future__ import annotations

import numpy as np

from ...config import pure_python
from .recovery import CongestionWindow, RttEstimator
from .stream import MembershipState, check_arrays

try:
    from . import _fastengine  # typed by _fastengine.pyi
except ImportError:  # not built (a source checkout without build_ext)
    _fastengine = None  # type: ignore[assignment]

#: run_io's return values.
IO_DONE, IO_STALLED, IO_CONTROL, IO_SLICE = 0, 1, 2, 3


def enabled() -> bool:
    """Whether the worker should use the compiled engine."""
    return _fastengine is not None and not pure_python()


def supports(membership: MembershipState) -> bool:
    """Whether the C core can stand in for the Python engine on ``membership``: it
    implements the stock RTT estimator and window, not subclasses of them."""
    return (_fastengine is not None and type(membership.rtt) is RttEstimator
            and type(membership.window) is CongestionWindow)


def supports_sparse(membership: MembershipState) -> bool:
    """``supports``, for sparse calls: the C core takes chunk c to be blocks
    c*lanes .. c*lanes + lanes - 1, as sparse.py does, so a packet must be whole
    blocks (a Membership whose packet is not is left to the Python engine)."""
    return (supports(membership)
            and membership.packet_elements == membership.lanes * membership.block_elements)


class CompiledDenseAllreduce:
    """``DenseAllreduce`` with its state machine in C."""

    #: The C core's mode: SparseAllreduce's rounds instead of the dense stream.
    SPARSE = False

    def __init__(self, membership: MembershipState, array: np.ndarray, out: np.ndarray, seq: int,
                 now: float, wire_bits: int = 32):
        check_arrays(array, out)
        self.s = membership
        src, dst = array.reshape(-1), out.reshape(-1)
        k = membership.packet_elements  # words a packet; two values a word on the 16-bit wire
        self.chunk_values = 2 * k if wire_bits == 16 else k
        chunks = -(-src.size // self.chunk_values)
        self._core = _fastengine.DenseCore(
            src, dst, is_float=array.dtype == np.float32, session=membership.session,
            token=membership.token,
            slot_base=membership.slot_base, width=min(membership.slot_count, chunks),
            packet_elements=k, lanes=membership.lanes,
            bits=membership.bits16 if wire_bits == 16 else membership.bits, seq=seq,
            slot_msgs=membership.slot_msgs, now=now, progress_timeout=membership.progress_timeout,
            rtt=membership.rtt.state(), window=membership.window.state(),
            wire_bits=wire_bits, world_size=membership.world_size,
            # Sparse: W = min(slots, ceil(blocks / lanes)) is min(slots, chunks) too,
            # a packet being whole blocks (supports_sparse).
            sparse=self.SPARSE, block_elements=membership.block_elements,
            reordering=membership.reordering, data_threads=membership.data_threads)
        self.width = self._core.width
        self.sync()
        self._sync_when_over()  # an empty call is over at once

    def sync(self) -> None:
        """Write the core's message numbers, RTT, window, reordering threshold and
        counters to the Membership."""
        state = self._core.export_state()
        s = self.s
        s.reordering = state["reordering"]
        msgs = state["slot_msgs"]
        s.slot_msgs[: len(msgs)] = msgs
        s.rtt.restore(state["rtt"])  # by recovery.py's field names, both ways
        s.window.restore(state["window"])
        for name, value in state["counters"].items():
            s.counters[name] += value

    # ------------------------------------------------------------ DenseAllreduce's API
    @property
    def done(self) -> bool:
        return self._core.done

    @property
    def error(self) -> str | None:
        return self._core.error

    @property
    def nonfinite_chunks(self) -> list[int]:
        """Chunks left as they were for the follow-up exchange (worker/engine/nonfinite.py)."""
        return self._core.nonfinite_chunks()

    @property
    def inflight_count(self) -> int:
        return self._core.inflight_count

    @property
    def last_progress(self) -> float:
        return self._core.last_progress

    def datagrams_to_send(self) -> list:
        return self._core.datagrams_to_send()

    def get_timer(self) -> float | None:
        return self._core.get_timer()

    def handle_timer(self, now: float) -> None:
        self._core.handle_timer(now)
        self._sync_when_over()

    def pending(self) -> list[tuple[int, int]]:
        return self._core.pending()

    def send_refused(self, now: float) -> None:
        self._core.send_refused(now)

    def receive_datagram(self, data, now: float) -> None:
        self._core.receive_datagram(data, now)
        self._sync_when_over()

    def _sync_when_over(self) -> None:
        # Not per datagram while the call runs: the export builds Python objects.
        # After its end, late datagrams are counted at once, as in Python.
        if self._core.done or self._core.error:
            self.sync()

    # ------------------------------------------------------------ the socket driver
    def run_io(self, udp, address: tuple[str, int], control_fd: int, slice_s: float,
               gso: bool = True) -> int:
        """Drive the call on non-blocking ``udp`` without the GIL for up to ``slice_s``
        seconds; returns IO_DONE, IO_STALLED, IO_CONTROL (readable) or IO_SLICE.
        ``gso``: whether the switch takes runs of UDP GSO segments
        (``protocol.Ready.gso``); else each datagram leaves apart."""
        try:
            return self._core.run_io(udp.fileno(), address, control_fd, slice_s, gso)
        finally:
            self.sync()


class CompiledSparseAllreduce(CompiledDenseAllreduce):
    """``SparseAllreduce`` with its state machine in C: the same API and driver."""

    SPARSE = True
