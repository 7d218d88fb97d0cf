"""Authenticated jobs: a job's secret proven at join, the switch's admission token,
and per-rank data-plane tokens.

Sans-IO against the controller (a squatter before and after the real ranks, a
replayed proof, a wrong key or token), hypothesis over the data plane (Python and
C: datagrams carrying another rank's token, from a stranger's address, with a
guessed token change no sum and are counted), and real switches and workers
(the squatter with real sockets; an admission token through the environment).
"""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import switchml
from switchml import auth, protocol, wire
from switchml.errors import (
    AuthenticationError,
    SecretMismatchError,
    SwitchMLError,
    SwitchMLTimeoutError,
)
from switchml.netutil import encode_line
from switchml.switch.control import Controller
from switchml.switch.dataplane import fastpipeline
from switchml.switch.dataplane.pipeline import Pipeline
from switchml.worker.control import OTHER_SECRET_GRACE, ControlClient

SECRET = "correct horse battery staple"
TOKEN = b"switch-admission-token-42"
PIPELINES = [Pipeline] + ([fastpipeline.FastPipeline] if fastpipeline._fastpath else [])


# ---------------------------------------------------------------- the key
def test_every_rank_derives_the_same_key_and_another_secret_or_name_another():
    key = auth.JobKey(SECRET, "j")
    assert key.public == auth.JobKey(SECRET.encode(), "j").public
    assert key.public != auth.JobKey(SECRET + "!", "j").public
    assert key.public != auth.JobKey(SECRET, "k").public
    assert SECRET not in repr(key) and len(key.public) == auth.KEY_HEX


def test_a_signature_checks_only_under_its_key_and_message():
    key, other = auth.JobKey(SECRET, "j"), auth.JobKey("guess", "j")
    message = auth.transcript(auth.new_nonce(), "j", 0, key.public)
    signature = key.sign(message)
    assert auth.verify(key.public, signature, message)
    assert not auth.verify(other.public, signature, message)
    assert not auth.verify(key.public, signature, message + b"x")
    assert not auth.verify(key.public, "00" * 64, message)
    assert not auth.verify("zz", signature, message)


# ---------------------------------------------------------------- sans-IO controller
class Rank:
    """A ControlClient wired to a Controller on connection ``conn``."""

    def __init__(self, ctl, conn, rank, world, *, secret=None, token=None, job="j"):
        self.ctl, self.conn = ctl, conn
        self.client = ControlClient(job, rank, world, timeout=10, secret=secret,
                                    switch_token=token)
        self.events: list = []

    def join(self):
        self.client.join(("10.0.0.1", 1000 + self.conn), 0.0)
        return self.flush()

    def flush(self, now=1.0):
        """Send what the client has; deliver every answer to whom it is for."""
        out = []
        data = self.client.data_to_send()
        for line in data.splitlines():
            out += self.ctl.handle_message(self.conn, json.loads(line))
        deliver(out, now)
        return out

    def wait_until(self, until: float) -> None:
        """Fire the client's timers up to ``until``: its status queries (whether the
        switch is still there, while the job gathers) answered at once."""
        while (t := self.client.get_timer()) is not None and t <= until:
            self.client.handle_timer(t)
            self.flush(t)

    def gives_up_at(self, deadline: float) -> SwitchMLError | None:
        """Whether the client is still joined just before ``deadline``; its error at it."""
        self.wait_until(deadline - 0.01)
        assert self.client.error is None, self.client.error
        self.wait_until(deadline)
        return self.client.error


RANKS: dict = {}


def deliver(out, now=1.0):
    """The switch's answers to their clients; then what the clients answer (proofs)."""
    for conn, msg in out:
        RANKS[conn].events += RANKS[conn].client.receive_data(encode_line(msg), now)
    for conn in dict.fromkeys(c for c, _ in out):
        RANKS[conn].flush(now)


def rank(ctl, conn, r, world, **kw) -> Rank:
    RANKS[conn] = Rank(ctl, conn, r, world, **kw)
    return RANKS[conn]


@pytest.fixture
def ctl():
    RANKS.clear()
    return Controller(Pipeline(slots=16, packet_elements=64), data_port=9, slots_per_job=4)


def readies(*ranks):
    return [r.client.ready for r in ranks]


def test_ranks_with_the_secret_form_the_job_and_get_tokens_of_their_own(ctl):
    a, b = rank(ctl, 1, 0, 2, secret=SECRET), rank(ctl, 2, 1, 2, secret=SECRET)
    a.join()
    b.join()
    ra, rb = readies(a, b)
    assert ra and rb and ra.session == rb.session and 0 != ra.token != rb.token != 0
    job = ctl.pipeline.jobs[ra.session]
    assert job.tokens == [ra.token, rb.token]
    assert ctl.pipeline.counters["jobs_open"] == 0


@pytest.mark.parametrize("squatter", [None, "guessed secret"])
def test_a_squatter_before_the_real_ranks_never_joins_their_job(ctl, squatter):
    """It knows the job's name and takes rank 0 first, with no secret or a wrong
    one: on the switch it is another job, so the real ranks form theirs and it
    gets nothing of it."""
    s = rank(ctl, 9, 0, 2, secret=squatter)
    s.join()
    a, b = rank(ctl, 1, 0, 2, secret=SECRET), rank(ctl, 2, 1, 2, secret=SECRET)
    a.join()
    b.join()
    ra, rb = readies(a, b)
    assert ra is not None and rb is not None
    assert s.client.ready is None and s.client.error is None  # still waiting for its world
    job = ctl.pipeline.jobs[ra.session]
    assert ("10.0.0.1", 1009) not in job.members
    assert len(ctl.pipeline.jobs) == 1


def test_a_squatter_after_the_real_ranks_does_not_stop_them(ctl):
    a, b = rank(ctl, 1, 0, 2, secret=SECRET), rank(ctl, 2, 1, 2, secret=SECRET)
    a.join()
    s = rank(ctl, 9, 1, 2, secret="guessed")  # takes rank 1 before the real rank 1
    s.join()
    b.join()
    assert readies(a, b) != [None, None] and None not in readies(a, b)
    s2 = rank(ctl, 8, 0, 2)  # and an open one with the name, once the job runs
    s2.join()
    assert s.client.ready is None and s2.client.ready is None
    assert s2.client.error is None  # a job of its own, gathering
    assert len(ctl.pipeline.jobs) == 1


def test_a_replayed_proof_is_refused_and_counted(ctl):
    """A proof captured from one connection: on another, the switch's nonce differs."""
    a = rank(ctl, 1, 0, 2, secret=SECRET)
    a.client.join(("10.0.0.1", 1001), 0.0)
    [join_line] = a.client.data_to_send().splitlines()
    [(_, challenge)] = ctl.handle_message(1, json.loads(join_line))
    a.events += a.client.receive_data(json.dumps(challenge).encode() + b"\n", 0.0)
    [prove_line] = a.client.data_to_send().splitlines()
    ctl.handle_message(1, json.loads(prove_line))  # the real rank 0 is in
    # the attacker replays both lines on its own connection
    [(_, second)] = ctl.handle_message(7, json.loads(join_line))
    assert second["event"] == "challenge" and second["nonce"] != challenge["nonce"]
    [(_, refused)] = ctl.handle_message(7, json.loads(prove_line))
    assert refused["event"] == "error" and refused["reason"] == "authentication"
    assert "job 'j' rank 0" in refused["message"] and SECRET not in refused["message"]
    assert ctl.refused["authentication"] == 1
    assert sorted(ctl.jobs["j", a.client.key].conns) == [0]


def test_a_proof_for_another_key_or_rank_is_refused(ctl):
    a = rank(ctl, 1, 0, 2, secret=SECRET)
    a.client.join(("10.0.0.1", 1001), 0.0)
    [(_, challenge)] = ctl.handle_message(1, json.loads(a.client.data_to_send()))
    message = auth.transcript(challenge["nonce"], "j", 0, a.client.key)
    forged = auth.JobKey("guess", "j").sign(message)
    [(_, refused)] = ctl.handle_message(1, {"op": "prove", "rank": 0, "signature": forged})
    assert refused["reason"] == "authentication"
    [(_, refused)] = ctl.handle_message(1, {"op": "prove", "rank": 1, "signature": forged})
    assert "no challenge is open for rank 1" in refused["message"]


def test_the_worker_raises_authentication_error_naming_job_and_rank(ctl):
    client = ControlClient("j", 0, 2, timeout=10, secret=SECRET)
    failed = client.receive_data(json.dumps({
        "event": "error", "message": "job 'j' rank 0: the request did not prove the job's "
        "secret", "reason": "authentication"}).encode() + b"\n", 0.0)
    assert isinstance(client.error, AuthenticationError) and failed
    assert client.error.reason == "authentication" and "rank 0" in str(client.error)


def test_a_first_rank_with_another_secret_is_told_and_gives_up_after_the_grace(ctl):
    """Rank 0 with the secret waits; rank 1 with a mistyped one starts a job of its
    own: it is told that ranks of the name wait with another secret, and gives up
    at the grace's end with SecretMismatchError; rank 0's timeout error says a
    join with another secret was seen.  Neither learns more of the other."""
    a = rank(ctl, 1, 0, 2, secret=SECRET)
    a.join()
    typo = rank(ctl, 2, 1, 2, secret=SECRET + "!")
    a.events.clear()
    typo.join()
    assert [type(e).__name__ for e in typo.events] == ["Joined", "OtherSecretWaiting"]
    assert a.events == [protocol.OtherSecretSeen("j")]
    deadline = typo.client.get_timer()
    assert deadline == pytest.approx(1.0 + OTHER_SECRET_GRACE)
    assert typo.client.handle_timer(deadline - 0.01) == []
    typo.client.handle_timer(deadline)
    error = typo.client.error
    assert isinstance(error, SecretMismatchError) and isinstance(error, AuthenticationError)
    assert error.reason == "secret_mismatch"
    assert "waiting on the switch with a different secret" in str(error)
    assert SECRET not in str(error)
    a.wait_until(10.0)
    assert isinstance(a.client.error, SwitchMLTimeoutError)
    assert "ranks [1] did not join" in str(a.client.error)
    assert "another secret" in str(a.client.error)


def test_a_rank_of_its_own_secret_within_the_grace_keeps_a_first_rank_joined(ctl):
    """A squatter with a guessed secret holds rank 1 first; the real rank 0 is told
    that ranks of the name wait with another secret, but the real rank 1 joins
    within the grace: the real job runs, the squatter waits on alone."""
    s = rank(ctl, 9, 1, 2, secret="guessed")
    s.join()
    a, b = rank(ctl, 1, 0, 2, secret=SECRET), rank(ctl, 2, 1, 2, secret=SECRET)
    a.join()
    assert a.client.get_timer() == pytest.approx(1.0 + OTHER_SECRET_GRACE)
    b.join()
    assert None not in readies(a, b) and a.client.error is None
    assert s.client.ready is None and s.client.error is None


def test_a_process_holding_some_ranks_of_a_name_does_not_make_a_first_rank_give_up(ctl):
    """A squatter (or another job of the same name) holding rank 1 of three: the real
    rank 0 would not complete it, so it is not told, and waits for its own ranks."""
    rank(ctl, 9, 1, 3, secret="guessed").join()
    a = rank(ctl, 1, 0, 3, secret=SECRET)
    a.join()
    assert not [e for e in a.events if isinstance(e, protocol.OtherSecretWaiting)]
    assert isinstance(a.gives_up_at(0.0 + 10), SwitchMLTimeoutError)  # its timeout, not the grace


def test_ranks_that_cannot_be_one_job_are_not_told_to_give_up(ctl):
    """Another world size, or a rank the waiting job has already: not one job with a
    mistyped secret, so the new rank is not told to give up."""
    rank(ctl, 9, 0, 2, secret="guessed").join()
    same_rank = rank(ctl, 1, 0, 2, secret=SECRET)
    other_world = rank(ctl, 2, 1, 3, secret="third")
    for r in (same_rank, other_world):
        r.join()
        assert not [e for e in r.events if isinstance(e, protocol.OtherSecretWaiting)]
        assert isinstance(r.gives_up_at(0.0 + 10), SwitchMLTimeoutError)


@pytest.mark.parametrize("host, level", [("127.0.0.1", "INFO"), ("0.0.0.0", "WARNING")])
def test_an_open_job_is_warned_of_only_where_other_hosts_reach_the_switch(caplog, host, level):
    """A switch on loopback alone (the quick start's) logs an open job at INFO: no
    other host can join it; one that other hosts reach warns."""
    caplog.set_level("INFO", logger="switchml.switch")
    with switchml.Switch(host) as sw:
        assert sw.controller.loopback_only is (host == "127.0.0.1")
        with switchml.Worker(("127.0.0.1", sw.address[1]), 0, 1, job="open") as w:
            w.allreduce(np.ones(10, np.float32))
    [record] = [r for r in caplog.records if "unauthenticated" in r.getMessage()]
    assert record.levelname == level


# ---------------------------------------------------------------- admission token
@pytest.fixture
def guarded():
    RANKS.clear()
    return Controller(Pipeline(slots=16, packet_elements=64), data_port=9, slots_per_job=4,
                      admission_token=TOKEN)


def test_without_the_admission_token_no_job_is_created(guarded):
    s = rank(guarded, 1, 0, 1)
    s.join()
    assert isinstance(s.client.error, AuthenticationError)
    assert s.client.error.reason == "admission" and "SWITCHML_SWITCH_TOKEN" in str(s.client.error)
    wrong = rank(guarded, 2, 0, 1, token=b"not it")
    wrong.join()
    assert isinstance(wrong.client.error, AuthenticationError)
    assert not guarded.jobs and not guarded.pipeline.jobs
    assert guarded.refused["admission"] == 1  # the first never sent a proof: it had none
    ok = rank(guarded, 3, 0, 1, token=TOKEN)
    ok.join()
    assert ok.client.ready is not None
    assert guarded.pipeline.counters["jobs_open"] == 1  # admitted, but its job has no secret


def test_stats_show_job_names_but_never_secrets_or_tokens(guarded):
    a = rank(guarded, 1, 0, 1, token=TOKEN, secret=SECRET, job="visible-name")
    a.join()
    ready = a.client.ready
    assert ready is not None
    stats = json.dumps({"admission": guarded.admission(), "pipeline": guarded.pipeline.stats()})
    assert "visible-name" in stats
    for hidden in (SECRET, TOKEN.decode(), str(ready.token), f"{ready.token:08x}"):
        assert hidden not in stats


# ---------------------------------------------------------------- data plane
K = 8
M0, M1, M2 = (("10.0.0.1", 1000 + r) for r in range(3))
TOKENS = [0x11111111, 0x22222222, 0x33333333]
SESSION = 0x5E55_1011


def contribution(token: int, values, slot: int = 0) -> bytes:
    return wire.encode(wire.KIND_CONTRIBUTION, wire.DTYPE_INT32, slot, token, 0, 0, 0,
                       np.zeros(1, wire.LANE), np.asarray(values, np.int32))


hostile = st.one_of(
    # a member with another rank's token (its own address)
    st.tuples(st.sampled_from([M0, M1]), st.sampled_from(TOKENS), st.just("other")),
    # another rank's address (spoofed) with this member's own token
    st.tuples(st.just(M2), st.sampled_from(TOKENS[:2]), st.just("spoofed")),
    # a stranger's address with any token
    st.tuples(st.sampled_from([("10.0.0.9", 1002), ("10.0.0.1", 999)]),
              st.sampled_from(TOKENS), st.just("stranger")),
    # a guessed token
    st.tuples(st.sampled_from([M0, M1, M2]), st.integers(0, 2**32 - 1), st.just("guess")),
)


@settings(max_examples=80, derandomize=True, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(attacks=st.lists(st.tuples(hostile, st.lists(st.integers(-2**31, 2**31 - 1),
                                                     min_size=K, max_size=K)),
                        max_size=12))
def test_forged_datagrams_change_no_sum_and_are_counted_in_both_data_planes(attacks):
    rng = np.random.default_rng(len(attacks))
    real = rng.integers(-1000, 1000, (3, K)).astype(np.int32)
    seen = []
    for cls in PIPELINES:
        p = cls(slots=4, packet_elements=K, block_elements=K)
        p.install_job("j", SESSION, [M0, M1, M2], 0, 4, tokens=TOKENS)
        addresses = {M0: 0, M1: 1, M2: 2}
        out = p.receive_datagram(contribution(TOKENS[0], real[0]), M0)
        out += p.receive_datagram(contribution(TOKENS[1], real[1]), M1)
        expected_bad = expected_unknown = 0
        for (addr, token, _what), values in attacks:
            if addr not in addresses:
                expected_unknown += 1
            elif token != TOKENS[addresses[addr]]:
                expected_bad += 1
            else:
                continue  # the genuine sender itself: not an attack (a guess that hit)
            out += p.receive_datagram(contribution(token, values), addr)
        assert out == []  # nothing completed, nothing answered
        [(result, _), *_] = p.receive_datagram(contribution(TOKENS[2], real[2]), M2)
        got = wire.values(bytes(result), 1, K)
        assert (got == real.sum(axis=0, dtype=np.int32)).all()
        assert wire.decode_header(bytes(result)).session == SESSION  # not a token
        if hasattr(p, "sync_counters"):
            p.sync_counters()
        counters = p.totals()
        assert counters["dropped_bad_token"] == expected_bad
        assert counters["dropped_unknown_source"] == expected_unknown
        seen.append((bytes(result), dict(counters)))
    assert all(s == seen[0] for s in seen)  # the C data plane is the Python one


@pytest.mark.parametrize("cls", PIPELINES)
def test_a_probe_is_answered_with_the_jobs_session_not_the_rank_token(cls):
    p = cls(slots=4, packet_elements=K, block_elements=K)
    p.install_job("j", SESSION, [M0, M1], 0, 4, tokens=TOKENS[:2])
    probe = wire.probe_of(contribution(TOKENS[0], np.ones(K)), wire.KIND_PROBE)
    [(resend, addr)] = p.receive_datagram(probe, M0)
    h = wire.decode_header(bytes(resend))
    assert addr == M0 and h.kind == wire.KIND_RESEND and h.session == SESSION


# ---------------------------------------------------------------- real sockets
def run_ranks(address, count, job, secret, results, errors, timeout=20, *, world=None,
              ranks=None):
    """Threads for ``ranks`` (0..count-1) of a job of ``world`` (count) ranks."""
    world = count if world is None else world

    def body(r):
        try:
            with switchml.Worker(address, r, world, job=job, timeout=timeout,
                                 secret=secret, local_stage=False) as w:
                results[r] = w.allreduce(np.full(1000, r + 1, np.float32))
        except Exception as exc:  # noqa: BLE001 - the test reads it
            errors[r] = exc
    threads = [threading.Thread(target=body, args=(r,))
               for r in (range(count) if ranks is None else ranks)]
    for t in threads:
        t.start()
    return threads


def test_a_squatter_process_with_the_name_gets_no_sum_and_the_job_runs():
    with switchml.Switch() as sw:
        stolen: dict = {}
        squatter_errors: dict = {}
        # The squatter joins rank 0 of "train" first, without the secret.
        squat = threading.Thread(target=lambda: squatter_errors.setdefault(0, _squat(
            sw.address, stolen)))
        squat.start()
        deadline = time.monotonic() + 10
        while not sw.controller.jobs:  # it holds rank 0 of a job named "train"
            assert time.monotonic() < deadline
            time.sleep(0.01)
        results: dict = {}
        errors: dict = {}
        for t in run_ranks(sw.address, 2, "train", SECRET, results, errors):
            t.join(30)
        assert not errors, errors
        assert all((results[r] == 3.0).all() for r in (0, 1))
        squat.join(30)
        assert not stolen  # it never joined the real job, never received its sums
        assert isinstance(squatter_errors[0], SwitchMLTimeoutError)


@pytest.mark.parametrize("local_stage", [False, True], ids=["join", "gather"])
def test_a_rank_with_a_mistyped_secret_gets_secret_mismatch_within_two_seconds(local_stage):
    """Rank 0 with the secret joins (or, with the local stage, gathers its host
    records); rank 1 with a mistyped one raises SecretMismatchError within 2 s,
    not after its 20 s timeout; rank 0 times out saying another secret was seen."""
    with switchml.Switch() as sw:
        errors: dict = {}

        def body(r, secret, timeout):
            try:
                with switchml.Worker(sw.address, r, 2, job="sec", timeout=timeout,
                                     secret=secret, local_stage=local_stage):
                    pass
            except Exception as exc:  # noqa: BLE001 - the test reads it
                errors[r] = (exc, time.monotonic())
        right = threading.Thread(target=body, args=(0, SECRET, 3))
        right.start()
        deadline = time.monotonic() + 10
        while not (sw.controller.jobs or len(sw.controller.gatherings)):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        start = time.monotonic()
        body(1, SECRET + "!", 20)
        right.join(30)
    typo, when = errors[1]
    assert isinstance(typo, SecretMismatchError), typo
    assert when - start < 2.0
    assert isinstance(errors[0][0], SwitchMLTimeoutError)
    assert "another secret" in str(errors[0][0])


def test_a_squatter_after_the_first_real_rank_gives_up_and_the_job_runs():
    """A process with the name and a guessed secret takes rank 1 after the real
    rank 0 joined: it is told to give up, and the real job runs."""
    with switchml.Switch() as sw:
        results: dict = {}
        errors: dict = {}
        (first,) = run_ranks(sw.address, 1, "train", SECRET, results, errors, world=2)
        deadline = time.monotonic() + 10
        while not sw.controller.jobs:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        stolen: dict = {}
        squatter = _squat(sw.address, stolen, rank=1, secret="guessed", timeout=20)
        assert isinstance(squatter, SecretMismatchError) and not stolen
        (second,) = run_ranks(sw.address, 1, "train", SECRET, results, errors, world=2,
                              ranks=[1])
        first.join(30)
        second.join(30)
        assert not errors, errors
        assert all((results[r] == 3.0).all() for r in (0, 1))


def _squat(address, stolen, rank=0, secret=None, timeout=3):
    try:
        with switchml.Worker(address, rank, 2, job="train", timeout=timeout, secret=secret,
                             local_stage=False) as w:
            stolen["sum"] = w.allreduce(np.zeros(1000, np.float32))
    except Exception as exc:  # noqa: BLE001 - the test reads it
        return exc
    return None


def test_a_switch_with_an_admission_token_takes_workers_that_have_it(monkeypatch):
    monkeypatch.setenv("SWITCHML_SWITCH_TOKEN", TOKEN.decode())
    with switchml.Switch() as sw:
        results: dict = {}
        errors: dict = {}
        for t in run_ranks(sw.address, 2, "ok", None, results, errors):
            t.join(30)
        assert not errors and all((results[r] == 3.0).all() for r in (0, 1))
        monkeypatch.delenv("SWITCHML_SWITCH_TOKEN")
        with pytest.raises(AuthenticationError, match="admission token"):
            switchml.Worker(sw.address, 0, 1, job="nope", timeout=5, local_stage=False)
        # refused before it sent a proof: it knew it had no token to prove
        assert not sw.controller.jobs and "nope" not in json.dumps(sw.stats())
