"""The `switchml` command: a real switch process, stats from outside, the demo."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest
from conftest import interruptible

import switchml
from switchml import config
from switchml.errors import AuthenticationError

CLI = [sys.executable, "-m", "switchml.cli"]


def test_switch_command_serves_and_reports_stats():
    proc = subprocess.Popen(CLI + ["switch", "--port", "0", "--slots", "16",
                                   "--packet-elements", "512", "--log-level", "warning",
                                   "--metrics-port", "0", "--join-deadline", "0.3"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=interruptible)
    try:
        line = proc.stdout.readline()
        assert "listening on" in line, line + proc.stderr.read()
        address = line.split("SWITCHML_SWITCH=")[1].strip()
        metrics_url = proc.stdout.readline().split()[-1]
        assert metrics_url.startswith("http://127.0.0.1:") and metrics_url.endswith("/metrics")
        with switchml.Worker(address, 0, 1, job="cli-test") as w:
            assert np.array_equal(w.allreduce(np.arange(2000, dtype=np.int32)), np.arange(2000))
            session = f"{w.membership.session:08x}"
        junk = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        for _ in range(3):
            junk.sendto(b"junk", config.parse_address(address))
        junk.close()
        idle = socket.create_connection(config.parse_address(address))
        idle.sendall(b'{"op": ')
        time.sleep(0.5)  # past the join deadline
        assert idle.recv(100) == b""
        idle.close()
        table = subprocess.run(CLI + ["stats", "--switch", address], capture_output=True,
                               text=True, timeout=30)
        assert table.returncode == 0, table.stderr
        rows = {line.split()[0]: line.split() for line in table.stdout.splitlines() if line}
        # job, session, state, world, slots, packets_in, results_out, retransmits, ...
        assert rows["cli-test"][:7] == ["cli-test", session, "ended", "1", "0..15", "4", "4"]
        assert rows["unknown_source"] == ["unknown_source", "3", "0"]  # (no job), cli-test
        assert rows["jobs_started"] == ["jobs_started", "1"]
        assert rows["jobs_unauthenticated"] == ["jobs_unauthenticated", "1"]
        assert "control connections closed: did not join within the deadline 1" in table.stdout
        raw = subprocess.run(CLI + ["stats", "--switch", address, "--json"],
                             capture_output=True, text=True, timeout=30)
        stats = json.loads(raw.stdout)
        assert stats["slots"] == 16 and stats["packet_elements"] == 512
        # 2000 int32 in 512-value packets: 4 packets, each answered once
        assert stats["ended_jobs"]["cli-test"]["counters"]["results_completed"] == 4
        metrics = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
        assert f'switchml_job_results_completed_total{{job="cli-test",session="{session}"}} 4.0' \
            in metrics
        assert 'switchml_dropped_packets_total{reason="unknown_source"} 3.0' in metrics
        assert 'switchml_control_closed_total{reason="join_deadline"} 1.0' in metrics
        assert 'switchml_control_closed_total{reason="source_cap"} 0.0' in metrics
        assert 'switchml_control_connections{state="unjoined"}' in metrics
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=10) == 0


def test_stats_of_a_missing_switch_is_a_clear_error():
    with switchml.Switch() as sw:
        address = f"{sw.address[0]}:{sw.address[1]}"
    result = subprocess.run(CLI + ["stats", "--switch", address], capture_output=True,
                            text=True, timeout=30)
    assert result.returncode == 1
    assert f"cannot read the switch at {address}" in result.stderr


def test_demo_checks_its_sums():
    result = subprocess.run(CLI + ["demo", "--workers", "3", "--sizes", "0", "1", "20000",
                                   "--repeats", "1"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "demo passed" in result.stdout
    assert result.stdout.count(" ok ") == 8  # 3 sizes x 2 dtypes dense, 2 sparse
    assert result.stdout.count("sparse (d=0.1)") == 2


def test_bench_runs_from_the_package_alone(tmp_path):
    """`switchml bench` is in the package (switchml/bench/): a copy of the package
    with no source checkout beside it shows its flags and runs a case, its role
    processes importing the package from where it is."""
    package = os.path.dirname(switchml.__file__)

    def built_only(folder, names):  # the built extensions run, not their C sources; the
        # XDP program's source and headers are compiled when that data plane is used
        return [n for n in names if n == "__pycache__" or
                n.endswith(".c") and not n.endswith(".bpf.c")]

    shutil.copytree(package, tmp_path / "site" / "switchml", ignore=built_only)
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}
    shown = subprocess.run(CLI + ["bench", "--help"], capture_output=True, text=True,
                           timeout=60, cwd=tmp_path, env=env)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.startswith("usage: switchml bench") and "--densities" in shown.stdout
    out = tmp_path / "out"
    ran = subprocess.run(CLI + ["bench", "--workers", "2", "--sizes", "0.01", "--systems",
                                "dense", "--warmup", "0", "--repeats", "1", "--no-plots",
                                "--out", str(out)],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    data = json.loads((out / "results.json").read_text())
    assert data["command"].startswith("switchml bench --workers 2")
    [row] = data["rows"]
    assert row["system"] == "switchml-dense" and row["checked"] is True


def test_version_is_the_packages():
    shown = subprocess.run(CLI + ["--version"], capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.strip() == f"switchml {switchml.__version__}"


@pytest.mark.parametrize("command", [[], ["switch"], ["demo"], ["stats"], ["testbed"],
                                     ["bench"]])
def test_help_is_plain_text_and_every_flag_says_what_it_does(command):
    """--help prints docstrings without reST's marks (``literal``, :mod:), and each
    flag has a line of its own saying what it sets."""
    shown = subprocess.run(CLI + command + ["--help"], capture_output=True, text=True,
                           timeout=60)
    assert shown.returncode == 0, shown.stderr
    assert "``" not in shown.stdout and ":mod:" not in shown.stdout, shown.stdout
    import argparse

    from switchml.bench.suite import add_arguments
    from switchml.cli import build_parser
    parser = build_parser()
    if command == ["bench"]:
        parser = argparse.ArgumentParser()
        add_arguments(parser)
    elif command:
        parser = parser._subparsers._group_actions[0].choices[command[0]]
    parsers = [parser]
    while parsers:  # with the subcommands' own (testbed up, run, ...)
        parser = parsers.pop()
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                parsers += action.choices.values()
            elif action.option_strings and action.dest != "help":
                assert action.help, f"{parser.prog}: {action.option_strings} has no help"


def test_a_switch_with_a_token_file_admits_only_workers_with_the_token(tmp_path, monkeypatch):
    token = tmp_path / "token"
    token.write_text("s3cret admission\n")
    empty = tmp_path / "empty"
    empty.write_text("\n")
    refused = subprocess.run(CLI + ["switch", "--port", "0", "--token-file", str(empty)],
                             capture_output=True, text=True, timeout=30)
    assert refused.returncode == 2 and "token file" in refused.stderr and "empty" in refused.stderr
    proc = subprocess.Popen(CLI + ["switch", "--port", "0", "--token-file", str(token),
                                   "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=interruptible)
    try:
        line = proc.stdout.readline()
        address = line.split("SWITCHML_SWITCH=")[1].strip()
        with pytest.raises(AuthenticationError, match="admission token"):
            switchml.Worker(address, 0, 1, job="no-token", timeout=10, local_stage=False)
        monkeypatch.setenv("SWITCHML_SWITCH_TOKEN_FILE", str(token))
        with switchml.Worker(address, 0, 1, job="with-token", timeout=10) as w:
            assert np.array_equal(w.allreduce(np.arange(10, dtype=np.int32)), np.arange(10))
        stats = json.loads(subprocess.run(CLI + ["stats", "--switch", address, "--json"],
                                          capture_output=True, text=True, timeout=30).stdout)
        assert "with-token" in stats["ended_jobs"] and "no-token" not in json.dumps(stats)
        assert "s3cret" not in json.dumps(stats)
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=10) == 0
