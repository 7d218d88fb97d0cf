"""torch.distributed backend and DDP hook: real processes, a real switch."""

import functools
import json
import os
import socket
import subprocess
import sys
import time

import pytest

torch = pytest.importorskip("torch", reason="the torch extra is not installed")

from rank_processes import RankProcess  # noqa: E402

JOB = os.path.join(os.path.dirname(__file__), "torch_job.py")


def free_port():
    """A free port whose successor is free too (a job may begin again on port + 1)."""
    while True:
        with socket.socket() as s, socket.socket() as t:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
            try:
                t.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return port


def launch(world, *args, timeout=120, env=None, job=JOB, rank_env=None, fresh=False):
    """Run ``job`` (tests/torch_job.py) as ``world`` ranks; return each rank's RESULT
    (if it printed one).  ``rank_env(rank)``: variables of that rank's own."""
    return collect(start(world, *args, env=env, job=job, rank_env=rank_env, fresh=fresh),
                   timeout)


@functools.cache
def gloo_ddp(world, steps):
    """DDP on gloo, ``steps`` steps of ``world`` ranks: each rank's RESULT (the same
    every time: the reference of several tests, run once)."""
    return launch(world, "ddp", "gloo", steps)


@functools.cache
def gloo_ddp_with_the_hook(world, steps):
    """DDP on gloo with switchml's comm hook (32-bit wire), ``steps`` steps of ``world``
    ranks: each rank's RESULT (run once: two tests read it)."""
    return launch(world, "hook", "gloo", steps)


def start(world, *args, env=None, job=JOB, rank_env=None, fresh=False):
    """``world`` ranks of ``job`` started: their processes (``collect`` ends them),
    forked from a server that imported torch once (tests/rank_processes.py), or each
    a fresh interpreter where ``fresh``."""
    port = free_port()
    extra = env or {}
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PYTHONPATH=os.pathsep.join(
                       [os.path.dirname(os.path.dirname(__file__)),
                        os.environ.get("PYTHONPATH", "")]))
        env.pop("SWITCHML_SWITCH", None)
        env.update(extra)
        env.update(rank_env(rank) if rank_env else {})
        if fresh:
            procs.append(subprocess.Popen([sys.executable, job, *map(str, args)], env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                          text=True))
        else:
            procs.append(RankProcess(job, args, env))
    return procs


def collect(procs, timeout=120):
    """Each rank's RESULT (if it printed one); a rank that failed fails the test."""
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            # (a rank killed by a signal has a negative return code: SIGSEGV is -11)
            assert p.returncode == 0, f"rank exited with {p.returncode}: {err[-3000:]}"
            lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
            results.append(json.loads(lines[-1][len("RESULT "):]) if lines else None)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return results


@pytest.mark.parametrize("world", [2, 4])
def test_ddp_on_switchml_matches_gloo(world):
    ours = launch(world, "ddp", "switchml", 10)
    theirs = gloo_ddp(world, 10)
    a = torch.tensor(ours[0]["params"])
    for r in ours[1:]:
        assert torch.equal(torch.tensor(r["params"]), a)  # replicas stay identical
    b = torch.tensor(theirs[0]["params"])
    assert torch.allclose(a, b, atol=1e-4), (a - b).abs().max()
    assert all(r["switch_results"] > 0 for r in ours)  # the gradients went through the switch
    assert all(r["switch_results"] == 0 for r in theirs)


def test_ranks_that_share_hosts_combine_through_the_store():
    """2 hosts of 2 ranks (SWITCHML_LOCAL_GROUP): the ranks learn it through torch's
    store, DDP's replicas match gloo's, and a new_group of ranks 0, 2, 3 (hosts of
    1 and 2 ranks) sums right."""
    ours = launch(4, "local", "switchml", env={"SWITCHML_LOCAL_STAGE": "1"},
                  rank_env=lambda r: {"SWITCHML_LOCAL_GROUP": str(r // 2)})
    theirs = gloo_ddp(4, 10)
    b = torch.tensor(theirs[0]["params"])
    for r in ours:
        assert r["worker"] == "LocalStageWorker" and r["groups"] == [[0, 1], [2, 3]]
        assert r["local_calls"] > 0
        assert torch.allclose(torch.tensor(r["params"]), b, atol=1e-4)
    assert len({tuple(r["params"]) for r in ours}) == 1  # replicas stay identical
    # the gradients (one segment, so one shard) crossed the switch from each host's
    # first rank alone
    assert ours[0]["bytes_sent"] > 0 and ours[2]["bytes_sent"] > 0
    assert ours[1]["bytes_sent"] == ours[3]["bytes_sent"] == 0
    for rank in (0, 2, 3):
        assert ours[rank]["irregular"] == [1 + 3 + 4] * 2
        assert ours[rank]["irregular_groups"] == [[0], [1, 2]]  # the group's own ranks


def test_new_group_shares_the_jobs_switch():
    """Without SWITCHML_SWITCH, every group of a job (new_group, whichever rank is its
    rank 0) is a job on one switch: one process, one port, not one per group (was 7
    switch processes for the default group and 6 new_groups, on ranks 0 and 1)."""
    results = launch(3, "groups", "switchml")
    addresses = {tuple(a) for r in results for a in r["addresses"]}
    assert len(addresses) == 1, addresses
    assert sum(r["switches"] for r in results) == 1
    assert results[0]["switches"] == 1  # rank 0 runs it
    # sums per group: the world (6), [1,2] (5), [0,2] (4), [0,1] (3), the world, [2,1]
    assert results[0]["sums"] == [6.0, 4.0, 3.0, 6.0, 9.0]
    assert results[1]["sums"] == [6.0, 5.0, 3.0, 6.0, 5.0, 9.0]
    assert results[2]["sums"] == [6.0, 5.0, 4.0, 6.0, 5.0, 9.0]
    # destroying three groups leaves the switch to the rest; destroying all stops it
    assert results[0]["switches_after_destroy"] == 1
    assert all(r["switches_at_end"] == 0 for r in results)
    assert [r.get("again") for r in results] == [None, 3.0, 3.0]


def test_every_collective_works_through_the_backend():
    world = 3
    for rank, out in enumerate(launch(world, "collectives", "switchml")):
        assert out["allreduce_sum"] == 6.0
        assert out["allreduce_avg"] == 2.0
        assert out["allreduce_int_async"] == 6
        assert out["allreduce_int_avg"] == -1  # (-2 - 1 - 1) / 3, truncated toward zero
        assert out["allreduce_max"] == 3.0
        assert out["allreduce_f64"] == 6.0
        assert out["broadcast"] == 2.0
        assert out["all_gather"] == [0.0, 1.0, 2.0]
        assert out["reduce_scatter"] == sum(r * 10 + rank for r in range(world))
        assert out["all_to_all"] == [r * 10 + rank for r in range(world)]
        assert out["broadcast_object"] == {"hello": 1}
        assert out["new_group"] == 6.0
        assert out["functional_all_gather"] == [r for r in range(world) for _ in range(2)]
        assert out["functional_reduce_scatter"] == world * rank
        assert out["functional_all_to_all"] == [float(r) for r in range(world)]
        assert out["allreduce_coalesced"] == [6.0, 3]
        assert out["broadcast_view"] and out["reduce_view"] and out["reduce_scatter_view"]
        assert "expand()ed view" in out["broadcast_overlapping"]
        assert out["summed_at_barrier"]
        assert out["hook_float64_grad"] == 3 * (world + 1) / 2


def test_ddp_comm_hook_on_a_gloo_group_matches_gloo():
    hooked = gloo_ddp_with_the_hook(2, 10)
    plain = gloo_ddp(2, 10)
    a, b = torch.tensor(hooked[0]["params"]), torch.tensor(plain[0]["params"])
    assert torch.equal(torch.tensor(hooked[1]["params"]), a)
    assert torch.allclose(a, b, atol=1e-4)
    assert all(r["switch_results"] > 0 for r in hooked)


def test_ddp_comm_hook_on_the_16_bit_wire_trains_like_gloo_with_half_the_bytes():
    narrow = launch(2, "hook16", "gloo", 10)
    wide = gloo_ddp_with_the_hook(2, 10)
    plain = gloo_ddp(2, 10)
    a, b = torch.tensor(narrow[0]["params"]), torch.tensor(plain[0]["params"])
    assert torch.equal(torch.tensor(narrow[1]["params"]), a)  # the same on every rank
    assert torch.allclose(a, b, atol=1e-2) and not torch.equal(a, b)
    # bytes a result received: for a 788-parameter model headers and small
    # datagrams weigh, so the averages are about 0.7 of each other, not 0.5; a
    # wire that did not halve the values would be near 1 (test_wire16.py counts
    # values exactly).  Received results, not sent datagrams: a busy machine's
    # retransmissions are mostly 32-byte probes, which moved the average of what
    # a rank sent by more than the wire's halving (1.08x in one run)
    def per_result(run):
        return run[0]["bytes_received"] / run[0]["switch_results"]
    assert per_result(narrow) < 0.85 * per_result(wide)


def test_a_rank_that_exits_early_makes_the_others_fail_clearly():
    start = time.monotonic()
    results = launch(3, "early-exit", "switchml", timeout=60, env={"SWITCHML_TIMEOUT": "5"})
    for out in results[:2]:
        assert out["error"] is not None
        assert "rank 2" in out["error"], out["error"]
    assert time.monotonic() - start < 45


def test_ranks_that_disagree_on_a_call_fail_at_once_naming_both():
    """Not after the group's 30-minute timeout: within a round trip."""
    results = launch(2, "mismatch", "switchml", timeout=60)
    for out in results:
        assert out["error"] is not None and out["seconds"] < 5, out
        assert "CallMismatchError" in out["error"] or "disagree" in out["error"], out
        assert "1000 float32 values" in out["error"] and "2000 float32 values" in out["error"]


def test_an_unreachable_switch_is_an_exception_naming_it():
    """With fallback off (tests/test_torch_failover.py: with it on, gloo)."""
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    start = time.monotonic()
    results = launch(2, "unreachable", "switchml", timeout=60,
                     env={"SWITCHML_SWITCH": address, "SWITCHML_TIMEOUT": "3",
                          "SWITCHML_FALLBACK": "0"})
    for out in results:
        assert "SwitchUnreachableError" in out["error"] and address in out["error"], out
    assert time.monotonic() - start < 45


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_cuda_tensors_are_staged_through_host_memory():
    for out in launch(2, "cuda", "switchml"):
        assert out == {"sum": 3.0, "device": "cuda", "avg": 1.5,
                       "switch_results": out["switch_results"]}
        assert out["switch_results"] > 0


@pytest.mark.parametrize("scenario", ["ddp", "hook"])
def test_a_job_over_two_switches_trains_bit_for_bit_as_over_one(scenario):
    """SWITCHML_SWITCH=a,b through the backend's _connect and through HookState: the
    same weights as the same job through switch a alone, and both switches summed
    (packets of 128 values: the model's 788 gradients are 7 of them, 4 and 3);
    every job authenticated by the secret rank 0 made."""
    import switchml

    def switch():
        return switchml.Switch(packet_elements=128, block_elements=64).start()

    a, b = switch(), switch()
    try:
        backend = "switchml" if scenario == "ddp" else "gloo"
        one = launch(2, scenario, backend, 5, env={"SWITCHML_SWITCH": "%s:%d" % a.address})
        two = launch(2, scenario, backend, 5,
                     env={"SWITCHML_SWITCH": "%s:%d,%s:%d" % (a.address + b.address)})
        for run in (one, two):
            assert all(r["switch_results"] > 0 for r in run)
        params = torch.tensor(one[0]["params"])
        for r in two:
            assert torch.equal(torch.tensor(r["params"]), params)
        for sw in (a, b):
            jobs = sw.stats()["ended_jobs"]
            assert sum(j["counters"]["packets_in"] for j in jobs.values()) > 0
            # the backend and the hook made the job a secret, no variable set: no
            # job on either switch was open
            totals = sw.stats()["totals"]
            assert totals["jobs_started"] > 0 and totals.get("jobs_open", 0) == 0
    finally:
        a.stop()
        b.stop()
