"""Block-sparse allreduce over real sockets: same sums as dense, fewer blocks sent."""

import numpy as np
import pytest
from conftest import run_ranks

import switchml

K, BLOCK = 1024, 256  # the test switch's packet and block sizes


def sparse_inputs(world, blocks, density, dtype, seed):
    rng = np.random.default_rng([seed, world, blocks])
    size = blocks * BLOCK - 17  # a short last block
    out = []
    for _ in range(world):
        if dtype == np.int32:
            x = rng.integers(-(2**20), 2**20, size, dtype=np.int32)
        else:
            x = rng.standard_normal(size).astype(np.float32)
        keep = rng.random(blocks) < density
        x[np.repeat(~keep, BLOCK)[:size]] = 0
        out.append(x)
    return out


@pytest.mark.parametrize("drop_rate", [0.0, 0.05])
@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_sparse_equals_dense_over_sockets(world, drop_rate):
    with switchml.Switch(packet_elements=K, slots=64, slots_per_job=8, drop_rate=drop_rate,
                         seed=world) as sw:
        cases = [(dtype, density) for dtype in (np.float32, np.int32)
                 for density in (0.0, 0.05, 0.3, 1.0)]
        data = {c: sparse_inputs(world, 150, c[1], c[0], seed=7) for c in cases}

        def body(rank):
            with switchml.Worker(sw.address, rank, world, timeout=20) as w:
                got = {c: (w.allreduce(data[c][rank], sparse=True), w.allreduce(data[c][rank]))
                       for c in cases}
                return got, w.counters

        results = run_ranks(world, body)
        for c in cases:
            sparse0, dense0 = results[0][0][c]
            assert sparse0.tobytes() == dense0.tobytes()
            for got, _ in results:
                assert got[c][0].tobytes() == sparse0.tobytes()
            if c[0] == np.int32:
                assert np.array_equal(sparse0, np.sum(data[c], axis=0, dtype=np.int32))
        counters = sw.stats()["ended_jobs"]["default"]["counters"]
        assert counters["sparse_blocks_skipped"] > 0
        expected_blocks = sum(
            int(np.count_nonzero([np.any(x[i * BLOCK:(i + 1) * BLOCK]) for i in range(150)]))
            for c in cases for x in data[c])
        assert counters["sparse_blocks_in"] == expected_blocks  # zero blocks never sent


def test_auto_stays_dense_with_packets_of_few_blocks(switch):
    """The test switch's packets hold 4 blocks, like frame-sized ones: sparse's rounds
    would cost more than they save, so auto goes dense without measuring."""
    sparse_data = sparse_inputs(2, 100, 0.05, np.float32, seed=3)

    def body(rank):
        with switchml.Worker(switch.address, rank, 2) as w:
            assert w.membership.lanes < 32
            w.allreduce(sparse_data[rank], sparse="auto")
            return w.counters, w.membership.slot_count

    chunks = -(-sparse_data[0].size // K)
    for counters, slots in run_ranks(2, body):
        assert counters["sparse_blocks_sent"] == 0
        # the dense call's results (a chunk each, an exponent seed a slot), and no
        # measuring call before it
        assert counters["results_in"] == chunks + min(slots, chunks)


def test_auto_picks_sparse_for_sparse_gradients_and_dense_for_dense(switch, monkeypatch):
    monkeypatch.setenv("SWITCHML_SPARSE_AUTO_EVERY", "1")  # measure every call
    monkeypatch.setenv("SWITCHML_SPARSE_AUTO_MIN_LANES", "1")  # as loopback-sized packets
    sparse_data = sparse_inputs(2, 100, 0.05, np.float32, seed=3)
    dense_data = sparse_inputs(2, 100, 1.0, np.float32, seed=4)
    # half the blocks each: the union coming down is ~3/4 of the tensor, over the
    # default margin, so dense although sparse would send fewer bytes up
    half_data = sparse_inputs(2, 100, 0.5, np.float32, seed=5)

    def body(rank):
        with switchml.Worker(switch.address, rank, 2) as w:
            a = w.allreduce(sparse_data[rank], sparse="auto")
            after_sparse = w.counters["sparse_blocks_sent"]
            b = w.allreduce(dense_data[rank], sparse="auto")
            w.allreduce(half_data[rank], sparse="auto")
            after_dense = w.counters["sparse_blocks_sent"]
            return a, b, after_sparse, after_dense

    for a, b, after_sparse, after_dense in run_ranks(2, body):
        assert after_sparse > 0 and after_dense == after_sparse
        assert np.allclose(b, np.sum(np.array(dense_data, np.float64), axis=0), atol=1e-5)
        assert np.allclose(a, np.sum(np.array(sparse_data, np.float64), axis=0), atol=1e-5)


def test_auto_measures_again_every_n_calls_of_a_size_alike_on_every_rank(switch, monkeypatch):
    monkeypatch.setenv("SWITCHML_SPARSE_AUTO_MIN_LANES", "1")
    monkeypatch.setenv("SWITCHML_SPARSE_AUTO_EVERY", "3")
    measured = []
    original = switchml.Worker._sparse_pays

    def counting(self, src):
        measured.append((self.rank, src.size))
        return original(self, src)

    monkeypatch.setattr(switchml.Worker, "_sparse_pays", counting)
    small = sparse_inputs(2, 20, 0.05, np.float32, seed=6)
    large = sparse_inputs(2, 100, 0.05, np.float32, seed=7)

    def body(rank):
        with switchml.Worker(switch.address, rank, 2) as w:
            for _ in range(7):
                w.allreduce(large[rank], sparse="auto")
                w.allreduce(small[rank], sparse="auto")
            return w.counters["sparse_blocks_sent"]

    sent = run_ranks(2, body)
    # each size measured on calls 1, 4 and 7, on both ranks
    assert sorted(measured) == sorted([(r, x[0].size) for r in range(2)
                                       for x in (small, large) for _ in range(3)])
    assert all(count > 0 for count in sent)  # and the measured choice (sparse) was kept


def test_sparse_argument_is_checked(switch):
    with switchml.Worker(switch.address, 0, 1) as w:
        with pytest.raises(ValueError, match="sparse"):
            w.allreduce(np.ones(3, np.float32), sparse="maybe")


def test_auto_goes_sparse_on_8_lane_packets_with_the_c_engine_only(switch, monkeypatch):
    """Frame-sized packets at MTU 9000 hold 8 blocks: with the C sparse engine the
    rounds cost microseconds and sparse pays there (docs/protocol.md); the Python
    engine's rounds need 32 blocks a packet."""
    from switchml.worker.engine import compiled
    monkeypatch.delenv("SWITCHML_SPARSE_AUTO_MIN_LANES", raising=False)
    with switchml.Worker(switch.address, 0, 1) as w:
        assert w._sparse_auto_min_lanes == (8 if compiled.enabled() else 32)
    monkeypatch.setenv("SWITCHML_PURE_PYTHON", "1")
    with switchml.Worker(switch.address, 0, 1) as w:
        assert w._sparse_auto_min_lanes == 32
