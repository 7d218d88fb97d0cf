"""One job over K switches (issue 15, parts 1 and 4): real switches on loopback.

The same inputs summed through one switch and through two and three must give the
same bytes on every rank: a part cut anywhere but at a chunk boundary changes the
exponents of the chunks it splits (the inputs below have spikes where a misplaced
cut would show), a part summed on the wrong switch or not at all changes values.
"""

import os
import signal
import threading
import time

import numpy as np
import pytest
from conftest import run_ranks

import switchml
from switchml import wire
from switchml.config import switch_addresses
from switchml.switch.process import SwitchProcess
from switchml.worker.multi import MultiSwitchWorker, most_telling, part_bounds

PACKET, BLOCK = 256, 64  # 4 lanes a packet: the sparse path fuses blocks
SLOTS, SLOTS_PER_JOB = 64, 16
TIMEOUT = 2.0


def make_switch(**settings):
    settings = {"packet_elements": PACKET, "block_elements": BLOCK, "slots": SLOTS,
                "slots_per_job": SLOTS_PER_JOB, **settings}
    return switchml.Switch(**settings).start()


@pytest.fixture
def switches():
    started = [make_switch() for _ in range(3)]
    try:
        yield started
    finally:
        for sw in started:
            sw.stop()


def address(sw) -> str:
    return "%s:%d" % sw.address


_jobs = iter(range(10**6))


def first_time_bytes(counters: dict) -> int:
    """The bytes a worker (or channel) sent, but for its retransmissions: each a
    whole packet of PACKET int32 values again, or a probe (a header)."""
    probes = counters["probe_retransmissions"]
    again = counters["retransmissions"] - probes
    return counters["bytes_sent"] - again * wire.packet_size(PACKET // BLOCK, PACKET) - \
        probes * wire.HEADER_SIZE


def run_job(addresses, inputs, timeout=10.0, first_time=False, **call):
    """Each rank's result of one allreduce of its input over ``addresses``, and the
    rank-0 worker's per-switch bytes sent (with ``first_time``, of dense calls,
    its retransmissions aside: ``first_time_bytes``)."""
    job = f"job-{next(_jobs)}"

    def body(rank):
        with switchml.Worker(addresses, rank, len(inputs), job=job, timeout=timeout) as w:
            result = w.allreduce(inputs[rank], **call)
            channels = w.channels if isinstance(w, MultiSwitchWorker) else [w]
            return result, [first_time_bytes(c.counters) if first_time else
                            c.counters["bytes_sent"] for c in channels]

    results = run_ranks(len(inputs), body)
    return [r for r, _ in results], results[0][1]


def spiky(rng, size, dtype=np.float32):
    """Values of many magnitudes, with a spike every few hundred elements: chunks of
    different exponents, so where a chunk begins matters."""
    values = rng.standard_normal(size) * np.exp(rng.uniform(-8, 8, size))
    values[rng.integers(0, size, max(1, size // 300))] *= 1e4
    return values.astype(dtype)


def assert_same_bytes(results, expected):
    for rank, result in enumerate(results):
        assert result.dtype == expected.dtype and result.shape == expected.shape
        assert result.tobytes() == expected.tobytes(), f"rank {rank} differs"


def assert_like_one_switch(switches, inputs, **call):
    """Through 1, 2 and 3 switches: the same bytes on every rank."""
    one, _ = run_job(address(switches[0]), inputs, **call)
    assert_same_bytes(one, one[0])
    for k in (2, 3):
        addresses = [address(sw) for sw in switches[:k]]
        many, sent = run_job(addresses, inputs, **call)
        assert_same_bytes(many, one[0])
        assert all(s > 0 for s in sent), sent  # every switch carried a part


# ------------------------------------------------------------------ addresses, cuts
def test_addresses_one_or_several():
    assert switch_addresses("a:1") == [("a", 1)]
    assert switch_addresses(("a", 1)) == [("a", 1)]
    assert switch_addresses(["a", "1"]) == [("a", 1)]  # (host, port), not two addresses
    assert switch_addresses("a:1, b:2") == [("a", 1), ("b", 2)]
    assert switch_addresses(["a:1", "b:2"]) == [("a", 1), ("b", 2)]
    assert switch_addresses([("a", 1), "b:2", ("c", 3)]) == [("a", 1), ("b", 2), ("c", 3)]
    for bad in ("a:1,", "a:1,,b:2", [], "a:1,a:1", ["a:1", "nope"]):
        with pytest.raises(ValueError):
            switch_addresses(bad)


def test_addresses_from_the_environment(monkeypatch):
    monkeypatch.setenv("SWITCHML_SWITCH", "a:1,b:2")
    assert switch_addresses(None) == [("a", 1), ("b", 2)]
    monkeypatch.delenv("SWITCHML_SWITCH")
    with pytest.raises(switchml.SwitchMLError, match="SWITCHML_SWITCH"):
        switch_addresses(None)


@pytest.mark.parametrize("size", [0, 1, 255, 256, 257, 1000, 10 * 256, 10 * 256 + 1, 99_999])
@pytest.mark.parametrize("parts", [1, 2, 3, 4])
def test_parts_are_whole_chunks_in_order_and_even(size, parts):
    unit = 256
    bounds = part_bounds(size, unit, parts)
    assert len(bounds) == parts
    assert bounds[0][0] == 0 and bounds[-1][1] == size
    for (_, stop), (start, _) in zip(bounds, bounds[1:]):
        assert stop == start  # contiguous, in order
    for start, stop in bounds:
        assert start % unit == 0 or start == stop == size  # (an empty part at the end)
        assert stop % unit == 0 or stop == size
    chunks = [-(-(stop - start) // unit) for start, stop in bounds]
    assert max(chunks) - min(chunks) <= 1  # within one packet of equal


# ------------------------------------------------------------------ bit for bit
@pytest.mark.parametrize("case", ["dense", "sparse", "wire16", "nonfinite", "int32"])
@pytest.mark.parametrize("parts", [2, 3])
def test_parts_under_seeded_loss_sum_as_one_switch_in_the_simulator(case, parts):
    """Deterministic: each part on a simulated switch of its own, with 5% loss,
    duplicates and reordering, gives the bytes one lossless switch gives."""
    from switchml.sim.network import Faults, Simulation

    rng = np.random.default_rng([9, parts])
    size = 10 * PACKET * parts + 77
    if case == "int32":
        inputs = [rng.integers(-2**31, 2**31, size, dtype=np.int64).astype(np.int32)
                  for _ in range(3)]
    else:
        inputs = [spiky(rng, size) for _ in range(3)]
    if case == "sparse":
        for x in inputs:
            x[np.repeat(rng.random(-(-size // BLOCK)) > 0.1, BLOCK)[:size]] = 0
    if case == "nonfinite":
        inputs[0][[3, size // 2, size - 1]] = np.inf
        inputs[1][[3, size // 3]] = np.nan
    call = {"sparse": case == "sparse", "wire_bits": 16 if case == "wire16" else 32}

    def simulation(seed, faults=None):
        return Simulation(3, slots=8, packet_elements=PACKET, block_elements=BLOCK,
                          faults=faults, seed=seed)

    want = simulation(0).allreduce(inputs, **call)
    unit = PACKET * (2 if case == "wire16" else 1)
    got = [np.empty_like(x) for x in inputs]
    lossy = Faults(loss=0.05, duplicate=0.02, jitter=50e-6)
    for k, (start, stop) in enumerate(part_bounds(size, unit, parts)):
        sums = simulation(k + 1, lossy).allreduce([x[start:stop] for x in inputs], **call)
        for out, part in zip(got, sums):
            out[start:stop] = part
    assert_same_bytes(got, want[0])
    assert_same_bytes(want, want[0])


@pytest.mark.parametrize("engine", ["c", "python"])
def test_dense_float32_is_bit_identical_to_one_switch(switches, engine, monkeypatch):
    if engine == "python":  # the workers' reference engine (the switches stay C)
        monkeypatch.setenv("SWITCHML_PURE_PYTHON", "1")
    rng = np.random.default_rng(1)
    inputs = [spiky(rng, 25_000 + 37) for _ in range(3)]
    assert_like_one_switch(switches, inputs)


def test_int32_is_bit_identical_to_one_switch(switches):
    rng = np.random.default_rng(2)
    inputs = [rng.integers(-2**31, 2**31, 9_999, dtype=np.int64).astype(np.int32)
              for _ in range(3)]
    assert_like_one_switch(switches, inputs)


@pytest.mark.parametrize("sparse", [True, "auto"])
def test_sparse_is_bit_identical_to_one_switch(switches, sparse, monkeypatch):
    # "auto" decides per part; 4-lane packets take the sparse path only when let
    monkeypatch.setenv("SWITCHML_SPARSE_AUTO_MIN_LANES", "1")
    rng = np.random.default_rng(3)
    inputs = []
    for _ in range(3):
        x = spiky(rng, 40_000 + 5)
        blocks = -(-x.size // BLOCK)
        zero = np.repeat(rng.random(blocks) > 0.05, BLOCK)[: x.size]  # 5% of blocks live
        x[zero] = 0
        inputs.append(x)
    assert_like_one_switch(switches, inputs, sparse=sparse)
    # and the dense path's bytes too
    dense, dense_sent = run_job([address(sw) for sw in switches], inputs)
    sparse_many, sparse_sent = run_job([address(sw) for sw in switches], inputs, sparse=sparse)
    assert_same_bytes(sparse_many, dense[0])
    for k in range(3):  # every part went sparse: a fraction of the dense bytes
        assert sparse_sent[k] < dense_sent[k] / 2, (sparse_sent, dense_sent)


def test_16_bit_wire_is_bit_identical_to_one_switch(switches):
    """Its chunk is two packets' worth of values: cut at 256, it would differ."""
    rng = np.random.default_rng(4)
    inputs = [spiky(rng, 20_000 + 3) for _ in range(3)]
    assert_like_one_switch(switches, inputs, bits=16)


def test_float16_is_bit_identical_to_one_switch(switches):
    rng = np.random.default_rng(5)
    inputs = [(rng.standard_normal(12_345) * 100).astype(np.float16) for _ in range(3)]
    assert_like_one_switch(switches, inputs)
    assert_like_one_switch(switches, inputs, bits=16)


def test_inf_and_nan_are_bit_identical_to_one_switch(switches):
    """The follow-up exchange runs within each part, on its own switch."""
    rng = np.random.default_rng(6)
    size = 30_000
    inputs = [spiky(rng, size) for _ in range(3)]
    inputs[0][[5, 9_000, 29_999]] = np.inf  # in the first, middle and last parts
    inputs[1][[5, 20_100]] = -np.inf         # +inf and -inf: NaN
    inputs[2][[9_001, 15_000]] = np.nan
    assert_like_one_switch(switches, inputs)
    result, _ = run_job([address(sw) for sw in switches], inputs)
    assert np.isnan(result[0][5]) and result[0][9_000] == np.inf
    assert result[0][20_100] == -np.inf and np.isnan(result[0][15_000])
    assert_like_one_switch(switches, inputs, bits=16)


def test_in_place_shapes_scalars_and_async_calls(switches):
    """2-d and 0-d arrays, out= the input, several calls in flight: as on one switch."""
    addresses = ",".join(address(sw) for sw in switches)
    rng = np.random.default_rng(7)
    inputs = [(spiky(rng, 3_000).reshape(50, 60), np.float32(rank + 0.5)) for rank in range(2)]

    def body(rank, where):
        matrix, scalar = inputs[rank]
        with switchml.Worker(where, rank, 2, job=f"shapes-{len(where)}", timeout=10) as w:
            inplace = matrix.copy()
            handles = [w.allreduce_async(inplace, out=inplace),
                       w.allreduce_async(np.array(scalar)),
                       w.allreduce_async(matrix.T)]  # strided: copied first
            return [h.wait() for h in handles]

    one = run_ranks(2, lambda rank: body(rank, address(switches[0])))
    many = run_ranks(2, lambda rank: body(rank, addresses))
    for a, b in zip(one[0], many[1]):
        assert_same_bytes([b], a)
    assert many[0][1].shape == () and many[0][1] == np.float32(2.0)


def test_calls_end_in_the_order_queued_though_a_later_one_needs_fewer_switches():
    """Call A has a part on each of two switches, call B (one chunk) on the first
    only.  With the second switch stopped (SIGSTOP), B's part comes back first, yet
    B ends after A, as on one switch: the local stage counts a shard's segments
    done by the last call that ended, and read a segment before its sum was back."""
    first = make_switch()
    second = SwitchProcess(packet_elements=PACKET, block_elements=BLOCK, slots=SLOTS,
                           slots_per_job=SLOTS_PER_JOB).start()
    try:
        addresses = [address(first), "%s:%d" % second.address]
        joined = threading.Barrier(2)

        def body(rank):
            with switchml.Worker(addresses, rank, 2, job="order", timeout=10.0) as w:
                w.allreduce(np.ones(2 * PACKET, np.float32))  # both switches work
                joined.wait(10)
                if rank == 0:
                    os.kill(second._proc.pid, signal.SIGSTOP)
                joined.wait(10)
                ended = []
                before = w.channels[0].counters["results_in"]
                a = w.allreduce_async(np.full(2 * PACKET, rank + 1.0, np.float32))
                b = w.allreduce_async(np.full(PACKET // 2, rank + 3.0, np.float32))
                for name, handle in (("A", a), ("B", b)):
                    handle.add_done_callback(lambda _, name=name: ended.append(name))
                # B's part and A's first are back from the first switch
                assert wait_for(lambda: w.channels[0].counters["results_in"] >= before + 2)
                time.sleep(0.2)  # time for B to end, were it not held back
                b_ended_early = b.done()
                joined.wait(10)
                if rank == 0:
                    os.kill(second._proc.pid, signal.SIGCONT)
                return b_ended_early, a.wait(), b.wait(), ended

        for b_ended_early, a, b, ended in run_ranks(2, body):
            assert not b_ended_early
            assert ended == ["A", "B"]
            assert (a == 3.0).all() and (b == 7.0).all()
    finally:
        try:
            os.kill(second._proc.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        second.stop()
        first.stop()


def test_a_small_call_uses_the_first_switches_only(switches):
    """One chunk, three switches: switch 0 carries it, the others see nothing."""
    inputs = [np.full(100, rank, np.float32) for rank in range(2)]
    result, sent = run_job([address(sw) for sw in switches], inputs)
    assert_same_bytes(result, np.full(100, 1, np.float32))
    assert sent[0] > 0 and sent[1:] == [0, 0]


def test_bytes_per_switch_are_even(switches):
    """Each switch gets S/K: within one packet, retransmissions aside."""
    inputs = [np.ones(10 * PACKET * 3, np.int32) for _ in range(2)]
    addresses = [address(sw) for sw in switches]
    _, sent = run_job(addresses, inputs, first_time=True)
    assert max(sent) == min(sent), sent  # ten full packets each, int32: no seeds
    for sw in switches:
        assert sum(j["counters"]["packets_in"] for j in sw.stats()["ended_jobs"].values()) > 0


@pytest.mark.parametrize("parts", [1, 2, 3])
def test_the_parts_share_one_jobs_window(switches, parts):
    """The K parts leave through one link: together they keep in flight what one
    switch's job would (SLOTS_PER_JOB), each channel at most its share of it."""
    addresses = [address(sw) for sw in switches[:parts]]

    def body(rank):
        with switchml.Worker(addresses, rank, 2, job=f"window-{parts}", timeout=7) as w:
            w.allreduce(np.ones(20 * PACKET, np.float32))
            channels = w.channels if isinstance(w, MultiSwitchWorker) else [w]
            return [(c.membership.window.limit, c.membership.window.cwnd) for c in channels]

    for windows in run_ranks(2, body):
        share = -(-SLOTS_PER_JOB // parts)
        assert [limit for limit, _ in windows] == [share] * parts
        assert all(cwnd <= share for _, cwnd in windows)


def test_workers_read_as_one_worker(switches):
    """What bench/, examples/ and the torch backend read from a worker."""
    addresses = [address(sw) for sw in switches[:2]]

    def body(rank):
        with switchml.Worker(addresses, rank, 2, job="attrs", timeout=7) as w:
            w.allreduce(np.ones(4 * PACKET, np.float32))
            per_switch = [c.counters for c in w.channels]
            return (w.rank, w.world_size, w.timeout, w.job, w.switch_address,
                    w.switch_addresses, w.membership.packet_elements, w.membership.block_elements,
                    w.membership.lanes, w.counters, per_switch)

    for rank, out in enumerate(run_ranks(2, body)):
        (r, world, timeout, job, first, every, packet, block, lanes, counters, parts) = out
        assert (r, world, timeout, job) == (rank, 2, 7.0, "attrs")
        assert first == switches[0].address and every == [sw.address for sw in switches[:2]]
        assert (packet, block, lanes) == (PACKET, BLOCK, PACKET // BLOCK)
        assert counters["results_in"] == sum(p["results_in"] for p in parts) > 0
        assert all(p["results_in"] > 0 for p in parts)


def test_one_address_in_a_list_is_todays_worker(switches):
    with switchml.Worker([address(switches[0])], 0, 1, job="single") as w:
        assert type(w) is switchml.Worker and w.switch_address == switches[0].address
        assert w.allreduce(np.arange(10, dtype=np.int32)).tolist() == list(range(10))


def test_ranks_listing_the_switches_in_other_orders_fail_at_join_saying_so(switches):
    """Joined at once, rank 0's part 1 would meet rank 1's part 2 on one switch: same
    sizes, no mismatch seen, wrong sums.  One join after the other, they time out."""
    orders = [[address(switches[0]), address(switches[1])],
              [address(switches[1]), address(switches[0])]]

    def body(rank):
        with pytest.raises(switchml.SwitchMLTimeoutError) as info:
            switchml.Worker(orders[rank], rank, 2, job="order", timeout=1.0)
        return str(info.value)

    for message in run_ranks(2, body):
        assert "same order" in message and "switch 1 of 2" in message
    for sw in switches[:2]:
        assert wait_for(lambda sw=sw: not sw.stats()["admission"]["gathering"])


def test_switches_cutting_different_packets_are_refused_naming_both(switches):
    other = make_switch(packet_elements=512)
    try:
        addresses = [address(switches[0]), address(other)]

        def body(rank):
            with pytest.raises(switchml.JoinRefusedError) as info:
                switchml.Worker(addresses, rank, 2, job="geometry", timeout=5)
            return str(info.value)

        for message in run_ranks(2, body):
            assert address(switches[0]) in message and address(other) in message
            assert "packet_elements=256" in message and "packet_elements=512" in message
        for sw in (switches[0], other):  # both left: nothing held
            assert wait_for(lambda sw=sw: sw.stats()["free_slots"] == SLOTS)
            assert sw.stats()["admission"]["running"] == 0
    finally:
        other.stop()


def test_ranks_that_disagree_fail_on_every_rank_naming_the_switch(switches):
    """Rank 1 sums one more element (the same 12 chunks): only the last part's switch
    sees the mismatch; the job fails on every switch, and the error says which switch
    and which part, on both ranks."""
    addresses = [address(sw) for sw in switches]

    def body(rank):
        with switchml.Worker(addresses, rank, 2, job="mismatch", timeout=TIMEOUT) as w:
            with pytest.raises(switchml.SwitchMLError) as info:
                w.allreduce(np.ones(3 * 4 * PACKET - 10 + rank, np.float32))
            with pytest.raises(switchml.SwitchMLError):  # the worker stays failed
                w.allreduce(np.ones(10, np.float32))
            return info.value

    for error in run_ranks(2, body):
        assert isinstance(error, switchml.CallMismatchError), error
        assert address(switches[2]) in str(error) and "part 3 of 3" in str(error)
    for sw in switches:
        assert wait_for(lambda sw=sw: sw.stats()["free_slots"] == SLOTS)


def test_a_mismatch_relayed_to_the_other_parts_first_still_names_its_own_part():
    """The race CI once lost: switch 3 announced the mismatch on the control
    connection, the worker aborted parts 1 and 2 with that error, and their
    failures reached the call before part 3's own.  The call must still raise
    part 3's error, naming its switch and part, not the first relay in time."""
    worker = MultiSwitchWorker.__new__(MultiSwitchWorker)
    aborted: list = []

    class Channel:
        def abort(self, error):
            aborted.append(error)

    worker.switch_addresses = [("10.0.0.1", 7300), ("10.0.0.2", 7300), ("10.0.0.3", 7300)]
    worker._channel_at = [(address, 0) for address in worker.switch_addresses]
    worker.channels = [Channel(), Channel(), Channel()]
    worker._lock = threading.Lock()
    worker._failure = None
    raw = switchml.CallMismatchError("ranks disagree on allreduce #0 (on the switch at "
                                     "10.0.0.3:7300)")
    worker._switch_failed(raw, 2)  # the control connection's announcement
    assert len(aborted) == 2
    relays = [worker._part_error(error, k, 0, 9, 30) for k, error in enumerate(aborted)]
    own = worker._part_error(raw, 2, 20, 29, 30)
    chosen = most_telling([*relays, own])
    assert "part 3 of 3" in str(chosen) and "10.0.0.3:7300" in str(chosen)
    assert isinstance(chosen, switchml.CallMismatchError)


# ------------------------------------------------------------------ a switch dies
def wait_for(condition, seconds=5.0) -> bool:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_a_switch_killed_mid_call_fails_every_rank_naming_it_and_frees_the_others():
    """Four switches (issue 15's aim), the third a process killed (SIGKILL) while rank
    0's call is in flight (rank 1 holds back its contribution): both ranks raise
    naming it within the timeout, the other three switches free the job's slots,
    and the job formed again on those three sums."""
    survivors = [make_switch(), make_switch(), make_switch()]
    victim = SwitchProcess(packet_elements=PACKET, block_elements=BLOCK, slots=SLOTS,
                           slots_per_job=SLOTS_PER_JOB).start()
    try:
        dead = "%s:%d" % victim.address
        addresses = [address(survivors[0]), address(survivors[1]), dead,
                     address(survivors[2])]
        killed = threading.Event()
        both_done = threading.Barrier(2)
        size = 4 * 8 * PACKET

        def body(rank):
            with switchml.Worker(addresses, rank, 2, job="victim", timeout=TIMEOUT) as w:
                w.allreduce(np.ones(size, np.float32))  # every switch works
                both_done.wait(10)
                start = time.monotonic()
                if rank == 0:
                    handle = w.allreduce_async(np.ones(size, np.float32))
                    time.sleep(0.2)  # in flight: waiting for rank 1
                    os.kill(victim._proc.pid, signal.SIGKILL)
                    killed.set()
                else:
                    assert killed.wait(10)
                    time.sleep(0.1)
                    handle = w.allreduce_async(np.ones(size, np.float32))
                with pytest.raises(switchml.SwitchMLError) as info:
                    handle.wait()
                elapsed = time.monotonic() - start
                # still in the job: the worker itself made the other switches let go
                freed = all(wait_for(lambda sw=sw: sw.stats()["free_slots"] == SLOTS)
                            for sw in survivors)
                return info.value, elapsed, freed

        for error, elapsed, freed in run_ranks(2, body):
            assert dead in str(error), error
            # its own part's loss, or another rank's relayed: a switch failure either way
            assert isinstance(error, switchml.SwitchUnreachableError), error
            assert elapsed < TIMEOUT + 1.0
            assert freed
        for sw in survivors:
            assert wait_for(lambda sw=sw: sw.stats()["free_slots"] == SLOTS), sw.stats()
            assert sw.stats()["admission"]["running"] == 0
            assert sw.stats()["counters"]["jobs_failed"] == 1  # aborted, not left hanging
        # the job formed again on the switches left
        rng = np.random.default_rng(8)
        inputs = [spiky(rng, 5_000) for _ in range(2)]
        again, _ = run_job([address(sw) for sw in survivors], inputs)
        one, _ = run_job(address(survivors[0]), inputs)
        assert_same_bytes(again, one[0])
    finally:
        victim.stop()
        for sw in survivors:
            sw.stop()


def test_a_switch_gone_between_calls_frees_the_others_and_fails_the_next_call(switches):
    addresses = [address(sw) for sw in switches]
    both_done = threading.Barrier(2)
    stopped: list = []

    def body(rank):
        with switchml.Worker(addresses, rank, 2, job="gone", timeout=TIMEOUT) as w:
            w.allreduce(np.ones(10 * PACKET, np.int32))
            both_done.wait(10)
            if rank == 0:
                switches[2].stop()
                stopped.append(time.monotonic())
            # no call running: the worker lets go of the other two all the same, once
            # its channel to the gone one gave up rejoining it (``timeout``)
            freed = all(wait_for(lambda sw=sw: sw.stats()["free_slots"] == SLOTS,
                                 TIMEOUT + 2.0) for sw in switches[:2])
            # Each rank's own channel gives up too: its error, not the other rank's
            # relayed through the switches left (which may come first), is the call's.
            assert wait_for(lambda: bool(stopped))
            time.sleep(max(0.0, stopped[0] + TIMEOUT + 0.5 - time.monotonic()))
            start = time.monotonic()
            with pytest.raises(switchml.SwitchMLError) as info:
                w.allreduce(np.ones(10 * PACKET, np.int32))
            return info.value, time.monotonic() - start, freed

    for error, elapsed, freed in run_ranks(2, body):
        assert isinstance(error, switchml.SwitchUnreachableError), error
        assert address(switches[2]) in str(error), error
        assert elapsed < TIMEOUT + 1.0
        assert freed  # before the workers closed


def test_an_unreachable_switch_at_join_names_it_and_leaves_the_others(switches):
    with switchml.Switch() as gone:
        dead = address(gone)
    addresses = [address(switches[0]), dead]

    with pytest.raises(switchml.SwitchUnreachableError, match=dead):
        switchml.Worker(addresses, 0, 1, job="unreachable", timeout=2)
    assert switches[0].stats()["free_slots"] == SLOTS
    assert switches[0].stats()["admission"]["running"] == 0


@pytest.mark.parametrize("engine", ["c", "python"])
def test_abort_from_another_thread_fails_the_call_and_frees_the_slots(switches, engine,
                                                                      monkeypatch):
    """``Worker.abort``, what a job over several switches does to the others: the call
    in flight (stalled on rank 1, which never calls) raises the error at once, not
    after the timeout; the switch fails the job for rank 1 too and frees its slots."""
    if engine == "python":
        monkeypatch.setenv("SWITCHML_PURE_PYTHON", "1")
    sw = switches[0]
    given_up = switchml.SwitchUnreachableError("the switch at elsewhere:1 went away")

    def body(rank):
        with switchml.Worker(address(sw), rank, 2, job="abort", timeout=30) as w:
            start = time.monotonic()
            if rank == 0:
                handle = w.allreduce_async(np.ones(50 * PACKET, np.float32))
                time.sleep(0.3)
                w.abort(given_up)
                with pytest.raises(switchml.SwitchMLError) as info:
                    handle.wait()
                with pytest.raises(switchml.SwitchMLError):  # and every later call
                    w.allreduce(np.ones(10, np.float32))
            else:  # never calls; learns of the failure from the switch, between calls
                assert wait_for(lambda: w._failure is not None, 10)
                elapsed = time.monotonic() - start
                with pytest.raises(switchml.SwitchMLError) as info:
                    w.allreduce(np.ones(10, np.float32))
                return info.value, elapsed
            return info.value, time.monotonic() - start

    (mine, elapsed), (theirs, their_elapsed) = run_ranks(2, body)
    assert mine is given_up and elapsed < 3.0  # not after the 30 s timeout
    # a switch lost, relayed: a switch failure on rank 1 too (the torch backend's
    # fallback takes those), not a stall
    assert isinstance(theirs, switchml.SwitchUnreachableError) and "rank 0" in str(theirs)
    assert "elsewhere:1" in str(theirs) and their_elapsed < 5.0
    assert wait_for(lambda: sw.stats()["free_slots"] == SLOTS)
    assert sw.stats()["counters"]["jobs_failed"] == 1


# ------------------------------------------------------------------ threads of one rank
def run_threaded(where, inputs, threads, job, calls):
    """Each rank's results of ``calls`` (keyword sets for ``allreduce``), sent with
    ``threads[rank]`` I/O threads, and rank 0's channels' (job name, slot count)."""
    def body(rank):
        with switchml.Worker(where, rank, len(inputs), job=job, timeout=10,
                             threads=threads[rank]) as w:
            results = [w.allreduce(inputs[rank], **call) for call in calls]
            channels = w.channels if isinstance(w, MultiSwitchWorker) else [w]
            return results, [(c.job, c.membership.slot_count) for c in channels]

    return run_ranks(len(inputs), body)


THREAD_CALLS = [{}, {"bits": 16}, {"sparse": True}]


def test_threads_of_a_rank_are_bit_identical_to_one_thread_each_a_job_with_its_share(
        switches):
    """Three threads a rank: three jobs on the switch (the job's name, then #1, #2),
    each with a third of the job's slots, and every call's bytes those of one
    thread's, dense, 16-bit and sparse, infs and NaNs included (a cut inside a
    chunk, or a part summed twice or not at all, would change them)."""
    rng = np.random.default_rng(11)
    inputs = [spiky(rng, 30_000 + 11) for _ in range(2)]
    for x in inputs:
        x[rng.random(x.size) < 0.5] = 0  # blocks of zeros and live ones: sparse runs
    inputs[0][[7, 29_000]] = np.inf
    inputs[1][[15_000]] = np.nan
    one = run_threaded(address(switches[0]), inputs, [1, 1], "one-thread", THREAD_CALLS)
    three = run_threaded(address(switches[0]), inputs, [3, 3], "three", THREAD_CALLS)
    for (results, _), (expected, _) in zip(three, one):
        for got, want in zip(results, expected):
            assert_same_bytes([got], want)
    share = -(-SLOTS_PER_JOB // 3)
    assert three[0][1] == [("three", share), ("three#1", share), ("three#2", share)]
    assert one[0][1] == [("one-thread", SLOTS_PER_JOB)]


def test_ranks_asking_for_different_threads_all_send_with_the_least(switches):
    """Rank 0 asks for 3 threads, rank 1 for 2: the switch tells both 2 (a rank on
    more threads than another would cut its calls elsewhere: wrong sums)."""
    rng = np.random.default_rng(12)
    inputs = [spiky(rng, 20_000) for _ in range(2)]
    one = run_threaded(address(switches[0]), inputs, [1, 1], "least-1", [{}])
    mixed = run_threaded(address(switches[0]), inputs, [3, 2], "least", [{}])
    for (results, channels), (expected, _) in zip(mixed, one):
        assert_same_bytes(results, expected[0])
        assert [name for name, _ in channels] == ["least", "least#1"]


def test_threads_over_two_switches(switches):
    """Two switches, two threads each: four parts, the bytes of one switch's."""
    rng = np.random.default_rng(13)
    inputs = [spiky(rng, 25_000) for _ in range(2)]
    one = run_threaded(address(switches[0]), inputs, [1, 1], "two-by-two-1", [{}])
    many = run_threaded([address(sw) for sw in switches[:2]], inputs, [2, 2], "two-by-two",
                        [{}])
    for (results, _), (expected, _) in zip(many, one):
        assert_same_bytes(results, expected[0])
    assert [name for name, _ in many[0][1]] == ["two-by-two", "two-by-two#1"] * 2


def test_a_switch_restart_counts_once_for_a_rank_on_several_threads():
    """Its threads' channels each rejoin a restarted switch; the rank's counters say
    one rejoin and one resumed call a switch, and sum everything else."""
    from types import SimpleNamespace

    from switchml.worker.multi import PER_SWITCH

    def channel(switch, **counters):
        return SimpleNamespace(switch_address=switch, counters=counters)
    rank = SimpleNamespace(channels=[
        channel(("a", 1), rejoins=1, calls_resumed=1, results_in=10),
        channel(("a", 1), rejoins=1, calls_resumed=1, results_in=12),  # a's thread 1
        channel(("b", 2), rejoins=2, calls_resumed=0, results_in=5)])
    counted = MultiSwitchWorker.counters.fget(rank)
    assert counted == {"rejoins": 3, "calls_resumed": 1, "results_in": 27}
    assert set(PER_SWITCH) == {"rejoins", "calls_resumed"}


def test_threads_of_a_job_named_near_the_limit_join_under_names_of_their_own(switches):
    """A name of 199 characters: "name#1" would pass the switch's 200, which cuts
    it, so every thread past the first would join as the same job (refused as a
    duplicate rank); their names keep a digest of the whole name instead, the
    same on every rank, and the calls give one thread's bytes.  A name the switch
    would cut is refused at once."""
    from switchml.protocol import MAX_NAME
    from switchml.worker.multi import thread_job
    long = "n" * (MAX_NAME - 1)
    names = [thread_job(long, t) for t in (1, 2, 3)]
    assert len(set(names)) == 3 and all(len(n) <= MAX_NAME for n in names)
    assert thread_job(long + "x", 1) not in names  # another name: other digests
    assert thread_job("short", 2) == "short#2"
    rng = np.random.default_rng(14)
    inputs = [spiky(rng, 20_000) for _ in range(2)]
    one = run_threaded(address(switches[0]), inputs, [1, 1], "near-limit-1", [{}])
    three = run_threaded(address(switches[0]), inputs, [3, 3], long, [{}])
    for (results, channels), (expected, _) in zip(three, one):
        assert_same_bytes(results, expected[0])
        assert [name for name, _ in channels] == [long] + names[:2]
    with pytest.raises(ValueError, match=f"at most {MAX_NAME} characters"):
        switchml.Worker(address(switches[0]), 0, 2, job="n" * (MAX_NAME + 1))


def test_a_switch_killed_under_a_threaded_call_fails_every_rank_naming_it():
    """SIGKILL while two ranks' calls are in flight on two threads each: both raise
    ``SwitchUnreachableError`` naming the switch within the timeout."""
    victim = SwitchProcess(packet_elements=PACKET, block_elements=BLOCK, slots=SLOTS,
                           slots_per_job=SLOTS_PER_JOB).start()
    try:
        dead = "%s:%d" % victim.address
        started = threading.Barrier(2)

        def body(rank):
            with switchml.Worker(dead, rank, 2, job="threads-killed", timeout=TIMEOUT,
                                 threads=2) as w:
                assert len(w.channels) == 2
                w.allreduce(np.ones(8 * PACKET, np.float32))
                started.wait(10)
                start = time.monotonic()
                if rank == 0:
                    handle = w.allreduce_async(np.ones(8 * PACKET, np.float32))
                    time.sleep(0.2)  # in flight: rank 1 holds back its contribution
                    os.kill(victim._proc.pid, signal.SIGKILL)
                else:
                    time.sleep(0.3)
                    handle = w.allreduce_async(np.ones(8 * PACKET, np.float32))
                with pytest.raises(switchml.SwitchMLError) as info:
                    handle.wait()
                return info.value, time.monotonic() - start

        for error, elapsed in run_ranks(2, body):
            assert isinstance(error, switchml.SwitchUnreachableError), error
            assert dead in str(error), error
            assert elapsed < TIMEOUT + 1.0
    finally:
        victim.stop()


def test_a_rank_takes_a_thread_per_8_gbits_of_its_link_unless_told(monkeypatch):
    """One thread per 8 Gbit/s its interface reports, at most half the cores its
    host's senders share, 1 to 8; a link of no reported speed (loopback) one;
    SWITCHML_WORKER_THREADS wins; the join says it and an older switch's ready
    (no field) means one."""
    from switchml import protocol
    from switchml.config import auto_worker_threads
    from switchml.worker.client import worker_threads
    assert [auto_worker_threads(mbit, cores=16) for mbit in
            (None, 1000, 8_000, 10_000, 25_000, 100_000, 400_000)] == [1, 1, 1, 2, 4, 8, 8]
    assert auto_worker_threads(100_000, senders=4, cores=16) == 2
    assert auto_worker_threads(100_000, senders=8, cores=16) == 1
    assert auto_worker_threads(25_000, cores=2) == 1
    monkeypatch.delenv("SWITCHML_WORKER_THREADS", raising=False)
    assert worker_threads([("127.0.0.1", 7300)]) == 1  # loopback reports no speed
    monkeypatch.setenv("SWITCHML_WORKER_THREADS", "4")
    assert worker_threads([("127.0.0.1", 7300)]) == 4
    monkeypatch.setenv("SWITCHML_WORKER_THREADS", "0")
    with pytest.raises(ValueError, match="SWITCHML_WORKER_THREADS"):
        worker_threads([("127.0.0.1", 7300)])
    join = protocol.Join("j", 0, 2, ("127.0.0.1", 9), threads=3)
    assert protocol.Join.from_dict(join.fields()).threads == 3
    assert "threads" not in protocol.Join("j", 0, 2, ("127.0.0.1", 9)).fields()
    ready = protocol.Ready(1, 0, 8, 256, 64, 7300, threads=3)
    assert protocol.decode_event({**ready.fields(), "event": "ready"}).threads == 3
    older = {**protocol.Ready(1, 0, 8, 256, 64, 7300).fields(), "event": "ready"}
    assert "threads" not in older and protocol.decode_event(older).threads == 1
    with pytest.raises(protocol.BadRequest, match="threads"):
        protocol.Join.from_dict({**join.fields(), "threads": 0})
    with pytest.raises(protocol.MalformedMessage, match="threads"):  # a switch's bad answer
        protocol.decode_event({**ready.fields(), "event": "ready", "threads": 10**9})


def test_calls_made_after_an_abort_end_after_the_calls_before():
    """A rank of two I/O threads aborts while a call runs (its peer never makes
    it): a call it makes after the abort fails, but not before the call made
    before it ends, as on one thread; each raises the caller's error (the first
    call's part on one thread may hear it first relayed by the other rank)."""
    sw = make_switch()
    try:
        workers = run_ranks(2, lambda r: switchml.Worker(address(sw), r, 2, job="abort",
                                                         timeout=5.0, threads=2))
        run_ranks(2, lambda r: workers[r].allreduce(np.ones(4, np.float32)))
        first = workers[0].allreduce_async(np.ones(1_000_000, np.float32))
        time.sleep(0.2)
        workers[0].abort(switchml.SwitchMLError("the caller gave up"))
        later = workers[0].allreduce_async(np.ones(4, np.float32))
        assert not later.done() or first.done()
        ended = []
        for name, handle in (("first", first), ("later", later)):
            handle.add_done_callback(lambda _, name=name: ended.append(name))
        for handle in (first, later):
            with pytest.raises(switchml.SwitchMLError, match="the caller gave up"):
                handle.wait(10)
        assert ended == ["first", "later"]
        for w in workers:
            w.close()
    finally:
        sw.stop()


def test_a_part_a_channel_refuses_at_once_fails_the_call_and_the_next_one_ends(switches,
                                                                              monkeypatch):
    """A channel that raises as a part is queued (closed under the call by another
    thread): the part fails the call as a part's failure does, and the calls after
    it end (they waited for it, a call that could never complete: a hang)."""
    addresses = [address(sw) for sw in switches[:2]]
    with switchml.Worker(addresses, 0, 1, job=f"job-{next(_jobs)}", timeout=5.0) as w:
        values = np.arange(4 * PACKET, dtype=np.int32)
        assert np.array_equal(w.allreduce(values), values)
        refuse = switchml.SwitchMLError("this worker is closed")
        monkeypatch.setattr(w.channels[1], "allreduce_async",
                            lambda *args, **kwargs: (_ for _ in ()).throw(refuse))
        with pytest.raises(switchml.SwitchMLError, match="closed"):
            w.allreduce_async(values).wait(10)
        assert len(w.parts(PACKET)) == 1  # the next call: on the first switch alone
        with pytest.raises(switchml.SwitchMLError):
            w.allreduce_async(values[:PACKET]).wait(10)  # ends: waits for no part that
            # never ran


def test_a_close_in_a_done_callback_waits_for_no_channel(switches):
    """A job over two switches: rank 0 closes in its first call's done callback,
    which runs on one channel's thread, while its second call is queued and rank 1
    makes its second call 1 s later.  The close returns at once (it joined the
    other channel's thread, which waited on rank 1: two ranks doing so, each on
    another channel, waited for each other until the timeout), and both calls
    sum on both ranks."""
    addresses = [address(sw) for sw in switches]

    def body(rank):
        w = switchml.Worker(addresses, rank, 2, job="cb-close", timeout=10)
        closing: dict = {}

        def close(_):
            start = time.monotonic()
            w.close()
            closing["s"] = time.monotonic() - start

        x = np.ones(64 * 1024, np.float32)
        registered = threading.Event()  # rank 0's call waits for its callback to be set
        first = w.allreduce_async(x, ready=registered.wait if rank == 0 else None)
        if rank == 0:
            first.add_done_callback(close)
            registered.set()
            second = w.allreduce_async(2 * x)
        else:
            first.wait(10)
            time.sleep(1.0)
            second = w.allreduce_async(2 * x)
        results = (first.wait(10), second.wait(10))
        if rank == 1:
            w.close()
        for channel in w.channels:
            channel._thread.join(10)
        return results, closing.get("s")

    (ours, took), (theirs, _) = run_ranks(2, body)
    assert took is not None and took < 0.5, took
    for results in (ours, theirs):
        assert (results[0] == 2.0).all() and (results[1] == 4.0).all()
