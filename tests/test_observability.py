"""Prometheus metrics scraped from a real switch's endpoint, and the switch's logs."""

import logging
import re
import socket
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest
from conftest import job_whose_rank_1_vanishes, run_ranks
from prometheus_client.parser import text_string_to_metric_families

import switchml
from switchml import wire

K = 1024


def scrape(switch) -> dict:
    """{(sample name, sorted label items): value} from the switch's /metrics."""
    url = "http://%s:%d/metrics" % switch.metrics_address
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(metrics: dict, name: str, default=None, **labels):
    """The sample ``name`` with exactly these labels (``default`` if absent)."""
    key = (name, tuple(sorted(labels.items())))
    return metrics[key] if default is None else metrics.get(key, default)


def wait_for(condition, seconds=5.0):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "the switch did not count the packets in time"
        time.sleep(0.02)


def first_contributions(m: dict, job: dict) -> float:
    """The first contributions the job's counters account for. Every contribution
    or probe admitted is a first contribution, or a retransmission: answered with the
    stored result, not yet complete (a duplicate, a probe waiting), stale, a done,
    or a resend asked for. A worker late for a result sends a probe, which counts no
    packet in."""
    def other(counter):
        return value(m, "switchml_job_other_events_total", 0, counter=counter, **job)
    return (value(m, "switchml_job_packets_in_total", **job) + other("probes_in")
            - value(m, "switchml_job_retransmissions_answered_total", **job)
            - value(m, "switchml_job_duplicates_total", **job)
            - value(m, "switchml_job_dropped_packets_total", 0, reason="stale", **job)
            - other("probes_waiting") - other("queries_done") - other("resends_asked"))


def test_counters_account_for_every_first_contribution_under_loss():
    """Losses both ways make the workers probe, query and send again: the counters
    still account for exactly ranks x chunks first contributions (a probe answered
    with the stored result counted as a contribution made this one short)."""
    with switchml.Switch(packet_elements=K, slots=64, slots_per_job=16, metrics_port=0,
                         drop_rate=0.1, egress_drop_rate=0.1) as sw:
        data = [np.arange(10 * K + 5, dtype=np.int32) * (r + 1) for r in range(2)]
        workers = [None, None]

        def body(rank):
            if workers[rank] is None:
                workers[rank] = switchml.Worker(sw.address, rank, 2, job="lossy", timeout=10)
            return workers[rank].allreduce(data[rank])

        job, calls, probes = {"job": "lossy"}, 0, 0
        while not probes and calls < 20:  # until a probe was answered
            for out in run_ranks(2, body):
                assert np.array_equal(out, data[0] + data[1])
            calls += 1
            job["session"] = f"{workers[0].membership.session:08x}"
            m = scrape(sw)
            probes = value(m, "switchml_job_other_events_total", 0, counter="probes_in", **job)
        assert first_contributions(m, job) == 2 * 11 * calls
        for w in workers:
            w.close()


def test_metrics_count_a_real_allreduce_and_injected_garbage():
    with switchml.Switch(packet_elements=K, slots=64, slots_per_job=16, metrics_port=0) as sw:
        data = [np.arange(10 * K + 5, dtype=np.int32) * (r + 1) for r in range(2)]
        workers = [None, None]

        def body(rank):
            w = workers[rank] = switchml.Worker(sw.address, rank, 2, job="obs", timeout=10)
            return w.allreduce(data[rank])

        for out in run_ranks(2, body):
            assert np.array_equal(out, data[0] + data[1])
        job = {"job": "obs", "session": f"{workers[0].membership.session:08x}"}
        m = scrape(sw)
        chunks = 11
        assert value(m, "switchml_job_results_completed_total", **job) == chunks
        retrans = value(m, "switchml_job_retransmissions_answered_total", **job)
        first = first_contributions(m, job)
        assert first == 2 * chunks
        assert value(m, "switchml_job_results_out_total", **job) - retrans == 2 * chunks
        assert value(m, "switchml_packets_in_total") == \
            value(m, "switchml_job_packets_in_total", **job)
        assert value(m, "switchml_job_info", slots="0..15", state="running", world_size="2",
                     **job) == 1
        assert value(m, "switchml_slots_free") == 48
        assert value(m, "switchml_jobs", state="running") == 1

        # garbage: a stranger, and a member with a wrong session and truncated packets
        stranger = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        for i in range(7):
            stranger.sendto(b"garbage %d" % i, sw.address)
        lanes = np.zeros(K // 256, wire.LANE)
        wrong = wire.encode(wire.KIND_CONTRIBUTION, wire.DTYPE_INT32, 0,
                            workers[0].membership.session ^ 1, 0, 0, 0, lanes, np.ones(K, np.int32))
        for _ in range(5):
            workers[0]._udp.sendto(wrong, sw.address)
        for _ in range(4):
            workers[0]._udp.sendto(wrong[:20], sw.address)
        totals = lambda: sw.stats()["totals"]  # noqa: E731
        wait_for(lambda: totals().get("dropped_unknown_source", 0) == 7
                 and totals().get("dropped_bad_token", 0) == 5
                 and totals().get("dropped_truncated", 0) == 4)
        m = scrape(sw)
        assert value(m, "switchml_dropped_packets_total", reason="unknown_source") == 7
        assert value(m, "switchml_job_dropped_packets_total", reason="bad_token", **job) == 5
        assert value(m, "switchml_job_dropped_packets_total", reason="truncated", **job) == 4
        assert value(m, "switchml_dropped_packets_total", reason="bad_token") == 5
        stranger.close()
        for w in workers:
            w.close()
        # an ended job keeps its series, with its state; the totals never go down
        m = scrape(sw)
        assert value(m, "switchml_job_info", slots="0..15", state="ended", world_size="2",
                     **job) == 1
        assert value(m, "switchml_dropped_packets_total", reason="bad_token") == 5
        assert value(m, "switchml_control_events_total", event="jobs_ended") == 1
        assert value(m, "switchml_slots_free") == 64


def test_refused_joins_are_counted_by_limit():
    with switchml.Switch(packet_elements=K, slots=16, slots_per_job=16, metrics_port=0) as sw:
        with switchml.Worker(sw.address, 0, 1, job="a"):
            for _ in range(2):
                with pytest.raises(switchml.LimitExceededError):
                    switchml.Worker(sw.address, 0, 1, job="b", timeout=2)
        m = scrape(sw)
        assert value(m, "switchml_joins_refused_total", reason="slots") == 2
        assert value(m, "switchml_control_events_total", event="control_join_refused") == 2


def test_metrics_without_prometheus_client_name_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # as if not installed
    with pytest.raises(switchml.MetricsUnavailableError,
                       match=r"the 'metrics' extra.*pip install 'prometheus-client"):
        switchml.Switch(metrics_port=0)
    code = ("import sys; sys.modules['prometheus_client'] = None; from switchml.cli import main; "
            "sys.exit(main(['switch', '--port', '0', '--metrics-port', '0']))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=30)
    assert result.returncode == 2
    assert "pip install 'prometheus-client>=0.17'" in result.stderr


def test_logs_joins_leaves_failures_and_summarises_drops(caplog):
    caplog.set_level(logging.DEBUG, logger="switchml.switch")
    sw = switchml.Switch(packet_elements=K, slots=64, slots_per_job=16)
    sw.drop_log_interval = 0.2
    with sw:
        with switchml.Worker(sw.address, 0, 1, job="logged") as w:
            w.allreduce(np.ones(100, np.float32))
            stranger = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            for _ in range(200):
                stranger.sendto(b"junk", sw.address)
            stranger.close()
            wait_for(lambda: sw.stats()["counters"].get("dropped_unknown_source") == 200)
            time.sleep(0.5)  # one more summary interval
            # What follows may add drops of its own: rank 0's first packets reach the
            # switch after the doomed job is gone, as many as the race allows.
            summarised = len(caplog.records)
        # a job that fails: its rank 1 (a bare control connection) goes away without leaving
        errors = job_whose_rank_1_vanishes(sw.address, "doomed", timeout=2)
        assert errors and errors[0].missing_ranks == [1]
    records = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "switchml.switch"]
    info = [m for level, m in records if level == logging.INFO]
    assert any(re.search(r"job logged: rank 0/1 joined from", m) for m in info)
    assert any(m.startswith("job logged started: session") for m in info)
    assert "job logged: rank 0 left" in info and "job logged ended; its slots are free" in info
    warnings = [m for level, m in records if level == logging.WARNING]
    assert "job doomed failed: rank 1 disconnected without leaving" in warnings
    # drops: never a line per packet, only DEBUG summaries that add up
    before_doomed = [(r.levelno, r.getMessage()) for r in caplog.records[:summarised]
                     if r.name == "switchml.switch"]
    summaries = [m for level, m in before_doomed if "unknown_source" in m]
    assert all(level == logging.DEBUG for level, m in records if "unknown_source" in m)
    assert 1 <= len(summaries) <= 5
    assert sum(int(re.search(r"unknown_source (\d+)", m).group(1)) for m in summaries) == 200


def test_idle_metrics_clients_take_no_more_than_their_share(monkeypatch):
    """Scrapers that connect and send nothing (or a byte a minute) are served
    MAX_METRICS_CLIENTS at a time, each let go after METRICS_CLIENT_S; the rest
    are closed at once.  (Unbounded, they took every descriptor of the switch's
    process, and no job could join.)"""
    from switchml.switch import metrics

    monkeypatch.setattr(metrics._Handler, "timeout", 0.5)
    with switchml.Switch(metrics_port=0) as sw:
        idle = [socket.create_connection(sw.metrics_address) for _ in range(40)]
        try:
            for conn in idle:
                conn.sendall(b"GET /met")  # part of a request, never the rest
                conn.settimeout(3.0)
            closed_at_once = 0
            for conn in idle:
                conn.settimeout(0.2)
                try:
                    closed_at_once += conn.recv(1) == b""
                except TimeoutError:
                    pass
            assert closed_at_once >= 40 - metrics.MAX_METRICS_CLIENTS
            time.sleep(1.0)  # the ones served: let go at their timeout
            scrape = urllib.request.urlopen("http://%s:%d/metrics" % sw.metrics_address,
                                            timeout=5).read().decode()
            assert "switchml_uptime_seconds" in scrape
            with switchml.Worker(sw.address, 0, 1, job="after", timeout=5) as w:
                assert w.allreduce(np.ones(3, np.float32)).tolist() == [1.0, 1.0, 1.0]
        finally:
            for conn in idle:
                conn.close()


def test_stats_from_a_peer_that_is_no_switch_fail_within_the_timeout():
    """A peer that talks and never answers (a line a while), or answers stats that
    are no switch's: ``fetch_stats`` (``switchml stats``) fails within its timeout
    or says so (it waited forever, or raised KeyError from the table)."""
    import threading

    from switchml.worker.client import fetch_stats

    def peer(lines):
        listener = socket.create_server(("127.0.0.1", 0))

        def serve():
            conn, _ = listener.accept()
            with conn:
                for line in lines:
                    try:
                        conn.sendall(line)
                    except OSError:  # fetch_stats gave up and hung up: as it should
                        return
                    time.sleep(0.3)
        threading.Thread(target=serve, daemon=True).start()
        return listener

    chatter = peer([b'{"event": "news"}\n'] * 20)
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        fetch_stats("127.0.0.1:%d" % chatter.getsockname()[1], timeout=1.0)
    assert time.monotonic() - started < 2.0
    other = peer([b'{"event": "stats", "stats": {"version": 2}}\n'])
    with pytest.raises(ValueError, match="not a switchml switch"):
        fetch_stats("127.0.0.1:%d" % other.getsockname()[1], timeout=2.0)
    chatter.close()
    other.close()
