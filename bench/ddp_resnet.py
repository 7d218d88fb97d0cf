"""DDP on ResNet-18, switchml against gloo: samples/s, identical replicas, weights.

    python bench/ddp_resnet.py --device cuda --workers 2 4 --out ddp.json
    python bench/ddp_resnet.py --device cpu --workers 2 --batch 2 --image 32 --steps 2

For every worker count K, one ``torchrun --standalone --nproc-per-node K`` of this
file on gloo, then one on switchml (``switchml.torch``'s backend at its defaults: on
one host the local stage is the whole allreduce): DistributedDataParallel over
ResNet-18 (torchvision's ``resnet18`` where torchvision is installed, else this
file's ``ResNet18``, the same architecture: 11.7M parameters), the same initial
weights, SGD with momentum, ``--batch`` synthetic images of ``--image`` pixels a
side a rank (rank r's batches from seed r, on its device before the first step).
Rank r trains on the GPU ``LOCAL_RANK`` mod the GPUs (every rank of a one-GPU host
on cuda:0).

Each launch does ``--warmup`` steps, then ``--steps`` timed ones (a step ends when
its device is idle); a step's time is the slowest rank's, and samples/s is K x
batch over the median step.  "compute" is the median of a few steps' forward and
backward with DDP's communication off (``no_sync``), rank 0's;
``step_without_communication_ms`` the median of a few whole steps so (the
optimizer's included, the ranks started together, the slowest rank's): the
step an allreduce that took no time would give.  After the timed
steps every rank's parameters must be bit-identical (``replicas_identical``), and
switchml's are compared with gloo's (``max_weight_diff_vs_gloo``: the largest
absolute difference; the two backends sum in different orders).  ``--runs`` R
launches each configuration R times (the backends in turn) and keeps the run
of median samples/s.  ``--backends`` launches only those named; ``--set
SWITCHML_VAR=VALUE`` (repeatable) sets switchml's launches apart from its defaults
(the caller's own SWITCHML_* are not passed on), named in the results.
``--profile-dir DIR`` profiles three more steps of each configuration's first
launch (rank 0, torch's profiler, the GPU's kernels and copies too) into DIR:
profile-BACKEND-K.json (a Chrome trace) and profile-BACKEND-K-ops.txt.
Writes a table and ``--out`` (JSON, rewritten as each K ends).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BACKENDS = ("gloo", "switchml")


# ------------------------------------------------------------------ the model
def _resnet18_in_repo(num_classes: int = 1000):
    """ResNet-18 as torchvision builds it (BasicBlocks [2, 2, 2, 2], 11.7M
    parameters at 1000 classes), for machines without torchvision."""
    from torch import nn

    class BasicBlock(nn.Module):
        def __init__(self, inplanes: int, planes: int, stride: int = 1):
            super().__init__()
            self.conv1 = nn.Conv2d(inplanes, planes, 3, stride, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(planes)
            self.relu = nn.ReLU(inplace=True)
            self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(planes)
            self.downsample = (nn.Sequential(nn.Conv2d(inplanes, planes, 1, stride, bias=False),
                                             nn.BatchNorm2d(planes))
                               if stride != 1 or inplanes != planes else None)

        def forward(self, x):
            identity = x if self.downsample is None else self.downsample(x)
            out = self.relu(self.bn1(self.conv1(x)))
            return self.relu(self.bn2(self.conv2(out)) + identity)

    class ResNet18(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
            self.bn1 = nn.BatchNorm2d(64)
            self.relu = nn.ReLU(inplace=True)
            self.maxpool = nn.MaxPool2d(3, 2, 1)
            layers, inplanes = [], 64
            for planes, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
                layers.append(nn.Sequential(BasicBlock(inplanes, planes, stride),
                                            BasicBlock(planes, planes)))
                inplanes = planes
            self.layer1, self.layer2, self.layer3, self.layer4 = layers
            self.avgpool = nn.AdaptiveAvgPool2d(1)
            self.fc = nn.Linear(512, num_classes)
            for m in self.modules():
                if isinstance(m, nn.Conv2d):
                    nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

        def forward(self, x):
            x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
            x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
            return self.fc(self.avgpool(x).flatten(1))

    return ResNet18()


def resnet18():
    """(the model, its name): torchvision's where it is installed, else this file's."""
    try:
        import torchvision
    except ImportError:
        return _resnet18_in_repo(), "ResNet-18 (bench/ddp_resnet.py's, torchvision's architecture)"
    return (torchvision.models.resnet18(weights=None),
            f"torchvision {torchvision.__version__} resnet18")


# ------------------------------------------------------------------ one rank
def _settle(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile_steps(args, rank: int, world: int, device, step) -> None:
    """Three more steps, rank 0's under torch's profiler (the CPU, and the GPU's
    kernels and copies on each stream): ``args.profile``-BACKEND-K.json, a
    Chrome trace, and -ops.txt, the table of its busiest operations."""
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    dist.barrier()
    if rank != 0:
        for i in range(3):
            step(i)
        return
    with profile(activities=activities) as prof:
        for i in range(3):
            step(i)
    base = f"{args.profile}-{args.backend}-{world}"
    prof.export_chrome_trace(base + ".json")
    sort = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    with open(base + "-ops.txt", "w") as f:
        f.write(prof.key_averages().table(sort_by=sort, row_limit=30))


def rank_job(args) -> None:
    """One rank of a torchrun launch; rank 0 writes the summary and the weights."""
    import numpy as np
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if args.device == "cuda":
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if args.backend == "switchml":
        import switchml.torch  # noqa: F401  registers the "switchml" backend
    dist.init_process_group(args.backend)
    torch.manual_seed(0)  # the same initial weights in every launch (DDP broadcasts rank 0's)
    model, model_name = resnet18()
    model = model.to(device)
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    gen = torch.Generator().manual_seed(1000 + rank)
    batches = [(torch.randn(args.batch, 3, args.image, args.image, generator=gen).to(device),
                torch.randint(0, 1000, (args.batch,), generator=gen).to(device))
               for _ in range(2)]

    def step(i: int) -> float:
        x, y = batches[i % len(batches)]
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss_fn(ddp(x), y).backward()
        optimizer.step()
        _settle(device)
        return time.perf_counter() - start

    for i in range(args.warmup):
        step(i)
    dist.barrier()
    times = [step(i) for i in range(args.steps)]
    flat = torch.cat([p.detach().reshape(-1).float().cpu() for p in model.parameters()])
    digest = hashlib.sha256(flat.numpy().tobytes()).hexdigest()
    compute, alone = [], []
    with ddp.no_sync():  # no communication (the weights' digest is taken)
        for i in range(min(args.steps, 5)):  # forward and backward
            x, y = batches[i % len(batches)]
            start = time.perf_counter()
            loss_fn(ddp(x), y).backward()
            _settle(device)
            compute.append(time.perf_counter() - start)
        for i in range(min(args.steps, 5)):  # whole steps, the ranks started together
            dist.barrier()
            alone.append(step(i))
    if args.profile:
        profile_steps(args, rank, world, device, step)
    gathered: list = [None] * world
    dist.all_gather_object(gathered, {"times": times, "digest": digest, "alone": alone})
    counted = None  # what switchml's worker did (rank 0's): the gradients went through it
    if args.backend == "switchml":
        counters = dist.distributed_c10d._get_default_group()._worker.counters
        counted = {k: counters.get(k, 0) for k in ("local_calls", "results_in", "bytes_sent")}
    if rank == 0:
        per_step = [max(g["times"][i] for g in gathered) for i in range(args.steps)]
        step_s = statistics.median(per_step)
        np.save(args.params, flat.numpy())
        summary = {
            "backend": args.backend, "workers": world, "device": args.device,
            "device_name": (torch.cuda.get_device_name(device) if device.type == "cuda"
                            else platform.processor() or platform.machine()),
            "model": model_name, "parameters": int(flat.numel()), "batch": args.batch,
            "image": args.image, "warmup": args.warmup, "steps": args.steps,
            "step_s_all": per_step, "step_ms": 1e3 * step_s,
            "samples_per_s": world * args.batch / step_s,
            "compute_ms_per_step": 1e3 * statistics.median(compute),
            "step_without_communication_ms": 1e3 * statistics.median(
                max(g["alone"][i] for g in gathered) for i in range(len(alone))),
            "replicas_identical": len({g["digest"] for g in gathered}) == 1,
            "weights_sha256": digest, "switchml_counters_rank0": counted}
        with open(args.summary, "w") as f:
            json.dump(summary, f)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # past torch's teardown, which now and then aborts (tests/torch_cases.py)


# ------------------------------------------------------------------ the launcher
def _environment(settings: dict) -> dict:
    """The launch's: switchml at its defaults but for ``settings`` (no SWITCHML_* of
    the caller's), one intra-op thread a rank (the ranks share the host's cores),
    this tree importable."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWITCHML_")}
    env.update(settings)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    return env


def launch(backend: str, workers: int, args, prefix: str, profile: bool = False) -> dict:
    """One torchrun of ``workers`` ranks on ``backend``; rank 0's summary, the
    weights' file (``prefix``...) in ``params``."""
    summary = f"{prefix}{backend}-{workers}.json"
    params = f"{prefix}{backend}-{workers}.npy"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={workers}", os.path.abspath(__file__), "--rank-job",
           "--backend", backend, "--device", args.device, "--batch", str(args.batch),
           "--image", str(args.image), "--warmup", str(args.warmup), "--steps", str(args.steps),
           "--lr", str(args.lr), "--summary", summary, "--params", params]
    if profile and args.profile_dir:
        os.makedirs(args.profile_dir, exist_ok=True)
        cmd += ["--profile", os.path.join(os.path.abspath(args.profile_dir), "profile")]
    settings = dict(args.set) if backend == "switchml" else {}
    proc = subprocess.Popen(cmd, env=_environment(settings), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        _, err = proc.communicate(timeout=args.timeout)
    except BaseException as exc:  # too long, or interrupted: no rank left behind
        _, err = _stop(proc)
        if isinstance(exc, subprocess.TimeoutExpired):
            raise SystemExit(f"ddp_resnet: {backend} at K={workers} took over "
                             f"{args.timeout:g} s:\n{err[-3000:]}") from None
        raise
    if proc.returncode != 0 or not os.path.exists(summary):
        raise SystemExit(f"ddp_resnet: {shlex.join(cmd)} failed (exit {proc.returncode}):\n"
                         f"{err[-3000:]}")
    with open(summary) as f:
        return dict(json.load(f), params=params, settings=settings)


def _stop(proc: subprocess.Popen) -> tuple:
    """End a launch: SIGTERM first, which torchrun passes on to its ranks (they run
    in sessions of their own, which a SIGKILL of torchrun alone would leave
    behind), then SIGKILL."""
    proc.terminate()
    try:
        return proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.communicate()


def compare(ours: dict, gloo: dict) -> dict:
    """switchml's run against gloo's of the same K: speed and weights."""
    import numpy as np

    a, b = np.load(ours["params"]), np.load(gloo["params"])
    return {"speedup_over_gloo": ours["samples_per_s"] / gloo["samples_per_s"],
            "max_weight_diff_vs_gloo": float(np.max(np.abs(a.astype(np.float64) - b))),
            "max_abs_weight": float(np.max(np.abs(b)))}


def table(runs: list) -> str:
    lines = ["| K | backend | device | samples/s (runs) | step ms | compute ms | "
             "step without communication ms | vs gloo | replicas identical | "
             "max weight diff vs gloo |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        each = ", ".join(f"{x:.1f}" for x in r["samples_per_s_all"])
        ratio = f"{r['speedup_over_gloo']:.2f}x" if r.get("speedup_over_gloo") else "-"
        diff = (f"{r['max_weight_diff_vs_gloo']:.2e}" if r.get("max_weight_diff_vs_gloo")
                is not None else "-")
        backend = " ".join([r["backend"], *(f"{k}={v}" for k, v in r["settings"].items())])
        lines.append(f"| {r['workers']} | {backend} | {r['device']} | "
                     f"{r['samples_per_s']:.1f} ({each}) | {r['step_ms']:.1f} | "
                     f"{r['compute_ms_per_step']:.1f} | "
                     f"{r['step_without_communication_ms']:.1f} | {ratio} | "
                     f"{'yes' if r['replicas_identical'] else 'NO'} | {diff} |")
    return "\n".join(lines)


def _setting(text: str) -> tuple[str, str]:
    """``--set``'s VAR=VALUE, a switchml setting."""
    name, equals, value = text.partition("=")
    if not name.startswith("SWITCHML_") or not equals:
        raise argparse.ArgumentTypeError(f"{text!r}: give SWITCHML_VAR=VALUE")
    return name, value


def write(args, argv, runs: list) -> None:
    """``--out``'s JSON of the runs so far."""
    if not args.out:
        return
    result = {"command": "python bench/ddp_resnet.py " + shlex.join(argv or sys.argv[1:]),
              "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                          "python": platform.python_version()},
              "date": time.strftime("%Y-%m-%d %H:%M"), "runs": runs}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--workers", type=int, nargs="+", default=[2, 4], metavar="K",
                   help="ranks of this host (default: 2 4)")
    p.add_argument("--batch", type=int, default=32, help="images a rank a step (default 32)")
    p.add_argument("--image", type=int, default=224, help="pixels a side (default 224)")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps (default 5)")
    p.add_argument("--steps", type=int, default=20, help="timed steps (default 20)")
    p.add_argument("--runs", type=int, default=1,
                   help="launches of each configuration; the median's kept (default 1)")
    p.add_argument("--lr", type=float, default=0.01, help=argparse.SUPPRESS)
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds one launch may take (default 300)")
    p.add_argument("--out", default=None, help="JSON file (default: none)")
    p.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS),
                   help="the backends to launch, in turn (default: both)")
    p.add_argument("--set", action="append", type=_setting, default=[],
                   metavar="SWITCHML_VAR=VALUE",
                   help="a setting of switchml's launches (repeatable; default: none)")
    # a rank of a launch (torchrun runs this file with these)
    p.add_argument("--rank-job", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--backend", choices=BACKENDS, help=argparse.SUPPRESS)
    p.add_argument("--summary", help=argparse.SUPPRESS)
    p.add_argument("--params", help=argparse.SUPPRESS)
    p.add_argument("--profile", help=argparse.SUPPRESS)
    p.add_argument("--profile-dir", default=None, metavar="DIR",
                   help="profile 3 more steps of each configuration's first launch "
                        "(rank 0, torch's profiler) into DIR: a Chrome trace and a table")
    args = p.parse_args(argv)
    if args.rank_job:
        rank_job(args)
        return 0
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise SystemExit(f"ddp_resnet: --device cuda: torch {torch.__version__} sees no "
                             "CUDA device here; run on a GPU machine, or --device cpu")
    runs: list = []
    with tempfile.TemporaryDirectory() as tmp:
        for workers in args.workers:
            trials: dict = {b: [] for b in args.backends}
            for i in range(args.runs):  # the backends in turn: a slow spell hits both
                for backend in args.backends:
                    t = launch(backend, workers, args, os.path.join(tmp, f"run{i}-"),
                               profile=i == 0)
                    trials[backend].append(t)
                    print(f"K={workers} {backend:<8} {t['samples_per_s']:8.1f} samples/s  "
                          f"step {t['step_ms']:7.1f} ms  compute "
                          f"{t['compute_ms_per_step']:6.1f} ms  without communication "
                          f"{t['step_without_communication_ms']:6.1f} ms  replicas identical: "
                          f"{t['replicas_identical']}", flush=True)
            kept = {}
            for backend, tried in trials.items():
                rate = statistics.median(t["samples_per_s"] for t in tried)
                best = min(tried, key=lambda t: abs(t["samples_per_s"] - rate))
                kept[backend] = dict(best, samples_per_s_all=[t["samples_per_s"] for t in tried])
            if len(kept) == len(BACKENDS):
                kept["switchml"].update(compare(kept["switchml"], kept["gloo"]))
            for backend in args.backends:
                kept[backend].pop("params")
            runs += [kept[b] for b in args.backends]
            write(args, argv, runs)  # each K as it ends: a run cut short keeps the ones done
    print(table(runs))
    if args.out:
        print(f"wrote {args.out}")
    bad = [r for r in runs if not r["replicas_identical"]]
    if bad:
        print(f"ddp_resnet: replicas differ in {len(bad)} run(s)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
