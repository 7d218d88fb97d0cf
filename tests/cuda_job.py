"""One rank of a job on CUDA tensors, for tests/test_torch_cuda.py (RANK etc. from env).

Every rank uses the GPU ``LOCAL_RANK`` mod the GPUs (all of them the one GPU of a
single-GPU machine).  Each check returns what the test compares; the reference for a
CUDA result is the same call on the same values as CPU tensors, whose path the CPU
tests compare with gloo.
"""

import json
import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist

import switchml.torch  # noqa: F401  registers the "switchml" backend
from switchml.torch import staging as staging_module
from switchml.torch.staging import CudaStaging

#: Segments that moved to the host one at a time (straight to the shared memory
#: or through the pipelined host copy).
DIRECT = {"segments": 0}


def _counted(method):
    def counted(self, *args):
        DIRECT["segments"] += 1
        return method(self, *args)
    return counted


staging_module.SegmentCopies.into_host = _counted(  # type: ignore[method-assign]
    staging_module.SegmentCopies.into_host)
staging_module.PipelinedCopies.arrive = _counted(  # type: ignore[method-assign]
    staging_module.PipelinedCopies.arrive)

#: GPU cycles a busy kernel spins (torch.cuda._sleep): about half a second or more.
BUSY_CYCLES = 1_000_000_000


def rank_values(shape, dtype, rank: int) -> torch.Tensor:
    """This rank's inputs: different on every rank, exact in every switched dtype."""
    gen = torch.Generator().manual_seed(10 + rank)
    if dtype == torch.int32:
        return torch.randint(-1000, 1000, shape, generator=gen, dtype=torch.int32)
    return (torch.randn(shape, generator=gen) * 4).to(dtype)


def same_on_cpu_and_cuda(device) -> dict:
    """dtypes x ops x layouts: the CUDA result is bit for bit the CPU one."""
    rank = dist.get_rank()
    out = {}
    cases = [("f32", (1000,), torch.float32), ("i32", (777,), torch.int32),
             ("f16", (3000,), torch.float16), ("bf16", (3000,), torch.bfloat16),
             ("scalar", (), torch.float32), ("big", (3_000_000,), torch.float32)]
    for name, shape, dtype in cases:
        for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            host = rank_values(shape, dtype, rank)
            gpu = host.to(device)
            dist.all_reduce(host, op=op)
            dist.all_reduce(gpu, op=op)
            out[f"{name}-{op}"] = torch.equal(gpu.cpu(), host)
    # a strided view (the transpose of a matrix) and a mostly-zero tensor (sparse path)
    base = rank_values((300, 200), torch.float32, rank)
    host, gpu = base.t(), base.to(device).t()
    assert not gpu.is_contiguous()
    dist.all_reduce(host)
    dist.all_reduce(gpu)
    out["strided"] = torch.equal(gpu.cpu(), host)
    host = torch.zeros(2_000_000)
    host[rank * 1000:(rank + 1) * 1000] = rank_values((1000,), torch.float32, rank)
    gpu = host.to(device)
    dist.all_reduce(host)
    dist.all_reduce(gpu)
    out["sparse"] = torch.equal(gpu.cpu(), host)
    return out


def stream_order(device) -> dict:
    """The call waits for the kernels that make its tensor, on the caller's stream, without
    blocking the thread; its Work completes on that stream."""
    rank, size = dist.get_rank(), dist.get_world_size()
    stream = torch.cuda.Stream(device)
    out = {}
    with torch.cuda.stream(stream):
        t = torch.zeros(8_000_000, device=device)
        torch.cuda._sleep(BUSY_CYCLES)  # the tensor's values come after a long kernel
        t.fill_(rank + 1.0)
        made = torch.cuda.Event()
        made.record(stream)
        work = dist.all_reduce(t, async_op=True)
        # the call returned while the stream was still busy: it did not synchronise
        out["returned_before_the_kernel_ended"] = not made.query()
        work.wait()
        # enqueued on the same stream right after wait(): sees the sum, not a stale copy
        first, total = t[0].clone(), t.sum(dtype=torch.float64)
    stream.synchronize()
    expected = size * (size + 1) / 2
    out["sum_after_the_kernel"] = first.item() == expected
    out["whole_tensor"] = total.item() == expected * t.numel()
    # the future a DDP hook chains on carries the stream too
    with torch.cuda.stream(stream):
        t = torch.full((4_000_000,), float(rank + 1), device=device)
        fut = dist.all_reduce(t, async_op=True).get_future()
        value = fut.wait()[0]
        copy = value.clone()
    stream.synchronize()
    out["future_value"] = bool((copy == expected).all().item())
    return out


def staging_facts(device) -> dict:
    """The host copy is pinned and made on a stream of its own."""
    t = torch.ones(1000, device=device)
    staging = CudaStaging(t)
    staging.ready()
    return {"pinned": staging.host.is_pinned(),
            "side_stream": staging.stream != torch.cuda.current_stream(device),
            "copied": bool((staging.host == 1).all().item())}


def killed_mid_call(device) -> dict:
    """Rank 1 is SIGKILLed while big calls run (in the middle of one, with many
    segments each): the others' call fails, naming it, within seconds."""
    t = torch.ones(16_000_000, device=device)  # 64 MiB
    for _ in range(2):
        dist.all_reduce(t)
    if dist.get_rank() == 1:
        threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGKILL)).start()
    began = time.monotonic()
    try:
        for _ in range(500):
            dist.all_reduce(t)
            torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001 - what the test reads
        return {"error": str(exc), "seconds": time.monotonic() - began,
                "direct_segments": DIRECT["segments"]}
    return {"error": None, "seconds": time.monotonic() - began}


def ddp(device, backend: str, hook_bits=None) -> dict:
    """A few DDP steps of a CUDA model: its parameters after them."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(20, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 4)).to(device)
    model_ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index])
    state = None
    if hook_bits is not None:
        state = switchml.torch.HookState(bits=hook_bits)
        model_ddp.register_comm_hook(state, switchml.torch.allreduce_hook)
    opt = torch.optim.SGD(model_ddp.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(100 + dist.get_rank())
    for _ in range(10):
        x = torch.randn(16, 20, generator=gen).to(device)
        y = torch.randint(0, 4, (16,), generator=gen).to(device)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model_ddp(x), y).backward()
        opt.step()
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu()
    if state is not None:
        state.close()
    return {"params": params.tolist()}


def main():
    scenario = sys.argv[1]
    backend = sys.argv[2]
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
    torch.cuda.set_device(device)
    dist.init_process_group(backend)
    if scenario == "kill":
        print("RESULT " + json.dumps(killed_mid_call(device)), flush=True)
        os._exit(0)  # no barrier: a rank is gone
    if scenario == "calls":
        result = {**same_on_cpu_and_cuda(device), **stream_order(device),
                  **staging_facts(device)}
        result["direct_segments"] = DIRECT["segments"]
    elif scenario == "ddp":
        result = ddp(device, backend)
    elif scenario == "hook":
        result = ddp(device, backend, hook_bits=int(sys.argv[3]))
    else:
        raise SystemExit(f"unknown scenario {scenario}")
    dist.barrier()
    dist.destroy_process_group()
    print("RESULT " + json.dumps(result), flush=True)
    os._exit(0)  # past torch's teardown, which now and then aborts (see torch_cases.py)


if __name__ == "__main__":
    main()
