"""A torch job whose switch dies: real ranks, a real `switchml switch`, SIGKILL."""

import signal
import socket
import subprocess
import sys
import time

import pytest

torch = pytest.importorskip("torch", reason="the torch extra is not installed")

from test_torch import collect, start  # noqa: E402

from switchml.config import SWITCH_ANSWER_S, SWITCH_SILENCE_S  # noqa: E402

CLI = [sys.executable, "-m", "switchml.cli"]
WORLD = 3


class SwitchProcess:
    """`switchml switch` in a child process, SIGKILLed and started again on its port."""

    def __init__(self, *args):
        self.args = list(args)
        self.port = 0
        self.proc = None
        self.start()

    def start(self):
        self.proc = subprocess.Popen(CLI + ["switch", "--port", str(self.port),
                                            "--log-level", "warning", *self.args],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        assert "listening on" in line, line + self.proc.stderr.read()
        self.address = line.split("SWITCHML_SWITCH=")[1].strip()
        self.port = int(self.address.rsplit(":", 1)[1])

    def kill(self):
        self.proc.kill()
        self.proc.wait(10)

    def stop(self):
        if self.proc.poll() is None:
            self.kill()


def run_with_switch_faults(tmp_path, scenario, steps, kill_at, restart_at=None, env=None,
                           switches=1):
    """``scenario`` (switch-dies or switch-dies-hook) as WORLD ranks, each a host of its
    own, on ``switches`` switches, the first SIGKILLed before step ``kill_at`` and
    started again on its port before ``restart_at``; each rank's RESULT and the
    killed switch's address.  (The first: the model's calls are one chunk each, and a
    call of fewer chunks than switches goes to the first ones only.  A switch that
    carries none of them is only seen to go between calls, a race with the steps.)"""
    others = [SwitchProcess() for _ in range(switches - 1)]
    switch = SwitchProcess()
    restart_at = steps + 1 if restart_at is None else restart_at
    addresses = ",".join(s.address for s in [switch, *others])
    try:
        procs = start(WORLD, scenario, "gloo" if scenario.endswith("hook") else "switchml",
                      steps, kill_at, restart_at,
                      env={"SWITCHML_SWITCH": addresses, "SWITCHML_LOCAL_STAGE": "0",
                           "SWITCHML_TIMEOUT": "5", "CONTROL_DIR": str(tmp_path), **(env or {})})
        for point, action, done in (("kill", switch.kill, "killed"),
                                    ("restart", switch.start, "restarted")):
            if point == "restart" and restart_at > steps:
                break
            deadline = time.monotonic() + 60
            while not (tmp_path / point).exists():
                assert time.monotonic() < deadline and all(p.poll() is None for p in procs), \
                    [p.communicate()[1][-2000:] for p in procs if p.poll() is not None]
                time.sleep(0.01)
            action()
            (tmp_path / done).touch()
        return collect(procs, timeout=90), switch.address
    finally:
        for s in [*others, switch]:
            s.stop()


@pytest.mark.parametrize("scenario", ["switch-dies", "switch-dies-hook"])
def test_a_switch_killed_mid_training_is_an_error_in_the_script_not_a_crash(tmp_path, scenario):
    """DDP's reducer read a failed call's exception as the bucket's tensors and indexed
    an empty list: every rank died of SIGSEGV (the hook: a RuntimeError "Unable to cast
    ... to Tensor").  With fallback off, the named error reaches the script on every
    rank (``collect`` fails on a rank killed by a signal)."""
    results, address = run_with_switch_faults(tmp_path, scenario, steps=5, kill_at=2,
                                              env={"SWITCHML_FALLBACK": "0",
                                                   "SWITCHML_TIMEOUT": "2"})
    for out in results:
        assert out["steps"] == 2, out["steps"]
        assert "SwitchUnreachableError" in out["error"] and address in out["error"], out["error"]


@pytest.fixture(scope="module")
def undisturbed():
    """The weights of the 12 steps on gloo, undisturbed."""
    return torch.tensor(collect(start(WORLD, "ddp", "gloo", 12))[0]["params"])


@pytest.mark.parametrize("scenario,switches", [("switch-dies", 1), ("switch-dies-hook", 1),
                                               ("switch-dies", 2)])
def test_training_goes_on_through_gloo_and_returns_to_the_restarted_switch(tmp_path, scenario,
                                                                          switches, undisturbed):
    """The switch SIGKILLed before step 3 and started again on its port before step 6
    of 12 (where the ranks make backward passes that change no weight until their
    calls are back on the switch, at most 20 s): every rank ends, with the weights of
    an undisturbed run (gloo's: within the float32 bound, as the switch's own are);
    calls went through gloo after the kill and back to the switch after the restart
    (the counters and the switch's results on the job joined again).  A job over two
    switches, one of them killed, falls back and comes back as a whole."""
    results, _ = run_with_switch_faults(tmp_path, scenario, steps=12, kill_at=3, restart_at=6,
                                        env={"SWITCHML_RETRY_S": "0.2"}, switches=switches)
    params = torch.tensor(results[0]["params"])
    for out in results:
        assert out["error"] is None and out["steps"] == 12, out["error"]
        assert torch.equal(torch.tensor(out["params"]), params)  # replicas stay identical
        counters = out["counters"]
        assert counters["fallbacks"] == 1 and counters["returns"] == 1, counters
        assert counters["calls_on_gloo"] >= 3, counters  # steps 3, 4, 5 at least
        assert out["results_before_kill"] > 0 and out["results_after_return"] > 0, out
    assert torch.allclose(params, undisturbed, atol=1e-4), (params - undisturbed).abs().max()


@pytest.mark.parametrize("hosts", ["flat", "2x2", "two-switches"])
def test_calls_the_switch_left_half_summed_end_exact_from_what_the_ranks_held(tmp_path, hosts):
    """The switch SIGKILLed in the middle of back-to-back 16 MiB in-place calls (two
    in flight at a time) and never back: each call it left half-summed ends with the
    switch's sums where some rank held them (whole chunks; with ranks combined on
    their hosts, whole local-stage segments) and gloo's sums of the inputs for the
    rest, added once: every result is the exact sum (a rank that summed the whole
    array again, or lost a part, gets another), and the calls after it run on gloo.
    "flat": 3 ranks, each a host of its own; "2x2": 2 hosts of 2 ranks;
    "two-switches": "flat" over two switches, the second killed (the first, alive,
    ends or aborts its parts: each switch's are settled on their own)."""
    other = SwitchProcess() if hosts == "two-switches" else None
    # (without ranks combined, the switch killed drops a datagram in 20: its calls,
    # or parts, take long enough for the kill to fall inside one once rank 0 saw
    # its first results, on a machine whose cores the ranks keep busy)
    switch = SwitchProcess(*(["--drop-rate", "0.05"] if hosts != "2x2" else []))
    world, local = ((4, {"SWITCHML_LOCAL_STAGE": "1"}) if hosts == "2x2"
                    else (3, {"SWITCHML_LOCAL_STAGE": "0"}))
    address = switch.address if other is None else f"{other.address},{switch.address}"
    try:
        procs = start(world, "big-calls", "switchml", 4, 4 * 1024 * 1024,
                      env={"SWITCHML_SWITCH": address, "SWITCHML_TIMEOUT": "10",
                           "SWITCHML_RETRY_S": "0.5", "CONTROL_DIR": str(tmp_path), **local},
                      rank_env=lambda r: {"SWITCHML_LOCAL_GROUP": str(r // 2)})
        deadline = time.monotonic() + 60
        while not (tmp_path / "kill").exists():
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs)
            time.sleep(0.005)
        switch.kill()
        results = collect(procs, timeout=120)
    finally:
        for s in (switch, other):
            if s is not None:
                s.stop()
    for out in results:
        assert out["calls"] == 8 and out["wrong"] == 0, out
        assert out["counters"]["fallbacks"] == 1, out["counters"]
    # the kill fell inside a call: its rest went through gloo, not the whole of it
    assert any(out["counters"]["calls_settled"] for out in results), [
        {k: v for k, v in out["counters"].items() if "calls" in k or k in ("fallbacks",)}
        for out in results]


def test_a_switch_gone_for_good_sends_the_calls_to_gloo_within_the_retry_interval(tmp_path):
    """The group's timeout is long (60 s), the switch SIGKILLed before step 2 of 6 and
    never back: the calls go to gloo once SWITCHML_RETRY_S (1 s) passed without it,
    not after the timeout, which the worker waits for a switch that may restart."""
    began = time.monotonic()
    results, _ = run_with_switch_faults(tmp_path, "switch-dies", steps=6, kill_at=2,
                                        env={"SWITCHML_TIMEOUT": "60", "SWITCHML_RETRY_S": "1"})
    elapsed = time.monotonic() - began
    for out in results:
        assert out["error"] is None and out["steps"] == 6, out["error"]
        assert out["counters"]["fallbacks"] == 1 and out["counters"]["calls_on_gloo"] >= 4
    assert elapsed < 30, elapsed


def test_a_rank_that_dies_is_still_an_error(tmp_path):
    """Fallback is for the switch, not for peers: rank 2 exits at step 2, the switch
    lives on, and the others' backward() raises naming it (no gloo, no hang)."""
    switch = SwitchProcess()
    try:
        procs = start(WORLD, "switch-dies", "switchml", 5, 2, 9,
                      env={"SWITCHML_SWITCH": switch.address, "SWITCHML_LOCAL_STAGE": "0",
                           "SWITCHML_TIMEOUT": "3", "CONTROL_DIR": str(tmp_path),
                           "DIE_AT_KILL": "2"})
        (tmp_path / "killed").touch()  # nothing is killed: the ranks go on at once
        for p in procs[2:]:
            assert p.wait(60) == 3
        for out in collect(procs[:2], timeout=60):
            assert out["steps"] == 2 and "rank 2" in out["error"], out["error"]
            assert out["counters"]["fallbacks"] == 0, out["counters"]
    finally:
        switch.stop()


def test_a_job_the_full_switch_refuses_runs_on_gloo_and_moves_over_when_room_opens(tmp_path):
    """A switch with room for one job: the second job's join is refused
    (LimitExceededError), it runs on gloo, logged, and joins the switch once the
    first job ends; its sums are right throughout."""
    switch = SwitchProcess("--max-jobs", "1")
    try:
        env = {"SWITCHML_SWITCH": switch.address, "SWITCHML_LOCAL_STAGE": "0",
               "SWITCHML_TIMEOUT": "5", "SWITCHML_RETRY_S": "0.2"}
        (tmp_path / "first").mkdir()
        first = start(2, "allreduce-loop", "switchml", 60, 0,
                      env={**env, "CONTROL_DIR": str(tmp_path / "first")})
        deadline = time.monotonic() + 60
        while not (tmp_path / "first" / "joined").exists():
            assert time.monotonic() < deadline and all(p.poll() is None for p in first)
            time.sleep(0.01)
        second = start(2, "allreduce-loop", "switchml", 30, 1,
                       env={**env, "CONTROL_DIR": str(tmp_path)})
        while not (tmp_path / "joined").exists():  # the second job runs (on gloo)
            assert time.monotonic() < deadline and all(p.poll() is None for p in second)
            time.sleep(0.01)
        (tmp_path / "first" / "stop").touch()
        for out in collect(first, timeout=60):
            assert out["wrong"] == 0 and out["counters"]["fallbacks"] == 0, out
        for out in collect(second, timeout=60):
            counters = out["counters"]
            assert out["wrong"] == 0 and out["calls"] > 1, out
            assert counters["fallbacks"] == 1 and counters["returns"] == 1, counters
            assert counters["calls_on_gloo"] > 0 and out["results_after_return"] > 0, out
            assert any("LimitExceededError" in line or "max_jobs" in line
                       for line in out["log"]), out["log"]
    finally:
        switch.stop()


def test_a_hung_switch_sends_the_calls_to_gloo_and_they_return_when_it_runs_again(tmp_path):
    """The switch stopped (SIGSTOP) mid-job, under the group's own timeout (30
    minutes): its connections stay open and nothing answers, yet within
    SWITCH_SILENCE_S + SWITCH_ANSWER_S the calls go on through gloo, and once it
    runs again they come back to it; every sum right."""
    switch = SwitchProcess()
    try:
        env = {"SWITCHML_SWITCH": switch.address, "SWITCHML_LOCAL_STAGE": "0",
               "SWITCHML_RETRY_S": "0.3", "CONTROL_DIR": str(tmp_path)}
        procs = start(2, "allreduce-loop", "switchml", 120, 1, env=env)
        for point in ("joined", "on-gloo"):
            deadline = time.monotonic() + 60
            while not (tmp_path / point).exists():
                assert time.monotonic() < deadline and all(p.poll() is None for p in procs)
                time.sleep(0.01)
            if point == "joined":
                time.sleep(0.5)
                switch.proc.send_signal(signal.SIGSTOP)
                stopped = time.monotonic()
        on_gloo_after = time.monotonic() - stopped
        switch.proc.send_signal(signal.SIGCONT)
        for out in collect(procs, timeout=60):
            counters = out["counters"]
            assert out["wrong"] == 0 and counters["calls_on_gloo"] > 0, out
            assert counters["fallbacks"] == 1 and counters["returns"] == 1, counters
            assert out["results_after_return"] > 0, out
            assert any("did not answer a status query" in line for line in out["log"]), out
        assert on_gloo_after < SWITCH_SILENCE_S + SWITCH_ANSWER_S + 10  # not the 30 minutes
    finally:
        switch.proc.send_signal(signal.SIGCONT)
        switch.stop()


@pytest.mark.parametrize("there", ["nothing", "a-silent-listener"])
def test_an_unreachable_switch_at_the_start_means_gloo(tmp_path, there):
    """Nothing listens at SWITCHML_SWITCH, or something that never answers a join
    (or a hung switch): the group starts on gloo within SWITCH_ANSWER_S, sums right."""
    from test_torch import free_port
    with socket.socket() as listener:
        if there == "nothing":
            port = free_port()
        else:  # accepts connections (the kernel does, from its backlog) and says nothing
            listener.bind(("127.0.0.1", 0))
            listener.listen(8)
            port = listener.getsockname()[1]
        began = time.monotonic()
        # the group's own timeout (30 minutes): the join's answer is what is waited for
        results = collect(start(2, "allreduce-loop", "switchml", 0.3, 0,
                                env={"SWITCHML_SWITCH": f"127.0.0.1:{port}",
                                     "CONTROL_DIR": str(tmp_path)}))
        assert time.monotonic() - began < SWITCH_ANSWER_S + 30
    for out in results:
        assert out["wrong"] == 0 and out["counters"]["fallbacks"] == 1, out
        assert out["counters"]["calls_on_gloo"] == out["calls"] * 2, out  # and the flags


def test_a_hook_state_closed_ends_its_fallback_group():
    """HookState.close leaves the switch and ends the gloo group its calls fall back
    to (a group left open keeps its connections to the other ranks until exit)."""
    import switchml.torch

    ended: list = []

    class Group:
        def shutdown(self):
            ended.append("fallback")

    class Path:
        def close(self):
            ended.append("path")

    state = switchml.torch.HookState()  # not joined: torch.distributed not initialized
    state._path, state._fallback = Path(), Group()
    state.close()
    assert ended == ["path", "fallback"]
    state.close()  # twice: the group is ended once
    assert ended == ["path", "fallback", "path"]


@pytest.mark.parametrize("join_s, most, least", [(0.3, 4, 2), (0.0, None, 10)])
def test_a_return_that_fails_slowly_is_tried_less_often(join_s, most, least):
    """A switch that answers its probes but whose joins fail (a rack switch whose
    spine hangs takes 7 s to say so; every rank's calls wait for the join): after
    a failed return that took t, the next comes 4t later, not at the next probe;
    a quick refusal (a full switch) is tried at every probe as before.  One rank,
    the gloo group in this process, the probes at a real switch."""
    from datetime import timedelta

    import torch.distributed as dist

    import switchml
    from switchml.errors import SwitchUnreachableError
    from switchml.torch.failover import SwitchPath

    gloo = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, timedelta(seconds=30))
    attempts: list = []

    def join(generation):
        attempts.append(time.monotonic())
        time.sleep(join_s)
        raise SwitchUnreachableError("the spine switch at 10.0.0.1:7300 did not answer")

    with switchml.Switch() as probed:
        path = SwitchPath(gloo, 0, 1, join, enabled=True, retry_s=0.05,
                          address="%s:%d" % probed.address, name="job t")
        try:
            start = time.monotonic()
            while time.monotonic() - start < 2.5:  # a call on gloo every 10 ms
                path._come_back(None)
                time.sleep(0.01)
        finally:
            path.close()
    # (the first attempt is the join at the start)
    if most is not None:  # at 0.3 s each: about 0.35, then 4 x 0.3 s after each
        assert least <= len(attempts) <= most, [round(a - attempts[0], 2) for a in attempts]
    else:
        assert len(attempts) >= least, len(attempts)


# ---------------------------------------------------------------- the recovery's own threads
class FakeWorker:
    """A switch worker whose calls end when the test says (``ends``), or fail at
    once (``gone``: its switch went away again)."""

    recoverable_in_place = False
    lost = None

    def __init__(self, gone=False):
        self.gone, self.ends = gone, []

    def allreduce_async(self, array, out=None, sparse=False, bits=None, ready=None):
        from concurrent.futures import Future

        from switchml.errors import SwitchUnreachableError
        from switchml.worker.calls import AllreduceHandle

        future = Future()
        if self.gone:
            future.set_exception(SwitchUnreachableError("the switch went away again"))
        self.ends.append(future)
        return AllreduceHandle(future)

    def close(self):
        pass


def one_rank_path(join, monkeypatch, **settings):
    """A SwitchPath of one rank (its gloo group in this process) whose probes
    always reach the switch."""
    from datetime import timedelta

    import torch.distributed as dist

    from switchml.torch import failover

    monkeypatch.setattr(failover, "fetch_stats", lambda address, timeout=None: {})
    gloo = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, timedelta(seconds=30))
    return failover.SwitchPath(gloo, 0, 1, join, enabled=True, retry_s=0.05,
                               address="127.0.0.1:9", name="job t", **settings)


def a_call(value=1.0):
    from switchml.torch.failover import Call

    tensor = torch.full((4,), value)
    return Call(tensor, None, False, None, lambda: [tensor])


def settled(call, within=5.0) -> bool:
    deadline = time.monotonic() + within
    while not call.settled.done() and time.monotonic() < deadline:
        time.sleep(0.01)
    return call.settled.done()


def test_a_return_to_a_switch_that_fails_the_calls_at_once_sends_them_to_gloo(monkeypatch):
    """The group comes back to a switch that is gone again before the calls are
    queued there (a worker over several switches fails them at once): they go
    back through gloo, none is left waiting."""
    from switchml.errors import SwitchUnreachableError

    def join(generation):
        if generation == 0:
            raise SwitchUnreachableError("no switch at the start")
        return FakeWorker(gone=True)

    path = one_rank_path(join, monkeypatch)
    try:
        time.sleep(0.2)  # the probe reached the switch
        call = a_call()
        path.submit(call)
        assert settled(call), (path._direct, sorted(path._pending))
        assert path.counters["returns"] >= 1 and path.counters["fallbacks"] >= 2
    finally:
        path.close()


def test_calls_that_fail_after_the_recovery_gave_up_fail_too(monkeypatch):
    """The recovery gives up on the group (a call it cannot settle) while a later
    call still runs on the worker: that call's failure, when it comes, settles
    it with the group's error instead of leaving it waiting."""
    from switchml.errors import SwitchUnreachableError

    worker = FakeWorker()
    path = one_rank_path(lambda generation: worker, monkeypatch)
    try:
        first, second = a_call(), a_call()
        path.submit(first)
        path.submit(second)
        worker.ends[0].set_exception(SwitchUnreachableError("gone"))
        assert settled(first) and path._broken is not None  # (lost: nothing to settle)
        worker.ends[1].set_exception(SwitchUnreachableError("gone"))
        assert settled(second)
        assert second.settled.value().error is path._broken
    finally:
        path.close()


def test_a_call_that_fails_otherwise_behind_a_failover_breaks_the_group(monkeypatch):
    """Calls settle in call order once the group left the switch: a later call that
    fails with the job's own error (not the switch's) cannot be settled, nor any
    call after it; they fail, none waits forever."""
    from switchml.errors import SwitchMLError, SwitchUnreachableError

    worker = FakeWorker()
    worker.lost = None
    path = one_rank_path(lambda generation: worker, monkeypatch)
    path._agree = lambda first, call: time.sleep(0.3) or False  # (settles nothing)
    path._come_back = lambda call: False
    try:
        calls = [a_call() for _ in range(3)]
        for call in calls:
            path.submit(call)
        worker.ends[0].set_exception(SwitchUnreachableError("gone"))
        worker.ends[1].set_exception(SwitchMLError("ranks disagree"))
        worker.ends[2].set_exception(SwitchUnreachableError("gone"))
        assert all(settled(call) for call in calls), sorted(path._pending)
        assert str(calls[1].settled.value().error) == "ranks disagree"
    finally:
        path.close()


def test_closing_the_group_fails_the_calls_still_waiting(monkeypatch):
    """Closed while calls wait for the recovery (on gloo, behind one it holds):
    they fail, saying so, rather than never settle."""
    from switchml.errors import SwitchUnreachableError

    worker = FakeWorker()
    path = one_rank_path(lambda generation: worker, monkeypatch)
    path._agree = lambda first, call: time.sleep(1.0) or False
    path._come_back = lambda call: False
    calls = [a_call() for _ in range(3)]
    for call in calls:
        path.submit(call)
    for end in worker.ends:
        end.set_exception(SwitchUnreachableError("gone"))
    time.sleep(0.2)  # the recovery holds call 0; 1 and 2 wait
    path.close()
    assert settled(calls[1]) and settled(calls[2])
    assert "closed" in str(calls[2].settled.value().error)


def test_a_works_wait_ends_at_its_timeout_and_its_result_is_the_tensors():
    """``Work.wait(timeout)``: a call not done by then raises, as gloo's does
    (it waited for the call whatever the timeout); ``result()`` gives the call's
    tensors, as gloo's does."""
    from datetime import timedelta

    from switchml.torch import _SwitchWork

    work = _SwitchWork(torch.futures.Future())
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="did not complete within 0.2s"):
        work.wait(timedelta(seconds=0.2))
    assert time.monotonic() - start < 5
    done = torch.futures.Future()
    tensors = [torch.ones(3)]
    done.set_result(tensors)
    work = _SwitchWork(done)
    assert work.wait(timedelta(seconds=1)) and work.result() is tensors
