"""Real sockets on loopback: a running switch and worker threads."""

import errno
import os
import socket
import threading
import time

import numpy as np
import pytest
from conftest import run_ranks

import switchml
from switchml import netutil
from switchml.quant import error_bound
from switchml.worker.driver import send_waiting

K = 1024  # packet_elements of the test switch
SIZES = [0, 1, K - 1, K + 1, 16 * K * 3 + 5]


def inputs(world, size, dtype, seed=0):
    rng = np.random.default_rng([seed, world, size])
    if dtype == np.int32:
        return [rng.integers(-(2**24), 2**24, size, dtype=np.int32) for _ in range(world)]
    return [(rng.standard_normal(size) * 10.0 ** rng.integers(-3, 4)).astype(np.float32)
            for _ in range(world)]


def check(results, data, dtype):
    for r in results[1:]:
        assert r.tobytes() == results[0].tobytes(), "ranks disagree"
    if dtype == np.int32:
        assert np.array_equal(results[0], np.sum(data, axis=0, dtype=np.int32))
    elif data[0].size:
        err = np.abs(results[0].astype(np.float64) - np.sum(np.array(data, np.float64), axis=0))
        assert np.all(err <= error_bound(data, K))


@pytest.mark.parametrize("drop_rate", [0.0, 0.05])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_sums_over_sockets(world, drop_rate):
    with switchml.Switch(packet_elements=K, slots=64, slots_per_job=16, drop_rate=drop_rate,
                         seed=world) as sw:
        cases = [(size, dtype) for size in SIZES for dtype in (np.float32, np.int32)]
        data = {case: inputs(world, *case) for case in cases}

        def body(rank):
            with switchml.Worker(sw.address, rank, world, timeout=20) as w:
                return {case: w.allreduce(data[case][rank]) for case in cases}

        results = run_ranks(world, body)
        for case in cases:
            check([res[case] for res in results], data[case], case[1])
        counters = sw.stats()["ended_jobs"]["default"]["counters"]
        if drop_rate:
            simulated = (counters.get("dropped_ingress_simulated", 0)
                         + counters.get("dropped_egress_simulated", 0))
            assert simulated > 0 and counters["retransmissions_answered"] > 0
        assert sw.stats()["free_slots"] == 64


def test_hundreds_of_megabytes():
    size = 64 * 2**20  # 256 MiB of float32 per worker
    with switchml.Switch() as sw:
        base = np.arange(size, dtype=np.float32) % 4096

        def body(rank):
            with switchml.Worker(sw.address, rank, 2, timeout=60) as w:
                return w.allreduce(base * (rank + 1))

        a, b = run_ranks(2, body, timeout=300)
        assert a.tobytes() == b.tobytes()
        # integer-valued floats within the block's bits come back exactly
        assert np.array_equal(a, base * 3)


def test_int32_sums_wrap_around(switch):
    big = np.full(10, 2**31 - 1, dtype=np.int32)

    def body(rank):
        with switchml.Worker(switch.address, rank, 2) as w:
            return w.allreduce(big)

    a, b = run_ranks(2, body)
    assert np.array_equal(a, np.full(10, -2, dtype=np.int32))  # two's complement wrap


@pytest.mark.parametrize("sparse", [False, True])
def test_non_finite_inputs_stay_non_finite(switch, sparse):
    """inf and NaN are summed element by element, as gloo sums them; every other
    element, in their packets too, is the sum it would be without them."""
    size = 3 * K

    def body(rank):
        x = np.ones(size, dtype=np.float32)
        if rank == 1:
            x[5] = np.inf
            x[2 * K + 7] = np.nan
        with switchml.Worker(switch.address, rank, 3) as w:
            return w.allreduce(x, sparse=sparse)

    results = run_ranks(3, body)
    expected = np.full(size, 3, np.float32)
    expected[5], expected[2 * K + 7] = np.inf, np.nan
    for r in results:
        assert np.array_equal(r, expected, equal_nan=True)
        assert r.tobytes() == results[0].tobytes()


def test_async_calls_are_served_in_call_order(switch):
    arrays = [np.full(5000 + i, i, dtype=np.int32) for i in range(6)]

    def body(rank):
        with switchml.Worker(switch.address, rank, 2) as w:
            handles = [w.allreduce_async(a) for a in arrays]
            return [h.wait() for h in reversed(handles)][::-1]

    for results in run_ranks(2, body):
        for i, r in enumerate(results):
            assert np.array_equal(r, np.full(5000 + i, 2 * i, dtype=np.int32))


def test_ready_runs_on_the_workers_thread_before_the_input_is_read(switch):
    """allreduce_async(ready=...): the call is queued before its input exists (as the
    torch backend queues a CUDA tensor's copy); ready() fills it first, on the I/O
    thread.  A strided or float16 input, which would be copied at once, is refused."""
    def body(rank):
        x = np.zeros(70_000, np.float32)
        seen = []

        def ready():
            seen.append(threading.current_thread().name)
            x[:] = np.arange(x.size, dtype=np.float32) * (rank + 1)

        with switchml.Worker(switch.address, rank, 2) as w:
            out = w.allreduce_async(x, out=x, ready=ready).wait()
            with pytest.raises(ValueError, match="ready"):
                w.allreduce_async(np.zeros(8, np.float16), ready=ready)
            with pytest.raises(ValueError, match="ready"):
                w.allreduce_async(np.zeros((4, 4), np.float32)[:, ::2], ready=ready)
        return out, seen

    for out, seen in run_ranks(2, body):
        assert np.array_equal(out, np.arange(70_000, dtype=np.float32) * 3)
        assert seen and seen[0].startswith("switchml-worker")


def test_out_argument_and_in_place(switch):
    def body(rank):
        x = np.arange(3000, dtype=np.float32)
        with switchml.Worker(switch.address, rank, 2) as w:
            out = w.allreduce(x, out=x)
            assert out is x
            return x

    for r in run_ranks(2, body):
        assert np.array_equal(r, 2 * np.arange(3000, dtype=np.float32))


def test_scalars_and_strided_arrays_keep_their_shape(switch):
    """A 0-d array (a loss) comes back 0-d, in place; a strided view is summed whole."""
    def body(rank):
        loss = np.array(rank + 0.5, np.float32)
        grid = np.arange(24, dtype=np.int32).reshape(4, 6)
        with switchml.Worker(switch.address, rank, 2) as w:
            total = w.allreduce(loss, out=loss)
            columns = w.allreduce(grid[:, ::2])
        return total, loss, columns

    for total, loss, columns in run_ranks(2, body):
        assert total is loss and total.shape == () and total == 2.0
        assert columns.shape == (4, 3)
        assert np.array_equal(columns, 2 * np.arange(24, dtype=np.int32).reshape(4, 6)[:, ::2])


def test_bad_arguments_raise(switch):
    with switchml.Worker(switch.address, 0, 1) as w:
        with pytest.raises(TypeError):
            w.allreduce(np.ones(3, dtype=np.float64))
        with pytest.raises(ValueError):
            w.allreduce(np.ones(3, np.float32), out=np.ones(4, np.float32))


@pytest.mark.parametrize("case", ["read-only", "read-only-float16", "partial-overlap"])
def test_an_output_no_sum_can_go_to_is_refused_by_the_caller_and_the_job_goes_on(
        switch, case):
    """A read-only ``out`` (a float16 one hung its wait() for ever and ended the I/O
    thread), or one that partly overlaps the input, is refused on the caller's
    thread before anything is queued: the job does not fail for the other rank,
    whose next call sums with this rank's next one."""
    def body(rank):
        with switchml.Worker(switch.address, rank, 2, timeout=10) as w:
            if rank == 0:
                dtype = np.float16 if case.endswith("float16") else np.float32
                if case == "partial-overlap":
                    both = np.ones(8, dtype)
                    array, out = both[:6], both[2:]
                else:
                    array, out = np.ones(6, dtype), np.ones(6, dtype)
                    out.flags.writeable = False
                with pytest.raises(ValueError, match="read-only|not overlap"):
                    w.allreduce_async(array, out=out)
            return w.allreduce(np.full(6, rank + 1.0, np.float32))

    for out in run_ranks(2, body):
        assert (out == 3.0).all()


def seen_first(seen: list, seconds: float = 10.0):
    deadline = time.monotonic() + seconds
    while not seen:
        assert time.monotonic() < deadline, "the callback did not run"
        time.sleep(0.01)
    return seen[0]


def test_a_done_callback_may_queue_calls_and_close_but_not_wait(switch):
    """A done callback runs on the worker's thread: a call it waited for would wait
    for that thread (a deadlock, and close at exit with it), so allreduce() and
    wait() there raise; one it queues runs, and a close there leaves the job as a
    close elsewhere does (it closed the sockets under the thread, and the switch
    failed the job for the others)."""
    def body(rank):
        w = switchml.Worker(switch.address, rank, 2, timeout=10)
        seen = []

        def callback(handle):
            with pytest.raises(switchml.SwitchMLError, match="wait for itself"):
                w.allreduce(np.ones(4, np.float32))
            queued = w.allreduce_async(np.full(4, 2.0, np.float32))
            with pytest.raises(switchml.SwitchMLError, match="wait for itself"):
                queued.wait()
            seen.append(queued)
            if rank == 0:
                w.close()

        registered = threading.Event()  # the call waits for its callback to be set
        first = w.allreduce_async(np.ones(4, np.float32), ready=registered.wait)
        first.add_done_callback(callback)
        registered.set()
        assert (first.wait(10) == 2.0).all()
        result = seen_first(seen).wait(10)
        if rank == 0:  # closed by the callback: the thread leaves after the queued call
            w._thread.join(10)
            assert not w._thread.is_alive() and w._udp.fileno() == -1
        w.close()
        return result

    before = switch.stats()["counters"].get("jobs_failed", 0)
    for out in run_ranks(2, body):
        assert (out == 4.0).all()
    assert switch.stats()["counters"].get("jobs_failed", 0) == before


def test_switch_address_from_environment(switch, monkeypatch):
    host, port = switch.address
    monkeypatch.setenv("SWITCHML_SWITCH", f"{host}:{port}")
    with switchml.Worker(None, 0, 1) as w:
        assert np.array_equal(w.allreduce(np.arange(7, dtype=np.int32)), np.arange(7))


def test_garbage_during_a_job_changes_no_sum(switch):
    """Junk at the switch and at a worker, from a stranger, while a job runs."""
    rng = np.random.default_rng(3)
    stranger = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    data = inputs(2, 40 * K, np.float32)
    worker_addrs = []

    def spray(targets, count=300):
        from switchml import wire
        lanes = np.zeros(K // 256, wire.LANE)
        for i in range(count):
            kind = i % 4
            if kind == 0:
                junk = rng.bytes(int(rng.integers(0, 2000)))
            elif kind == 1:
                junk = wire.encode(wire.KIND_CONTRIBUTION, wire.DTYPE_INT32, 0, 1234, 0, 0, 0,
                                   lanes, np.ones(K, np.int32))[:40]
            elif kind == 2:
                junk = wire.encode(wire.KIND_CONTRIBUTION, wire.DTYPE_INT32, 0, 1234, 0, 0, 0,
                                   lanes, np.full(K, 7, np.int32))
            else:
                junk = wire.encode(wire.KIND_RESULT, wire.DTYPE_FLOAT32, 0, 99, 0, 0, 0,
                                   lanes, np.full(K, 7, np.int32))
            for t in targets:
                stranger.sendto(junk, t)

    def body(rank):
        with switchml.Worker(switch.address, rank, 2, timeout=20) as w:
            worker_addrs.append(w._udp.getsockname())
            out = []
            for _i in range(5):
                if rank == 0 and len(worker_addrs) == 2:
                    spray([switch.address] + worker_addrs)
                out.append(w.allreduce(data[rank]))
            return out, w.counters

    results = run_ranks(2, body)
    reference = None
    for outs, _counters in results:
        for o in outs:
            reference = reference if reference is not None else o
            assert o.tobytes() == reference.tobytes()
    check([results[0][0][0], results[1][0][0]], data, np.float32)
    stats = switch.stats()
    assert stats["counters"]["dropped_unknown_source"] >= 300
    dropped = sum(v for k, v in results[0][1].items() if k.startswith("dropped"))
    dropped += sum(v for k, v in results[1][1].items() if k.startswith("dropped"))
    assert dropped >= 300
    stranger.close()


@pytest.mark.parametrize("options", [{"keepalive": 0}, {"keepalive": -1.0},
                                     {"keepalive": float("inf")}, {"keepalive": float("nan")},
                                     {"slots_per_job": 0}, {"max_jobs": 0},
                                     {"drop_rate": 1.0}])
def test_bad_switch_options_are_refused_before_it_starts(options):
    with pytest.raises(ValueError, match=next(iter(options))):
        switchml.Switch(**options)


class RefusingSocket:
    """A socket whose host queue refuses the first ``refusals`` sends (ENOBUFS)."""

    def __init__(self, refusals: int, error: int = errno.ENOBUFS):
        self.refusals, self.error, self.sent = refusals, error, []

    def sendto(self, data, address):
        if self.refusals:
            self.refusals -= 1
            raise OSError(self.error, os.strerror(self.error))
        self.sent.append(data)
        return len(data)


class Call:
    def __init__(self):
        self.refused = []

    def send_refused(self, now):
        self.refused.append(now)


def test_a_datagram_the_host_queue_refuses_waits_and_the_call_hears_once():
    udp, call = RefusingSocket(3), Call()
    assert send_waiting(udp, b"x" * 100, ("10.0.0.1", 7300), call) == 100
    assert udp.sent == [b"x" * 100]
    assert len(call.refused) == 1  # once a datagram, however many tries


def test_a_queue_full_past_the_patience_loses_the_datagram_to_the_timers(monkeypatch):
    monkeypatch.setattr(netutil, "SEND_PAUSE", netutil.SEND_PATIENCE / 4)
    monkeypatch.setattr(netutil.time, "sleep", lambda s: None)
    udp, call = RefusingSocket(100), Call()
    assert send_waiting(udp, b"x", ("10.0.0.1", 7300), call) == 0
    assert udp.sent == [] and len(call.refused) == 1


def test_a_full_socket_buffer_is_a_loss_an_icmp_error_is_retried_once_too_big_raises():
    """A firewall's drop on the way out (EPERM) or no route is a loss the timers
    recover, as the C engine counts it, not an error that ends the call."""
    call = Call()
    assert send_waiting(RefusingSocket(1, errno.EAGAIN), b"x", ("h", 1), call) == 0
    assert send_waiting(RefusingSocket(1, errno.ECONNREFUSED), b"x", ("h", 1), call) == 1
    assert send_waiting(RefusingSocket(2, errno.ECONNREFUSED), b"x", ("h", 1), call) == 0
    for error in (errno.EPERM, errno.ENETUNREACH, errno.EHOSTUNREACH):
        assert send_waiting(RefusingSocket(1, error), b"x", ("h", 1), call) == 0
    with pytest.raises(OSError):
        send_waiting(RefusingSocket(1, errno.EMSGSIZE), b"x", ("h", 1), call)
    assert call.refused == []


def test_the_workers_socket_reports_refusals_of_its_host_queue(switch):
    with switchml.Worker(switch.address, 0, 1, job="recverr", timeout=10) as w:
        assert w._udp.getsockopt(socket.IPPROTO_IP, 11) == 1  # IP_RECVERR
