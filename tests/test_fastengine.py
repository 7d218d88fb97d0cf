"""The C engine (switchml.worker.engine._fastengine) against the Python reference.

Fed the same inputs, both must send the same datagrams (bytes, in order), give
the same results bit for bit, and leave the same counters, message numbers, RTT
estimate and window in the Membership.  Through the simulator with seeded loss,
duplication, reordering, a bottleneck queue, and hostile or stale datagrams.
"""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import reference_sum, run_ranks
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from switchml import quant, wire
from switchml.quant import EXP_NONFINITE, EXP_ZERO
from switchml.sim.network import SWITCH, Bottleneck, Faults, Simulation
from switchml.worker.engine import compiled

pytestmark = pytest.mark.skipif(compiled._fastengine is None,
                                reason="the C engine is not built "
                                       "(python setup.py build_ext --inplace)")
fast = compiled._fastengine

BIG_TIME = 1e9
SETTINGS = settings(max_examples=200, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# float32 of every kind: tiny (subnormal), huge, signed zeros, inf, NaN
any_float32 = st.floats(width=32, allow_nan=True, allow_infinity=True, allow_subnormal=True)
finite_float32 = st.floats(width=32, allow_nan=False, allow_infinity=False,
                           allow_subnormal=True)
exponents = st.one_of(st.integers(-148, 128), st.sampled_from([EXP_ZERO,
                                                                              EXP_NONFINITE]))
bits_of_worlds = st.sampled_from([quant.scale_bits(n) for n in (1, 2, 3, 4, 8, 32)])


# ---------------------------------------------------------------- the arithmetic
def quantized_both_ways(values, exponent, bits) -> tuple[np.ndarray, np.ndarray]:
    """(quant.quantize_into's result, the C kernel's) for the same inputs."""
    expected = np.zeros(values.size, np.int32)
    with np.errstate(all="ignore"):
        quant.quantize_into(values, exponent, bits, expected, np.empty(values.size, np.float32))
    got = np.zeros(values.size, np.int32)
    fast.quantize_into(values, exponent, bits, got)
    return expected, got


@SETTINGS
@given(values=hnp.arrays(np.float32, st.integers(0, 300), elements=any_float32),
       exponent=exponents, bits=bits_of_worlds)
def test_quantize_is_quant_quantize_into(values, exponent, bits):
    expected, got = quantized_both_ways(values, exponent, bits)
    assert got.tobytes() == expected.tobytes()


@pytest.mark.parametrize("exponent", [-148, -120, -100, 0, 3, 30, 128])
def test_quantize_rounds_halves_to_even_at_every_magnitude(exponent):
    """Ties, and values about 2**23 (where the C rounding changes method) and 2**31."""
    bits = quant.scale_bits(2)
    scale = np.float32(2.0) ** np.float32(exponent - bits) if exponent - bits > -149 else None
    steps = np.concatenate([np.arange(-40, 41) + 0.5, np.arange(-40, 41) + 0.25,
                            2.0**23 + np.arange(-4, 5) * 0.5, 2.0**24 + np.arange(-4, 5),
                            -(2.0**23) - np.arange(5) * 0.5, [2.0**31, -(2.0**31), 2.0**30]])
    with np.errstate(over="ignore"):  # at exponent 128 the largest steps are inf: fine too
        values = (steps * float(scale)).astype(np.float32) if scale is not None else \
            np.ldexp(steps, exponent - bits).astype(np.float32)
    expected, got = quantized_both_ways(values, exponent, bits)
    assert got.tolist() == expected.tolist()


@pytest.mark.parametrize("exponent", [-148, -100, -20, 0, 1, 20, 127])
def test_quantize_agrees_over_a_sweep_of_every_float32_pattern(exponent):
    """Every 997th bit pattern (all signs, exponents, NaN payloads, subnormals):
    the vector loop's rounding and out-of-range results are the reference's."""
    values = np.arange(0, 2**32, 997, dtype=np.uint64).astype(np.uint32).view(np.float32)
    bits = quant.scale_bits(4)
    expected, got = quantized_both_ways(values, exponent, bits)
    mismatched = np.flatnonzero(got != expected)
    assert mismatched.size == 0, values[mismatched[:5]]


@SETTINGS
@given(sums=hnp.arrays(np.int32, st.integers(0, 300)), exponent=exponents, bits=bits_of_worlds)
def test_dequantize_is_quant_dequantize_into(sums, exponent, bits):
    expected = np.zeros(sums.size, np.float32)
    with np.errstate(all="ignore"):  # sums times a large power: inf, as in C
        quant.dequantize_into(sums, exponent, bits, expected)
    got = np.zeros(sums.size, np.float32)
    fast.dequantize_into(sums, exponent, bits, got)
    assert got.tobytes() == expected.tobytes()


@SETTINGS
@given(values=hnp.arrays(np.float32, st.integers(1, 300), elements=any_float32))
def test_chunk_exponent_is_quant_chunk_exponents(values):
    (expected,) = quant.chunk_exponents(values, values.size)
    assert fast.chunk_exponent(values) == expected


@SETTINGS
@given(values=hnp.arrays(np.float32, st.integers(1, 300), elements=any_float32),
       build=st.sampled_from(["baseline", "avx2"]))
def test_each_build_of_the_magnitude_peak_is_quant_block_peaks(values, build):
    """Both builds of the exponent pass's max (the AVX2 one is what runs where the
    CPU has it), on NaN payloads, infinities, subnormals and -0.0."""
    got = fast.magnitude_peak(values.tobytes(), build)
    if got is None:
        pytest.skip(f"no {build} build on this machine")
    assert got == int(quant.block_peaks(values, values.size)[0].view(np.int32))


# ---------------------------------------------------------------- whole calls
def hostile(rng: random.Random, data: bytes) -> bytes:
    """A datagram made from a real one: a field changed, cut short, or garbage."""
    d = bytearray(data)
    kind = rng.randrange(9)
    if kind == 0:
        return bytes(d[: rng.randrange(len(d))])
    if kind == 1:
        return bytes(d + b"\0" * rng.randrange(1, 9))
    if kind == 2:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(64)))
    if kind == 3 and len(d) >= wire.HEADER_SIZE + wire.LANE_SIZE:  # any exponent
        d[wire.HEADER_SIZE + 8: wire.HEADER_SIZE + 10] = rng.randrange(65536).to_bytes(2, "little")
        return bytes(d)
    if kind == 4 and len(d) >= wire.HEADER_SIZE:  # a stale or future message number
        msg = int.from_bytes(d[12:16], "little") + rng.choice([-2, -1, 1, 2])
        d[12:16] = (msg & 0xFFFFFFFF).to_bytes(4, "little")
        return bytes(d)
    if kind == 5 and len(d) >= wire.HEADER_SIZE:  # another call's, or another packet's
        field = rng.choice([16, 20])
        v = int.from_bytes(d[field:field + 4], "little") + rng.choice([-1, 1, 7])
        d[field:field + 4] = (v & 0xFFFFFFFF).to_bytes(4, "little")
        return bytes(d)
    if kind == 6 and len(d) >= wire.HEADER_SIZE:  # any one header byte
        d[rng.randrange(wire.HEADER_SIZE)] = rng.randrange(256)
        return bytes(d)
    if kind == 7 and len(d) > wire.HEADER_SIZE:  # values changed: still a valid result
        i = rng.randrange(wire.HEADER_SIZE, len(d))
        d[i] = rng.randrange(256)
        return bytes(d)
    return bytes(data)  # a plain duplicate


def tap(sim: Simulation, seed: int, hostile_rate: float, forge=None) -> list:
    """Record every datagram the workers send (the list returned fills as the run
    goes); after ``hostile_rate`` of the datagrams to a worker deliver a hostile one
    made from it; ``forge`` rewrites every result the switch sends."""
    sent: list = []
    attacker = random.Random(seed)
    deliver = sim._send

    def record(data, src, dst):
        data = bytes(data)
        if forge is not None and src == SWITCH:
            data = forge(data)
        if src != SWITCH:
            sent.append((src[1], data))
        deliver(data, src, dst)
        if dst != SWITCH and attacker.random() < hostile_rate:
            deliver(hostile(attacker, data), src, dst)

    sim._send = record
    return sent


def run_calls(compiled_engine, calls, world, slots, k, faults, seed, bottleneck, hostile_rate,
              wire_bits=32, data_threads=1):
    """Every datagram sent, every result, and the Memberships' state after ``calls``."""
    sim = Simulation(world, slots=slots, packet_elements=k, faults=faults, seed=seed,
                     bottleneck=bottleneck, compiled=compiled_engine,
                     data_threads=data_threads)
    sent = tap(sim, seed, hostile_rate)
    results = []
    for arrays in calls:
        outs = sim.allreduce(arrays, max_time=BIG_TIME, wire_bits=wire_bits)
        results.append([o.tobytes() for o in outs])
    state = [(dict(s.counters), list(s.slot_msgs), s.next_seq, s.rtt.srtt, s.rtt.rttvar,
              s.rtt.min_rtt, s.rtt.rto(), s.window.cwnd, s.window.ssthresh,
              s.window._last_decrease, s.window._undo, s.window._epoch_start,
              s.window._epoch_min, s.window._queue_at, s.window._clear_at, s.reordering)
             for s in sim.memberships]
    return sent, results, state


@st.composite
def scenarios(draw):
    world = draw(st.integers(1, 4))
    k = draw(st.sampled_from([4, 16, 64]))
    slots = draw(st.sampled_from([1, 2, 5, 8, 32]))
    dtype = draw(st.sampled_from([np.float32, np.int32]))
    calls = []
    for _ in range(draw(st.integers(1, 3))):
        size = draw(st.one_of(st.integers(0, 3 * k), st.integers(0, 40 * k)))
        if dtype == np.float32:
            values = (st.one_of(finite_float32, any_float32) if draw(st.booleans())
                      else finite_float32)
            arrays = [draw(hnp.arrays(np.float32, size, elements=values)) for _ in range(world)]
        else:
            arrays = [draw(hnp.arrays(np.int32, size)) for _ in range(world)]
        calls.append(arrays)
    faults = draw(st.sampled_from([
        None,
        Faults(loss=0.05, duplicate=0.05, jitter=0.002),
        Faults(loss=0.2, duplicate=0.1, jitter=0.03),
    ]))
    bottleneck = draw(st.sampled_from([
        None, Bottleneck(rate=2e6, queue_bytes=6 * (44 + 4 * k)),
        Bottleneck(rate=2e6, queue_bytes=6 * (44 + 4 * k), refuse=True)]))
    hostile_rate = draw(st.sampled_from([0.0, 0.3]))
    seed = draw(st.integers(0, 2**16))
    wire_bits = draw(st.sampled_from([32, 32, 16])) if dtype == np.float32 else 32
    data_threads = draw(st.sampled_from([1, 1, 3]))  # fast retransmit per switch thread
    return calls, world, slots, k, faults, seed, bottleneck, hostile_rate, wire_bits, data_threads


@settings(max_examples=80, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(scenario=scenarios())
def test_c_engine_sends_and_computes_what_python_does(scenario):
    (calls, world, slots, k, faults, seed, bottleneck, hostile_rate, wire_bits,
     data_threads) = scenario
    args = (calls, world, slots, k, faults, seed, bottleneck, hostile_rate, wire_bits,
            data_threads)
    py_sent, py_results, py_state = run_calls(False, *args)
    c_sent, c_results, c_state = run_calls(True, *args)
    assert len(c_sent) == len(py_sent)
    for i, (a, b) in enumerate(zip(py_sent, c_sent)):
        assert a == b, f"datagram {i} differs"
    assert c_results == py_results
    assert c_state == py_state


@pytest.mark.parametrize("dtype", [np.float32, np.int32])
def test_c_engine_results_are_the_reference_sum_under_faults(dtype):
    rng = np.random.default_rng(5)
    world, k = 3, 64
    size = k * 8 * 5 + 3
    if dtype == np.float32:
        arrays = [(rng.standard_normal(size) * 2.0 ** float(rng.integers(-30, 30)))
                  .astype(np.float32) for _ in range(world)]
    else:
        arrays = [rng.integers(-2**20, 2**20, size, dtype=np.int32) for _ in range(world)]
    sim = Simulation(world, slots=8, packet_elements=k, seed=2, compiled=True,
                     faults=Faults(loss=0.1, duplicate=0.1, jitter=0.01))
    outs = sim.allreduce(arrays, max_time=BIG_TIME)
    assert isinstance(sim.call_ops[0], compiled.CompiledDenseAllreduce)
    expected = reference_sum(arrays, k)
    for out in outs:
        assert out.tobytes() == expected.tobytes()
    assert sim.memberships[0].counters["retransmissions"] > 0
    assert sim.memberships[0].counters["fast_retransmissions"] > 0


def test_pure_python_switch(monkeypatch):
    monkeypatch.setenv("SWITCHML_PURE_PYTHON", "1")
    assert not compiled.enabled()
    monkeypatch.setenv("SWITCHML_PURE_PYTHON", "0")
    assert compiled.enabled()


def test_c_engine_refuses_what_python_refuses():
    sim = Simulation(1, slots=2, packet_elements=4, compiled=True)
    s = sim.memberships[0]
    with pytest.raises(TypeError):
        s.allreduce(np.zeros(3, np.float64), np.zeros(3, np.float64), 0.0, compiled=True)
    a = np.zeros(8, np.float32)
    with pytest.raises(ValueError):
        s.allreduce(a[:6], a[2:], 0.0, compiled=True)


# ---------------------------------------------------------------- behind sockets
def _two_ranks(switch, arrays, monkeypatch, pure):
    import threading

    import switchml
    monkeypatch.setenv("SWITCHML_PURE_PYTHON", "1" if pure else "0")
    loops = []
    run_io = compiled.CompiledDenseAllreduce.run_io

    def counting_run_io(self, *args):
        loops.append(1)
        return run_io(self, *args)

    monkeypatch.setattr(compiled.CompiledDenseAllreduce, "run_io", counting_run_io)
    outs = [None, None]

    def body(rank):
        with switchml.Worker(switch.address, rank, 2, job=f"fast-{pure}", timeout=20) as w:
            outs[rank] = w.allreduce(arrays[rank])
            assert w.counters["results_in"] > 0

    threads = [threading.Thread(target=body, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return outs, len(loops)


@pytest.mark.parametrize("dtype", [np.float32, np.int32])
def test_worker_runs_dense_calls_on_the_c_loop_with_the_same_results(dtype, monkeypatch):
    import switchml
    rng = np.random.default_rng(3)
    size = 50_000
    arrays = [(rng.standard_normal(size) * 1e3).astype(dtype) for _ in range(2)]
    with switchml.Switch(packet_elements=1024, block_elements=256) as sw:
        c_outs, c_loops = _two_ranks(sw, arrays, monkeypatch, pure=False)
        py_outs, py_loops = _two_ranks(sw, arrays, monkeypatch, pure=True)
    assert c_loops > 0 and py_loops == 0
    expected = reference_sum(arrays, 1024) if dtype == np.float32 else arrays[0] + arrays[1]
    for out in c_outs + py_outs:
        assert out.tobytes() == expected.tobytes()


def test_run_io_lets_other_threads_run():
    """While the C loop waits for results (here: none ever come), the GIL is free."""
    import socket
    import threading
    import time

    sim = Simulation(2, slots=4, packet_elements=16)
    data = np.arange(100, dtype=np.int32)
    op = sim.memberships[0].allreduce(data, np.empty_like(data), time.monotonic(), compiled=True)
    sink = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)  # receives, never answers
    sink.bind(("127.0.0.1", 0))
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("127.0.0.1", 0))
    udp.setblocking(False)
    ticks = []
    stop = threading.Event()

    def other():
        while not stop.is_set():
            ticks.append(time.monotonic())

    thread = threading.Thread(target=other)
    try:
        thread.start()
        while not ticks:
            time.sleep(0.001)
        start = time.monotonic()
        status = op.run_io(udp, sink.getsockname(), -1, 0.5)
        stop.set()
        thread.join()
        assert status == compiled.IO_SLICE and not op.done
        # The other thread ran while the loop did, not only once it returned
        # (a loop that holds the GIL lets it run at start + 0.5 s at the earliest).
        assert any(start < t < start + 0.4 for t in ticks)
        assert sink.recv(65536)  # and the messages did go out
        assert sim.memberships[0].counters["bytes_sent"] > 0
    finally:
        stop.set()
        sink.close()
        udp.close()


# A float32 input whose pages past the first window's chunks cannot be read:
# the first messages of a call must go out without touching them.
GUARDED_CALL = """
import ctypes, mmap, sys
import numpy as np
from switchml.sim.network import Simulation
size, readable = {size}, {readable}
memory = mmap.mmap(-1, size)
array = np.frombuffer(memory, dtype=np.float32)
array[:] = np.linspace(-3.0, 3.0, array.size, dtype=np.float32)
libc = ctypes.CDLL(None, use_errno=True)
start = ctypes.addressof(ctypes.c_char.from_buffer(memory))
if libc.mprotect(ctypes.c_void_p(start + readable), size - readable, 0) != 0:  # PROT_NONE
    sys.exit("mprotect failed")
sim = Simulation(2, slots=4, packet_elements=256, block_elements=32)
op = sim.memberships[0].allreduce(array, np.empty_like(array), 0.0, compiled=True)
assert op.datagrams_to_send()
"""


def test_a_call_starts_sending_without_reading_its_whole_input():
    """A dense chunk's local exponent is read when a message announces it, not in
    a pass over the whole input before the first send: that pass kept the links
    idle for 20 ms of every 64 MiB call (85 ms of 256 MiB) on the testbed.  Here
    the input's pages past the first window's chunks (0-3, 1 KiB each) are
    unreadable; setting the call up and sending its first messages must not
    fault (it did, SIGSEGV, with the pass).  (A sparse call does read its whole
    input first: its seed needs the whole map, and its one exponent round every
    chunk of its slot; test_sparse.py counts those rounds.)"""
    import subprocess
    import sys

    script = GUARDED_CALL.format(size=64 * 1024, readable=8192)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])


def test_a_steady_state_of_calls_allocates_no_large_blocks():
    """After a first call, calls take their packet and receive buffers from the
    blocks earlier calls kept, and keep their last chunks (for a rank behind) in
    the storage of the call before's, which they replace: a steady state
    allocates neither, so that it faults in no fresh pages
    (tests/test_fresh_memory.py counts those)."""
    import switchml
    x = np.arange(300_000, dtype=np.float32)
    made, storages = {}, {0: [], 1: []}
    with switchml.Switch("127.0.0.1", 0) as switch:
        def body(rank):
            with switchml.Worker(switch.address, rank, 2, job="steady", timeout=20,
                                 local_stage=False) as w:
                out = np.empty_like(x)
                w.allreduce(x, out)
                w.allreduce(x, out)
                made[rank] = fast.blocks_allocated()
                for _ in range(4):
                    w.allreduce(x, out)
                    storages[rank].append(id(w._kept.storage))
                return fast.blocks_allocated(), out
        (after, out), _ = run_ranks(2, body)
    assert compiled.enabled()
    assert out.tobytes() == (2 * x).tobytes()
    assert after == max(made.values())  # both ranks' blocks came from the kept ones
    for ids in storages.values():  # the one storage, over and over
        assert len(set(ids)) == 1


def test_an_empty_datagram_at_a_worker_is_dropped_and_counted():
    """An empty datagram is one datagram, not a run of none: the C loop counts it
    as malformed, as the Python engine does, and the call is not disturbed.  It
    arrives while rank 0's call waits for rank 1 (between calls the worker drops
    what comes as stale).  Rank 0's probes may fire while it waits, and an answer
    to one that comes after the result is stale: so at most one stale datagram a
    retransmission, and none without one."""
    import threading

    import switchml
    x = np.arange(50_000, dtype=np.float32)
    in_flight, sent = threading.Event(), threading.Event()
    with switchml.Switch("127.0.0.1", 0) as switch:
        def body(rank):
            with switchml.Worker(switch.address, rank, 2, job="empty", timeout=20,
                                 local_stage=False) as w:
                w.allreduce(x)
                before = dict(w.counters)
                if rank == 0:
                    handle = w.allreduce_async(x)
                    in_flight.wait(10)  # rank 1 holds back until the datagram went out
                    time.sleep(0.2)  # the C loop is polling rank 0's socket
                    # from the switch's own socket: the worker's is connected to it
                    switch._udp.sendto(b"", w._udp.getsockname())
                    sent.set()
                    total = handle.wait()
                else:
                    in_flight.set()
                    sent.wait(10)
                    total = w.allreduce(x)
                after = w.counters
                return total, {k: after.get(k, 0) - before.get(k, 0)
                               for k in ("dropped_malformed", "dropped_stale",
                                         "retransmissions")}
        (total, counted), (other, _) = run_ranks(2, body)
    assert compiled.enabled()
    assert total.tobytes() == other.tobytes() == (2 * x).tobytes()
    assert counted["dropped_malformed"] == 1
    assert counted["dropped_stale"] <= counted["retransmissions"]


def test_results_that_arrive_as_one_gro_run_are_cut_into_their_datagrams():
    """The switch sends a worker its results as GSO runs; on loopback a run reaches
    a socket with UDP_GRO on whole, as one receive (checked first: the premise),
    which the C loop cuts at the segment size: nothing dropped as malformed (a
    run read as one datagram would be, and only retransmissions would bring its
    results).  Workers with it on and off get the same sums, bit for bit."""
    import os
    import socket
    import subprocess
    import sys

    import switchml
    udp_gro, udp_segment = 104, 103
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as rx, \
            socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as tx:
        rx.bind(("127.0.0.1", 0))
        rx.setsockopt(socket.SOL_UDP, udp_gro, 1)
        tx.setsockopt(socket.SOL_UDP, udp_segment, 1000)
        tx.sendto(bytes(4000), rx.getsockname())
        data, ancillary, _, _ = rx.recvmsg(65536, 64)
        assert len(data) == 4000, "loopback delivered the run cut: nothing to test"
        assert any(level == socket.SOL_UDP and kind == udp_gro
                   for level, kind, _ in ancillary)
    script = (
        "import sys, numpy as np, switchml\n"
        "rank, port = int(sys.argv[1]), int(sys.argv[2])\n"
        "x = (np.random.default_rng(rank).standard_normal(300_000) * 1e3).astype(np.float32)\n"
        "with switchml.Worker(('127.0.0.1', port), rank, 2, job='gro', timeout=30) as w:\n"
        "    total = w.allreduce(x)\n"
        "    assert w.counters['dropped_malformed'] == 0, w.counters\n"
        "    sys.stdout.buffer.write(total.tobytes())\n")
    sums = {}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with switchml.Switch("127.0.0.1", 0) as switch:
        port = switch.address[1]
        for gro in ("1", "0"):
            env = dict(os.environ, SWITCHML_WORKER_GRO=gro, SWITCHML_LOCAL_STAGE="0",
                       PYTHONPATH=root)
            ranks = [subprocess.Popen([sys.executable, "-c", script, str(r), str(port)],
                                      env=env, stdout=subprocess.PIPE) for r in range(2)]
            outs = [p.communicate(timeout=60)[0] for p in ranks]
            assert all(p.returncode == 0 for p in ranks) and outs[0] == outs[1]
            sums[gro] = outs[0]
    assert len(sums["1"]) == 4 * 300_000 and sums["1"] == sums["0"]


PATH_MTU_FALLS = """
import json, subprocess, threading, time
import numpy as np
subprocess.run(["ip", "link", "set", "lo", "up", "mtu", "1500"], check=True)
import switchml
from switchml.worker.engine import compiled
x = np.arange(20_000, dtype=np.float32)
results = {}
with switchml.Switch("127.0.0.1", 0) as switch:
    barrier = threading.Barrier(2)
    def body(rank):
        with switchml.Worker(switch.address, rank, 2, job="mtu", timeout=6,
                             local_stage=False) as w:
            w.allreduce(x)
            barrier.wait()
            if rank == 0:  # the route's MTU falls under the job's packets
                subprocess.run(["ip", "link", "set", "lo", "mtu", "1000"], check=True)
            barrier.wait()
            started = time.monotonic()
            try:
                w.allreduce(x)
                results[rank] = ["ok", 0]
            except OSError as exc:
                results[rank] = [exc.errno, time.monotonic() - started, str(exc)]
    threads = [threading.Thread(target=body, args=(r,)) for r in range(2)]
    [t.start() for t in threads]
    [t.join(60) for t in threads]
print(json.dumps({"compiled": compiled.enabled(), "results": results}))
"""


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                    reason="needs root and unshare(1) for a network namespace of its own")
@pytest.mark.parametrize("pure_python", ["0", "1"], ids=["c-loop", "python"])
def test_a_datagram_too_big_for_the_path_fails_the_call_at_once_in_both_engines(pure_python):
    """The route's MTU falls under the job's packets between two calls (DF set:
    every datagram refused, EMSGSIZE): both engines fail the call at once with
    that error, or with the job's failure that names the other rank's where that
    rank failed first.  (The C loop left each to the retransmission timer, which
    sent it again and again until the timeout blamed the ranks.)"""
    done = subprocess.run(["unshare", "-n", sys.executable, "-c", PATH_MTU_FALLS],
                          env=dict(os.environ, SWITCHML_MTU="1500",
                                   SWITCHML_PURE_PYTHON=pure_python),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.splitlines()[-1])
    assert report["compiled"] == (pure_python == "0")
    for errno_, seconds, message in report["results"].values():
        assert seconds < 2.0, report
        assert errno_ == errno.EMSGSIZE or "Message too long" in message, report
    assert errno.EMSGSIZE in [errno_ for errno_, _, _ in report["results"].values()], report
