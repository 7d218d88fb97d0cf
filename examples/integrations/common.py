"""What the integration examples share: a tiny model, fixed data, and a report.

Each example trains the same model on the same data for a few steps, so a run on
switchml and a run on gloo can be compared weight for weight.
"""

import argparse
import json
import os

import torch
import torch.distributed as dist

STEPS = 8
BATCH = 16


def model() -> torch.nn.Module:
    """The same initial weights in every process and every run."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(20, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def dataset() -> torch.utils.data.TensorDataset:
    """Fixed random samples: every rank sees its share through a DistributedSampler."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(STEPS * BATCH * 4, 20, generator=gen)
    y = torch.randint(0, 4, (len(x),), generator=gen)
    return torch.utils.data.TensorDataset(x, y)


def arguments(doc: str) -> argparse.ArgumentParser:
    """An example's command line: its docstring's first line, and --json."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--json", help="write each rank's weights to JSON.rank<N>")
    return parser


def sharded_loader() -> torch.utils.data.DataLoader:
    """This rank's share of ``dataset()``, in order (torch.distributed must be up)."""
    data = dataset()
    sampler = torch.utils.data.DistributedSampler(data, shuffle=False)
    return torch.utils.data.DataLoader(data, batch_size=BATCH, sampler=sampler)


def leave() -> None:
    """End the process group together: a rank that tears gloo down while its peer
    is still in a collective can abort that peer.  Drop a DDP model first: its
    reducer holds the group, and a gloo group whose last holder is the reducer
    ends in the reducer's teardown, which holds the GIL while it waits for
    gloo's threads, one of which may need it to free a tensor (a hang at exit)."""
    dist.barrier()
    dist.destroy_process_group()


def switch_results(state=None) -> int:
    """Results switchml gave this process: from the switch, or summed on its host by
    the local stage (ranks that share a host); > 0 when it carried gradients."""
    worker = getattr(state, "worker", None)
    if worker is None and dist.is_initialized():
        worker = getattr(dist.distributed_c10d._get_default_group(), "_worker", None)
    if worker is None:
        return 0
    counters = worker.counters
    return counters.get("results_in", 0) + counters.get("local_calls", 0)


def report(path: str | None, rank: int, params, **extra) -> None:
    """Write this rank's weights and figures to ``path``.rank<N> as JSON."""
    if path is None:
        return
    flat = torch.cat([p.detach().reshape(-1) for p in params]).tolist()
    with open(f"{path}.rank{rank}", "w") as f:
        json.dump({"params": flat, "rank": rank, "pid": os.getpid(), **extra}, f)
