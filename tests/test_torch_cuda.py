"""The backend and the DDP hook on CUDA tensors: real processes on the machine's GPU,
a real switch.  Skipped where torch sees no CUDA device (CI); run on a GPU machine
with ``pytest tests/test_torch_cuda.py``."""

import json
import os
import signal

import pytest

torch = pytest.importorskip("torch", reason="the torch extra is not installed")

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="no CUDA device on this machine")

from test_torch import launch, start  # noqa: E402  (after the skip: it imports torch's extras)

JOB = os.path.join(os.path.dirname(__file__), "cuda_job.py")
# Each rank a fresh interpreter (fresh=True), as a user's are: a process forked after
# torch was imported would share CUDA's state of its parent with it where any was made.


def test_cuda_calls_equal_the_cpu_path_wait_for_their_stream_and_complete_on_it():
    for out in launch(3, "calls", "switchml", job=JOB, fresh=True, timeout=300):
        assert out.pop("direct_segments") == 0  # each rank sends its own: a host copy
        failed = sorted(name for name, ok in out.items() if ok is not True)
        assert not failed, out


@pytest.mark.parametrize("copies", ["direct", "pipelined"])
def test_cuda_calls_through_the_local_stage_move_a_segment_at_a_time(copies):
    """Ranks of one host combining in shared memory: contiguous CUDA tensors move
    segment by segment (small segments: many a call), by DMA straight between the
    GPU and the shared memory or through the pipelined host copy, 16-bit ones
    widened and rounded back on the GPU, AVG divided there; every result is the
    CPU path's, bit for bit, and the stream semantics are the same."""
    for out in launch(3, "calls", "switchml", job=JOB, fresh=True, timeout=300,
                      env={"SWITCHML_LOCAL_STAGE": "1", "SWITCHML_CUDA_COPIES": copies,
                           "SWITCHML_LOCAL_SEGMENT": str(256 * 1024)}):
        assert out.pop("direct_segments") > 100
        failed = sorted(name for name, ok in out.items() if ok is not True)
        assert not failed, out


@pytest.mark.parametrize("copies", ["direct", "pipelined"])
def test_a_rank_killed_mid_copy_is_named_on_the_others_and_leaves_nothing(copies):
    shm = {n for n in os.listdir("/dev/shm") if n.startswith("switchml-")}
    procs = start(3, "kill", "switchml", job=JOB, fresh=True,
                  env={"SWITCHML_LOCAL_STAGE": "1", "SWITCHML_CUDA_COPIES": copies})
    try:
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert procs[1].returncode == -signal.SIGKILL, outs[1][1][-2000:]
    for rank in (0, 2):
        assert procs[rank].returncode == 0, outs[rank][1][-3000:]
        lines = [line for line in outs[rank][0].splitlines() if line.startswith("RESULT ")]
        result = json.loads(lines[-1][len("RESULT "):])
        assert result["direct_segments"] > 0
        assert result["error"] and "rank 1" in result["error"], result
        assert result["seconds"] < 10, result
    assert {n for n in os.listdir("/dev/shm") if n.startswith("switchml-")} <= shm


def test_ddp_on_cuda_matches_gloo_on_cuda():
    ours = launch(3, "ddp", "switchml", job=JOB, fresh=True, timeout=300)
    theirs = launch(3, "ddp", "gloo", job=JOB, fresh=True, timeout=300)
    a = torch.tensor(ours[0]["params"])
    for r in ours[1:]:
        assert torch.equal(torch.tensor(r["params"]), a)  # replicas stay identical
    assert torch.allclose(a, torch.tensor(theirs[0]["params"]), atol=1e-4)


@pytest.mark.parametrize("bits", [32, 16])
def test_the_ddp_hook_on_cuda_buckets_trains_like_gloo(bits):
    ours = launch(3, "hook", "gloo", bits, job=JOB, fresh=True, timeout=300)
    theirs = launch(3, "ddp", "gloo", job=JOB, fresh=True, timeout=300)
    a = torch.tensor(ours[0]["params"])
    for r in ours[1:]:
        assert torch.equal(torch.tensor(r["params"]), a)
    assert torch.allclose(a, torch.tensor(theirs[0]["params"]), atol=1e-4 if bits == 32 else 1e-2)


def test_cuda_calls_take_no_fresh_pages():
    """Pinned staging made once and reused: a steady-state call of a CUDA tensor
    faults no fresh host page in (tests/test_fresh_memory.py on the CPU)."""
    from test_fresh_memory import ALLOWED, MIB
    from test_fresh_memory import JOB as PAGES_JOB
    for local_stage, copies in (("1", "direct"), ("1", "pipelined"), ("0", "whole")):
        for found in launch(2, "torch", "cuda", MIB, "float32,float16,bfloat16,strided",
                            job=PAGES_JOB, timeout=300,
                            env={"SWITCHML_LOCAL_STAGE": local_stage,
                                 "SWITCHML_CUDA_COPIES": copies}):
            found.pop("worker")
            assert max(found.values()) <= ALLOWED, (local_stage, copies, found)
