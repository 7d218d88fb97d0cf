import json
import os
import shutil
import signal
import socket
import threading

import numpy as np
import pytest
from hypothesis import settings

import switchml
from switchml import quant
from switchml.netutil import LineReader

# The suite's rank-per-thread and rank-per-process jobs run on one machine, where
# the local stage would combine them before the switch: the tests of the switch
# path run without it, and tests/test_local*.py turn it on where they test it.
os.environ["SWITCHML_LOCAL_STAGE"] = "0"

# make test runs the suite on several processes at once: a property's examples take
# what time the machine gives them, so Hypothesis's per-example deadline is off.
settings.register_profile("suite", deadline=None)
settings.load_profile("suite")

#: Modules whose tests run alone, after the others (``make test``'s second pass,
#: ``pytest -m alone``): they shape links or serve real traffic and count what
#: crossed them, time floods, or look at machine-wide state (/dev/shm) that a test
#: running beside them would change.  Tests elsewhere that do (the benchmarks on the
#: testbed, of the XDP program) are marked ``@pytest.mark.alone`` one by one.  (The
#: window's shares and losses are the simulator's, in simulated time:
#: tests/test_window.py runs beside other tests.)
ALONE = {"test_testbed.py", "test_racks_testbed.py", "test_xdp_serve.py",
         "test_availability.py", "test_local_runtime.py", "test_torch_cuda.py"}


def pytest_configure(config):
    config.addinivalue_line("markers", "alone: run with no other test beside it "
                            "(make test's second pass)")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in ALONE:
            item.add_marker(pytest.mark.alone)


def pytest_ignore_collect(collection_path, config):
    """``-m alone`` (make test's second pass) imports only the modules that hold
    tests to run alone: the others' imports (torch, Hypothesis's strategies) would
    cost the pass seconds of collection for tests it deselects."""
    if config.getoption("markexpr") != "alone" or collection_path.suffix != ".py":
        return None
    name = collection_path.name
    if not name.startswith("test_") or name in ALONE:
        return None
    return "mark.alone" not in collection_path.read_text()


def _testbed_missing() -> str | None:
    """Why the emulated cluster cannot run here (None: it can)."""
    if os.geteuid() != 0:
        return "needs root: network namespaces, veths and tc qdiscs"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "needs iproute2's ip and tc"
    return None


#: For tests on the emulated cluster: skipped, saying why, where it cannot run.
needs_root = pytest.mark.skipif(_testbed_missing() is not None,
                                reason=_testbed_missing() or "")


def interruptible() -> None:
    """``Popen(preexec_fn=interruptible)``: a child that SIGINT interrupts, as Ctrl-C would.

    A background job of a non-interactive shell (``make test &``, some CI runners)
    starts with SIGINT ignored and its children inherit that, so Python in them
    would never raise KeyboardInterrupt.
    """
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run_ranks(world, body, timeout=60.0):
    """Run body(rank) on one thread per rank; return results, re-raise the first error."""
    results = [None] * world
    errors = [None] * world

    def target(rank):
        try:
            results[rank] = body(rank)
        except BaseException as exc:  # collected and re-raised below
            errors[rank] = exc

    threads = [threading.Thread(target=target, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        assert not t.is_alive(), "a rank hung"
    for exc in errors:
        if exc is not None:
            raise exc
    return results


@pytest.fixture
def switch():
    with switchml.Switch(packet_elements=1024, slots=64, slots_per_job=16) as sw:
        yield sw


def make_inputs(world, size, dtype, seed, chunk=16):
    """Random inputs for ``world`` ranks: int32 over the whole range, or float32 with a
    different magnitude per ``chunk`` values (the simulator tests' packet) and some
    all-zero chunks."""
    rng = np.random.default_rng(seed)
    if dtype == np.int32:
        return [rng.integers(-2**31, 2**31, size, dtype=np.int64).astype(np.int32)
                for _ in range(world)]
    arrays = []
    chunks = -(-size // chunk)
    for _ in range(world):
        a = rng.standard_normal(size).astype(np.float32)
        for c in range(chunks):
            kind = rng.integers(0, 6)
            sl = slice(c * chunk, (c + 1) * chunk)
            if kind == 0:
                a[sl] = 0
            else:
                a[sl] *= np.float32(2.0 ** int(rng.integers(-60, 60)))
        arrays.append(a)
    return arrays


def reference_sum(arrays, block):
    """The dense result every rank must get, from the quantisation primitives."""
    n = len(arrays)
    size = arrays[0].size
    if arrays[0].dtype == np.int32:
        total = np.zeros(size, np.int32)
        for a in arrays:
            np.add(total, a, out=total)  # wraps modulo 2**32
        return total
    B = quant.scale_bits(n)
    # An inf or NaN is summed apart, element by element (worker/engine/nonfinite.py): the
    # finite values of its chunk are summed as if it were 0, then IEEE decides.
    special = None
    if not all(np.isfinite(a).all() for a in arrays):
        special = np.any([~np.isfinite(a) for a in arrays], axis=0)
        with np.errstate(invalid="ignore"):
            ieee = np.sum([a.astype(np.float64) for a in arrays], axis=0)[special]
        arrays = [np.where(np.isfinite(a), a, np.float32(0)) for a in arrays]
    E = np.max([quant.chunk_exponents(a, block) for a in arrays], axis=0) if size \
        else np.zeros(0, np.int16)
    total = np.zeros(size, np.int32)
    scratch = np.empty(block, np.float32)
    for a in arrays:
        q = np.empty(size, np.int32)
        for c in range(E.size):
            sl = slice(c * block, (c + 1) * block)
            quant.quantize_into(a[sl], int(E[c]), B, q[sl], scratch)
        np.add(total, q, out=total)
    out = np.empty(size, np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        for c in range(E.size):
            sl = slice(c * block, (c + 1) * block)
            quant.dequantize_into(total[sl], int(E[c]), B, out[sl])
    if special is not None:
        out[special] = ieee
    return out


def job_whose_rank_1_vanishes(address, job, timeout):
    """A 2-rank job whose rank 1, a bare control connection, closes right after "ready"
    without leaving; return what rank 0's allreduce raised (a list of 0 or 1 errors)."""
    errors = []

    def rank0():
        with switchml.Worker(address, 0, 2, job=job, timeout=timeout) as w:
            try:
                w.allreduce(np.ones(100, np.float32))
            except switchml.SwitchMLTimeoutError as exc:
                errors.append(exc)

    t = threading.Thread(target=rank0)
    t.start()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as data, \
            socket.create_connection(address) as control:
        data.bind(("127.0.0.1", 0))
        control.sendall(json.dumps({"op": "join", "version": 2, "job": job, "rank": 1,
                                    "world_size": 2,
                                    "data_addr": list(data.getsockname())}).encode() + b"\n")
        reader = LineReader()
        while not any(m.get("event") == "ready" for m in reader.feed(control.recv(4096))):
            pass
    t.join(10)
    return errors
