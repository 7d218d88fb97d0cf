"""The C engine's sparse mode (engine/sparse.c) against the Python reference (sparse.py).

Fed the same inputs, both must send the same datagrams (bytes, in order), give
the same results bit for bit, and leave the same counters, message numbers, RTT
estimate and window in the Membership.  Through the simulator with seeded loss,
duplication, reordering, a bottleneck queue, and hostile or stale datagrams
(forged exponents among them, which sparse.py takes unchecked, and forged
positions, which it refuses where they would hold a lane in place or point past
a column's end).
"""

from __future__ import annotations

import random
import threading
import zlib

import numpy as np
import pytest
from conftest import reference_sum
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from test_fastengine import BIG_TIME, any_float32, finite_float32, tap

from switchml import quant, wire
from switchml.quant import EXP_NONFINITE, EXP_ZERO
from switchml.sim.network import Bottleneck, Faults, Simulation, StalledSimulation
from switchml.worker.engine import compiled
from switchml.worker.engine.sparse import SparseAllreduce

pytestmark = pytest.mark.skipif(
    compiled._fastengine is None,
    reason="the C engine is not built (python setup.py build_ext --inplace)")

#: (packet_elements, block_elements): 1 to 8 lanes, blocks of 1 to 16 values
GEOMETRIES = [(4, 4), (4, 1), (8, 4), (16, 4), (16, 2), (64, 16), (64, 8)]


def sparse_arrays(draw, world, size, block, dtype):
    """Per-rank arrays of ``size`` with blocks zeroed at a drawn density per rank."""
    if dtype == np.float32:
        values = st.one_of(finite_float32, any_float32) if draw(st.booleans()) else finite_float32
        arrays = [draw(hnp.arrays(np.float32, size, elements=values)) for _ in range(world)]
        # Whole chunks of tiny (subnormal) or huge values: the exponents that
        # take quantize_blocks' and dequantize_blocks' special cases.
        scale = draw(st.sampled_from([1.0, 2.0**-140, 2.0**-120, 2.0**100]))
        if scale != 1.0:
            with np.errstate(all="ignore"):
                arrays = [(a * np.float32(scale)).astype(np.float32) for a in arrays]
    else:
        arrays = [draw(hnp.arrays(np.int32, size)) for _ in range(world)]
    blocks = -(-size // block)
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    for a in arrays:
        density = draw(st.sampled_from([0.0, 0.1, 0.5, 1.0]))
        zero = rng.random(blocks) >= density
        a[np.repeat(zero, block)[:size]] = 0
        if dtype == np.float32 and draw(st.booleans()):  # signed zeros where zero
            a[np.repeat(zero, block)[:size]] = np.float32(-0.0)
    return arrays


def forger(seed: int, bits: int, specials=None, exp_rate=0.3, nxt_rate=0.1):
    """A switch that lies alike to every rank: a result's exponents and next
    positions rewritten, as a function of its bytes (every rank gets the same ones).

    Exponents: the ones at the edges of quant.py's cases, which no honest switch
    returns for the chunks at hand (EXP_ZERO over non-zero blocks, tiny, beyond
    float32's range); positions: forward only (a lane skips blocks, never loops).
    """
    specials = specials or [EXP_ZERO, EXP_NONFINITE, bits - 127, bits - 126, bits - 128,
                            bits + 127, bits + 200, -148, 128, -32767, 0]

    def forge(data: bytes) -> bytes:
        if len(data) < wire.HEADER_SIZE:
            return data
        h = wire.HEADER.unpack_from(data)
        lanes, mode = h[11], h[4]
        if len(data) < wire.HEADER_SIZE + wire.LANE_SIZE * lanes:
            return data
        rng = random.Random(zlib.crc32(data) ^ seed)
        d = bytearray(data)
        for i in range(lanes):
            at = wire.HEADER_SIZE + wire.LANE_SIZE * i
            if mode != wire.MODE_SPARSE and rng.random() < exp_rate:  # exponent, seed rounds
                e = rng.choice(specials) if rng.random() < 0.8 else rng.randrange(-32768, 32768)
                d[at + 8: at + 10] = e.to_bytes(2, "little", signed=True)
            if mode & wire.MODE_SPARSE and rng.random() < nxt_rate:
                nxt = int.from_bytes(d[at + 4: at + 8], "little")
                nxt = rng.choice([nxt + 1, nxt + 2, 0xFFFFFFFE, wire.POS_END])
                d[at + 4: at + 8] = min(nxt, wire.POS_END).to_bytes(4, "little")
        return bytes(d)
    return forge


def run_sparse(compiled_engine, calls, world, slots, k, block, faults, seed, bottleneck,
               hostile_rate, in_place=False, forge=None):
    """Every datagram sent, every result, and the Memberships' state after ``calls``
    (each ``(arrays, sparse)``); ``forge``: rewrites every result the switch sends."""
    sim = Simulation(world, slots=slots, packet_elements=k, block_elements=block, faults=faults,
                     seed=seed, bottleneck=bottleneck, compiled=compiled_engine)
    if in_place:
        for s in sim.memberships:
            def allreduce(array, out, now, sparse=False, _orig=s.allreduce, **kw):
                return _orig(array, array, now, sparse, **kw)
            s.allreduce = allreduce
    sent = tap(sim, seed, hostile_rate, forge)
    results, kinds = [], []
    for arrays, sparse in calls:
        arrays = [a.copy() for a in arrays]  # in place: each engine its own inputs
        try:
            with np.errstate(all="ignore"):  # forged exponents: numpy's overflows, as in C
                outs = sim.allreduce(arrays, max_time=BIG_TIME, sparse=sparse)
        except StalledSimulation:
            # A forged position (nxt) leaves this rank's lanes where no other rank's
            # are: the call stalls, in Python as in C, at the same virtual time.
            results.append(("stalled", sim.now))
            for op in sim.ops:  # the C ranks still running hold their state
                if isinstance(op, compiled.CompiledDenseAllreduce):
                    op.sync()
            kinds.append(type(sim.call_ops[0]).__name__)
            break
        results.append([(arrays if in_place else outs)[r].tobytes() for r in range(world)])
        kinds.append(type(sim.call_ops[0]).__name__)
    state = [(dict(s.counters), list(s.slot_msgs), s.next_seq, s.rtt.srtt, s.rtt.rttvar,
              s.rtt.min_rtt, s.rtt.rto(), s.window.cwnd, s.window.ssthresh,
              s.window._last_decrease, s.window._undo, s.window._epoch_start,
              s.window._epoch_min, s.window._queue_at, s.window._clear_at, s.reordering)
             for s in sim.memberships]
    return sent, results, state, kinds


@st.composite
def scenarios(draw):
    world = draw(st.integers(1, 4))
    k, block = draw(st.sampled_from(GEOMETRIES))
    slots = draw(st.sampled_from([1, 2, 5, 8, 32]))
    dtype = draw(st.sampled_from([np.float32, np.int32]))
    calls = []
    for _ in range(draw(st.integers(1, 3))):
        # up to 3 packets, or to 40 (a short last block where block does not divide it)
        size = draw(st.one_of(st.integers(0, 3 * k), st.integers(0, 40 * k)))
        # mostly sparse; a dense call between sparse ones shares the Membership's state
        sparse = draw(st.sampled_from([True, True, True, False]))
        calls.append((sparse_arrays(draw, world, size, block, dtype), sparse))
    faults = draw(st.sampled_from([
        None,
        Faults(loss=0.05, duplicate=0.05, jitter=0.002),
        Faults(loss=0.2, duplicate=0.1, jitter=0.03),
    ]))
    bottleneck = draw(st.sampled_from([None, Bottleneck(rate=2e6, queue_bytes=6 * (44 + 4 * k))]))
    hostile_rate = draw(st.sampled_from([0.0, 0.3]))
    seed = draw(st.integers(0, 2**16))
    in_place = draw(st.booleans())
    return calls, world, slots, k, block, faults, seed, bottleneck, hostile_rate, in_place


def assert_same_runs(args, in_place=False, forge=None):
    py_sent, py_results, py_state, py_kinds = run_sparse(False, *args, in_place=in_place,
                                                         forge=forge)
    c_sent, c_results, c_state, c_kinds = run_sparse(True, *args, in_place=in_place,
                                                     forge=forge)
    calls = args[0]
    for (_, sparse), py_kind, c_kind in zip(calls, py_kinds, c_kinds):
        if sparse:  # the comparison is between the two engines, not Python twice
            assert (py_kind, c_kind) == ("SparseAllreduce", "CompiledSparseAllreduce")
    assert len(c_sent) == len(py_sent)
    for i, (a, b) in enumerate(zip(py_sent, c_sent)):
        assert a == b, f"datagram {i} differs"
    for i, (a, b) in enumerate(zip(py_results, c_results)):
        assert a == b, f"call {i}: results differ"
    assert c_state == py_state


@settings(max_examples=120, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(scenario=scenarios())
def test_c_sparse_engine_sends_and_computes_what_python_does(scenario):
    *args, in_place = scenario
    assert_same_runs(tuple(args), in_place)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("dtype", [np.float32, np.int32])
def test_c_sparse_engine_under_hostile_results(seed, dtype):
    """Most results forged or mangled (exponents, positions, flags, values, headers):
    what sparse.py accepts and does with them, C must too."""
    rng = np.random.default_rng(seed)
    world, k, block, size = 3, 16, 4, 16 * 23 + 3
    arrays = []
    for _ in range(world):
        if dtype == np.float32:
            a = (rng.standard_normal(size) * 2.0 ** float(rng.integers(-140, 60))).astype(dtype)
        else:
            a = rng.integers(-2**20, 2**20, size, dtype=np.int32)
        a[np.repeat(rng.random(-(-size // block)) < 0.6, block)[:size]] = 0
        arrays.append(a)
    args = ([(arrays, True), (arrays, True)], world, 4, k, block,
            Faults(loss=0.05, duplicate=0.1, jitter=0.01), seed, None, 0.8)
    assert_same_runs(args)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("dtype", [np.float32, np.int32])
def test_c_sparse_engine_on_calls_of_many_rounds(seed, dtype):
    """Hundreds of rounds per slot, per-rank densities from none to all, chunks of
    tiny, huge and non-finite values, signed zeros, in place or not, under faults."""
    rng = np.random.default_rng([seed, dtype == np.float32])
    k, block = ((16, 4), (64, 16), (64, 8), (8, 1))[seed]
    world, size = 3, k * 150 + 1 + seed  # a short last block where block > 1
    arrays = []
    for density in (0.0, 0.15, 1.0) if seed % 2 else (0.05, 0.4, 0.9):
        if dtype == np.float32:
            scale = 2.0 ** rng.integers(-149, 100, -(-size // k)).astype(np.float64)
            a = (rng.standard_normal(size) * np.repeat(scale, k)[:size]).astype(np.float32)
            a[rng.integers(0, size, 3)] = [np.inf, np.nan, -0.0]
            a[rng.integers(0, size, 20)] = np.float32(-0.0)
        else:
            a = rng.integers(-2**31, 2**31, size, dtype=np.int64).astype(np.int32)
        a[np.repeat(rng.random(-(-size // block)) >= density, block)[:size]] = 0
        arrays.append(a)
    faults = Faults(loss=0.05, duplicate=0.05, jitter=0.003) if seed % 2 else None
    args = ([(arrays, True), (arrays, False), (arrays, True)], world, 8, k, block, faults,
            seed, None, 0.05 * seed)
    assert_same_runs(args, in_place=bool(seed % 2))


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(scenario=scenarios())
def test_c_sparse_engine_does_what_python_does_with_a_lying_switch(scenario):
    """sparse.py takes the switch's exponents and positions unchecked: whatever they
    are, C must scale, write, skip and finish as it does (quant.py's special cases
    for EXP_ZERO, tiny, huge and non-finite exponents, on ordinary slots or not)."""
    calls, world, slots, k, block, faults, seed, bottleneck, hostile_rate, in_place = scenario
    bits = quant.scale_bits(world)
    calls = [(arrays, True) for arrays, _ in calls]
    assert_same_runs((calls, world, slots, k, block, faults, seed, bottleneck, 0.0), in_place,
                     forge=forger(seed, bits))


@pytest.mark.parametrize("also_tiny", [False, True])
@pytest.mark.parametrize("seed", range(3))
def test_c_sparse_engine_scales_by_forged_zero_exponents_as_python_does(seed, also_tiny):
    """EXP_ZERO for chunks with non-zero blocks: quantize_rows and dequantize_rows
    (a slot of ordinary exponents) scale by 2**127 and 2**-126, dequantize_blocks
    (a slot with a tiny exponent too) writes 0."""
    rng = np.random.default_rng(seed)
    world, k, block = 2, 16, 4
    arrays = sparse_case(rng, world, k * 40 + 2, block, 0.6, np.float32)
    bits = quant.scale_bits(world)
    specials = [EXP_ZERO, EXP_ZERO, EXP_ZERO, bits - 140] if also_tiny else [EXP_ZERO]
    args = ([(arrays, True)], world, 3, k, block, None, seed, None, 0.0)
    forge = forger(seed, bits, specials, exp_rate=0.5, nxt_rate=0.0)
    assert_same_runs(args, forge=forge)
    # and the forgery did reach the output: not the honest sums
    honest = run_sparse(False, *args)[1]
    assert run_sparse(False, *args, forge=forge)[1] != honest


def sparse_case(rng, world, size, block, density, dtype):
    arrays = []
    for _ in range(world):
        if dtype == np.float32:
            a = (rng.standard_normal(size) * 1e3).astype(dtype)
        else:
            a = rng.integers(-2**20, 2**20, size, dtype=np.int32)
        a[np.repeat(rng.random(-(-size // block)) >= density, block)[:size]] = 0
        arrays.append(a)
    return arrays


@pytest.mark.parametrize("dtype", [np.float32, np.int32])
def test_c_sparse_results_are_the_dense_sums_under_faults(dtype):
    """Sparse results are the dense path's bit for bit (sparse.py's promise), on C."""
    rng = np.random.default_rng(11)
    world, k, block = 3, 64, 16
    size = k * 8 * 5 + 3  # a short last block
    arrays = sparse_case(rng, world, size, block, 0.3, dtype)
    # an inf: summed apart, element by element
    arrays[1][5] = np.float32(np.inf) if dtype == np.float32 else 7
    sim = Simulation(world, slots=8, packet_elements=k, block_elements=block, seed=2,
                     compiled=True, faults=Faults(loss=0.1, duplicate=0.1, jitter=0.01))
    outs = sim.allreduce(arrays, max_time=BIG_TIME, sparse=True)
    assert isinstance(sim.call_ops[0], compiled.CompiledSparseAllreduce)
    expected = reference_sum(arrays, k)
    for out in outs:
        assert out.tobytes() == expected.tobytes()
    counters = sim.memberships[0].counters
    assert counters["sparse_blocks_sent"] == int(np.count_nonzero(
        [np.any(arrays[0][i * block:(i + 1) * block]) for i in range(-(-size // block))]))
    assert 0 < counters["sparse_blocks_received"] < -(-size // block)
    assert counters["retransmissions"] > 0


def test_memberships_whose_packet_is_not_whole_blocks_stay_on_python():
    sim = Simulation(2, slots=2, packet_elements=8, block_elements=8, compiled=True)
    s = sim.memberships[0]
    assert compiled.supports_sparse(s)
    s.packet_elements = 10  # not lanes * block_elements: sparse.py's chunks are not C's
    assert not compiled.supports_sparse(s)
    data = np.ones(20, np.float32)
    op = s.allreduce(data, np.empty_like(data), 0.0, sparse=True, compiled=True)
    assert isinstance(op, SparseAllreduce)


def test_c_sparse_engine_refuses_what_python_refuses():
    sim = Simulation(1, slots=2, packet_elements=8, block_elements=4, compiled=True)
    s = sim.memberships[0]
    with pytest.raises(TypeError):
        s.allreduce(np.zeros(3, np.float64), np.zeros(3, np.float64), 0.0, sparse=True,
                    compiled=True)
    a = np.zeros(8, np.float32)
    with pytest.raises(ValueError):
        s.allreduce(a[:6], a[2:], 0.0, sparse=True, compiled=True)


# ---------------------------------------------------------------- behind sockets
def _two_ranks(switch, arrays, monkeypatch, pure):
    import switchml
    monkeypatch.setenv("SWITCHML_PURE_PYTHON", "1" if pure else "0")
    loops = []
    run_io = compiled.CompiledDenseAllreduce.run_io

    def counting_run_io(self, *args):
        loops.append(type(self).__name__)
        return run_io(self, *args)

    monkeypatch.setattr(compiled.CompiledDenseAllreduce, "run_io", counting_run_io)
    outs, counters = [None, None], [None, None]

    def body(rank):
        with switchml.Worker(switch.address, rank, 2, job=f"fastsparse-{pure}", timeout=20) as w:
            outs[rank] = w.allreduce(arrays[rank], sparse=True)
            counters[rank] = dict(w.counters)

    threads = [threading.Thread(target=body, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return outs, loops, counters


@pytest.mark.parametrize("dtype", [np.float32, np.int32])
def test_worker_runs_sparse_calls_on_the_c_loop_with_the_same_results(dtype, monkeypatch):
    import switchml
    rng = np.random.default_rng(3)
    size = 50_000  # 196 blocks of 256, the last short
    arrays = sparse_case(rng, 2, size, 256, 0.2, dtype)
    with switchml.Switch(packet_elements=1024, block_elements=256) as sw:
        c_outs, c_loops, c_counters = _two_ranks(sw, arrays, monkeypatch, pure=False)
        py_outs, py_loops, py_counters = _two_ranks(sw, arrays, monkeypatch, pure=True)
    assert c_loops and set(c_loops) == {"CompiledSparseAllreduce"} and not py_loops
    expected = reference_sum(arrays, 1024) if dtype == np.float32 else arrays[0] + arrays[1]
    for out in c_outs + py_outs:
        assert out.tobytes() == expected.tobytes()
    for c, p in zip(c_counters, py_counters):  # the same blocks went each way
        assert c["sparse_blocks_sent"] == p["sparse_blocks_sent"] > 0
        assert c["sparse_blocks_received"] == p["sparse_blocks_received"] > 0


def lanes_held_in_place(data: bytes) -> bytes:
    """A member's sparse contribution that reports each lane's next position as
    the one it is at (0 in the seed round): the switch keeps the least, so no
    lane of the job would ever move on."""
    h = wire.decode_header(data)
    if h.kind != wire.KIND_CONTRIBUTION or not h.mode & wire.MODE_SPARSE:
        return data
    out = bytearray(data)
    lanes = np.frombuffer(out, wire.LANE, h.lanes, wire.HEADER_SIZE)
    lanes["nxt"] = np.where(lanes["pos"] == wire.POS_END, 0, lanes["pos"])
    return bytes(out)


def blocks_past_the_end(data: bytes) -> bytes:
    """A member's sparse contribution with a block flagged on every lane, those
    past their column's end too (the switch cannot tell, and adds them)."""
    h = wire.decode_header(data)
    if h.kind != wire.KIND_CONTRIBUTION or h.mode != wire.MODE_SPARSE:
        return data
    lanes = wire.lane_table(data, h.lanes).copy()
    sent = iter(wire.values(data, h.lanes, h.count).reshape(-1, 4))
    blocks = [next(sent) if lanes["flag"][i] else np.full(4, 7 << 20, np.int32)
              for i in range(h.lanes)]
    lanes["flag"] = 1
    return wire.encode(h.kind, h.dtype, h.slot, h.session, h.msg, h.seq, h.pkt_id, lanes,
                       np.concatenate(blocks), mode=h.mode, call=h.call)


@pytest.mark.parametrize("forge", [lanes_held_in_place, blocks_past_the_end])
def test_results_a_lying_member_shapes_fail_the_call_in_both_engines(forge):
    """Results that keep a live lane where it is, or flag a block past a column's
    end, are refused (``dropped_stale``) by both engines: the honest rank's call
    fails at its progress timeout.  Before, every round had a result and the
    call ran forever; or Python raised IndexError where C skipped the block."""
    counters = []
    for engine_in_c in (False, True):
        sim = Simulation(2, slots=1, packet_elements=8, block_elements=4,
                         compiled=engine_in_c, progress_timeout=0.5)
        deliver = sim._send

        def send(data, src, dst, deliver=deliver, switch=sim.switch_address):
            if src != switch and src[1] == 1:
                data = forge(bytes(data))
            return deliver(data, src, dst)

        sim._send = send
        with pytest.raises(StalledSimulation):
            sim.allreduce([np.arange(1, 10, dtype=np.float32)] * 2, max_time=5.0, sparse=True)
        assert sim.ops[0].error == "stalled"
        counters.append(dict(sim.memberships[0].counters))
    assert counters[0] == counters[1] and counters[0]["dropped_stale"] > 0
