"""Block-sparse (OmniReduce) allreduce: the switch's sparse lanes, and whole sparse
allreduces through the deterministic simulator, checked against the dense path.

Everything here is deterministic and socket-free: seeded inputs, seeded faults, a
virtual clock.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import reference_sum

from switchml import wire
from switchml.quant import EXP_NONFINITE, EXP_ZERO
from switchml.sim.network import Faults, Simulation
from switchml.switch.dataplane.pipeline import Pipeline

K = 64       # packet_elements
BLK = 16     # block_elements: 4 lanes per packet
LANES = K // BLK
SLOTS = 4
WORLDS = [1, 2, 3, 4, 8]
DTYPES = [np.float32, np.int32]
FAULTY = Faults(loss=0.1, duplicate=0.1, jitter=0.004)
FAULT_CASES = [None, FAULTY]
BIG_TIME = 1e9  # the simulator's max_time is on its absolute clock


# ---------------------------------------------------------------- helpers
def same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and \
        np.array_equal(a.view(np.uint32), b.view(np.uint32))


def block_mask(a, block=BLK):
    """Which blocks of a flat array hold a non-zero value (NaN counts), computed here."""
    n = a.size
    padded = np.zeros(-(-n // block) * block, a.dtype)
    padded[:n] = a
    return (padded.reshape(-1, block) != 0).any(axis=1)


def nonzero_block_count(a, block=BLK):
    return int(block_mask(a, block).sum())


def blocks_of(size, block=BLK):
    return -(-size // block)


def reference(arrays, chunk=K):
    """The dense result: one exponent per packet-sized chunk."""
    return reference_sum(arrays, chunk)


def random_block(rng, dtype, length):
    if dtype == np.int32:
        return rng.integers(-2**31, 2**31, length, dtype=np.int64).astype(np.int32)
    v = rng.standard_normal(length).astype(np.float32)
    v *= np.float32(2.0 ** int(rng.integers(-60, 60)))
    v[rng.random(length) < 0.2] = 0  # zeros inside non-zero blocks too
    return v


def sparse_inputs(world, size, dtype, density, seed, block=BLK):
    """Every rank's tensor: each block non-zero with probability ``density``, per rank."""
    rng = np.random.default_rng(seed)
    arrays = []
    for _ in range(world):
        a = np.zeros(size, dtype)
        for b in np.flatnonzero(rng.random(blocks_of(size, block)) < density):
            piece = a[b * block:(b + 1) * block]
            piece[:] = random_block(rng, dtype, piece.size)
            if not piece.any():
                piece[0] = 1
        arrays.append(a)
    return arrays


def simulation(world, faults=None, seed=0, **kw):
    kw.setdefault("slots", SLOTS)
    kw.setdefault("packet_elements", K)
    kw.setdefault("block_elements", BLK)
    return Simulation(world, faults=faults, seed=seed, **kw)


def dense_and_sparse(arrays, faults=None, seed=0, **kw):
    """(dense results, sparse results, sparse simulation) for the same inputs."""
    world = len(arrays)
    dense = simulation(world, faults, seed, **kw).allreduce(arrays, max_time=BIG_TIME)
    sim = simulation(world, faults, seed + 1, **kw)
    sparse = sim.allreduce(arrays, max_time=BIG_TIME, sparse=True)
    return dense, sparse, sim


def check_sparse_matches_dense(arrays, faults=None, seed=0, **kw):
    copies = [a.copy() for a in arrays]
    dense, sparse, sim = dense_and_sparse(arrays, faults, seed, **kw)
    expected = reference(arrays, kw.get("packet_elements", K))
    for r in range(len(arrays)):
        assert same_bits(dense[r], expected), f"dense rank {r} differs from the reference"
        assert same_bits(sparse[r], dense[r]), f"sparse rank {r} differs from dense"
    for a, c in zip(arrays, copies):
        assert same_bits(a, c)  # the inputs are left alone
    return sparse, sim


def record_contributions(sim):
    """Wrap the switch's receive_datagram to log every datagram it is given."""
    log = []
    original = sim.pipeline.receive_datagram

    def receive(data, addr):
        data = bytes(data)
        h = wire.decode_header(data)
        log.append((addr[1], h, wire.lane_table(data, h.lanes).copy(),
                    wire.values(data, h.lanes, h.count).copy()))
        return original(data, addr)

    sim.pipeline.receive_datagram = receive
    return log


def in_place(sim):
    """Make every rank's allreduce write into its input array (out is the input)."""
    for s in sim.memberships:
        def allreduce(array, out, now, sparse=False, _orig=s.allreduce):
            return _orig(array, array, now, sparse)
        s.allreduce = allreduce


# ---------------------------------------------------------------- the switch's sparse lanes
SA = 0x5A
MEMBERS = [("w", r) for r in range(4)]


def sparse_contrib(slot, msg, pos, nxt, exps, flags, blocks, *, seed=False, seq=0,
                   pkt_id=0, dtype=wire.DTYPE_FLOAT32):
    table = np.zeros(len(nxt), wire.LANE)
    table["pos"], table["nxt"], table["exp"], table["flag"] = pos, nxt, exps, flags
    values = np.asarray(blocks, np.int32).reshape(-1)
    mode = wire.MODE_SPARSE | (wire.MODE_SEED if seed else 0)
    return wire.encode(wire.KIND_CONTRIBUTION, dtype, slot, SA, msg, seq, pkt_id, table,
                       values, mode=mode)


def send(p, data, addr):
    return [(bytes(d), a) for d, a in p.receive_datagram(data, addr)]


def decode(datagram):
    h = wire.decode_header(datagram)
    return h, wire.lane_table(datagram, h.lanes), wire.values(datagram, h.lanes, h.count)


def small_pipeline(world, slots=2):
    p = Pipeline(slots=slots, packet_elements=8, block_elements=2)  # four lanes of two
    job = p.install_job("sparse", SA, MEMBERS[:world], 0, slots)
    return p, job


@pytest.mark.parametrize("order", [(0, 1, 2), (2, 1, 0), (1, 2, 0), (2, 0, 1)])
def test_seed_round_keeps_least_next_and_max_exponent_per_lane(order):
    p, job = small_pipeline(3)
    E = EXP_ZERO
    nxt = [[3, 0, 5, 2], [3, 1, 5, 7], [4, 0, 5, 2]]
    exps = [[1, 9, 2, 4], [6, 20, E, 3], [10, 7, EXP_NONFINITE, -4]]
    for i, r in enumerate(order):
        out = send(p, sparse_contrib(1, 0, wire.POS_END, nxt[r], exps[r], 0, [], seed=True),
                   MEMBERS[r])
        assert (out == []) == (i < 2)
    assert len(out) == 3
    for datagram, _ in out:
        h, lanes, values = decode(datagram)
        assert (h.kind, h.mode, h.count, h.lanes) == \
            (wire.KIND_RESULT, wire.MODE_SPARSE | wire.MODE_SEED, 0, 4)
        assert lanes["nxt"].tolist() == [3, 0, 5, 2]
        assert lanes["exp"].tolist() == [10, 20, EXP_NONFINITE, 4]  # max per lane
        assert lanes["flag"].tolist() == [0, 0, 0, 0]
    c = job.counters
    assert c["sparse_blocks_in"] == 0
    assert c["sparse_blocks_skipped"] == 3 * (3 + 0 + 5 + 2)  # positions before the first
    assert c["sparse_bytes_saved"] == c["sparse_blocks_skipped"] * 2 * 4
    assert c["sparse_blocks_out"] == 0


def test_data_round_sums_flagged_blocks_and_compacts_present_ones():
    p, job = small_pipeline(3)
    pos = [2, 0, 7, 1]  # lane 2 is exhausted (its column has 7 blocks)
    # rank 0: blocks for lanes 0 and 3; rank 1: lane 0; rank 2: lane 3 only
    contribs = [
        sparse_contrib(0, 6, pos, [5, 4, 7, 3], [1, 2, EXP_ZERO, 3], [1, 0, 0, 1],
                       [[1, 2], [10, 20]], seq=9, pkt_id=4),
        sparse_contrib(0, 6, pos, [4, 4, 7, 2], [5, 2, EXP_ZERO, 9], [1, 0, 0, 0],
                       [[100, 200]], seq=9, pkt_id=4),
        sparse_contrib(0, 6, pos, [4, 6, 7, 3], [7, 1, EXP_ZERO, 1], [0, 0, 0, 1],
                       [[-1000, 3000]], seq=9, pkt_id=4),
    ]
    for r in (1, 0):
        assert send(p, contribs[r], MEMBERS[r]) == []
    assert p.slot_state(0, 6) == (True, 0b011)
    out = send(p, contribs[2], MEMBERS[2])
    assert [a for _, a in out] == MEMBERS[:3]
    h, lanes, values = decode(out[0][0])
    assert (h.msg, h.seq, h.pkt_id, h.mode, h.lanes) == (6, 9, 4, wire.MODE_SPARSE, 4)
    assert lanes["pos"].tolist() == pos
    assert lanes["flag"].tolist() == [1, 0, 0, 1]
    assert lanes["nxt"].tolist() == [4, 4, 7, 2]
    assert lanes["exp"].tolist() == [7, 2, EXP_ZERO, 9]  # max per lane
    # only the two present blocks come back, in lane order
    assert h.count == 2 * 2
    assert values.tolist() == [101, 202, -990, 3020]
    assert len(out[0][0]) == wire.packet_size(4, 4)
    c = job.counters
    assert c["sparse_blocks_in"] == 4
    # lane 0 at 2: 3 - 2 sent, then position 3 zero everywhere; lane 1 at 0: nobody sent,
    # then 1..3; lane 2 exhausted; lane 3 at 1: 3 - 2 sent, nothing between 1 and 2.
    assert c["sparse_blocks_skipped"] == (1 + 3 * 1) + (3 + 3 * 3) + 0 + (1 + 0)
    assert c["sparse_bytes_saved"] == c["sparse_blocks_skipped"] * 2 * 4
    assert c["sparse_blocks_out"] == 2 * 3


def test_result_flags_keep_only_the_block_bit():
    p, job = small_pipeline(2)
    # flag bit 1 means nothing: lane 1 of rank 0 carries no block, lane 0 does
    send(p, sparse_contrib(0, 0, [0] * 4, [1] * 4, [0] * 4, [3, 2, 0, 0], [[1, 2]]),
         MEMBERS[0])
    out = send(p, sparse_contrib(0, 0, [0] * 4, [1] * 4, [0] * 4, [0, 0, 2, 1], [[3, 4]]),
               MEMBERS[1])
    h, lanes, values = decode(out[0][0])
    assert lanes["flag"].tolist() == [1, 0, 0, 1]
    assert values.tolist() == [1, 2, 3, 4]
    assert job.counters["sparse_blocks_in"] == 2


def test_sparse_duplicates_are_never_added_twice_and_answered_after_completion():
    p, job = small_pipeline(2)
    a = sparse_contrib(1, 3, [0] * 4, [1] * 4, [1] * 4, [1, 1, 0, 0], [[1, 1], [2, 2]])
    b = sparse_contrib(1, 3, [0] * 4, [1] * 4, [1] * 4, [0, 1, 0, 1], [[10, 10], [20, 20]])
    send(p, a, MEMBERS[0])
    assert send(p, a, MEMBERS[0]) == []
    assert job.counters["duplicates"] == 1
    out = send(p, b, MEMBERS[1])
    first = out[0][0]
    assert decode(first)[2].tolist() == [1, 1, 12, 12, 20, 20]
    for r, d in ((1, b), (0, a), (1, b)):
        again = send(p, d, MEMBERS[r])
        assert again == [(first, MEMBERS[r])]  # the stored, compacted result, to r only
    assert job.counters["retransmissions_answered"] == 3
    assert job.counters["results_completed"] == 1
    assert job.counters["sparse_blocks_in"] == 4  # counted once each
    assert job.counters["sparse_blocks_out"] == 3 * 2


def test_sparse_contribution_for_other_positions_is_a_mismatch():
    p, job = small_pipeline(2)
    send(p, sparse_contrib(0, 0, [2, 2, 2, 2], [3] * 4, [0] * 4, [1, 0, 0, 0], [[1, 1]]),
         MEMBERS[0])
    for bad in (sparse_contrib(0, 0, [2, 2, 2, 3], [3] * 4, [0] * 4, [1, 0, 0, 0], [[1, 1]]),
                sparse_contrib(0, 0, [2, 2, 2, 2], [3] * 4, [0] * 4, 0, [], seed=True),
                sparse_contrib(0, 0, [2, 2, 2, 2], [3] * 4, [0] * 4, [1, 0, 0, 0], [[1, 1]],
                               dtype=wire.DTYPE_INT32)):
        assert send(p, bad, MEMBERS[1]) == []
    assert job.counters["dropped_mismatch"] == 3
    assert p.slot_state(0, 0) == (True, 0b01)
    out = send(p, sparse_contrib(0, 0, [2, 2, 2, 2], [3] * 4, [0] * 4, [1, 0, 0, 1],
                                 [[5, 5], [7, 7]]), MEMBERS[1])
    assert decode(out[0][0])[2].tolist() == [6, 6, 7, 7]


def test_sparse_message_does_not_see_older_values_of_its_set():
    p, job = small_pipeline(2, slots=1)
    for m in (0, 1):  # dense messages leave big values in both sets
        for r in (0, 1):
            table = np.zeros(4, wire.LANE)
            send(p, wire.encode(wire.KIND_CONTRIBUTION, wire.DTYPE_INT32, 0, SA, m, 0, 0,
                                table, np.full(8, 1000 + m, np.int32)), MEMBERS[r])
    # msg 2 reuses set 0: rank 0 has no block for lanes 1 and 2, rank 1 has lane 2
    send(p, sparse_contrib(0, 2, [0] * 4, [1] * 4, [0] * 4, [1, 0, 0, 1], [[1, 2], [3, 4]],
                           dtype=wire.DTYPE_INT32), MEMBERS[0])
    out = send(p, sparse_contrib(0, 2, [0] * 4, [1] * 4, [0] * 4, [0, 0, 1, 0], [[5, 6]],
                                 dtype=wire.DTYPE_INT32), MEMBERS[1])
    h, lanes, values = decode(out[0][0])
    assert lanes["flag"].tolist() == [1, 0, 1, 1]
    assert values.tolist() == [1, 2, 5, 6, 3, 4]
    # and a dense message after it sums from scratch too
    for r in (0, 1):
        out = send(p, wire.encode(wire.KIND_CONTRIBUTION, wire.DTYPE_INT32, 0, SA, 4, 0, 0,
                                  np.zeros(4, wire.LANE), np.arange(8, dtype=np.int32)),
                   MEMBERS[r])
    assert decode(out[0][0])[2].tolist() == (2 * np.arange(8)).tolist()


def test_switch_memory_does_not_grow_with_sparse_traffic():
    sim = simulation(3, FAULTY, seed=5)
    rows = sim.pipeline._rows
    shape, nbytes = rows.shape, rows.nbytes
    for i in range(6):
        arrays = sparse_inputs(3, K * SLOTS * (i + 1) + 3, DTYPES[i % 2], 0.3, 40 + i)
        outs = sim.allreduce(arrays, max_time=BIG_TIME, sparse=True)
        assert same_bits(outs[0], reference(arrays))
    assert sim.pipeline._rows is rows
    assert rows.shape == shape == (2, SLOTS, wire.packet_size(LANES, K) + wire.HEADER_SIZE) and \
        rows.nbytes == nbytes
    assert all(len(x) == SLOTS for name in ("_valid", "_msg", "_bitmap", "_count", "_blocks")
               for x in getattr(sim.pipeline, name))


def test_sparse_job_on_a_slot_range_not_at_zero_leaves_another_job_alone():
    p = Pipeline(slots=2 * SLOTS, packet_elements=K, block_elements=BLK)
    other = p.install_job("other", 0x0DD, [("other", 0), ("other", 1)], 0, SLOTS)
    # the other job has an aggregation in progress on its slot 2
    pending = wire.encode(wire.KIND_CONTRIBUTION, wire.DTYPE_INT32, 2, 0x0DD, 0, 0, 0,
                          np.zeros(LANES, wire.LANE), np.arange(K, dtype=np.int32))
    assert p.receive_datagram(pending, ("other", 0)) == []
    sim = Simulation(3, slots=SLOTS, pipeline=p, seed=2, faults=FAULTY)
    assert sim.job.slot_base == SLOTS
    log = record_contributions(sim)
    for i in range(8):
        arrays = sparse_inputs(3, K * SLOTS + 40 * i, DTYPES[i % 2], 0.3, seed=i)
        outs = sim.allreduce(arrays, max_time=BIG_TIME, sparse=i % 3 != 1)
        for out in outs:
            assert same_bits(out, reference(arrays))
    assert log and all(SLOTS <= h.slot < 2 * SLOTS for _, h, _, _ in log)
    assert not any(k.startswith("dropped_") and k != "dropped_stale"
                   for k in sim.job.counters)
    assert not other.counters.keys() - {"packets_in"}
    assert p.slot_state(2, 0) == (True, 0b01)
    out = [(bytes(d), a) for d, a in p.receive_datagram(
        wire.encode(wire.KIND_CONTRIBUTION, wire.DTYPE_INT32, 2, 0x0DD, 0, 0, 0,
                    np.zeros(LANES, wire.LANE), np.ones(K, dtype=np.int32)), ("other", 1))]
    assert decode(out[0][0])[2].tolist() == list(range(1, K + 1))


# ---------------------------------------------------------------- sparse == dense
DENSITIES = [0.0, 0.01, 0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9, 1.0]


@pytest.mark.parametrize("faults", FAULT_CASES, ids=["clean", "faulty"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "i32"])
@pytest.mark.parametrize("world", WORLDS)
def test_sparse_is_bit_identical_to_dense(world, dtype, faults):
    rng = np.random.default_rng(world * 10 + (dtype == np.int32))
    densities = DENSITIES + rng.random(10).tolist()
    for i, density in enumerate(densities):
        size = int(rng.choice([1, BLK - 1, K + 3, K * SLOTS, K * SLOTS * 2 + 5, 900]))
        arrays = sparse_inputs(world, size, dtype, density, seed=1000 * world + i)
        check_sparse_matches_dense(arrays, faults, seed=i)


@pytest.mark.parametrize("faults", FAULT_CASES, ids=["clean", "faulty"])
@pytest.mark.parametrize("block,packet", [(1, 8), (4, 4), (8, 64), (256, 512)])
def test_sparse_is_bit_identical_to_dense_for_other_block_sizes(block, packet, faults):
    for world in (2, 5):
        for density in (0.05, 0.4, 1.0):
            size = packet * 5 + block // 2 + 1
            arrays = sparse_inputs(world, size, np.float32, density, seed=block + world,
                                   block=block)
            check_sparse_matches_dense(arrays, faults, seed=world, packet_elements=packet,
                                       block_elements=block)


def test_sparse_with_per_rank_densities_and_magnitudes():
    rng = np.random.default_rng(99)
    for world in (2, 3, 8):
        size = K * SLOTS * 3 + 7
        arrays = [sparse_inputs(1, size, np.float32, d, seed=int(rng.integers(1 << 30)))[0]
                  for d in rng.random(world)]
        arrays[0][-1] = 2.0**120  # a huge value in the short last block of one rank
        arrays[-1][:BLK] *= np.float32(2.0**-100)  # tiny values: subnormal results
        check_sparse_matches_dense(arrays, FAULTY, seed=world)


# ---------------------------------------------------------------- edge cases
def edge_case(arrays, **kw):
    for faults in FAULT_CASES:
        sparse, sim = check_sparse_matches_dense(arrays, faults, **kw)
    return sparse, sim


@pytest.mark.parametrize("faults", FAULT_CASES, ids=["clean", "faulty"])
def test_exponents_beyond_the_seed_take_rounds_of_their_own(faults):
    """A slot of more chunks than lanes: exponent rounds of K exponents each
    first (values the switch maxes), the seed the last LANES."""
    world = 3
    chunks_a_slot = 2 * K + LANES + 1  # K, K and 1 before the seed: 3 exponent rounds
    size = K * SLOTS * chunks_a_slot - 5
    arrays = sparse_inputs(world, size, np.float32, 0.3, seed=11)
    for r, a in enumerate(arrays):  # magnitudes that differ by chunk and rank
        a *= np.repeat(np.float32(2.0) ** ((np.arange(-(-size // K)) * 7 + r * 3) % 41 - 20),
                       K)[:size]
    sim = simulation(world, faults, seed=5)
    log = record_contributions(sim)
    sparse = sim.allreduce(arrays, max_time=BIG_TIME, sparse=True)
    expected = reference(arrays)
    for out in sparse:
        assert same_bits(out, expected)
    sent = {(addr, h.slot, h.msg, h.mode, h.count) for addr, h, _, _ in log
            if h.kind == wire.KIND_CONTRIBUTION}  # once each (not the probes)
    exponent_rounds = [m for m in sent if m[3] == wire.MODE_MAX]
    seeds = [m for m in sent if m[3] == wire.MODE_SPARSE | wire.MODE_SEED]
    assert sorted(m[4] for m in exponent_rounds) == sorted([K, K, 1] * world * SLOTS)
    assert len(seeds) == world * SLOTS


def test_a_tensor_of_many_chunks_a_slot_takes_one_exponent_round():
    """As on a real network (64 MiB is 256 chunks a slot at MTU 9000): one round of
    exponents, not one a lane table's worth (F) at a time."""
    world = 2
    size = K * SLOTS * (K // 2)  # 32 chunks a slot: 28 in one round, 4 in the seed
    arrays = sparse_inputs(world, size, np.float32, 0.2, seed=3)
    sim = simulation(world)
    log = record_contributions(sim)
    outs = sim.allreduce(arrays, max_time=BIG_TIME, sparse=True)
    for out in outs:
        assert same_bits(out, reference(arrays))
    counts = [h.count for _, h, _, _ in log if h.mode == wire.MODE_MAX]
    assert counts == [K // 2 - LANES] * world * SLOTS


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "i32"])
@pytest.mark.parametrize("world", WORLDS)
def test_all_zero_on_every_worker(world, dtype):
    size = K * SLOTS * 2 + 5
    arrays = [np.zeros(size, dtype) for _ in range(world)]
    sim = simulation(world)
    log = record_contributions(sim)
    outs = sim.allreduce(arrays, sparse=True)
    for out in outs:
        assert same_bits(out, np.zeros(size, dtype))
    # only the seed round crosses the network, carrying no values: a slot's 2 or 3
    # chunks fit in the seed's lane records, so floats need no exponent round
    assert all(h.count == 0 for _, h, _, _ in log)
    assert all(h.mode == wire.MODE_SPARSE | wire.MODE_SEED for _, h, _, _ in log)
    assert len(log) == world * SLOTS
    c = sim.job.counters
    assert c["sparse_blocks_in"] == 0
    assert c["sparse_blocks_skipped"] == world * blocks_of(size)
    edge_case(arrays)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "i32"])
@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_all_zero_on_some_workers_only(world, dtype):
    size = K * SLOTS + 9
    arrays = sparse_inputs(world, size, dtype, 0.5, seed=world)
    for r in range(0, world, 2):
        arrays[r][:] = 0
    sparse, sim = edge_case(arrays)
    c = sim.job.counters
    assert c["sparse_blocks_in"] == sum(nonzero_block_count(a) for a in arrays)
    for s, a in zip(sim.memberships, arrays):
        assert s.counters["sparse_blocks_sent"] == nonzero_block_count(a)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "i32"])
@pytest.mark.parametrize("size", [K * SLOTS * 3, K * SLOTS * 3 + 1, K * SLOTS * 3 + 7,
                                  K * SLOTS * 3 + BLK - 1, BLK, 5, 1])
@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_single_nonzero_block_at_the_very_end(world, size, dtype):
    for rank in {0, world - 1}:
        arrays = [np.zeros(size, dtype) for _ in range(world)]
        arrays[rank][-1] = 3  # the last element, in the (possibly short) last block
        sparse, sim = edge_case(arrays)
        assert sparse[0][-1] == 3 and not sparse[0][:-1].any()
        c = sim.job.counters
        assert c["sparse_blocks_in"] == 1
        assert c["sparse_blocks_in"] + c["sparse_blocks_skipped"] == world * blocks_of(size)
        assert c["sparse_blocks_out"] == world
    # the whole last block, non-zero on every rank
    arrays = [np.zeros(size, dtype) for _ in range(world)]
    start = (blocks_of(size) - 1) * BLK
    for r, a in enumerate(arrays):
        a[start:] = np.arange(1, size - start + 1) * (r + 1)
    edge_case(arrays)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "i32"])
@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_disjoint_nonzero_sets(world, dtype):
    size = K * SLOTS * 2 + 11
    nblocks = blocks_of(size)
    rng = np.random.default_rng(world)
    owner = rng.integers(0, world + 1, nblocks)  # world = nobody
    arrays = [np.zeros(size, dtype) for _ in range(world)]
    for b, r in enumerate(owner.tolist()):
        if r < world:
            piece = arrays[r][b * BLK:(b + 1) * BLK]
            piece[:] = random_block(rng, dtype, piece.size)
            piece[0] = 1
    sparse, sim = edge_case(arrays)
    # each block's sum is its owner's block (float: up to the quantisation)
    for b, r in enumerate(owner.tolist()):
        got = sparse[0][b * BLK:(b + 1) * BLK]
        if r == world:
            assert not got.any()
        elif dtype == np.int32:
            assert np.array_equal(got, arrays[r][b * BLK:(b + 1) * BLK])
    c = sim.job.counters
    assert c["sparse_blocks_in"] == int((owner < world).sum())
    assert c["sparse_blocks_out"] == world * int((owner < world).sum())


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "i32"])
@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_fully_overlapping_nonzero_sets(world, dtype):
    size = K * SLOTS * 2 + 11
    rng = np.random.default_rng(world + 50)
    mask = rng.random(blocks_of(size)) < 0.4
    arrays = []
    for _ in range(world):
        a = np.zeros(size, dtype)
        for b in np.flatnonzero(mask):
            piece = a[b * BLK:(b + 1) * BLK]
            piece[:] = random_block(rng, dtype, piece.size)
            piece[-1] = 2
        arrays.append(a)
    sparse, sim = edge_case(arrays)
    c = sim.job.counters
    assert c["sparse_blocks_in"] == world * int(mask.sum())
    assert c["sparse_blocks_out"] == world * int(mask.sum())


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "i32"])
@pytest.mark.parametrize("world", WORLDS)
def test_density_one(world, dtype):
    size = K * SLOTS * 2 + 3
    arrays = sparse_inputs(world, size, dtype, 1.0, seed=world)
    for a in arrays:
        a[a == 0] = 1  # every element non-zero
    sparse, sim = edge_case(arrays)
    c = sim.job.counters
    assert c["sparse_blocks_in"] == world * blocks_of(size)
    assert c["sparse_blocks_skipped"] == 0 and c["sparse_bytes_saved"] == 0


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "i32"])
@pytest.mark.parametrize("world", WORLDS)
def test_sizes_zero_and_one(world, dtype):
    empty = [np.zeros(0, dtype) for _ in range(world)]
    dense, sparse, sim = dense_and_sparse(empty)
    assert all(o.shape == (0,) and o.dtype == dtype for o in sparse)
    assert sim.datagrams == 0
    for value in (0, 7):
        arrays = [np.full(1, value * (r + 1), dtype) for r in range(world)]
        sparse, sim = edge_case(arrays)
        assert sparse[0].tolist() == [value * world * (world + 1) // 2]


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "i32"])
@pytest.mark.parametrize("world", [1, 2, 3, 8])
@pytest.mark.parametrize("size", [BLK - 1, BLK + 1, K - 1, K * SLOTS * 5 + 17])
def test_smaller_than_a_packet_and_larger_than_the_window(world, size, dtype):
    for density in (0.3, 0.8):
        arrays = sparse_inputs(world, size, dtype, density, seed=size + world)
        edge_case(arrays)


def test_multidimensional_sparse_keeps_shape():
    rng = np.random.default_rng(3)
    arrays = []
    for _ in range(3):
        a = rng.standard_normal((7, 5, 16)).astype(np.float32)
        a[rng.random(7) < 0.5] = 0
        arrays.append(a)
    dense, sparse, _ = dense_and_sparse(arrays, FAULTY)
    for d, s in zip(dense, sparse):
        assert s.shape == (7, 5, 16)
        assert same_bits(s, d)


# ---------------------------------------------------------------- traffic and counters
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "i32"])
@pytest.mark.parametrize("world", WORLDS)
def test_zero_blocks_never_cross_the_network(world, dtype):
    rng = np.random.default_rng(world + 7)
    for i, density in enumerate((0.0, 0.05, 0.3, 0.7, 1.0)):
        size = int(rng.choice([K * SLOTS * 3 + 5, 700, 33]))
        arrays = sparse_inputs(world, size, dtype, density, seed=100 * world + i)
        masks = [block_mask(a) for a in arrays]
        nblocks = blocks_of(size)
        sim = simulation(world)
        log = record_contributions(sim)
        sent = []
        original_send = sim._send

        def capture(data, src, dst, _sent=sent, _orig=original_send):
            if dst != ("switch", 0):
                _sent.append(bytes(data))
            _orig(data, src, dst)

        sim._send = capture
        outs = sim.allreduce(arrays, sparse=True)
        assert same_bits(outs[-1], reference(arrays))
        # values carried by contributions: exactly the ranks' non-zero blocks
        carried = sum(h.count for _, h, _, _ in log)
        assert carried == BLK * sum(int(m.sum()) for m in masks)
        # and every block carried is the sender's own, non-zero block at that position
        W = min(SLOTS, -(-nblocks // LANES))
        G = W * LANES
        base = sim.job.slot_base
        for rank, h, lanes, values in log:
            if not h.mode & wire.MODE_SPARSE:  # an exponent round: no values
                assert h.count == 0
                continue
            flagged = np.flatnonzero(lanes["flag"] & wire.FLAG_BLOCK)
            for k, lane in enumerate(flagged.tolist()):
                b = (h.slot - base) * LANES + lane + int(lanes["pos"][lane]) * G
                assert masks[rank][b], (rank, b)
                if dtype == np.int32:
                    own = np.zeros(BLK, np.int32)
                    piece = arrays[rank][b * BLK:(b + 1) * BLK]
                    own[:piece.size] = piece
                    assert values[k * BLK:(k + 1) * BLK].tolist() == own.tolist()
        # results bring back only blocks non-zero somewhere, once per rank
        union = int(np.logical_or.reduce(masks).sum())
        result_values = sum(wire.decode_header(d).count for d in sent)
        assert result_values == world * union * BLK
        c = sim.job.counters
        assert c["sparse_blocks_in"] == sum(int(m.sum()) for m in masks)
        assert c["sparse_blocks_in"] + c["sparse_blocks_skipped"] == world * nblocks
        assert c["sparse_bytes_saved"] == c["sparse_blocks_skipped"] * BLK * 4
        assert c["sparse_blocks_out"] == world * union
        for s, m in zip(sim.memberships, masks):
            assert s.counters["sparse_blocks_sent"] == int(m.sum())
            assert s.counters["sparse_blocks_received"] == union


@pytest.mark.parametrize("world", [2, 3, 8])
def test_sparse_counters_stay_exact_under_faults(world):
    """Retransmitted and duplicated contributions are never counted (or added) twice."""
    for i, density in enumerate((0.1, 0.5)):
        size = K * SLOTS * 3 + 9
        arrays = sparse_inputs(world, size, np.float32, density, seed=world * 10 + i)
        dense, sparse, sim = dense_and_sparse(arrays, Faults(loss=0.2, duplicate=0.2,
                                                             jitter=0.02), seed=i)
        for d, s in zip(dense, sparse):
            assert same_bits(s, d)
        c = sim.job.counters
        nz = sum(nonzero_block_count(a) for a in arrays)
        assert c["duplicates"] + c["retransmissions_answered"] > 0
        assert c["sparse_blocks_in"] == nz
        assert c["sparse_blocks_in"] + c["sparse_blocks_skipped"] == world * blocks_of(size)
        assert c["sparse_bytes_saved"] == c["sparse_blocks_skipped"] * BLK * 4


def test_sparse_sends_less_than_dense_at_low_density():
    world, size = 4, K * SLOTS * 8
    arrays = sparse_inputs(world, size, np.float32, 0.05, seed=11)
    dense_sim, sparse_sim = simulation(world), simulation(world)
    dense_log, sparse_log = record_contributions(dense_sim), record_contributions(sparse_sim)
    dense_sim.allreduce(arrays)
    sparse_sim.allreduce(arrays, sparse=True)
    dense_values = sum(h.count for _, h, _, _ in dense_log)
    block_values = sum(h.count for _, h, _, _ in sparse_log if h.mode & wire.MODE_SPARSE)
    exponent_values = sum(h.count for _, h, _, _ in sparse_log if h.mode == wire.MODE_MAX)
    assert dense_values == world * size
    assert block_values == BLK * sum(nonzero_block_count(a) for a in arrays)
    # 8 chunks a slot: the seed's lane records carry the last LANES exponents
    assert exponent_values == world * SLOTS * (8 - LANES)
    assert block_values + exponent_values < dense_values / 5


# ---------------------------------------------------------------- non-finite values
@pytest.mark.parametrize("faults", FAULT_CASES, ids=["clean", "faulty"])
@pytest.mark.parametrize("world", WORLDS)
def test_nonfinite_values_are_summed_element_by_element_as_in_dense(world, faults):
    size = K * SLOTS * 2 + 5  # the last block is short
    nblocks = blocks_of(size)
    arrays = sparse_inputs(world, size, np.float32, 0.3, seed=world + 300)
    cases = {  # block: (rank, offset in block, value)
        0: (0, 3, np.nan),                 # block 0, maybe zero elsewhere
        5: (world - 1, BLK - 1, np.inf),
        9: (world // 2, 0, -np.inf),
        nblocks - 1: (world - 1, 4, np.nan),  # in the short last block
    }
    for b in (5, 9):  # blocks zero on every other rank
        for a in arrays:
            a[b * BLK:(b + 1) * BLK] = 0
    for b in (0, nblocks - 1):  # blocks non-zero on every rank
        for a in arrays:
            a[b * BLK:(b + 1) * BLK][:5] = 1.5
    for b, (rank, offset, value) in cases.items():
        arrays[rank][b * BLK + offset] = value
    dense, sparse, sim = dense_and_sparse(arrays, faults, seed=world)
    special = np.array([b * BLK + offset for b, (_, offset, _) in cases.items()])
    with np.errstate(invalid="ignore"):
        ieee = np.sum([a.astype(np.float64) for a in arrays], axis=0)
    for r in range(world):
        assert same_bits(sparse[r], dense[r]), r
        assert same_bits(sparse[r], reference(arrays)), r
        assert np.array_equal(sparse[r][special], ieee[special].astype(np.float32),
                              equal_nan=True)
        rest = np.ones(size, bool)
        rest[special] = False
        assert np.isfinite(sparse[r][rest]).all(), r


def test_nonfinite_block_does_not_leak_into_the_next_sparse_allreduce():
    world = 3
    sim = simulation(world, FAULTY, seed=8)
    bad = sparse_inputs(world, K * SLOTS, np.float32, 0.5, seed=1)
    bad[1][:] = np.nan
    outs = sim.allreduce(bad, max_time=BIG_TIME, sparse=True)
    assert all(np.isnan(o).all() for o in outs)  # NaN + anything
    good = sparse_inputs(world, K * SLOTS, np.float32, 0.5, seed=2)
    outs = sim.allreduce(good, max_time=BIG_TIME, sparse=True)
    for o in outs:
        assert same_bits(o, reference(good))


# ---------------------------------------------------------------- in place
@pytest.mark.parametrize("faults", FAULT_CASES, ids=["clean", "faulty"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "i32"])
@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_in_place_sparse_allreduce(world, dtype, faults):
    for i, density in enumerate((0.0, 0.1, 0.5, 1.0)):
        size = [K * SLOTS * 2 + 5, 100, 1, K][i]
        arrays = sparse_inputs(world, size, dtype, density, seed=world * 7 + i)
        dense = simulation(world, faults, seed=i).allreduce(arrays, max_time=BIG_TIME)
        buffers = [a.copy() for a in arrays]
        sim = simulation(world, faults, seed=i + 1)
        in_place(sim)
        sim.allreduce(buffers, max_time=BIG_TIME, sparse=True)
        for r in range(world):
            assert same_bits(buffers[r], dense[r]), (r, density)


def test_in_place_sparse_negative_zero_blocks_match_dense():
    """A block of -0.0 (zero, never sent) must come back as the dense path's +0.0 sum,
    the same on every rank, also when the output is the input itself."""
    world = 2
    size = 3 * BLK
    arrays = [np.zeros(size, np.float32) for _ in range(world)]
    arrays[0][:] = -0.0            # rank 0: blocks 0 and 2 are -0.0 (zero blocks)
    arrays[0][BLK:2 * BLK] = 1.0   # block 1 non-zero
    arrays[1][BLK + 3] = 2.0
    dense = simulation(world).allreduce(arrays)
    assert not np.signbit(dense[0]).any()
    out_of_place = simulation(world).allreduce(arrays, sparse=True)
    buffers = [a.copy() for a in arrays]
    sim = simulation(world)
    in_place(sim)
    sim.allreduce(buffers, sparse=True)
    for r in range(world):
        assert same_bits(out_of_place[r], dense[r])
    signs = [np.signbit(b).tolist() for b in buffers]
    assert all(s == signs[0] for s in signs), "ranks disagree on the sign of zero"
    for r in range(world):
        assert same_bits(buffers[r], dense[r]), r


# ---------------------------------------------------------------- many calls
@pytest.mark.parametrize("world", [2, 3])
def test_consecutive_mixed_dense_and_sparse_calls_with_faults(world):
    """Slot message numbers persist across calls of either kind, dtype and size."""
    rng = np.random.default_rng(world * 31)
    sim = simulation(world, Faults(loss=0.05, duplicate=0.05, jitter=0.003), seed=world)
    calls = 500
    kinds = {"dense": 0, "sparse": 0}
    for i in range(calls):
        size = int(rng.choice([0, 1, 5, BLK, BLK + 1, K - 1, K, K + 1, 100, K * SLOTS,
                               K * SLOTS + 7, 333]))
        dtype = DTYPES[int(rng.integers(0, 2))]
        density = float(rng.choice([0.0, 0.1, 0.5, 1.0]))
        sparse = bool(rng.integers(0, 2))
        arrays = sparse_inputs(world, size, dtype, density, seed=int(rng.integers(1 << 30)))
        outs = sim.allreduce(arrays, max_time=BIG_TIME, sparse=sparse)
        expected = reference(arrays)
        for out in outs:
            assert same_bits(out, expected), (i, size, dtype, sparse)
        kinds["sparse" if sparse else "dense"] += 1
    assert min(kinds.values()) > calls // 3
    assert all(s.next_seq == calls for s in sim.memberships)
    assert all(s.slot_msgs == sim.memberships[0].slot_msgs for s in sim.memberships)
    assert sum(sim.memberships[0].slot_msgs) > calls  # every call moved some slot on
    assert sum(s.counters["retransmissions"] for s in sim.memberships) > 0
    c = sim.job.counters
    assert c["duplicates"] + c["retransmissions_answered"] > 0
    assert c["dropped_mismatch"] == 0


def test_sparse_message_numbers_wrap_around():
    world = 3
    sim = simulation(world, FAULTY, seed=9)
    start = 0xFFFFFFFF - 3
    for s in sim.memberships:
        s.slot_msgs = [start] * SLOTS
    for i in range(6):
        arrays = sparse_inputs(world, K * SLOTS * 2 + 3, DTYPES[i % 2], 0.4, seed=60 + i)
        outs = sim.allreduce(arrays, max_time=BIG_TIME, sparse=i % 3 != 2)
        for out in outs:
            assert same_bits(out, reference(arrays))
    msgs = sim.memberships[0].slot_msgs
    assert all(m < start for m in msgs)  # every slot went past 2**32 - 1
    assert all(s.slot_msgs == msgs for s in sim.memberships)
