"""The `switchml` command: a real switch process, stats from outside, the demo."""

import json
import signal
import subprocess
import sys

import numpy as np

import switchml

CLI = [sys.executable, "-m", "switchml.cli"]


def test_switch_command_serves_and_reports_stats():
    proc = subprocess.Popen(CLI + ["switch", "--port", "0", "--slots", "16",
                                   "--packet-elements", "512", "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert "listening on" in line, line + proc.stderr.read()
        address = line.split("SWITCHML_SWITCH=")[1].strip()
        with switchml.Worker(address, 0, 1, job="cli-test") as w:
            assert np.array_equal(w.allreduce(np.arange(2000, dtype=np.int32)), np.arange(2000))
        table = subprocess.run(CLI + ["stats", "--switch", address], capture_output=True,
                               text=True, timeout=30)
        assert table.returncode == 0, table.stderr
        assert "cli-test" in table.stdout and "packets_in" in table.stdout
        raw = subprocess.run(CLI + ["stats", "--switch", address, "--json"],
                             capture_output=True, text=True, timeout=30)
        stats = json.loads(raw.stdout)
        assert stats["slots"] == 16 and stats["packet_elements"] == 512
        # 2000 int32 in 512-value packets: 4 packets, each answered once
        assert stats["ended_jobs"]["cli-test"]["counters"]["results_completed"] == 4
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
