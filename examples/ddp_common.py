"""What both DDP examples share: arguments, process group set-up, the training loop.

Launched by torchrun, one process per rank.  The backend is the only difference
between runs: ``--backend switchml`` (allreduce through the switch), ``--backend
gloo``, or ``--backend gloo --hook`` (a gloo group whose DDP gradients go through
``switchml.torch.allreduce_hook``).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def parser(description: str, *, epochs: int, batch_size: int, lr: float) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--backend", choices=["switchml", "gloo"], default="switchml")
    p.add_argument("--hook", action="store_true",
                   help="keep the gloo group; send DDP's gradients through "
                        "switchml.torch.allreduce_hook")
    p.add_argument("--sparse", choices=["auto", "true", "false"], default=None,
                   help="switchml path for gradients (default: $SWITCHML_SPARSE or auto)")
    p.add_argument("--bits", type=int, choices=[32, 16], default=None,
                   help="switchml wire for gradients: 32, or 16 (half the bytes; "
                        "default: $SWITCHML_WIRE_BITS or 32)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="where the model trains (cuda: the GPU LOCAL_RANK mod the GPUs; "
                        "switchml stages its gradients through pinned host memory)")
    p.add_argument("--epochs", type=int, default=epochs)
    p.add_argument("--batch-size", type=int, default=batch_size, help="per rank")
    p.add_argument("--lr", type=float, default=lr)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="rank 0 writes its summary here")
    p.add_argument("--quiet", action="store_true", help="only the summary line")
    p.add_argument("--timeline", default=None, metavar="PREFIX",
                   help="each rank writes where its steps' time goes (forward, backward, "
                        "optimizer, each bucket's allreduce call and end) to "
                        "PREFIX.<backend>.rank<N>.json")
    return p


def init(args) -> None:
    """Join the torchrun job on the chosen backend (env:// rendezvous)."""
    if args.sparse is not None:
        os.environ["SWITCHML_SPARSE"] = args.sparse
    if args.bits is not None:
        os.environ["SWITCHML_WIRE_BITS"] = str(args.bits)
    if args.backend == "switchml" or args.hook:
        import switchml.torch  # noqa: F401  registers the "switchml" backend
    if args.hook and args.backend != "gloo":
        raise SystemExit("--hook goes with --backend gloo (the hook replaces gloo's allreduce)")
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    dist.init_process_group(args.backend)


def device(args) -> torch.device:
    """The device this rank trains on (its GPU once ``init`` chose it)."""
    return torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" \
        else torch.device("cpu")


#: This rank's (event, bucket index, elements, time) in training, for --timeline.
TIMELINE: list = []


def mark(event: str, bucket: int = -1, elements: int = 0) -> None:
    TIMELINE.append((event, bucket, elements, time.perf_counter()))


def timed(hook, durations: list):
    """A DDP comm hook that runs ``hook`` and records how long each bucket's allreduce took."""

    def run(state, bucket):
        start = time.perf_counter()
        index = bucket.index()
        mark("call", index, bucket.buffer().numel())

        def stop(fut):
            durations.append(time.perf_counter() - start)
            mark("done", index)
            return fut.value()

        return hook(state, bucket).then(stop)

    return run


def wrap(model: torch.nn.Module, args, durations: list):
    """DDP over ``model`` (moved to the rank's device), every bucket's allreduce timed
    (and the switchml hook if asked)."""
    where = device(args)
    model.to(where)
    ddp = DDP(model, device_ids=[where.index] if where.type == "cuda" else None)
    if args.hook:
        import switchml.torch

        state = switchml.torch.HookState(sparse=_sparse_setting(args))
        ddp.register_comm_hook(state, timed(switchml.torch.allreduce_hook, durations))
    else:
        state = None
        # the same division and SUM that DDP's built-in allreduce does, timed
        ddp.register_comm_hook(None, timed(default_hooks.allreduce_hook, durations))
    return ddp, state


def _sparse_setting(args):
    value = (args.sparse or os.environ.get("SWITCHML_SPARSE", "auto")).lower()
    return "auto" if value == "auto" else value in ("true", "1", "yes")


def loader(dataset: TensorDataset, args) -> DataLoader:
    sampler = DistributedSampler(dataset, shuffle=True, seed=args.seed, drop_last=True)
    return DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True)


def train(model, ddp, state, opt, data: DataLoader, test: tuple, args, durations: list,
          loss_fn) -> dict:
    """The epochs: train, evaluate on the whole test set, and report on rank 0."""
    rank, world = dist.get_rank(), dist.get_world_size()
    samples = steps = 0
    train_time = 0.0
    where = device(args)
    test = tuple(t.to(where) for t in test)
    history = []
    for epoch in range(args.epochs):
        data.sampler.set_epoch(epoch)
        ddp.train()
        loss_sum = torch.zeros(2, dtype=torch.float64)
        start = time.perf_counter()
        for x, y in data:
            mark("step")
            x, y = x.to(where, non_blocking=True), y.to(where, non_blocking=True)
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(ddp(x), y)
            mark("forward")
            loss.backward()
            mark("backward")
            opt.step()
            mark("optimizer")
            loss_sum += torch.tensor([loss.item() * len(y), len(y)], dtype=torch.float64)
            steps += 1
            samples += len(y) * world
        train_time += time.perf_counter() - start
        dist.all_reduce(loss_sum)  # float64: exact, and delegated to gloo by switchml
        accuracy = evaluate(model, *test)
        history.append({"epoch": epoch + 1, "loss": (loss_sum[0] / loss_sum[1]).item(),
                        "test_accuracy": accuracy})
        if rank == 0 and not args.quiet:
            print(f"epoch {epoch + 1:3d}  loss {history[-1]['loss']:.4f}  "
                  f"test accuracy {100 * accuracy:.2f}%", flush=True)
    if args.timeline:
        origin = TIMELINE[0][3] if TIMELINE else 0.0
        kind = args.backend + ("-hook" if args.hook else "")
        with open(f"{args.timeline}.{kind}.rank{rank}.json", "w") as f:
            json.dump({"rank": rank, "backend": args.backend, "events": [
                [event, bucket, elements, t - origin] for event, bucket, elements, t in TIMELINE]},
                f)
    identical = replicas_identical(model)
    compute_s = compute_time(ddp, data, loss_fn, where)
    counters = switchml_counters(state)
    summary = {
        "switchml_mb_sent_per_step": counters.get("bytes_sent", 0) / 1e6 / max(steps, 1),
        "switchml_mb_received_per_step": counters.get("bytes_received", 0) / 1e6 / max(steps, 1),
        "switchml_sparse_blocks_sent": counters.get("sparse_blocks_sent", 0),
        "switchml_local_calls": counters.get("local_calls", 0),
        "backend": args.backend + ("+switchml-hook" if args.hook else ""),
        "wire_bits": (args.bits or int(os.environ.get("SWITCHML_WIRE_BITS", 32))
                      if (args.backend == "switchml" or args.hook) else None),
        "sparse": _sparse_setting(args) if (args.backend == "switchml" or args.hook) else None,
        "device": args.device, "workers": world, "epochs": args.epochs,
        "batch_size_per_rank": args.batch_size,
        "steps": steps, "samples_per_s": samples / train_time if train_time else 0.0,
        "allreduce_ms_per_step": 1e3 * sum(durations) / steps if steps else 0.0,
        "step_ms": 1e3 * train_time / steps if steps else 0.0,
        "compute_ms_per_step": 1e3 * compute_s,
        "train_s": train_time, "loss": history[-1]["loss"] if history else None,
        "test_accuracy": history[-1]["test_accuracy"] if history else None,
        "history": history, "replicas_identical": identical,
        "switchml_failover": failover_counters(state),
    }
    if rank == 0:
        print(f"backend {summary['backend']}  workers {world}  epochs {args.epochs}  "
              f"test accuracy {100 * summary['test_accuracy']:.2f}%  "
              f"samples/s {summary['samples_per_s']:.0f}  "
              f"allreduce {summary['allreduce_ms_per_step']:.2f} ms/step", flush=True)
        if counters:
            local = (f"; {summary['switchml_local_calls']} calls combined on the host first"
                     if summary["switchml_local_calls"] else "")
            print(f"switchml per step and worker: {summary['switchml_mb_sent_per_step']:.2f} MB "
                  f"sent, {summary['switchml_mb_received_per_step']:.2f} MB received{local}",
                  flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(summary, f, indent=2)
    return summary


def compute_time(ddp, data: DataLoader, loss_fn, where: torch.device, steps: int = 20) -> float:
    """Seconds a step's forward and backward take without communication (median).

    Under ``no_sync`` DDP skips the allreduce; no optimizer step, so the trained
    weights are left as they are.  With the step time it gives the share of a
    step that communication costs.
    """
    times = []
    ddp.train()
    with ddp.no_sync():
        for i, (x, y) in enumerate(data):
            if i == steps:
                break
            x, y = x.to(where), y.to(where)
            start = time.perf_counter()
            loss_fn(ddp(x), y).backward()
            if where.type == "cuda":
                torch.cuda.synchronize(where)
            times.append(time.perf_counter() - start)
    ddp.zero_grad(set_to_none=True)
    times.sort()
    return times[len(times) // 2] if times else 0.0


def switchml_counters(state) -> dict:
    """This rank's switchml worker counters (empty on plain gloo)."""
    worker = state.worker if state is not None else getattr(
        dist.distributed_c10d._get_default_group(), "_worker", None)
    return dict(worker.counters) if worker is not None else {}


def failover_counters(state) -> dict:
    """This rank's group's (or hook's) calls on gloo, times it left the switch and
    came back (empty on plain gloo)."""
    counters = state.counters if state is not None else getattr(
        dist.distributed_c10d._get_default_group(), "counters", {})
    return {k: v for k, v in counters.items()
            if k in ("fallbacks", "returns", "calls_on_gloo", "calls_settled")}


@torch.no_grad()
def replicas_identical(model) -> bool:
    """Whether every rank's weights are bit for bit rank 0's."""
    mine = torch.cat([p.detach().reshape(-1).cpu() for p in model.parameters()])
    theirs = mine.clone()
    dist.broadcast(theirs, 0)
    same = torch.tensor([int(torch.equal(mine.view(torch.int32), theirs.view(torch.int32)))])
    dist.all_reduce(same, op=dist.ReduceOp.MIN)
    return bool(same.item())


@torch.no_grad()
def evaluate(model, x, y) -> float:
    model.eval()
    return (model(x).argmax(dim=1) == y).float().mean().item()


def finish(state) -> None:
    """Leave together and end the group.  Drop the DDP model first: its reducer
    holds the group, and a gloo group whose last holder is the reducer ends in
    the reducer's teardown, which holds the GIL while it waits for gloo's
    threads, one of which may need it to free a tensor (a hang at exit)."""
    if state is not None:
        state.close()
    dist.barrier()  # the TCPStore lives on rank 0: leave together
    dist.destroy_process_group()
