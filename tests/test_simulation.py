"""Whole allreduces through the deterministic simulator: switch pipeline + worker engines
on a virtual clock with seeded loss, duplication and reordering."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import make_inputs, reference_sum

from switchml import quant, wire
from switchml.quant import EXP_ZERO
from switchml.sim.network import Faults, Simulation, StripedSimulation
from switchml.switch.dataplane.pipeline import Pipeline
from switchml.worker.engine.dense import Membership
from switchml.worker.engine.recovery import RttEstimator

K = 16      # packet_elements
SLOTS = 4   # window
SIZES = [0, 1, K - 1, K, K + 1, K * SLOTS * 3 + 5]
WORLDS = [1, 2, 3, 4, 8]
DTYPES = [np.float32, np.int32]
FAULTS = [
    Faults(loss=0.05, duplicate=0.05, jitter=0.002),
    Faults(loss=0.2, duplicate=0.1, jitter=0.03),  # jitter beyond the RTO: reordering
]
BIG_TIME = 1e9  # the simulator's max_time is on its absolute clock


# ---------------------------------------------------------------- helpers
def reference(arrays, chunk=K):
    """The result every rank must get, computed with the quantisation primitives."""
    return reference_sum(arrays, chunk)


def exact_int32_sum(arrays):
    wide = np.sum([a.astype(np.int64) for a in arrays], axis=0)
    return (((wide + 2**31) % 2**32) - 2**31).astype(np.int32)


def check_float_bound(arrays, result, chunk=K):
    """|result - exact| <= n*2**(E-B-1) + half an ulp of the result, E from a chunk's
    finite values; an element with an inf or NaN anywhere is exactly the IEEE sum."""
    n = len(arrays)
    B = quant.scale_bits(n)
    if result.size == 0:
        return
    special = np.any([~np.isfinite(a) for a in arrays], axis=0)
    with np.errstate(invalid="ignore"):
        ieee = np.sum([a.astype(np.float64) for a in arrays], axis=0)
    assert np.array_equal(result[special], ieee[special].astype(np.float32), equal_nan=True)
    arrays = [np.where(np.isfinite(a), a, np.float32(0)) for a in arrays]
    E = np.max([quant.chunk_exponents(a, chunk) for a in arrays], axis=0)
    exact = np.sum([a.astype(np.float64) for a in arrays], axis=0)
    for c, e in enumerate(E.tolist()):
        sl = slice(c * chunk, (c + 1) * chunk)
        plain = ~special[sl]
        if e == EXP_ZERO:
            assert (result[sl][plain] == 0).all()
            continue
        r = result[sl][plain].astype(np.float64)
        assert np.isfinite(r).all()
        half_ulp = np.spacing(np.abs(result[sl][plain])).astype(np.float64) / 2
        bound = n * 2.0 ** (e - B - 1) + half_ulp
        assert np.all(np.abs(r - exact[sl][plain]) <= bound * (1 + 2**-30)), c


def same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and \
        np.array_equal(a.view(np.uint32), b.view(np.uint32))


def check_results(arrays, outs):
    expected = reference(arrays)
    for r, out in enumerate(outs):
        assert out.dtype == arrays[0].dtype and out.shape == arrays[0].shape
        assert same_bits(out, outs[0]), f"rank {r} differs from rank 0"
        assert same_bits(out, expected), f"rank {r} differs from the reference"
    if arrays[0].dtype == np.int32:
        assert np.array_equal(outs[0], exact_int32_sum(arrays))
    else:
        check_float_bound(arrays, outs[0])


# ---------------------------------------------------------------- sizes x worlds x dtypes
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "i32"])
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("world", WORLDS)
def test_faulty_network_gives_bit_identical_results(world, size, dtype):
    seed = world * 1000 + size * 10 + (dtype == np.int32)
    arrays = make_inputs(world, size, dtype, seed)
    clean = Simulation(world, slots=SLOTS, packet_elements=K).allreduce(arrays)
    check_results(arrays, clean)
    for i, faults in enumerate(FAULTS):
        sim = Simulation(world, slots=SLOTS, packet_elements=K, faults=faults, seed=seed + i)
        outs = sim.allreduce(arrays, max_time=BIG_TIME)
        for r in range(world):
            assert same_bits(outs[r], clean[r]), (faults, r)
        # the inputs are left alone
        assert same_bits(arrays[0], make_inputs(world, size, dtype, seed)[0])


def test_faults_really_happen():
    """The fault model is active: datagrams are lost, duplicated and retransmitted."""
    world = 3
    arrays = make_inputs(world, K * SLOTS * 3 + 5, np.float32, 7)
    sim = Simulation(world, slots=SLOTS, packet_elements=K, faults=FAULTS[1], seed=3)
    outs = sim.allreduce(arrays, max_time=BIG_TIME)
    check_results(arrays, outs)
    assert sum(s.counters["retransmissions"] for s in sim.memberships) > 0
    assert sum(s.counters["dropped_stale"] for s in sim.memberships) > 0
    assert sim.job.counters["duplicates"] + sim.job.counters["retransmissions_answered"] > 0
    clean = Simulation(world, slots=SLOTS, packet_elements=K)
    clean.allreduce(arrays)
    assert sim.datagrams > clean.datagrams


def test_multidimensional_arrays_keep_their_shape():
    world = 3
    rng = np.random.default_rng(5)
    arrays = [rng.standard_normal((5, 7, 3)).astype(np.float32) for _ in range(world)]
    sim = Simulation(world, slots=SLOTS, packet_elements=K, faults=FAULTS[0], seed=1)
    outs = sim.allreduce(arrays, max_time=BIG_TIME)
    flat = reference([a.reshape(-1) for a in arrays])
    for out in outs:
        assert out.shape == (5, 7, 3)
        assert same_bits(out.reshape(-1), flat)


@pytest.mark.parametrize("faults", [None, FAULTS[1]], ids=["clean", "faulty"])
@pytest.mark.parametrize("world", [1, 2, 3, 8])
@pytest.mark.parametrize("block", [1, 4, 8])
def test_one_exponent_per_packet_whatever_the_block_size(block, world, faults):
    """Blocks smaller than a packet share the packet's exponent: dense scaling does not
    depend on the sparse path's block size."""
    size = K * SLOTS * 2 + 7
    rng = np.random.default_rng(block * 100 + world)
    arrays = []
    for _ in range(world):
        a = rng.standard_normal(size).astype(np.float32)
        a *= np.float32(2.0) ** rng.integers(-40, 40, size).astype(np.float32)
        a[rng.random(size) < 0.2] = 0
        arrays.append(a)
    for a in arrays:  # a block zero everywhere
        a[block:2 * block] = 0
    sim = Simulation(world, slots=SLOTS, packet_elements=K, block_elements=block,
                     faults=faults, seed=world)
    assert sim.pipeline.lanes == K // block
    outs = sim.allreduce(arrays, max_time=BIG_TIME)
    expected = reference(arrays, chunk=K)
    for out in outs:
        assert same_bits(out, expected)
    check_float_bound(arrays, outs[0], chunk=K)
    if block < K and world > 1:
        # per-block exponents would have kept the small blocks next to big ones
        assert not same_bits(expected, reference(arrays, chunk=block))


# ---------------------------------------------------------------- consecutive calls
@pytest.mark.parametrize("world", [2, 3, 8])
def test_consecutive_allreduces_of_varying_sizes(world):
    rng = np.random.default_rng(world)
    sim = Simulation(world, slots=SLOTS, packet_elements=K,
                     faults=Faults(loss=0.1, duplicate=0.1, jitter=0.004), seed=world)
    sizes = [0, 1, 300, K, 5, K * SLOTS, K * SLOTS + 1, 0, 2, 150, K - 1, 77] * 2
    for i, size in enumerate(sizes):
        dtype = DTYPES[int(rng.integers(0, 2))]
        arrays = make_inputs(world, size, dtype, 100 * world + i)
        outs = sim.allreduce(arrays, max_time=BIG_TIME)
        check_results(arrays, outs)
    # sequence numbers and per-slot message numbers persisted and agree across ranks
    assert all(s.next_seq == len(sizes) for s in sim.memberships)
    assert all(s.slot_msgs == sim.memberships[0].slot_msgs for s in sim.memberships)
    assert sum(sim.memberships[0].slot_msgs) > SLOTS * 2


def test_two_thousand_small_allreduces_with_faults():
    world = 3
    rng = np.random.default_rng(2000)
    sim = Simulation(world, slots=4, packet_elements=16,
                     faults=Faults(loss=0.05, duplicate=0.05, jitter=0.003), seed=2000)
    calls = 0
    for i in range(2000):
        size = int(rng.choice([0, 1, 7, 16, 17, 33, 64, 65, 100, 200]))
        if i % 3:
            arrays = [rng.integers(-2**31, 2**31, size, dtype=np.int64).astype(np.int32)
                      for _ in range(world)]
        else:
            scale = np.float32(2.0 ** int(rng.integers(-20, 20)))
            arrays = [rng.standard_normal(size).astype(np.float32) * scale
                      for _ in range(world)]
        outs = sim.allreduce(arrays, max_time=BIG_TIME)
        expected = reference(arrays)
        for out in outs:
            assert same_bits(out, expected), (i, size)
        calls += 1
    assert calls == 2000
    assert all(s.next_seq == 2000 for s in sim.memberships)
    assert sum(s.counters["retransmissions"] for s in sim.memberships) > 0
    assert sim.job.counters["duplicates"] + sim.job.counters["retransmissions_answered"] > 0
    # the switch's memory stayed what it was built with
    assert sim.pipeline.lanes == 1
    assert sim.pipeline._rows.shape == (2, 4, wire.packet_size(1, 16) + wire.HEADER_SIZE)


def test_message_numbers_wrap_around_in_a_simulation():
    world = 3
    sim = Simulation(world, slots=SLOTS, packet_elements=K,
                     faults=Faults(loss=0.1, duplicate=0.1, jitter=0.004), seed=9)
    start = 0xFFFFFFFF - 5
    for s in sim.memberships:  # a long-lived membership, just before the wrap
        s.slot_msgs = [start] * SLOTS
    for i in range(8):
        dtype = DTYPES[i % 2]
        arrays = make_inputs(world, K * SLOTS * 2 + 3, dtype, 50 + i)
        outs = sim.allreduce(arrays, max_time=BIG_TIME)
        check_results(arrays, outs)
    msgs = sim.memberships[0].slot_msgs
    assert all(m < start for m in msgs)  # every slot went past 2**32 - 1
    assert all(s.slot_msgs == msgs for s in sim.memberships)


# ---------------------------------------------------------------- non-finite values
@pytest.mark.parametrize("faults", [None, FAULTS[1]], ids=["clean", "faulty"])
@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_nonfinite_values_are_summed_element_by_element(world, faults):
    """An inf or NaN gives its element the IEEE sum (NaN, or an infinity of one sign);
    every other element, of its chunk too, the sum it would have without it."""
    size = K * 6 + 5  # 7 chunks, the last one short
    arrays = make_inputs(world, size, np.float32, 77 + world)
    for a in arrays:  # no accidental all-zero chunks
        a[a == 0] = 1.0
    poisoned = {0: (0, 3, -np.inf), 2: (world - 1, 2 * K + 5, np.nan),
                6: (world // 2, 6 * K + 4, np.inf)}
    for _chunk, (rank, index, value) in poisoned.items():
        arrays[rank][index] = value
    sim = Simulation(world, slots=SLOTS, packet_elements=K, faults=faults, seed=world)
    outs = sim.allreduce(arrays, max_time=BIG_TIME)
    exact = np.sum([a.astype(np.float64) for a in arrays], axis=0)
    special = [index for _, index, _ in poisoned.values()]
    for out in outs:
        assert same_bits(out, outs[0])
        assert np.array_equal(out[special], exact[special].astype(np.float32), equal_nan=True)
        rest = np.ones(size, bool)
        rest[special] = False
        assert np.isfinite(out[rest]).all()
        assert same_bits(out, reference(arrays))
    check_float_bound(arrays, outs[0])
    # the flagged chunks cost one more exchange of values and one of codes, no more
    assert sim.memberships[0].next_seq == 3


def test_nonfinite_chunk_does_not_leak_into_the_next_allreduce():
    world = 2
    sim = Simulation(world, slots=2, packet_elements=K, faults=FAULTS[0], seed=4)
    bad = make_inputs(world, K * 4, np.float32, 1)
    bad[1][:] = np.nan
    outs = sim.allreduce(bad, max_time=BIG_TIME)
    assert all(np.isnan(o).all() for o in outs)  # NaN + anything
    good = make_inputs(world, K * 4, np.float32, 2)
    outs = sim.allreduce(good, max_time=BIG_TIME)
    check_results(good, outs)


# ---------------------------------------------------------------- stall detection
def _membership(rank, world, progress_timeout, slot_count=2):
    return Membership(session=0x77, rank=rank, world_size=world, slot_base=0,
                      slot_count=slot_count, packet_elements=K,
                      progress_timeout=progress_timeout,
                      rtt=RttEstimator(initial_rto=0.05, min_rto=0.01, max_rto=1.0))


def test_silent_peer_makes_the_call_stall_after_progress_timeout():
    pipeline = Pipeline(slots=2, packet_elements=K)
    job = pipeline.install_job("stall", 0x77, [("w", 0), ("w", 1)], 0, 2)
    s = _membership(0, 2, progress_timeout=2.0)
    data = np.arange(3 * K, dtype=np.int32)
    out = np.full(3 * K, -7, np.int32)
    op = s.allreduce(data, out, now=0.0)
    first = op.datagrams_to_send()
    assert len(first) == 2  # one message per slot of the window
    for d in first:
        assert pipeline.receive_datagram(bytes(d), ("w", 0)) == []
    times = []
    resent_total = 0
    while True:
        t = op.get_timer()
        assert t is not None
        assert op.error is None
        op.handle_timer(t)
        if op.error:
            break
        times.append(t)
        resent = op.datagrams_to_send()
        # Timeouts shrink the window: the lowest message always goes out again,
        # the other when the window still has room for it.
        assert resent[0] == wire.probe_of(first[0], wire.KIND_QUERY) and 1 <= len(resent) <= 2
        resent_total += len(resent)
        for d in resent:  # the switch only ever sees queries of packets it holds
            assert pipeline.receive_datagram(bytes(d), ("w", 0)) == []
    assert op.error == "stalled"
    assert not op.done
    assert t == pytest.approx(2.0)
    # the first retransmission comes after the initial RTO, later ones back off
    assert times[0] == pytest.approx(0.05)
    gaps = np.diff(times)
    assert len(times) >= 3 and np.all(gaps >= 0.05 - 1e-12)
    assert np.all(np.diff(gaps) >= -1e-12) and gaps[-1] >= 2 * gaps[0]
    assert times[-1] < 2.0
    assert s.counters["retransmissions"] == resent_total
    assert op.get_timer() is None
    op.handle_timer(t + 10)  # nothing more happens once stalled
    assert op.datagrams_to_send() == [] and op.error == "stalled"
    assert (out == -7).all()
    # each query found rank 0's contribution in, waiting for rank 1's
    assert job.counters["probes_waiting"] == job.counters["probes_in"] == resent_total
    assert job.counters["duplicates"] == job.counters["resends_asked"] == 0
    assert job.counters["results_completed"] == 0


def test_progress_postpones_the_stall():
    pipeline = Pipeline(slots=1, packet_elements=K)
    pipeline.install_job("stall", 0x77, [("w", 0), ("w", 1)], 0, 1)
    rtts = [RttEstimator(initial_rto=0.05, min_rto=0.01, max_rto=0.05) for _ in range(2)]
    s0, s1 = [Membership(session=0x77, rank=r, world_size=2, slot_base=0, slot_count=1,
                         packet_elements=K, progress_timeout=1.0, rtt=rtts[r]) for r in (0, 1)]
    data = np.arange(2 * K, dtype=np.int32)
    out0, out1 = np.zeros(2 * K, np.int32), np.zeros(2 * K, np.int32)
    op0 = s0.allreduce(data, out0, now=0.0)
    op1 = s1.allreduce(data, out1, now=0.0)
    for d in op0.datagrams_to_send():
        pipeline.receive_datagram(bytes(d), ("w", 0))
    # rank 1 contributes its first message late, then goes silent
    results = []
    for d in op1.datagrams_to_send():
        results += [(bytes(r), a) for r, a in pipeline.receive_datagram(bytes(d), ("w", 1))]
    assert [a for _, a in results] == [("w", 0), ("w", 1)]
    for r, a in results:
        if a == ("w", 0):
            op0.receive_datagram(r, 0.3)
    assert op0.last_progress == 0.3
    assert out0[:K].tolist() == (2 * data[:K]).tolist()
    assert len(op0.datagrams_to_send()) == 1  # message 1 goes out
    now = 0.3
    retransmitted_after_timeout = 0
    while op0.error is None:
        assert not op0.done
        now = op0.get_timer()
        assert now <= 1.3 + 1e-9
        op0.handle_timer(now)
        sent = op0.datagrams_to_send()
        if op0.error is None and now >= 1.0:
            assert len(sent) == 1
            retransmitted_after_timeout += 1
    assert op0.error == "stalled"
    # progress_timeout counts from the last progress (0.3), not from the start
    assert now == pytest.approx(1.3)
    assert retransmitted_after_timeout >= 4


def test_engine_drops_results_that_do_not_match_the_outstanding_message():
    pipeline = Pipeline(slots=1, packet_elements=K)
    pipeline.install_job("j", 0x77, [("w", 0), ("w", 1)], 0, 1)
    memberships = [_membership(r, 2, 5.0, slot_count=1) for r in (0, 1)]
    data = [np.arange(K, dtype=np.int32) * (r + 1) for r in (0, 1)]
    outs = [np.zeros(K, np.int32) for _ in (0, 1)]
    ops = [s.allreduce(d, o, now=0.0) for s, d, o in zip(memberships, data, outs)]
    results = []
    for r, op in enumerate(ops):
        for d in op.datagrams_to_send():
            results += [bytes(x) for x, a in pipeline.receive_datagram(bytes(d), ("w", r))
                        if a == ("w", 0)]
    (good,) = results
    h = wire.decode_header(good)
    lanes = wire.lane_table(good, h.lanes).copy()
    values = wire.values(good, h.lanes, h.count).copy()
    assert wire.encode(wire.KIND_RESULT, h.dtype, h.slot, h.session, h.msg, h.seq, h.pkt_id,
                       lanes, values, mode=h.mode, call=h.call) == good
    forged = [
        wire.encode(wire.KIND_RESULT, h.dtype, h.slot, h.session, h.msg, h.seq + 1,
                    h.pkt_id, lanes, values),
        wire.encode(wire.KIND_RESULT, h.dtype, h.slot, h.session, h.msg + 1, h.seq,
                    h.pkt_id, lanes, values),
        wire.encode(wire.KIND_RESULT, h.dtype, h.slot, h.session, h.msg, h.seq,
                    h.pkt_id + 1, lanes, values),
        wire.encode(wire.KIND_RESULT, wire.DTYPE_FLOAT32, h.slot, h.session, h.msg, h.seq,
                    h.pkt_id, lanes, values),
        wire.encode(wire.KIND_RESULT, h.dtype, h.slot, h.session, h.msg, h.seq,
                    h.pkt_id, lanes, values[:-1]),
        # a sparse result for a dense message, and a lane table of the wrong size
        wire.encode(wire.KIND_RESULT, h.dtype, h.slot, h.session, h.msg, h.seq,
                    h.pkt_id, lanes, values, mode=wire.MODE_SPARSE),
        wire.encode(wire.KIND_RESULT, h.dtype, h.slot, h.session, h.msg, h.seq,
                    h.pkt_id, np.concatenate([lanes, lanes]), values),
    ]
    foreign = [
        wire.encode(wire.KIND_RESULT, h.dtype, h.slot, h.session + 1, h.msg, h.seq,
                    h.pkt_id, lanes, values),
        wire.encode(wire.KIND_CONTRIBUTION, h.dtype, h.slot, h.session, h.msg, h.seq,
                    h.pkt_id, lanes, values),
        wire.encode(wire.KIND_RESULT, h.dtype, h.slot + 1, h.session, h.msg, h.seq,
                    h.pkt_id, lanes, values),
    ]
    for d in forged + foreign + [good[:40], good[:-4]]:
        ops[0].receive_datagram(d, 0.1)
        assert not ops[0].done
    assert (outs[0] == 0).all()
    c = memberships[0].counters
    assert (c["dropped_stale"], c["dropped_foreign"], c["dropped_malformed"]) == (7, 3, 2)
    assert c["results_in"] == 0
    ops[0].receive_datagram(good, 0.2)
    assert ops[0].done and c["results_in"] == 1
    assert outs[0].tolist() == (3 * np.arange(K)).tolist()
    ops[0].receive_datagram(good, 0.3)  # a duplicate of the result changes nothing
    assert c["dropped_stale"] == 8 and c["results_in"] == 1


# ---------------------------------------------------------------- one job over K switches
@pytest.mark.parametrize("switches", [1, 2, 3])
@pytest.mark.parametrize("faults", [None, FAULTS[0]], ids=["clean", "faulty"])
def test_a_job_striped_over_switches_gets_one_switchs_bits(switches, faults):
    """``StripedSimulation``: worker/multi.py's cut, the parts summed at once on K
    pipelines sharing one seeded network; every kind of call gives one switch's bits."""
    world = 3
    sim = StripedSimulation(world, switches, slots=SLOTS, packet_elements=K, faults=faults,
                            seed=switches)
    one = Simulation(world, slots=SLOTS, packet_elements=K)
    for call, (size, dtype) in enumerate([(K * SLOTS * 3 + 5, np.float32), (K - 1, np.float32),
                                          (K * 7, np.int32), (0, np.float32)]):
        arrays = make_inputs(world, size, dtype, 300 + call)
        for out in sim.allreduce(arrays, max_time=BIG_TIME):
            assert same_bits(out, reference(arrays))
    arrays = make_inputs(world, K * 9 + 3, np.float32, 5)
    for a in arrays:
        a[np.arange(a.size) % 3 == 0] = 0  # some blocks all zero, for the sparse path
    arrays[1][K + 2], arrays[2][8 * K] = np.nan, -np.inf
    for kind in ({"sparse": True}, {"wire_bits": 16}, {}):
        expected = one.allreduce(arrays, max_time=BIG_TIME, **kind)[0]
        for out in sim.allreduce(arrays, max_time=BIG_TIME, **kind):
            assert same_bits(out, expected), kind
    busy = [part.job.counters["packets_in"] > 0 for part in sim.parts]
    assert all(busy)  # every switch carried its part


def test_a_timer_that_does_not_move_on_is_an_error_not_a_hang(monkeypatch):
    """An engine whose timer fires and stays due (a broken handle_timer) held the
    virtual clock at one instant for ever; the simulation now says so."""
    from switchml.sim.network import StalledSimulation
    from switchml.worker.engine import stream
    monkeypatch.setattr(stream.Stream, "handle_timer", lambda self, now: None)
    sim = Simulation(2, slots=4, packet_elements=K, faults=Faults(loss=0.2), seed=1)
    with pytest.raises(StalledSimulation, match="does not move on"):
        sim.allreduce([np.arange(40 * K, dtype=np.int32)] * 2, max_time=100.0)


def test_a_queue_of_q_packets_holds_q_whatever_the_rounding():
    """A bottleneck's backlog is a sum of floats: a queue of q packets dropped the
    q-th where rounding put it a hair over, and a one-packet queue fed at exactly
    its rate dropped a fifth of what came."""
    from switchml.sim.network import Bottleneck, Network
    for rate in (3e6, 5e6, 7.3e6):
        for q in range(1, 9):
            network = Network(bottleneck=Bottleneck(rate=rate, queue_bytes=q * 1000))
            network.now = 0.1234567
            for _ in range(q):
                network.send(b"x" * 1000, "a", ("switch", 0))
            assert network.bottleneck_drops == 0, (rate, q)
    network = Network(bottleneck=Bottleneck(rate=3e6, queue_bytes=1000))
    for i in range(1000):
        network.now = i * 1000 / 3e6
        network.send(b"x" * 1000, "a", ("switch", 0))
    assert network.bottleneck_drops == 0


def test_settings_the_simulation_would_ignore_or_misread_are_refused():
    from switchml.sim.network import Bottleneck, Network, StalledSimulation
    with pytest.raises(ValueError):
        Faults(latency=-1e-3)  # the clock ran backwards
    with pytest.raises(ValueError):
        Faults(loss=1.5)
    with pytest.raises(ValueError):
        Bottleneck(rate=0, queue_bytes=1000)  # ZeroDivisionError, later
    network = Network(Faults(loss=0.1), seed=3)
    with pytest.raises(ValueError, match="the network's"):  # they were ignored
        Simulation(2, network=network, faults=Faults(loss=0.5))
    with pytest.raises(ValueError, match="would not cross it"):  # it went around it
        Simulation(2, network=Network(bottleneck=Bottleneck(rate=1e6, queue_bytes=10_000)),
                   switch_address=("switch", 1))
    sim = Simulation(2, packet_elements=K)
    with pytest.raises(StalledSimulation, match="nothing scheduled"):
        sim.step()  # no call running: no datagram in flight, no timer
