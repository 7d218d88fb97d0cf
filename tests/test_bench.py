"""`switchml bench` (and `python -m bench`, the same from a checkout) end to end with
tiny settings: every system runs on the same tensors, results are checked, bytes are
counted, and the JSON and PNG files appear."""

import json
import os
import shutil
import subprocess
import sys
import time

import pytest
from conftest import needs_root

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from switchml.bench.common import lower_bound_s, ring_bytes  # noqa: E402
from switchml.bench.plots import write_plots  # noqa: E402

CLI = [sys.executable, "-m", "bench"]  # from ROOT: bench/__main__.py is switchml bench
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.mark.alone  # a testbed or the XDP program: measured, not beside other tests
@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("tc") is None,
                    reason="the testbed needs root and tc")
@pytest.mark.parametrize("flat", [False, True], ids=["racks", "flat"])
def test_bench_with_racks_counts_each_uplinks_bytes(tmp_path, flat):
    """Two racks of two hosts under a spine: with rack switches each uplink carries
    one partial up a call (S, and a little: headers, re-sent partials), without
    them (``--flat``) both hosts' contributions (2 S)."""
    args = ["--testbed", "--link", "200mbit", "--workers", "4", "--racks", "2",
            "--sizes", "1", "--repeats", "1", "--systems", "dense",
            "--prefix", f"k{os.getpid() % 100000}", "--out", str(tmp_path), "--no-plots"]
    done = subprocess.run(CLI + args + (["--flat"] if flat else []), capture_output=True,
                          text=True, timeout=180, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    data = json.load(open(os.path.join(tmp_path, "results.json")))
    assert data["cluster"]["racks"] == 2
    [row] = data["rows"]
    assert row["checked"] is True and row["ranks_bit_identical"], row
    size = row["size_bytes"]
    for uplink in row["rack_uplink_bytes_per_call"]:
        if flat:
            assert 2 * size <= uplink["up"] < 2.5 * size
        else:
            assert size <= uplink["up"] < 1.5 * size and size <= uplink["down"] < 1.5 * size


def test_bounds_are_the_network_arithmetic():
    mib64 = 64 * 2**20
    assert lower_bound_s("switchml-dense", 4, mib64, 1e9) == pytest.approx(mib64 * 8 / 1e9)
    assert lower_bound_s("gloo", 4, mib64, 1e9) == pytest.approx(1.5 * mib64 * 8 / 1e9)
    assert ring_bytes(8, 800) == 1400
    # sparse at d = 0.1 on 4 ranks: the union (34%) comes back down
    assert lower_bound_s("switchml-sparse", 4, mib64, 1e9, 0.1) == pytest.approx(
        (1 - 0.9**4) * mib64 * 8 / 1e9)
    assert lower_bound_s("gloo", 4, mib64, None) is None
    # racks of 8 hosts at 1 Gbit/s, uplinks of 2 Gbit/s (4:1): rack switches send S up,
    # the flat job 8 S; gloo's ring crosses an uplink once each way
    racks = {"rack_hosts": 8, "uplink_bps": 2e9}
    assert lower_bound_s("switchml-dense", 16, mib64, 1e9, **racks) == pytest.approx(
        mib64 * 8 / 1e9)
    assert lower_bound_s("switchml-dense", 16, mib64, 1e9, flat=True, **racks) == (
        pytest.approx(8 * mib64 * 8 / 2e9))
    assert lower_bound_s("gloo", 16, mib64, 1e9, flat=True, **racks) == pytest.approx(
        ring_bytes(16, mib64) * 8 / 1e9)


def test_plots_are_written_for_the_data_there_is(tmp_path):
    rows = [{"system": s, "workers": n, "size_bytes": 2**20, "size_mib": 1.0, "density": d,
             "median_s": t, "speedup_over_gloo": g}
            for s, n, d, t, g in [("switchml-dense", 2, None, 0.010, 1.2),
                                  ("gloo", 2, None, 0.012, None),
                                  ("switchml-sparse", 2, 0.1, 0.004, 3.0),
                                  ("switchml-sparse", 2, 0.5, 0.008, 1.5)]]
    paths = write_plots(rows, 1e9, str(tmp_path))
    assert sorted(os.path.basename(p) for p in paths) == [
        "speedup_vs_workers.png", "time_vs_density.png", "time_vs_size.png"]
    for p in paths:
        assert open(p, "rb").read(8) == PNG
    # no gloo, no densities: only the plot that has data
    alone = [dict(rows[0], speedup_over_gloo=None)]
    assert [os.path.basename(p) for p in write_plots(alone, None, str(tmp_path))] == [
        "time_vs_size.png"]
    # every system the bench runs has a style (and one it would not know is drawn)
    others = [dict(rows[0], system=s) for s in ("switchml-dense16", "gloo-fp16", "other")]
    assert [os.path.basename(p) for p in write_plots(others, None, str(tmp_path))] == [
        "time_vs_size.png"]


def test_what_the_bench_cannot_measure_as_asked_is_refused_at_once(tmp_path):
    for extra, said in ((["--repeats", "0"], "--repeats takes 1 or more"),
                        (["--testbed", "--loss", "0.01", "--data-plane", "xdp"],
                         "--loss goes without --data-plane xdp")):
        done = subprocess.run(CLI + extra + ["--out", str(tmp_path / "out")],
                              capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert done.returncode != 0 and said in done.stderr, (extra, done.stderr)
    assert not (tmp_path / "out").exists()


def role_processes(parent: int) -> list:
    """The pids of the bench role processes whose parent is ``parent``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            status = open(f"/proc/{pid}/status").read()
            argv = open(f"/proc/{pid}/cmdline", "rb").read()
        except OSError:
            continue
        if f"\nPPid:\t{parent}\n" in status and b"switchml.bench.roles" in argv:
            found.append(int(pid))
    return found


def test_a_bench_stopped_by_sigterm_leaves_no_rank_running(tmp_path):
    """TERM (a scheduler's stop, ``kill``) ends a bench as Ctrl-C does: its ranks go
    with it, not on waiting out their timeout."""
    bench = subprocess.Popen(CLI + ["--workers", "2", "--sizes", "16", "--repeats", "1000",
                                    "--systems", "dense", "--no-plots", "--out", str(tmp_path)],
                             cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             text=True)
    deadline = time.monotonic() + 60
    while len(ranks := role_processes(bench.pid)) < 3:  # the switch and two ranks
        assert bench.poll() is None and time.monotonic() < deadline, bench.stderr.read()
        time.sleep(0.1)
    time.sleep(1.0)  # at work
    bench.terminate()
    assert bench.wait(timeout=30) == 128 + 15
    deadline = time.monotonic() + 10
    while alive := [pid for pid in ranks if os.path.exists(f"/proc/{pid}")
                    and "zombie" not in open(f"/proc/{pid}/status").read()]:
        assert time.monotonic() < deadline, f"ranks left running: {alive}"
        time.sleep(0.1)


def check_results(out, systems):
    data = json.load(open(os.path.join(out, "results.json")))
    rows = data["rows"]
    assert {r["system"] for r in rows} == systems
    for r in rows:
        assert r["checked"] is True and r["ranks_bit_identical"], r
        assert r["min_s"] <= r["median_s"] <= r["max_s"]
        if sys.platform.startswith("linux"):  # a call runs on the rank's threads
            assert 0 < r["cpu_s_per_worker"] and 0 <= r["runqueue_wait_s_per_worker"], r
    by = {(r["system"], r["density"]): r for r in rows}
    dense, sparse = by[("switchml-dense", None)], by[("switchml-sparse", 0.1)]
    size = dense["size_bytes"]
    # switchml sends the tensor once (plus headers and what it sent again: on a busy
    # machine a 4-packet call may probe a late result, a 64 KiB datagram at most);
    # the sparse path about a tenth of it
    resent = dense["retransmissions_per_worker"] * 65536
    assert size <= dense["bytes_sent_per_worker"] < 1.2 * size + resent
    assert sparse["bytes_sent_per_worker"] < 0.25 * size
    if "gloo" in systems:
        assert by[("gloo", None)]["bytes_sent_per_worker"] == ring_bytes(2, size)
        assert dense["speedup_over_gloo"] > 0
    for name in ("time_vs_size.png", "time_vs_density.png"):
        assert open(os.path.join(out, name), "rb").read(8) == PNG
    return data


def test_bench_on_loopback(tmp_path):
    systems = {"switchml-dense", "switchml-sparse"}
    args = ["--workers", "2", "--sizes", "0.25", "--densities", "0.1", "--repeats", "2",
            "--out", str(tmp_path)]
    try:
        import torch  # noqa: F401
        systems.add("gloo")
    except ImportError:
        args += ["--systems", "dense", "sparse"]
    done = subprocess.run(CLI + args, capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    data = check_results(str(tmp_path), systems)
    assert data["cluster"] == {"kind": "loopback"}
    assert "switchml-sparse" in done.stdout and "median s" in done.stdout  # the table
    assert all(r["wire_tx_bytes_per_worker"] is None for r in data["rows"])  # no own link
    for row in data["rows"]:  # where a run's datagrams could have been lost
        assert set(row["host_drops_in_run"]) == {"backlog_dropped", "udp_rcvbuf_errors",
                                                 "udp_sndbuf_errors", "udp_in_errors"}
    dense = next(r for r in data["rows"] if r["system"] == "switchml-dense")
    assert dense["switch_counters_in_run"]["jobs_started"] >= 1  # the switch's own
    for row in data["rows"]:  # each timed call, in order: the median is theirs
        assert len(row["call_s"]) == 2 and row["median_s"] == pytest.approx(
            sum(row["call_s"]) / 2, abs=1e-5)
    assert len(dense["recovery_per_call"]) == 2  # the counters that moved in each call


@pytest.mark.alone  # a testbed or the XDP program: measured, not beside other tests
@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("tc") is None,
                    reason="the testbed needs root and tc")
def test_bench_on_the_testbed(tmp_path):
    args = ["--testbed", "--link", "200mbit", "--workers", "2", "--sizes", "1",
            "--densities", "0.1", "--repeats", "1", "--systems", "dense", "sparse",
            # a window of 4 slots: the default 32 x 64 KiB sits ~80 ms in the tbf queue
            # at 200 Mbit/s and outlasts the retransmission timeout (docs/testbed.md)
            "--slots-per-job", "4",
            "--prefix", f"b{os.getpid() % 100000}", "--out", str(tmp_path)]
    done = subprocess.run(CLI + args, capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    data = check_results(str(tmp_path), {"switchml-dense", "switchml-sparse"})
    assert data["cluster"]["link_bps"] == 200e6
    dense = next(r for r in data["rows"] if r["system"] == "switchml-dense")
    # measured on the host's veth: at least the UDP payload the worker counted
    assert dense["wire_tx_bytes_per_worker"] >= dense["bytes_sent_per_worker"]
    assert dense["bound_s"] == pytest.approx(dense["size_bytes"] * 8 / 200e6)
    # the link really is in the way (unshaped: a tenth of this); the tbf bucket
    # (256 KiB) lets a quarter of the tensor through at once, hence 0.6
    assert dense["median_s"] >= 0.6 * dense["bound_s"]
    assert f"b{os.getpid() % 100000}-h0" not in subprocess.run(
        ["ip", "netns", "list"], capture_output=True, text=True).stdout


def test_udp_paths_moves_the_bytes_each_way_and_counts_the_calls(tmp_path):
    out = tmp_path / "udp.json"
    subprocess.run([sys.executable, os.path.join(ROOT, "bench", "udp_paths.py"), "--mib", "2",
                    "--repeats", "1", "--out", str(out)], check=True, timeout=120,
                   capture_output=True, cwd=ROOT)
    rows = {r["mode"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"datagram", "mtu", "gso"}
    for mode, row in rows.items():
        assert row["sender"]["bytes"] >= 2 * 2**20, mode
        assert 0 < row["receiver"]["bytes"] <= row["sender"]["bytes"], mode
    # 64 KiB-class sends whether whole or segmented; MTU-sized ones take ~7x the calls
    assert abs(rows["datagram"]["sender"]["calls"] - rows["gso"]["sender"]["calls"]) <= 3
    assert rows["mtu"]["sender"]["calls"] > 5 * rows["datagram"]["sender"]["calls"]
    # with UDP_GRO the receiver takes several datagrams per call
    assert rows["gso"]["receiver"]["calls"] < rows["mtu"]["receiver"]["calls"] / 3


def test_invocations_take_the_median_of_the_runs_and_gloo_from_the_same():
    from bench.invocations import format_summary, summarize_runs

    def row(system, median, bound=None, density=None):
        return {"system": system, "workers": 4, "size_bytes": 2**20, "density": density,
                "median_s": median, "bound_s": bound, "retransmissions_per_worker": 0.0,
                "checked": True, "ranks_bit_identical": True}

    runs = [[row("switchml-dense", t, 0.5), row("gloo", g, 0.75)]
            for t, g in ((0.9, 1.0), (0.5, 1.2), (0.6, 0.8))]
    rows = {r["system"]: r for r in summarize_runs(runs)}
    assert rows["switchml-dense"]["median_s"] == 0.6       # not the mean, not the best
    assert rows["gloo"]["median_s"] == 1.0
    assert rows["switchml-dense"]["speedup_over_gloo"] == pytest.approx(1.0 / 0.6)
    assert rows["gloo"]["of_bound"] == pytest.approx(0.75)
    assert "1.67x" in format_summary(list(rows.values()))
    # the check column: ok only where some run's sums were checked (--no-check: "-")
    for checked, cell in (([True, None, None], " ok"), ([None, None, None], " -"),
                          ([True, False, None], " FAIL")):
        unchecked = [[dict(row("gloo", 1.0), checked=c)] for c in checked]
        assert format_summary(summarize_runs(unchecked)).splitlines()[1].endswith(cell)


@pytest.mark.alone  # a testbed or the XDP program: measured, not beside other tests
@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("tc") is None,
                    reason="the testbed needs root and tc")
def test_bench_on_the_testbed_with_the_xdp_data_plane(tmp_path):
    from switchml.switch.xdp import pipeline as xdp
    if xdp.unavailable():
        pytest.skip(f"XDP: {xdp.unavailable()}")
    args = ["--testbed", "--link", "200mbit", "--workers", "2", "--sizes", "1",
            "--repeats", "1", "--systems", "dense", "--slots-per-job", "4",
            "--data-plane", "xdp", "--prefix", f"x{os.getpid() % 100000}", "--out",
            str(tmp_path)]
    done = subprocess.run(CLI + args, capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    data = json.load(open(os.path.join(tmp_path, "results.json")))
    [dense] = data["rows"]
    assert dense["system"] == "switchml-dense" and dense["switch_data_plane"] == "xdp"
    # on the testbed's bridge: attached to its ports (veths) in their driver mode
    assert dense["switch_xdp_mode"] == "driver"
    assert dense["checked"] is True and dense["ranks_bit_identical"], dense
    assert dense["bytes_sent_per_worker"] >= dense["size_bytes"]
    counters = data["switch_job_counters"]["2"]
    assert counters["results_completed"] > 0
    # its workers send runs (the veths' segmentation offload on, the kernel's
    # default), which the kernel cuts at their veths: none reached the program whole
    assert "gso_passed_up" not in counters, counters
    # the switch's CPU a call: its serving thread's, and the programs' own (counted)
    assert dense["switch_thread_cpu_s_per_call"] > 0 and dense["switch_program_s_per_call"] > 0
    refused = subprocess.run(CLI + args + ["--racks", "2"], capture_output=True,
                             text=True, timeout=60, cwd=ROOT)
    assert refused.returncode != 0 and "--data-plane xdp goes without --racks" in \
        refused.stderr, refused.stderr


@pytest.mark.alone  # a testbed or the XDP program: measured, not beside other tests
def test_xdp_core_bench_runs_with_tiny_settings(tmp_path):
    """bench/xdp_core.py end to end, tiny: every contribution added, each fourth
    completing its slot, on one CPU and two; MTU 9000's packets (multi-buffer
    frames) too; the medians table of its JSON.  No timing is checked."""
    from switchml.switch.xdp import pipeline as xdp
    if xdp.unavailable():
        pytest.skip(f"XDP: {xdp.unavailable()}")
    out = tmp_path / "xdp.json"
    env = {**os.environ, "PYTHONPATH": ROOT}
    subprocess.run([sys.executable, os.path.join(ROOT, "bench", "xdp_core.py"),
                    "--mtu", "1500", "9000", "--slots", "4", "--seconds", "0.2",
                    "--json", str(out)], check=True, timeout=120, env=env)
    rows = json.loads(out.read_text())["rows"]
    assert [(r["mtu"], r["cpus"], r["share"]) for r in rows] == [
        (m, c, s) for m in (1500, 9000) for c, s in ((1, "-"), (2, "disjoint"), (2, "same"))]
    for r in rows:
        assert "refused" not in r and r["contributions_added"] > 0, r
        # every fourth completed a slot, but those of the sets left waiting at the end
        assert 0 <= r["contributions_added"] - 4 * r["results_completed"] <= 2 * r["slots"] * 3
        if r["share"] != "same":  # nothing stale, duplicate or dropped
            assert r["dropped"] == {} and r["contributions_added"] == r["runs"], r
        # the first pass's results were checked against the exact sums: every slot's two
        assert r["results_checked"] == 2 * r["slots"], r
    assert rows[3]["packet_bytes"] == 8320 and rows[0]["packet_bytes"] == 1068
    table = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "xdp_core.py"),
                            "--median", str(out), str(out), str(out)], check=True,
                           capture_output=True, text=True, timeout=60, env=env).stdout
    assert table.count("\n| 9000 | 8320 |") == 3


@pytest.mark.alone  # a testbed or the XDP program: measured, not beside other tests
@needs_root
def test_xdp_driver_bench_runs_with_tiny_settings(tmp_path):
    """bench/xdp_driver.py end to end, tiny: the program in veth's driver mode adds
    every contribution that reaches it (it drops none, but the stale messages of a
    round the veth cut short: a busy machine's ring overflows), the kernel counted its
    runs, and no namespace is left behind; the medians table of its JSON.  No
    timing is checked."""
    from switchml.switch.xdp import pipeline as xdp
    from switchml.testbed import netns

    if xdp.unavailable():
        pytest.skip(f"XDP: {xdp.unavailable()}")
    out = tmp_path / "driver.json"
    env = {**os.environ, "PYTHONPATH": ROOT}
    cpus = [1, 2] if len(os.sched_getaffinity(0)) >= 2 else [1]
    subprocess.run([sys.executable, os.path.join(ROOT, "bench", "xdp_driver.py"),
                    "--mtu", "1500", "9000", "--cpus", *map(str, cpus), "--slots", "4",
                    "--seconds", "0.3", "--json", str(out)], check=True, timeout=120, env=env)
    rows = json.loads(out.read_text())["rows"]
    assert [(r["mtu"], r["cpus"]) for r in rows] == [(m, c) for m in (1500, 9000) for c in cpus]
    for r in rows:
        assert r["contributions_added"] > 0, r
        # the results the ranks' sockets held were read and were the exact sums
        assert r["results_checked"] > 0, r
        # A frame the veth's ring dropped leaves its slot's round open: the sender,
        # which never retransmits, goes on to the next round, stale to the program.
        assert set(r["dropped"]) <= {"dropped_stale"}, json.dumps(r)
        lost = r["dropped_at_the_veth"] + r["dropped_at_the_sender"]
        assert r["dropped"] == {} or lost > 0, json.dumps(r)
        assert r["runs"] >= r["contributions_added"] and r["program_ns_per_frame"] > 0, r
        # a completion takes four adds; a set short of one was left waiting at the
        # end, or lost a contribution dropped before the program (the veth's ring
        # full, or the sender's stack refusing it)
        assert 0 <= r["contributions_added"] - 4 * r["results_completed"] <= 3 * (
            r["slots"] * r["cpus"] + lost), json.dumps(r)
        # the program ran on each CPU the row has (on one, the kernel may still run
        # some of a queue's frames on another)
        assert sum(n > 0 for n in r["admitted_per_cpu"]) >= r["cpus"], r
    assert not [ns for ns in netns.list_namespaces() if ns.startswith("smlxdpd")]
    table = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "xdp_driver.py"),
                            "--median", str(out), str(out), str(out)], check=True,
                           capture_output=True, text=True, timeout=60, env=env).stdout
    assert table.count("\n| 9000 | 8320 |") == len(cpus)


def test_switch_core_bench_runs_with_tiny_settings(tmp_path):
    """bench/switch_core.py end to end, both data planes, tiny; no timing is checked."""
    from switchml.switch.dataplane import fastpipeline
    paths = ["python", "c"] if fastpipeline._fastpath is not None else ["python"]
    out = tmp_path / "core.json"
    subprocess.run([sys.executable, os.path.join(ROOT, "bench", "switch_core.py"),
                    "--mtu", "1500", "--workers", "2", "--slots", "4", "--seconds", "0.3",
                    "--warmup", "0.1", "--paths", *paths, "--json", str(out)], check=True,
                   timeout=120, env={**os.environ, "PYTHONPATH": ROOT})
    rows = json.loads(out.read_text())["rows"]
    assert [r["data_plane"] for r in rows] == paths
    for r in rows:
        assert r["packet_bytes"] <= 1500 - 28 and r["packets_in"] > 0
        assert r["results_completed"] > 0 and r["gbit_per_core_s"] > 0
        assert r["results_checked"] > 0  # the results the ranks' sockets held: the sums
    # a switch whose every result is off by one fails the bench (it exited 0)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "sitecustomize.py").write_text(BROKEN_SWITCH)
    done = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "switch_core.py"),
                           "--mtu", "1500", "--workers", "2", "--slots", "4", "--seconds", "0.2",
                           "--warmup", "0.1", "--paths", "python"], capture_output=True,
                          text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": f"{broken}{os.pathsep}{ROOT}"})
    assert done.returncode == 1 and "not the sum" in done.stderr, done.stderr


#: A sitecustomize.py that breaks the Python data plane: every result off by one.
BROKEN_SWITCH = """from switchml.switch.dataplane import pipeline as p
_complete = p.Pipeline._complete
def wrong(self, job, v, slot):
    job.values[v, slot] += 1
    return _complete(self, job, v, slot)
p.Pipeline._complete = wrong
"""


def _exits(code):
    os._exit(code)


def test_a_core_bench_names_a_process_that_died_instead_of_waiting_for_it():
    """switch_core waited forever on a dead sender's pipe, worker_core 600 s on a
    dead worker's report: both now fail at once, naming it and its exit code."""
    import multiprocessing

    from bench import switch_core, worker_core

    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_exits, args=(3,))
    proc.start()
    child.close()
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"sender 0 died \(exit code 3\)"):
        switch_core._recv(parent, proc, "sender 0", 30)
    here, there = ctx.Pipe(duplex=False)
    worker = ctx.Process(target=_exits, args=(9,))
    worker.start()
    there.close()
    with pytest.raises(worker_core.BenchFailed, match="worker 1 .* exited with code 9"):
        worker_core.wait_for({"worker 1": here}, {"worker 1": worker}, timeout=30)
    assert time.monotonic() - t0 < 10


def test_worker_core_checks_each_ranks_sum_and_refuses_unknown_engines(tmp_path):
    """bench/worker_core.py compares each rank's result with the exact sum: right
    sums pass; a switch whose every result is off by one fails the bench (it
    printed its rates and exited 0).  A misspelt engine is refused (it ran C)."""
    bench = [sys.executable, os.path.join(ROOT, "bench", "worker_core.py"), "--mib", "0.06",
             "--workers", "2", "--repeats", "1", "--warmup", "0", "--engines", "c",
             "--json", str(tmp_path / "wc.json")]
    env = {**os.environ, "PYTHONPATH": ROOT, "SWITCHML_PURE_PYTHON": "1"}
    done = subprocess.run(bench, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    [row] = json.loads((tmp_path / "wc.json").read_text())["results"]
    assert row["sums_ok"] == [True, True]
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "sitecustomize.py").write_text(BROKEN_SWITCH)
    done = subprocess.run(bench, capture_output=True, text=True, timeout=120,
                          env={**env, "PYTHONPATH": f"{broken}{os.pathsep}{ROOT}"})
    assert done.returncode != 0 and "wrong sums: c rank 0" in done.stderr, done.stderr
    done = subprocess.run(bench[:-4] + ["--engines", "c,pyhton"], capture_output=True,
                          text=True, timeout=60, env=env)
    assert done.returncode == 2 and "--engines: c,pyhton" in done.stderr, done.stderr


def test_xdp_medians_match_rows_by_case_and_average_the_middle_two(tmp_path):
    """--median of xdp_core.py and xdp_driver.py: an even count's median is the
    mean of the middle two (it was the upper one), and rows are matched by MTU,
    CPUs and share, wherever they lie in each file (row i of every file was taken)."""
    from bench import xdp_core, xdp_driver

    def row(mtu, ns, cpus=1, share="-"):
        return {"mtu": mtu, "cpus": cpus, "share": share, "packet_bytes": mtu - 400,
                "slots": 4, "program_ns_per_frame": ns}
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps({"rows": [row(1500, 500), row(9000, 2000)]}))
    b.write_text(json.dumps({"rows": [row(9000, 3000), row(1500, 700)]}))
    for table in (xdp_core.median_table([str(a), str(b)]),
                  xdp_driver.median_table([str(a), str(b)])):
        lines = table.splitlines()
        assert "| **600** (500, 700) |" in lines[2] and lines[2].startswith("| 1500 |")
        assert "| **2500** (2000, 3000) |" in lines[3] and lines[3].startswith("| 9000 |")


@pytest.mark.parametrize("bench, flags", [
    ("switch_core.py", ["--senders", "0"]), ("switch_core.py", ["--seconds", "-1"]),
    ("switch_core.py", ["--mtu", "100"]), ("worker_core.py", ["--mib", "0"]),
    ("worker_core.py", ["--workers", "0"]), ("worker_core.py", ["--repeats", "0"]),
    ("worker_core.py", ["--threads", "0"]), ("worker_core.py", ["--density", "1.5"]),
    ("udp_paths.py", ["--modes", "foo"]), ("udp_paths.py", ["--mtu", "70000"]),
    ("udp_paths.py", ["--mib", "0"]), ("multicast.py", ["--size", "0"]),
    ("multicast.py", ["--mib", "0.001"]), ("multicast.py", ["--receivers", "0"]),
    ("xdp_core.py", ["--block", "0"]), ("xdp_core.py", ["--mtu", "100"]),
    ("xdp_driver.py", ["--seconds", "0"]), ("xdp_driver.py", ["--mtu", "100"]),
    ("port_rates.py", ["--ports", "lo", "--seconds", "0"]),
    ("port_rates.py", ["--ports", "no-such-port"])])
def test_the_core_benches_refuse_flags_that_measure_nothing(bench, flags):
    """Counts, sizes, seconds and densities out of their range are argparse errors
    naming the flag, before anything runs (they ran and printed zeros, or ended
    in a traceback)."""
    done = subprocess.run([sys.executable, os.path.join(ROOT, "bench", bench), *flags],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": ROOT})
    assert done.returncode == 2 and "error:" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def test_port_rates_finds_the_idle_stretches_and_the_links_shares(tmp_path):
    """Byte counters of two ports, 1 ms apart: both move at the link rate (1 Gbit/s
    up, half that down) for 10 ms, stand still for 6 ms (a pass over the input
    before the first send, say), then move for 4 ms more."""
    from bench import port_rates

    rows, up, down = [], 0, 0
    for ms in range(21):
        rows.append([ms / 1e3, up, down, up, down])
        if not 10 <= ms < 16:
            up, down = up + 125_000, down + 62_500
    gaps = port_rates.idle_gaps(rows, 0.002)
    assert len(gaps) == 1
    assert gaps[0][0] == pytest.approx(0.010) and gaps[0][1] == pytest.approx(0.006)
    assert port_rates.idle_gaps(rows, 0.007) == []
    # a stretch that lasts to the end of the sampling counts too (it was never reported)
    assert port_rates.idle_gaps(rows[:16], 0.002) == [(pytest.approx(0.010),
                                                       pytest.approx(0.005))]
    for uplink, downlink in port_rates.shares(rows, 1e9):
        assert uplink == pytest.approx(14 / 20) and downlink == pytest.approx(7 / 20)
    # the real counters of this namespace's loopback, for a moment
    out = tmp_path / "rates.json"
    port_rates.main(["--ports", "lo", "--seconds", "0.05", "--out", str(out)])
    assert len(json.load(open(out))["samples"]) > 10


def test_report_prints_a_training_run_as_its_table(tmp_path):
    """bench/report.py reads bench/train.py's JSON too (it failed on it)."""
    run = {"workers": 4, "name": "digits switchml", "samples_per_s": 316.0,
           "samples_per_s_all": [319.0, 313.0, 316.0], "speedup_over_gloo": 1.328,
           "step_ms": 202.5, "communication_share": 0.92, "allreduce_ms_per_step": 302.6,
           "switchml_mb_sent_per_step": 17.89, "test_accuracy": 0.9444}
    path = tmp_path / "train.json"
    path.write_text(json.dumps({"command": "python bench/train.py ...", "machine": {},
                                "date": "", "network": "testbed, 1gbit links", "runs": [run]}))
    done = subprocess.run([sys.executable, "bench/report.py", str(path)], capture_output=True,
                          text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert "| 4 | digits switchml | 316 (319, 313, 316) | 1.33x | 202.5 | 92% |" in done.stdout
    # a core bench's JSON, or none: refused in a sentence (KeyError, IndexError before)
    core = tmp_path / "core.json"
    core.write_text(json.dumps({"machine": {}, "args": {}, "rows": [{"mtu": 1500}]}))
    for argv in ([str(core)], []):
        done = subprocess.run([sys.executable, "bench/report.py", *argv], capture_output=True,
                              text=True, timeout=60, cwd=ROOT)
        assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr


def test_first_send_bench_times_both_calls_and_each_build(tmp_path):
    out = tmp_path / "first.json"
    done = subprocess.run([sys.executable, "bench/first_send.py", "--mib", "0.25",
                           "--repeats", "2", "--slots", "4", "--json", str(out)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    if "not built" in done.stderr:
        pytest.skip("the C engine is not built")
    assert done.returncode == 0, done.stderr
    data = json.loads(out.read_text())
    assert set(data["first_send_s"]) == {"dense", "sparse"}
    assert all(s > 0 for s in data["first_send_s"].values())
    assert data["magnitude_peak_s"]["baseline"] > 0  # every x86-64 or other machine has it
    assert "sparse call: first datagrams after" in done.stdout


def test_bench_on_torch_tensors_sums_through_the_backend_and_counts_faults(tmp_path):
    """--device cpu: switchml's ranks call dist.all_reduce on the "switchml" backend
    (3 ranks, 2 hosts of the loopback: the local stage and the bench's switch),
    gloo on the same torch tensors; every row checked, its device and faults given."""
    pytest.importorskip("torch", reason="the torch extra is not installed")
    args = ["--device", "cpu", "--workers", "3", "--ranks-per-host", "2", "--sizes", "0.25",
            "--repeats", "2", "--no-plots", "--out", str(tmp_path)]
    # the local stage on, as a user has it (conftest.py turns it off for the suite)
    done = subprocess.run(CLI + args, capture_output=True, text=True, timeout=180, cwd=ROOT,
                          env=dict(os.environ, SWITCHML_LOCAL_STAGE="1"))
    assert done.returncode == 0, done.stdout + done.stderr
    data = json.load(open(os.path.join(tmp_path, "results.json")))
    rows = {r["system"]: r for r in data["rows"]}
    assert set(rows) == {"switchml-dense", "gloo"}
    for r in rows.values():
        assert r["checked"] is True and r["ranks_bit_identical"], r
        assert r["device"] == "cpu" and r["api"] == "torch.distributed", r
        assert r["faults_per_call"] is not None and r["faults_per_call"] >= 0, r
    dense = rows["switchml-dense"]
    # the ranks combined on their hosts, and host 0's leader sent through the switch
    assert dense["local_stage"] and dense["hosts"] == 2
    assert dense["switch_data_plane"] and dense["bytes_sent_per_worker"] > 0
    assert data["machine"]["torch"] and "device" in done.stdout


def test_bench_on_cuda_tensors_refuses_at_once_without_a_gpu(tmp_path):
    torch = pytest.importorskip("torch", reason="the torch extra is not installed")
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    out = tmp_path / "out"
    done = subprocess.run(CLI + ["--device", "cuda", "--workers", "2", "--sizes", "1",
                                 "--out", str(out)],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode != 0
    assert "--device cuda" in done.stderr and "no CUDA device" in done.stderr, done.stderr
    assert not out.exists()  # refused before anything ran or was written


def test_bench_on_torch_tensors_refuses_what_runs_on_numpy_arrays_only(tmp_path):
    for extra in (["--systems", "dense16"], ["--densities", "0.1"]):
        done = subprocess.run(CLI + ["--device", "cpu", *extra, "--out", str(tmp_path)],
                              capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert done.returncode != 0 and "--device runs --systems" in done.stderr, extra


FAULTS_SCRIPT = """
import json
import numpy as np
from switchml.bench import roles
roles.no_numpy_huge_pages()
# 40 MiB: past glibc's largest mmap threshold (32 MiB), so each array is fresh
pages = 40 * 256
reused = np.empty(pages * 1024, np.float32)
fresh, kept = [], []
roles._time(lambda: np.ones(pages * 1024, np.float32), 1, 3, faults=fresh)
roles._time(lambda: reused.fill(1.0), 1, 3, faults=kept)
print(json.dumps([pages, fresh, kept]))
"""


def test_a_call_that_touches_fresh_memory_counts_a_fault_a_page():
    """The rows' faults_per_call: a call that fills a new array faults once per
    4 KiB page of it (numpy's huge pages off), one that reuses an array none.
    (In a process of its own: what other tests allocated does not change it.)"""
    done = subprocess.run([sys.executable, "-c", FAULTS_SCRIPT], capture_output=True,
                          text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    pages, fresh, kept = json.loads(done.stdout.strip().splitlines()[-1])
    assert min(fresh) >= pages * 0.9, fresh
    assert max(kept) < pages / 20, kept


def test_ddp_resnet_bench_trains_on_both_backends_with_identical_replicas(tmp_path):
    """bench/ddp_resnet.py on the CPU with tiny images: ResNet-18 under DDP, two ranks
    of torchrun, gloo then switchml; the gradients went through switchml's local
    stage, every replica is identical and the weights match gloo's."""
    pytest.importorskip("torch", reason="the torch extra is not installed")
    out = tmp_path / "ddp.json"
    done = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "ddp_resnet.py"),
                           "--device", "cpu", "--workers", "2", "--batch", "2", "--image", "32",
                           "--warmup", "1", "--steps", "2", "--out", str(out)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    runs = {r["backend"]: r for r in json.loads(out.read_text())["runs"]}
    assert set(runs) == {"gloo", "switchml"}
    for r in runs.values():
        assert r["replicas_identical"] and r["samples_per_s"] > 0 and r["workers"] == 2, r
        assert r["parameters"] == 11_689_512, r  # ResNet-18 at 1000 classes
        assert len(r["step_s_all"]) == 2 and r["compute_ms_per_step"] > 0
    ours = runs["switchml"]
    assert ours["switchml_counters_rank0"]["local_calls"] >= 3  # one a step at least
    assert ours["max_weight_diff_vs_gloo"] <= 1e-4 * ours["max_abs_weight"], ours
    assert ours["speedup_over_gloo"] > 0 and "| switchml | cpu |" in done.stdout
    shown = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "report.py"), str(out)],
                           capture_output=True, text=True, timeout=60, check=True).stdout
    assert "| 2 | switchml | cpu |" in shown and "bench/ddp_resnet.py" in shown


@pytest.mark.parametrize("script", ["gpu_check.sh", "fast_check.sh", "check_stages.sh"])
def test_check_scripts_parse(script):
    done = subprocess.run(["bash", "-n", os.path.join(ROOT, "bench", script)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_fast_summary_sets_each_figure_against_its_aim(tmp_path, capsys):
    """bench/fast_summary.py: the testbed's ratio and gloo's share of its bound, the
    best thread count's median goodput, loopback at 8 workers."""
    from bench.fast_summary import main

    def row(system, workers, median, of_bound, retransmissions=0.0):
        return {"system": system, "workers": workers, "size_bytes": 256 * 2**20,
                "density": None, "device": "cpu", "median_s": median,
                "bound_s": median * of_bound, "faults_per_call": 0.0,
                "retransmissions_per_worker": retransmissions, "checked": True,
                "ranks_bit_identical": True}

    stages = {"testbed-10g": [row("switchml-dense", 4, 0.23, 0.95),
                              row("gloo", 4, 0.33, 0.97)],        # 1.43x: met
              "testbed-25g": [row("switchml-dense", 4, 0.10, 0.90),
                              row("gloo", 4, 0.15, 0.85)],
              "loopback": [row("switchml-dense", 8, 0.30, 1.0, 4.5),
                           row("gloo", 8, 0.27, 1.0)]}
    for name, rows in stages.items():
        for i in range(3):
            folder = tmp_path / name / f"run{i + 1}"
            folder.mkdir(parents=True)
            (folder / "results.json").write_text(json.dumps({
                "rows": rows, "machine": {"cpus": 16}, "settings": {"link": "10gbit"}}))
    (tmp_path / "engine").mkdir()
    for threads, runs in ((1, (14.0, 15.0, 13.0)), (4, (26.0, 24.0, 27.0))):
        for i, gbps in enumerate(runs):
            (tmp_path / "engine" / f"threads{threads}-run{i + 1}.json").write_text(json.dumps(
                {"results": [{"goodput_Gbps_per_worker": gbps, "cpu_ms_per_MiB_per_worker": 0.5,
                              "retransmissions": [0, 1]}]}))
    (tmp_path / "stages.tsv").write_text("build\t0\t20\t\n")
    assert main([str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "4 hosts, 10gbit links" in printed and "machine: cpus 16" in printed
    summary = json.loads((tmp_path / "summary.json").read_text())
    [fast] = summary["testbed-10g"]
    assert fast["speedup_over_gloo"] == pytest.approx(0.33 / 0.23) and fast["met"] is True
    assert summary["testbed-25g"][0]["met"] is None  # reported, no aim
    assert summary["loopback"][0]["met"] is False    # 0.9x gloo at 8 workers
    assert summary["loopback"][0]["retransmissions_per_worker"] == 4.5
    assert "| 4.5 |" in printed
    assert [(r["threads"], r["goodput_Gbps"], r["met"]) for r in summary["engine"]] == [
        (1, 14.0, None), (4, 26.0, True)]
    stages["testbed-10g"][1] = row("gloo", 4, 0.33, 0.85)  # gloo short of 90%: not a fair one
    (tmp_path / "testbed-10g" / "run1" / "results.json").write_text(json.dumps(
        {"rows": stages["testbed-10g"], "settings": {"link": "10gbit"}}))
    for i in (2, 3):
        (tmp_path / "testbed-10g" / f"run{i}" / "results.json").unlink()
    main([str(tmp_path)])
    assert json.loads((tmp_path / "summary.json").read_text())["testbed-10g"][0]["met"] is False


def test_gpu_summary_sets_each_figure_against_its_aim(tmp_path, capsys):
    """bench/gpu_summary.py: ratios from the invocations' medians, a cut-short stage
    counted from its finished runs, CUDA against CPU, faults, DDP and its modes."""
    from bench.gpu_summary import main

    mib45 = 45 * 2**20

    def row(system, workers, median, device, faults=0.0):
        return {"system": system, "workers": workers, "size_bytes": mib45, "density": None,
                "device": device, "median_s": median, "bound_s": None, "faults_per_call": faults,
                "retransmissions_per_worker": 0.0, "checked": True, "ranks_bit_identical": True}

    for device, times in (("cpu", {2: (0.010, 0.012), 4: (0.010, 0.016)}),
                          ("cuda", {2: (0.013, 0.020), 4: (0.011, 0.020)})):
        for i in range(2 if device == "cpu" else 3):  # the CPU stage cut short: 2 runs
            folder = tmp_path / f"bench-{device}" / f"run{i + 1}"
            folder.mkdir(parents=True)
            rows = [row("switchml-dense", k, s, device, 16385.0 if device == "cuda" else 2.0)
                    for k, (s, _) in times.items()]
            rows += [row("gloo", k, g, device) for k, (_, g) in times.items()]
            (folder / "results.json").write_text(json.dumps({"rows": rows, "machine": {
                "cpus": 16, "gpus": ["NVIDIA H100 80GB HBM3"]}}))
    ddp = [{"backend": b, "workers": 2, "device": "cuda", "model": "m", "samples_per_s": s,
            "step_ms": 1.0, "compute_ms_per_step": 0.5, "replicas_identical": True,
            "speedup_over_gloo": s / 100.0, "max_weight_diff_vs_gloo": 3e-5}
           for b, s in (("gloo", 100.0), ("switchml", 130.0))]
    (tmp_path / "ddp.json").write_text(json.dumps({"runs": ddp}))
    (tmp_path / "ddp-whole.json").write_text(json.dumps({"runs": [dict(  # switchml alone
        ddp[1], samples_per_s=150.0, samples_per_s_all=[150.0, 140.0, 155.0])]}))
    segment8m = tmp_path / "bench-cpu-segment8m" / "run1"  # a column of the modes' table
    segment8m.mkdir(parents=True)
    (segment8m / "results.json").write_text(json.dumps({"rows": [
        row("switchml-dense", 2, 0.009, "cpu", 0.0)], "machine": {"cpus": 16}}))
    (tmp_path / "stages.tsv").write_text("build\t0\t20\t\nbench-cpu\t124\t110\ttimed out\n")
    assert main([str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "bench-cpu | 124 | 110 | timed out" in printed and "H100" in printed
    assert "CPU tensors, 8 MiB segments ms (runs)" in printed and "| 9.0 " in printed
    assert "| 2 | 150.0 (150.0, 140.0, 155.0) | 130.0 | 100.0 |" in printed
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["invocations"] == {"cuda": 3, "cpu": 2}
    got = {(r["device"], r["workers"]): r for r in summary["allreduce"]}
    assert got[("cpu", 2)]["speedup_over_gloo"] == pytest.approx(1.2)
    assert got[("cpu", 2)]["speedup_met"] is False  # 1.3x at K=2
    assert got[("cpu", 4)]["speedup_met"] is True   # 1.6x against 1.5x at K=4
    assert got[("cuda", 2)]["cuda_over_cpu"] == pytest.approx(1.3)
    assert got[("cuda", 2)]["cuda_over_cpu_met"] is False
    assert got[("cuda", 4)]["cuda_over_cpu_met"] is True
    assert got[("cpu", 2)]["fresh_pages_met"] and not got[("cuda", 2)]["fresh_pages_met"]
    [trained] = summary["ddp"]
    assert trained["speedup_over_gloo"] == pytest.approx(1.3) and trained["speedup_met"]
    assert summary["ddp_modes"] == [{"workers": 2, "whole": 150.0}]
    # bench-cpu not run: the cuda-modes stage's switchml-alone CPU calls stand in
    (tmp_path / "bench-cpu").rename(tmp_path / "bench-cpu-switchml")
    assert main([str(tmp_path)]) == 0
    got = {(r["device"], r["workers"]): r
           for r in json.loads((tmp_path / "summary.json").read_text())["allreduce"]}
    assert got[("cuda", 2)]["cuda_over_cpu"] == pytest.approx(1.3)


def test_trace_summary_unions_each_streams_work_and_the_copies_beside_kernels():
    """bench/trace_summary.py: busy time is the union of a stream's intervals
    (overlapping ones counted once), the copies' time beside kernels is their
    overlap with the kernels of any stream, idle is the window less the union."""
    from bench.trace_summary import summarize

    def event(cat, name, ts, dur, stream, **args):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur,
                "args": {"stream": stream, **args}}

    trace = {"traceEvents": [
        event("kernel", "conv", 0, 10, 7), event("kernel", "relu", 5, 10, 7),  # 0-15
        event("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 12, 6, 20, bytes=2**20),  # 12-18
        event("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 30, 5, 21, bytes=2**21),  # 30-35
        {"ph": "X", "cat": "user_annotation", "name": "Optimizer.step#SGD.step", "ts": 0,
         "dur": 40, "args": {}},
        {"ph": "i", "cat": "kernel", "name": "instant", "ts": 1, "args": {}}]}
    s = summarize(trace)
    assert s["window_us"] == 35 and s["kernel_us"] == 15 and s["copy_us"] == 11
    assert s["gpu_busy_us"] == 23 and s["gpu_idle_us"] == 12
    assert s["copy_beside_kernels_us"] == 3  # 12-15
    assert s["streams"]["7"] == {"busy_us": 15, "kernels": 2, "copies": {}}
    assert s["streams"]["20"]["copies"] == {"DtoH": {"count": 1, "us": 6, "bytes": 2**20}}
    assert s["annotated"]["Optimizer.step#SGD.step"] == {"count": 1, "us": 40}


def test_a_rank_takes_the_gpu_of_its_place_on_its_host(monkeypatch):
    """--device cuda: rank r uses GPU (r mod ranks-per-host) mod the GPUs: every
    rank of a one-GPU host on cuda:0, the ranks of a 2-GPU host of 4 spread."""
    torch = pytest.importorskip("torch", reason="the torch extra is not installed")
    from switchml.bench.roles import torch_device

    chosen: list = []
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    for gpus, per_host, expected in ((1, 8, [0] * 8), (2, 4, [0, 1, 0, 1, 0, 1, 0, 1])):
        monkeypatch.setattr(torch.cuda, "device_count", lambda gpus=gpus: gpus)
        got = [torch_device({"device": "cuda", "rank": r, "ranks_per_host": per_host})
               for r in range(8)]
        assert [d.index for d in got] == expected and chosen[-8:] == got
    assert torch_device({"device": "cpu", "rank": 3}) == torch.device("cpu")
