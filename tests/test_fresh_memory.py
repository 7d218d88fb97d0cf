"""A steady state of allreduces touches no fresh memory: every buffer the size of a
tensor is made once and reused (``switchml.buffers``), on the local stage and on the
switch path, for the backend's every kind of CPU tensor and the Worker's calls.

A first touch of a page costs a fault and a zeroing, several times a copy of it:
a call that allocated its staging anew would take one minor fault per page of its
tensor (10,240 for 40 MiB), which ``getrusage`` counts (tests/fresh_pages_job.py).
"""

import os

import pytest

import switchml
from switchml.buffers import POOLED_BYTES, BufferPool

torch = pytest.importorskip("torch", reason="the torch extra is not installed")

from test_torch import launch  # noqa: E402  (after the skip: it imports torch's extras)

JOB = os.path.join(os.path.dirname(__file__), "fresh_pages_job.py")
MIB = 40  # past glibc's largest mmap threshold (32 MiB): freed blocks go back to the kernel
PAGES = MIB * 2**20 // 4096
#: Faults a call may take: a few pages of Python objects and stacks, far below one
#: page in twenty of its tensor.
ALLOWED = PAGES // 20
TORCH_KINDS = "float32,float16,bfloat16,strided,int32,sparse"


def assert_no_fresh_pages(results, worker_kind):
    for found in results:
        assert found.pop("worker") == worker_kind
        fresh = {kind: faults for kind, faults in found.items() if faults > ALLOWED}
        assert not fresh, f"minor faults per call (a {PAGES}-page tensor): {found}"


@pytest.mark.parametrize("local_stage", ["1", "0"], ids=["local-stage", "switch"])
def test_backend_calls_of_every_cpu_tensor_kind_take_no_fresh_pages(local_stage):
    # (fresh interpreters: a rank forked from one that imported torch would count the
    # copies of the pages it shares with it as its own)
    results = launch(2, "torch", "cpu", MIB, TORCH_KINDS, job=JOB, fresh=True,
                     timeout=180, env={"SWITCHML_LOCAL_STAGE": local_stage, "OMP_NUM_THREADS": "1"})
    assert_no_fresh_pages(results, "LocalStageWorker" if local_stage == "1" else "Worker")


@pytest.mark.parametrize("local_stage, threads", [("1", "1"), ("0", "1"), ("0", "2")],
                         ids=["local-stage", "switch", "switch-two-threads"])
def test_worker_calls_with_an_output_take_no_fresh_pages(local_stage, threads):
    with switchml.Switch("127.0.0.1", 0) as switch:
        host, port = switch.address
        results = launch(2, "worker", f"{host}:{port}", MIB, "float32,float16,int32,sparse",
                         job=JOB, fresh=True, timeout=180,
                         env={"SWITCHML_LOCAL_STAGE": local_stage,
                              "SWITCHML_WORKER_THREADS": threads})
    assert_no_fresh_pages(results, "LocalStageWorker" if local_stage == "1" else
                          "Worker" if threads == "1" else "MultiSwitchWorker")


def test_the_pool_hands_back_what_fits_and_keeps_the_largest():
    pool = BufferPool(keep=2)
    a = pool.take(POOLED_BYTES * 4)
    pool.give(a)
    assert pool.take(POOLED_BYTES * 3) is a  # fits, within twice the size asked
    pool.give(a)
    assert pool.take(POOLED_BYTES) is not a  # a small call does not hold a large one
    assert pool.take(POOLED_BYTES * 5) is not a  # too small
    small = [pool.take(POOLED_BYTES) for _ in range(2)]
    for buffer in small + [a]:
        pool.give(buffer)
    assert pool.take(POOLED_BYTES * 4) is a  # the smallest went when three were given
    assert pool.allocations == 5
    tiny = pool.take(100)
    pool.give(tiny)
    assert pool.take(100) is not tiny  # the allocator's own lists serve small ones
