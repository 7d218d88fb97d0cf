"""One rank of tests/test_fresh_memory.py: the minor page faults (``getrusage``) a
steady-state allreduce takes, per call, for each kind of tensor its arguments name.

    fresh_pages_job.py torch DEVICE MIB KIND,...   dist.all_reduce on the backend
    fresh_pages_job.py worker ADDRESS MIB KIND,... switchml.Worker(...).allreduce(out=)
"""

import json
import os
import resource
import sys

import numpy as np

CALLS = 2

try:  # numpy asks for huge pages for its large arrays, which fault once per 2 MiB:
    # without, a fresh array takes a fault for each of its pages, and counting shows it
    from numpy._core.multiarray import _set_madvise_hugepage
except ImportError:  # numpy < 2
    from numpy.core.multiarray import _set_madvise_hugepage
_set_madvise_hugepage(False)


def faults_per_call(call) -> float:
    for _ in range(2):  # the first calls make the buffers a steady state reuses
        call()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(CALLS):
        call()
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / CALLS


def torch_tensor(kind: str, n: int, device: str, values):
    """A tensor of ``kind`` made from ``values`` (2n of them, not changed)."""
    import torch
    gen = torch.Generator().manual_seed(int(os.environ["RANK"]))
    tensor = {"float32": values[:n].clone(), "float16": values[:n].half(),
              "bfloat16": values[:n].bfloat16(), "strided": values.clone()[::2],
              "int32": (values[:n] * 100).int()}.get(kind)
    if kind == "sparse":
        tensor = values[:n].clone()
        tensor.view(-1, 256)[torch.rand(n // 256, generator=gen) < 0.9] = 0
    if device == "cuda":
        tensor = tensor.cuda() if kind != "strided" else values.cuda()[::2]
    return tensor


def on_torch(device: str, n: int, kinds: list) -> dict:
    import torch
    import torch.distributed as dist

    import switchml.torch  # noqa: F401  registers the backend
    dist.init_process_group("switchml")
    found = {}
    # (drawn once: 20M normal values a kind were most of a rank's CPU)
    values = torch.randn(2 * n, generator=torch.Generator().manual_seed(dist.get_rank()))
    for kind in kinds:
        tensor = torch_tensor(kind, n, device, values)

        def call(tensor=tensor):
            dist.all_reduce(tensor)
            if device == "cuda":
                torch.cuda.synchronize()
        found[kind] = faults_per_call(call)
    found["worker"] = type(dist.distributed_c10d._get_default_group()._worker).__name__
    dist.barrier()
    dist.destroy_process_group()
    return found


def on_worker(address: str, n: int, kinds: list) -> dict:
    import switchml
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    rng = np.random.default_rng(rank)
    found = {}
    drawn = rng.standard_normal(n, dtype=np.float32)  # once: a copy a kind
    with switchml.Worker(address, rank, world, job="fresh-pages", timeout=30) as w:
        for kind in kinds:
            values = drawn.copy()
            sparse = kind == "sparse"
            if sparse:
                values.reshape(-1, 256)[rng.random(n // 256) < 0.9] = 0
            array = {"float16": values.astype(np.float16),
                     "int32": (values * 100).astype(np.int32)}.get(kind, values)
            out = np.empty_like(array)
            found[kind] = faults_per_call(
                lambda array=array, out=out, sparse=sparse: w.allreduce(array, out=out,
                                                                        sparse=sparse))
        found["worker"] = type(w).__name__
    return found


def main():
    where, target, mib, kinds = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4]
    n = int(mib * 2**20) // 4
    run = on_torch if where == "torch" else on_worker
    print("RESULT " + json.dumps(run(target, n, kinds.split(","))), flush=True)
    os._exit(0)  # past torch's teardown, which now and then aborts (see torch_cases.py)


if __name__ == "__main__":
    main()
