"""DDP's step time on the switch, on gloo after the switch died, and back on it.

    python bench/failover.py --world 3 --mib 16 --steps 20 --out failover.json

A switch (``switchml switch``) in a process of its own and ``--world`` ranks on
this machine, each a host of its own (``SWITCHML_LOCAL_STAGE=0``), train a model
of ``--mib`` MiB of float32 parameters (square linear layers, a batch of 8) with
``DistributedDataParallel`` on the "switchml" backend: ``--steps`` timed steps
on the switch; then the switch is SIGKILLed and ``--steps`` more go through the
backend's gloo fallback (the first step after the kill, which waits
``SWITCHML_RETRY_S`` for the switch, is reported apart); then the switch starts
again on its port and the ranks step until every rank's calls are back on it
(the seconds from the restart to that are reported), and ``--steps`` more are
timed there.  The same model and steps on a plain gloo job, in the same
invocation, are the reference.  Prints each phase's median step time (the
slowest rank's) and writes them as JSON (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

HERE = os.path.abspath(__file__)
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)

from switchml.bench.common import at_least, within  # noqa: E402
from switchml.bench.launch import die_with_parent  # noqa: E402
from switchml.testbed.core import signals_end_the_run  # noqa: E402

CLI = [sys.executable, "-m", "switchml.cli"]
BATCH = 8


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_file(path: str, procs: list | tuple = (), seconds: float = 120.0) -> None:
    """Until the ranks write ``path``; a rank that ended meanwhile fails the run at
    once, naming it (the others wait for it, and would for the whole time)."""
    deadline = time.monotonic() + seconds
    while not os.path.exists(path):
        for rank, proc in enumerate(procs):
            if proc.poll() is not None:
                raise SystemExit(f"rank {rank} ended (exit status {proc.returncode}) before "
                                 f"it wrote {os.path.basename(path)}")
        if time.monotonic() > deadline:
            raise SystemExit(f"no {path} within {seconds:g}s")
        time.sleep(0.01)


def phases(args) -> dict:
    """One rank's phases, each step timed."""
    import torch
    import torch.distributed as dist

    import switchml.torch  # noqa: F401  registers the backend

    torch.set_num_threads(1)
    dist.init_process_group(args.backend)
    rank = dist.get_rank()
    width = max(64, int((args.mib * 2**20 / 4 / 4) ** 0.5))  # 4 square layers
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(4)])
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(rank)
    group = dist.distributed_c10d._get_default_group()

    def step() -> float:
        x = torch.randn(BATCH, width, generator=gen)
        start = time.monotonic()
        opt.zero_grad()
        ddp(x).square().mean().backward()
        opt.step()
        return time.monotonic() - start

    def steps(n: int) -> list:
        return [step() for _ in range(n)]

    def say(name: str) -> None:
        if rank == 0:
            open(os.path.join(args.control, name), "w").close()

    out: dict = {"rank": rank, "width": width}
    steps(2)  # warm-up
    out["switch"] = steps(args.steps)
    if args.backend == "switchml":
        dist.barrier()
        say("kill")
        _wait_file(os.path.join(args.control, "killed"))
        out["first_after_kill"] = step()
        out["gloo"] = steps(args.steps)
        dist.barrier()
        say("restart")
        _wait_file(os.path.join(args.control, "restarted"))
        restarted = time.monotonic()
        while True:  # until every rank's calls are back on the switch
            back = torch.tensor([int(group.counters.get("returns", 0) > 0)])
            dist.all_reduce(back, op=dist.ReduceOp.MIN)  # (int64: gloo's)
            if back.item():
                break
            step()
        out["back_after_s"] = time.monotonic() - restarted
        out["back"] = steps(args.steps)
        out["counters"] = dict(group.counters)
    return out


def rank_main(args) -> None:
    """One rank: the phases (``phases``), each step timed; prints one JSON line.
    The group ends once ``phases`` returned and its DDP model went with it
    (examples/ddp_common.py's ``finish`` says why)."""
    import torch.distributed as dist

    out = phases(args)
    dist.barrier()
    dist.destroy_process_group()
    print(json.dumps(out), flush=True)


def _job(args, backend: str, switch=None) -> list:
    """One job of ``args.world`` ranks on ``backend``; each rank's report.  With a
    switch (a ``SwitchProcess``-like dict), kills and restarts it as the ranks ask."""
    port = _free_port()
    control = os.path.join(args.control_root, backend)
    os.makedirs(control, exist_ok=True)
    procs: list = []
    try:
        return _run_ranks(args, backend, switch, port, control, procs)
    finally:  # (a failure, or TERM under signals_end_the_run) no rank waits on
        for proc in procs:
            proc.kill()
            proc.wait()


def _run_ranks(args, backend: str, switch, port: int, control: str, procs: list) -> list:
    for rank in range(args.world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(args.world),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                   SWITCHML_LOCAL_STAGE="0", SWITCHML_RETRY_S=str(args.retry),
                   PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
        if switch is not None:
            env["SWITCHML_SWITCH"] = switch["address"]
        procs.append(subprocess.Popen(
            [sys.executable, HERE, "--role", "rank", "--backend", backend, "--control", control,
             "--mib", str(args.mib), "--steps", str(args.steps)],
            env=env, stdout=subprocess.PIPE, text=True, preexec_fn=die_with_parent))
    if switch is not None:
        _wait_file(os.path.join(control, "kill"), procs)
        switch["proc"].kill()
        switch["proc"].wait(10)
        open(os.path.join(control, "killed"), "w").close()
        _wait_file(os.path.join(control, "restart"), procs)
        switch["proc"] = _start_switch(switch["port"])[0]
        open(os.path.join(control, "restarted"), "w").close()
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    for rank, (proc, output) in enumerate(zip(procs, outputs)):
        if proc.returncode or not output.strip():
            raise SystemExit(f"rank {rank} of the {backend} job failed (exit status "
                             f"{proc.returncode})")
    return [json.loads(output.splitlines()[-1]) for output in outputs]


def _start_switch(port: int = 0):
    proc = subprocess.Popen(CLI + ["switch", "--port", str(port), "--log-level", "error"],
                            stdout=subprocess.PIPE, text=True, preexec_fn=die_with_parent)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if "listening on" not in line:
        raise SystemExit(f"the switch did not start: {line}")
    address = line.split("SWITCHML_SWITCH=")[1].strip()
    return proc, address


def _slowest(reports: list, key: str) -> float:
    """The median over steps of the slowest rank's step time."""
    return statistics.median(max(step) for step in zip(*(r[key] for r in reports)))


def run(args) -> dict:
    proc, address = _start_switch()
    switch = {"proc": proc, "address": address, "port": int(address.rsplit(":", 1)[1])}
    try:
        ours = _job(args, "switchml", switch)
    finally:
        switch["proc"].kill()
        switch["proc"].wait(10)
    theirs = _job(args, "gloo")
    gloo = _slowest(theirs, "switch")
    phases = {key: _slowest(ours, key) for key in ("switch", "gloo", "back")}
    return {
        "command": "python bench/failover.py " + " ".join(sys.argv[1:]),
        "settings": {k: v for k, v in vars(args).items()
                     if k not in ("role", "backend", "control", "control_root")},
        "parameters_mib": ours[0]["width"] ** 2 * 4 * 4 / 2**20,
        "step_s": {"on_switch": phases["switch"], "on_gloo_fallback": phases["gloo"],
                   "back_on_switch": phases["back"], "plain_gloo": gloo},
        "fallback_vs_plain_gloo": phases["gloo"] / gloo,
        "first_step_after_kill_s": max(r["first_after_kill"] for r in ours),
        "back_after_restart_s": max(r["back_after_s"] for r in ours),
        "counters": [r["counters"] for r in ours],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=at_least(2), default=3)
    p.add_argument("--mib", type=within(0, above_low=True), default=16.0,
                   help="the model's parameters, MiB")
    p.add_argument("--steps", type=at_least(1), default=20, help="timed steps of each phase")
    p.add_argument("--retry", type=within(0, above_low=True), default=1.0,
                   help="SWITCHML_RETRY_S")
    p.add_argument("--out", default=None, help="write the figures as JSON here")
    p.add_argument("--role", help=argparse.SUPPRESS)
    p.add_argument("--backend", default="switchml", help=argparse.SUPPRESS)
    p.add_argument("--control", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.role == "rank":
        return rank_main(args)
    import tempfile

    with signals_end_the_run(), tempfile.TemporaryDirectory(prefix="switchml-failover-") as root:
        args.control_root = root
        result = run(args)
    s = result["step_s"]
    print(f"{args.world} ranks, DDP on {result['parameters_mib']:.1f} MiB of parameters, "
          f"median step (the slowest rank's):")
    print(f"  on the switch         {s['on_switch'] * 1e3:8.1f} ms")
    print(f"  on gloo (fallback)    {s['on_gloo_fallback'] * 1e3:8.1f} ms  "
          f"({result['fallback_vs_plain_gloo']:.2f}x plain gloo's)")
    print(f"  back on the switch    {s['back_on_switch'] * 1e3:8.1f} ms")
    print(f"  plain gloo job        {s['plain_gloo'] * 1e3:8.1f} ms")
    print(f"first step after the kill {result['first_step_after_kill_s']:.2f} s; back on the "
          f"switch {result['back_after_restart_s']:.2f} s after its restart "
          f"(SWITCHML_RETRY_S={args.retry:g})")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
