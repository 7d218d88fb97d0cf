"""One rank of a torch.distributed job, for tests/test_torch.py (RANK etc. from env)."""

import json
import os
import sys

import torch
import torch.distributed as dist

# (no gloo barrier at the end: a rank out of it may close under another still in it)
from torch_cases import leave_together

import switchml.torch  # noqa: F401  registers the "switchml" backend


def ddp(backend: str, steps: int, hook: bool, bits=None):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(20, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    ddp_model = torch.nn.parallel.DistributedDataParallel(model)
    state = None
    if hook:
        state = switchml.torch.HookState(sparse="auto", bits=bits)
        ddp_model.register_comm_hook(state, switchml.torch.allreduce_hook)
    opt = torch.optim.SGD(ddp_model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(100 + dist.get_rank())
    for _ in range(steps):
        x = torch.randn(16, 20, generator=gen)
        y = torch.randint(0, 4, (16,), generator=gen)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp_model(x), y).backward()
        opt.step()
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    worker = state.worker if state is not None else getattr(
        dist.distributed_c10d._get_default_group(), "_worker", None)
    results = worker.counters["results_in"] if worker is not None else 0
    sent = worker.counters["bytes_sent"] if worker is not None else 0
    received = worker.counters["bytes_received"] if worker is not None else 0
    datagrams = (worker.counters["results_in"] + worker.counters["retransmissions"]
                 if worker is not None else 0)
    if state is not None:
        state.close()
    return {"params": params.tolist(), "switch_results": results, "bytes_sent": sent,
            "datagrams_sent": datagrams, "bytes_received": received}


def _await_file(name: str) -> None:
    """Wait for the test to create CONTROL_DIR/name (it killed or restarted the switch)."""
    import time
    path = os.path.join(os.environ["CONTROL_DIR"], name)
    deadline = time.monotonic() + 60
    while not os.path.exists(path):
        assert time.monotonic() < deadline, f"the test never wrote {name}"
        time.sleep(0.01)


def _say(name: str) -> None:
    """Rank 0 tells the test (CONTROL_DIR/name) the job reached a point."""
    if dist.get_rank() == 0:
        open(os.path.join(os.environ["CONTROL_DIR"], name), "w").close()


def switch_dies(hook: bool, steps: int, kill_at: int, restart_at: int):
    """DDP on the backend (or the hook on gloo) whose switch the test SIGKILLs before
    step ``kill_at`` (and starts again on its port before ``restart_at``, if below
    ``steps``): the steps' weights, or the error that reached this script."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(20, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    ddp_model = torch.nn.parallel.DistributedDataParallel(model)
    state = None
    if hook:
        state = switchml.torch.HookState(sparse="auto")
        ddp_model.register_comm_hook(state, switchml.torch.allreduce_hook)
    opt = torch.optim.SGD(ddp_model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(100 + dist.get_rank())
    out: dict = {"error": None, "steps": 0}
    results_before_kill = 0
    try:
        for step in range(steps):
            if step == kill_at:
                results_before_kill = _switch_results(state)
            if step == kill_at:
                if os.environ.get("DIE_AT_KILL") == str(dist.get_rank()):
                    os._exit(3)  # a rank that dies: no fallback covers it
                _say("kill")
                _await_file("killed")
            if step == restart_at:
                _say("restart")
                _await_file("restarted")
                _until_back(ddp_model, state)
            x = torch.randn(16, 20, generator=gen)
            y = torch.randint(0, 4, (16,), generator=gen)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(ddp_model(x), y).backward()
            opt.step()
            out["steps"] = step + 1
    except Exception as exc:  # the named error reaches the script
        out["error"] = f"{type(exc).__name__}: {exc}"
    out["params"] = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist()
    source = state if state is not None else dist.distributed_c10d._get_default_group()
    out["counters"] = dict(getattr(source, "counters", {}))
    # the switch's results on the worker of the job joined again, if any
    out["results_after_return"] = _switch_results(state) if out["counters"].get(
        "returns") else 0
    out["results_before_kill"] = results_before_kill
    return out


def big_calls(iterations: int, elements: int):
    """Pairs of async in-place all_reduces of ``elements`` small whole numbers (their
    float32 sums exact on the switch and on gloo alike), back to back; rank 0 tells
    the test when the first call of the third pair is partly summed (it kills the
    switch then): how many results were not the exact sum, and the group's
    counters."""
    import time
    rank, size = dist.get_rank(), dist.get_world_size()
    group = dist.distributed_c10d._get_default_group()
    # one pattern made once, shifted by a constant per rank and call: the arithmetic
    # of 4M int64 elements a call was most of a rank's CPU
    pattern = ((torch.arange(elements, dtype=torch.int64) * 13) % 2001 - 1000).to(torch.float32)

    def values(r, salt):
        return pattern + float(7 * r + salt)

    wrong = calls = 0
    for i in range(iterations):
        pair = [values(rank, 2 * i), values(rank, 2 * i + 1)]
        dist.barrier()  # the ranks start each pair together
        works = [dist.all_reduce(t, async_op=True) for t in pair]
        if i == 2:  # the switch dies in the middle of the first call of the third pair
            worker = group._worker
            if hasattr(worker, "copied_segments"):  # ranks combined on their hosts
                while rank == 0 and worker.copied_segments(pair[0].numpy()) < 3 and \
                        not works[0].is_completed():
                    time.sleep(0.0005)
            else:  # 40 results of the call in (over two switches: of the second's part)
                source = worker.channels[1] if hasattr(worker, "channels") else worker
                start = source.counters["results_in"]
                while rank == 0 and source.counters["results_in"] - start < 40 and \
                        not works[0].is_completed():
                    time.sleep(0.0005)
            _say("kill")
        for work in works:
            work.wait()
        for j, t in enumerate(pair):
            want = pattern * size + float(sum(7 * r + 2 * i + j for r in range(size)))
            wrong += int(not torch.equal(t, want))
            calls += 1
    return {"calls": calls, "wrong": wrong, "counters": dict(group.counters)}


def _until_back(ddp_model, state) -> None:
    """Backward passes that change no weight (their gradients dropped) until every
    rank's calls are back on the switch: the probes take their time, a busy
    machine's steps may not, and the weights must stay the undisturbed run's."""
    import time
    group = dist.distributed_c10d._get_default_group()
    source = state if state is not None else group
    deadline = time.monotonic() + 20
    while True:
        # int64: gloo's, the same decision on every rank (the deadline's too: each
        # rank's own clock could end one rank's loop a call before another's)
        flags = torch.tensor([int(source.counters.get("returns", 0) > 0),
                              int(time.monotonic() >= deadline)], dtype=torch.int64)
        dist.all_reduce(flags)
        if flags[0].item() == dist.get_world_size():
            return
        if flags[1].item() > 0:
            raise TimeoutError("the ranks' calls did not come back to the switch in 20 s")
        ddp_model(torch.zeros(1, 20)).sum().backward()
        ddp_model.zero_grad()
        time.sleep(0.05)


def _switch_results(state) -> int:
    worker = state.worker if state is not None else \
        dist.distributed_c10d._get_default_group()._worker
    return worker.counters["results_in"] if worker is not None else 0


def allreduce_loop(seconds: float, until_return: bool):
    """all_reduce of 1000 values (rank + 1) every 50 ms for ``seconds`` (or until the
    group came back to the switch, or CONTROL_DIR/stop exists): wrong sums, counters
    and the backend's log.  CONTROL_DIR/on-gloo: the calls went to gloo."""
    import time
    _say("joined")
    rank, size = dist.get_rank(), dist.get_world_size()
    group = dist.distributed_c10d._get_default_group()
    deadline = time.monotonic() + seconds
    calls = wrong = 0
    while True:
        t = torch.full((1000,), float(rank + 1))
        dist.all_reduce(t)
        wrong += int(not torch.all(t == size * (size + 1) / 2))
        calls += 1
        if group.counters["fallbacks"] and not group.counters["returns"]:
            _say("on-gloo")
        # every rank decides alike, the flags summed like any call: each rank's own
        # clock alone would let one rank leave while another makes one call more
        # (their loops start apart: the joins time out at different moments)
        stop = os.path.exists(os.path.join(os.environ["CONTROL_DIR"], "stop"))
        flags = torch.tensor([int(stop or until_return and group.counters["returns"] > 0),
                              int(time.monotonic() >= deadline)], dtype=torch.int32)
        dist.all_reduce(flags)
        if flags[0].item() == size or flags[1].item() > 0:
            break
        time.sleep(0.05)
    return {"calls": calls, "wrong": wrong, "counters": group.counters, "log": LOG,
            "results_after_return": _switch_results(None)}


def collectives():
    rank, size = dist.get_rank(), dist.get_world_size()
    out = {}
    t = torch.full((1000,), float(rank + 1))
    dist.all_reduce(t)
    out["allreduce_sum"] = t[0].item()
    t = torch.full((10,), float(rank + 1))
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    out["allreduce_avg"] = t[0].item()
    t = torch.full((10,), rank + 1, dtype=torch.int32)
    work = dist.all_reduce(t, async_op=True)
    work.wait()
    out["allreduce_int_async"] = t[0].item()
    t = torch.full((10,), -1 - int(rank == 0), dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    out["allreduce_int_avg"] = t[0].item()
    t = torch.full((4,), float(rank + 1))
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # delegated to gloo
    out["allreduce_max"] = t[0].item()
    t = torch.full((4,), rank + 1, dtype=torch.float64)
    dist.all_reduce(t)  # float64: delegated
    out["allreduce_f64"] = t[0].item()
    t = torch.tensor([float(rank)])
    dist.broadcast(t, src=size - 1)
    out["broadcast"] = t.item()
    gathered = [torch.zeros(1) for _ in range(size)]
    dist.all_gather(gathered, torch.tensor([float(rank)]))
    out["all_gather"] = [g.item() for g in gathered]
    chunks = [torch.full((1,), float(rank * 10 + i)) for i in range(size)]
    result = torch.zeros(1)
    dist.reduce_scatter(result, chunks)
    out["reduce_scatter"] = result.item()
    outs = [torch.zeros(1) for _ in range(size)]
    dist.all_to_all(outs, [torch.tensor([float(rank * 10 + i)]) for i in range(size)])
    out["all_to_all"] = [o.item() for o in outs]
    objs = [None]
    if rank == 0:
        objs = [{"hello": 1}]
    dist.broadcast_object_list(objs, src=0)
    out["broadcast_object"] = objs[0]
    dist.barrier()
    # What FSDP2 and DTensor call (functional collectives, coalesced forms): each
    # must reach gloo through the backend's own method, not torch's trampoline,
    # which calls gloo holding the GIL (a deadlock now and then).
    import torch.distributed._functional_collectives as funcol
    gathered = funcol.all_gather_single(torch.full((2,), float(rank)), 0, dist.group.WORLD)
    out["functional_all_gather"] = gathered.wait().tolist()
    scattered = funcol.reduce_scatter_single(torch.arange(size, dtype=torch.float32), "sum", 0,
                                             dist.group.WORLD)
    out["functional_reduce_scatter"] = scattered.wait().item()
    moved = funcol.all_to_all_single(torch.full((size,), float(rank)), None, None,
                                     dist.group.WORLD)
    out["functional_all_to_all"] = moved.wait().tolist()
    pair = [torch.full((2,), float(rank + 1)), torch.full((1,), 1.0)]
    dist.all_reduce_coalesced(pair)
    out["allreduce_coalesced"] = [pair[0][0].item(), pair[1][0].item()]
    for name in ("all_gather_single_coalesced", "reduce_scatter_single_coalesced",
                 "all_to_all_single", "allreduce_coalesced", "_reduce_scatter_base"):
        assert name in vars(switchml.torch.ProcessGroupSwitchML), name
    sub = dist.new_group(list(range(size)))
    t = torch.full((3,), 2.0)
    dist.all_reduce(t, group=sub)
    out["new_group"] = t[0].item()
    out.update(strided_views(rank, size))
    # a barrier waits for the allreduces before it, as gloo's does
    t = torch.full((1 << 22,), float(rank + 1))
    dist.all_reduce(t, async_op=True)
    dist.barrier()
    out["summed_at_barrier"] = bool((t == size * (size + 1) / 2).all())
    # a bucket the switch does not sum (float64) goes as torch's own hook sends it
    model = torch.nn.Linear(4, 2).double()
    hooked = torch.nn.parallel.DistributedDataParallel(model)
    state = switchml.torch.HookState()
    hooked.register_comm_hook(state, switchml.torch.allreduce_hook)
    hooked(torch.full((3, 4), float(rank + 1), dtype=torch.float64)).sum().backward()
    out["hook_float64_grad"] = model.weight.grad[0, 0].item()
    state.close()
    return out


def strided_views(rank: int, size: int) -> dict:
    """Collectives gloo serves, on views that are not contiguous (every other
    column): each as on a contiguous tensor, the columns between untouched; an
    output that overlaps itself refused."""
    def base(r):
        return torch.arange(24, dtype=torch.float32).reshape(4, 6) * (r + 1) + 100 * r

    out = {}
    b = base(rank)
    dist.broadcast(b[:, ::2], src=size - 1)
    out["broadcast_view"] = torch.equal(b[:, ::2], base(size - 1)[:, ::2]) and torch.equal(
        b[:, 1::2], base(rank)[:, 1::2])
    b = base(rank)
    dist.reduce(b[:, ::2], dst=0)
    out["reduce_view"] = torch.equal(b[:, 1::2], base(rank)[:, 1::2]) and (
        rank != 0 or torch.equal(b[:, ::2], sum(base(r) for r in range(size))[:, ::2]))
    b = torch.zeros(4, 6)
    dist.reduce_scatter(b[:, ::2], [torch.full((4, 3), float(r + i)) for i in range(size)
                                    for r in [rank]])
    out["reduce_scatter_view"] = torch.equal(b[:, ::2], torch.full(
        (4, 3), float(sum(r + rank for r in range(size))))) and not b[:, 1::2].any()
    try:
        dist.broadcast(torch.zeros(1).expand(1000), src=0)
        out["broadcast_overlapping"] = "taken"
    except ValueError as exc:
        out["broadcast_overlapping"] = str(exc)
    return out


def cuda():
    """allreduce of CUDA tensors: staged through host memory, results back on the device."""
    rank, _size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", rank % torch.cuda.device_count())
    t = torch.full((100_000,), float(rank + 1), device=device)
    dist.all_reduce(t)
    a = torch.full((10,), float(rank + 1), device=device)
    dist.all_reduce(a, op=dist.ReduceOp.AVG)
    return {"sum": t[0].item(), "device": t.device.type, "avg": a[0].item(),
            "switch_results": dist.distributed_c10d._get_default_group()._worker.counters[
                "results_in"]}


def _switch_children() -> int:
    """How many embedded switch processes this rank started (children running one)."""
    count = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if ppid == os.getpid() and b"switchml.switch.process" in cmd:
            count += 1
    return count


def groups():
    """new_group without SWITCHML_SWITCH: the switches the job starts, and whose each uses."""
    rank, size = dist.get_rank(), dist.get_world_size()
    subsets = [list(range(size)), [1, 2], [0, 2], [0, 1], list(range(size)), [2, 1]]
    sums, addresses, made = [], [], []
    default = dist.distributed_c10d._get_default_group()
    addresses.append(list(default._worker.switch_address))
    for members in subsets:
        g = dist.new_group(members)  # every rank calls new_group, members or not
        made.append(g)
        if rank in members:
            t = torch.full((1000,), float(rank + 1))
            dist.all_reduce(t, group=g)
            sums.append(t[0].item())
            addresses.append(list(g._worker.switch_address))
    switches = _switch_children()
    for g in made[:3]:  # destroying groups leaves the job's switch to the others
        dist.destroy_process_group(g)
    t = torch.ones(1000)
    dist.all_reduce(t)
    dist.all_reduce(t, group=made[4])
    sums.append(t[0].item())
    return {"sums": sums, "addresses": addresses, "switches": switches,
            "switches_after_destroy": _switch_children()}


def local():
    """Ranks that share hosts (SWITCHML_LOCAL_GROUP, or the testbed's namespaces):
    DDP's replicas, and a new_group that spans the hosts irregularly."""
    rank, size = dist.get_rank(), dist.get_world_size()
    out = ddp("switchml", 10, hook=False)
    worker = dist.distributed_c10d._get_default_group()._worker
    out["worker"] = type(worker).__name__
    out["groups"] = [list(g) for g in worker.placement.groups]
    out["local_calls"] = worker.counters["local_calls"]
    members = [0] + list(range(2, size))  # rank 1 stays out: hosts of unequal sizes
    g = dist.new_group(members)
    if rank in members:
        t = torch.full((100_001,), float(rank + 1))
        dist.all_reduce(t, group=g)
        out["irregular"] = [t[0].item(), t[-1].item()]
        out["irregular_groups"] = [list(x) for x in g._worker.placement.groups]
    return out


def early_exit():
    """The last rank leaves abruptly; the others' next allreduce must fail, not hang."""
    rank, size = dist.get_rank(), dist.get_world_size()
    t = torch.ones(1000)
    dist.all_reduce(t)
    if rank == size - 1:
        os._exit(0)
    try:
        dist.all_reduce(torch.ones(100_000))
    except Exception as exc:  # the training script sees a Python exception
        print("RESULT " + json.dumps({"error": f"{type(exc).__name__}: {exc}"}), flush=True)
        os._exit(0)
    print("RESULT " + json.dumps({"error": None}), flush=True)
    os._exit(0)


def mismatch():
    """Rank r all_reduces 1000 * (r + 1) values: every rank must fail at once, naming both."""
    import time
    rank = dist.get_rank()
    dist.all_reduce(torch.ones(10))
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1000 * (rank + 1)))
    except Exception as exc:
        print("RESULT " + json.dumps({"error": f"{type(exc).__name__}: {exc}",
                                      "seconds": time.monotonic() - start}), flush=True)
        os._exit(0)
    print("RESULT " + json.dumps({"error": None}), flush=True)
    os._exit(0)


#: What the backend logged (init included).
LOG: list = []


def main():
    import logging
    handler = logging.Handler()
    handler.emit = lambda record: LOG.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("switchml.torch").addHandler(handler)
    scenario = sys.argv[1]
    backend = sys.argv[2] if len(sys.argv) > 2 else "switchml"
    if scenario == "unreachable":
        try:
            dist.init_process_group(backend)
        except Exception as exc:  # the script sees a Python exception, not a hang
            print("RESULT " + json.dumps({"error": f"{type(exc).__name__}: {exc}"}), flush=True)
        os._exit(0)
    dist.init_process_group(backend)
    if scenario == "early-exit":
        early_exit()
    if scenario == "mismatch":
        mismatch()
    if scenario == "allreduce-loop":
        result = allreduce_loop(float(sys.argv[3]), sys.argv[4] == "1")
        leave_together(dist.get_world_size(), dist.get_rank())
        dist.destroy_process_group()
        print("RESULT " + json.dumps(result), flush=True)
        os._exit(0)
    if scenario == "big-calls":
        result = big_calls(int(sys.argv[3]), int(sys.argv[4]))
        print("RESULT " + json.dumps(result), flush=True)
        os._exit(0)
    if scenario in ("switch-dies", "switch-dies-hook"):
        result = switch_dies(scenario.endswith("hook"), *map(int, sys.argv[3:6]))
        print("RESULT " + json.dumps(result), flush=True)
        os._exit(0)  # no teardown: a rank whose peers failed may find them gone
    if scenario == "ddp":
        result = ddp(backend, int(sys.argv[3]), hook=False)
    elif scenario == "groups":
        result = groups()
    elif scenario == "local":
        result = local()
    elif scenario == "cuda":
        result = cuda()
    elif scenario == "hook":
        result = ddp("gloo", int(sys.argv[3]), hook=True)
    elif scenario == "hook16":
        result = ddp("gloo", int(sys.argv[3]), hook=True, bits=16)
    else:
        result = collectives()
    leave_together(dist.get_world_size(), dist.get_rank())
    dist.destroy_process_group()
    if scenario == "groups":  # the job's switch stops with its groups
        result["switches_at_end"] = _switch_children()
        # a job begun again, switchml on a subgroup only: rank 1 (its rank 0) must
        # start a switch, not publish the one that stopped
        # (a store of its own: the first one's keys would outlive it on its port)
        dist.init_process_group("gloo", init_method="tcp://%s:%d" % (
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]) + 1),
            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
        g = dist.new_group([1, 2], backend="switchml")
        if dist.get_rank() in (1, 2):
            t = torch.full((1000,), float(dist.get_rank()))
            dist.all_reduce(t, group=g)
            result["again"] = t[0].item()
        dist.barrier()
        dist.destroy_process_group()
    if os.environ.get("RESULT_DIR"):
        # a file a rank: ranks that share one stdout pipe (a torchrun's) interleave
        # lines longer than the pipe's atomic write
        with open(os.path.join(os.environ["RESULT_DIR"], f"rank{os.environ['RANK']}.json"),
                  "w") as f:
            json.dump(result, f)
    print("RESULT " + json.dumps(result), flush=True)
    os._exit(0)  # past torch's teardown, which now and then aborts (see torch_cases.py)


if __name__ == "__main__":
    main()
