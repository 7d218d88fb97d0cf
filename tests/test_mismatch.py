"""Ranks that disagree on a call get an error naming what each asked for, at once.

The switch compares what the packets carry (call number, packet, dtype, mode,
count and the header's ``call``: element count and sparseness); the first
disagreement in a job fails it, and every rank raises ``CallMismatchError``
within a round trip, not after its timeout.
"""

import time

import numpy as np
import pytest
from conftest import run_ranks

import switchml
from switchml import wire
from switchml.switch.dataplane import fastpipeline
from switchml.switch.dataplane.pipeline import Mismatch, Pipeline

TIMEOUT = 20.0  # far longer than the error may take: it must not be the timeout
SESSION = 0x5E55
ADDRS = [("10.0.0.1", 5000), ("10.0.0.2", 5000), ("10.0.0.3", 5000)]

pipelines = [Pipeline]
if fastpipeline._fastpath is not None:
    pipelines.append(fastpipeline.FastPipeline)


def contribution(values, call, dtype=wire.DTYPE_INT32, seq=7, msg=1):
    return wire.encode(wire.KIND_CONTRIBUTION, dtype, 0, SESSION, msg, seq, 0,
                       lane_records=np.zeros(1, wire.LANE), values=values, call=call)


@pytest.mark.parametrize("make", pipelines, ids=lambda c: c.__name__)
def test_the_pipeline_records_the_first_disagreement_and_adds_nothing(make):
    pipeline = make(slots=4, packet_elements=8)
    pipeline.install_job("j", SESSION, ADDRS, 0, 2)
    ones = np.ones(8, np.int32)
    assert pipeline.receive_datagram(contribution(ones, call=8), ADDRS[0]) == []
    assert not pipeline.has_mismatches
    # rank 2 asks for a 16-value call: its packet 0 looks the same but for `call`
    assert pipeline.receive_datagram(contribution(2 * ones, call=16), ADDRS[2]) == []
    assert pipeline.has_mismatches
    # a second disagreement in the same job is dropped, not recorded again
    pipeline.receive_datagram(contribution(ones, call=8 | wire.CALL_SPARSE), ADDRS[1])
    [(job, m)] = pipeline.take_mismatches()
    assert job.name == "j"
    assert m == Mismatch(ranks=(0,), first=(7, 8, wire.DTYPE_INT32), rank=2,
                         other=(7, 16, wire.DTYPE_INT32))
    assert not pipeline.has_mismatches and pipeline.take_mismatches() == []
    assert pipeline.jobs[SESSION].counters["dropped_mismatch"] == 2
    # nothing of the disagreeing packets was added: the agreeing ones complete the sum
    pipeline.receive_datagram(contribution(ones, call=8), ADDRS[1])
    [(result, _), *_] = pipeline.receive_datagram(contribution(ones, call=8), ADDRS[2])
    assert wire.values(result, 1, 8).tolist() == [3] * 8
    assert wire.decode_header(result).call == 8  # echoed in the result


@pytest.mark.parametrize("make", pipelines, ids=lambda c: c.__name__)
def test_agreeing_ranks_record_nothing(make):
    pipeline = make(slots=4, packet_elements=8)
    pipeline.install_job("j", SESSION, ADDRS, 0, 2)
    for addr in ADDRS:
        pipeline.receive_datagram(contribution(np.ones(8, np.int32), call=8), addr)
    assert not pipeline.has_mismatches and pipeline.take_mismatches() == []


def _disagree(address, calls, sparse=(False, False)):
    """Two ranks: rank r calls allreduce(calls[r]); each returns (error, seconds)."""

    def body(rank):
        with switchml.Worker(address, rank, 2, timeout=TIMEOUT) as w:
            w.allreduce(np.ones(10, np.float32))  # one call they agree on first
            start = time.monotonic()
            with pytest.raises(switchml.CallMismatchError) as info:
                w.allreduce(calls[rank], sparse=sparse[rank])
            elapsed = time.monotonic() - start
            with pytest.raises(switchml.SwitchMLError):  # the job failed: no more calls
                w.allreduce(np.ones(10, np.float32))
            return info.value, elapsed

    return run_ranks(2, body)


@pytest.mark.parametrize("fastpath", [False, True] if len(pipelines) == 2 else [False])
def test_different_element_counts_are_named_on_every_rank(fastpath):
    with switchml.Switch(packet_elements=1024, slots=64, slots_per_job=16,
                         fastpath=fastpath) as sw:
        results = _disagree(sw.address, [np.ones(1000, np.float32), np.ones(2000, np.float32)])
        assert sw.stats()["counters"]["jobs_failed"] == 1
        assert sw.stats()["free_slots"] == 64  # the switch freed the job's slots
    for error, elapsed in results:
        assert elapsed < 2.0
        text = str(error)
        assert "1000 float32 values, dense" in text and "2000 float32 values, dense" in text
        assert "rank 0" in text and "rank 1" in text


def test_different_dtypes_are_named(switch):
    results = _disagree(switch.address, [np.ones(500, np.float32), np.ones(500, np.int32)])
    for error, elapsed in results:
        assert elapsed < 2.0
        assert "500 float32 values" in str(error) and "500 int32 values" in str(error)


def test_sparse_against_dense_is_named(switch):
    x = np.zeros(4096, np.float32)
    x[:300] = 1
    results = _disagree(switch.address, [x, x], sparse=(True, False))
    for error, elapsed in results:
        assert elapsed < 2.0
        assert "4096 float32 values, sparse" in str(error)
        assert "4096 float32 values, dense" in str(error)


def test_same_call_different_values_is_no_mismatch(switch):
    """Only what a call is matters, not the values: a long job of agreeing calls."""

    def body(rank):
        with switchml.Worker(switch.address, rank, 2, timeout=TIMEOUT) as w:
            for size in (1, 1000, 70_000, 3):
                out = w.allreduce(np.full(size, rank + 1, np.int32))
                assert (out == 3).all()

    run_ranks(2, body)
    assert switch.stats()["counters"].get("jobs_mismatched", 0) == 0
