"""The XDP data plane serving for real: ``switchml switch --data-plane xdp`` in a
network namespace, its program attached (generic mode) to the veth that holds
its address, and real ``switchml.Worker``s in this namespace on the veth's other
end.  The sums must equal, bit for bit, those of a user-space switch (Python
data plane) on the same veth, the same geometry, the same inputs.

Skips, saying why, without root (namespaces, BPF), ``ip``, or what the XDP
data plane needs (``xdp.unavailable``).
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import re
import shutil
import socket
import struct
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import switchml
from switchml import config, wire
from switchml.errors import DataPlaneUnavailableError
from switchml.switch.dataplane.pipeline import Pipeline
from switchml.switch.xdp import dispatch as xdp_dispatch
from switchml.switch.xdp import loader as xdp_loader
from switchml.switch.xdp import pipeline as xdp
from switchml.switch.xdp import serving as xdp_serving

REPO = pathlib.Path(__file__).resolve().parent.parent
REASON = xdp.unavailable() or (None if shutil.which("ip") else "no ip(8) for the namespaces")
needs_xdp = pytest.mark.skipif(REASON is not None, reason=f"XDP: {REASON}")


def sh(*argv: str) -> str:
    return subprocess.run(argv, check=True, capture_output=True, text=True).stdout


def remove(ns: str, here: str) -> None:
    """A fixture's veth end ``here`` deleted (its peer goes with it), and namespace
    ``ns``, every process still in it killed first."""
    subprocess.run(["ip", "link", "del", here], capture_output=True)
    for pid in subprocess.run(["ip", "netns", "pids", ns], capture_output=True,
                              text=True).stdout.split():
        os.kill(int(pid), 9)
    subprocess.run(["ip", "netns", "del", ns], capture_output=True)


@pytest.fixture
def veth():
    """A namespace holding one end of a veth pair (the switch's, .1), this
    namespace the other (the workers', .2); removed afterwards, with whatever ran
    in it."""
    tag = f"{os.getpid() % 100000}"
    ns, here, there = f"smlxdp{tag}", f"smx{tag}a", f"smx{tag}b"
    net = f"10.213.{os.getpid() % 250}"
    sh("ip", "netns", "add", ns)
    try:
        sh("ip", "link", "add", here, "type", "veth", "peer", "name", there)
        sh("ip", "link", "set", there, "netns", ns)
        sh("ip", "addr", "add", f"{net}.2/24", "dev", here)
        sh("ip", "link", "set", here, "up")
        # UDP GSO segmented before the veth, as a NIC does on the wire: a veth
        # passes a GSO super-packet whole, and the program sees one datagram a frame
        sh(sys.executable, str(REPO / "switchml" / "ethtool.py"), here,
           "tx-udp-segmentation", "off")  # the ethtool ioctl: no ethtool needed
        sh("ip", "-n", ns, "addr", "add", f"{net}.1/24", "dev", there)
        sh("ip", "-n", ns, "link", "set", there, "up")
        sh("ip", "-n", ns, "link", "set", "lo", "up")
        yield ns, there, f"{net}.1", here, f"{net}.2"
    finally:
        remove(ns, here)


@pytest.fixture
def bridged():
    """A namespace holding a bridge with the switch's address (.1) and one port,
    a veth whose other end is in this namespace (the workers', .2, its offloads
    as the kernel leaves them); removed afterwards, with whatever ran in it."""
    tag = f"{os.getpid() % 100000}"
    ns, bridge, here, port = f"smlxdb{tag}", f"smb{tag}", f"smb{tag}a", f"smb{tag}p"
    net = f"10.214.{os.getpid() % 250}"
    sh("ip", "netns", "add", ns)
    try:
        sh("ip", "-n", ns, "link", "add", bridge, "type", "bridge")
        sh("ip", "link", "add", here, "type", "veth", "peer", "name", port)
        sh("ip", "link", "set", port, "netns", ns)
        sh("ip", "-n", ns, "link", "set", port, "master", bridge)
        sh("ip", "addr", "add", f"{net}.2/24", "dev", here)
        sh("ip", "link", "set", here, "up")
        sh("ip", "-n", ns, "addr", "add", f"{net}.1/24", "dev", bridge)
        for dev in (port, bridge, "lo"):
            sh("ip", "-n", ns, "link", "set", dev, "up")
        yield ns, bridge, port, f"{net}.1", here
    finally:
        remove(ns, here)


class SwitchIn:
    """``switchml switch`` run in namespace ``ns`` until closed."""

    def __init__(self, ns: str, host: str, port: int, *flags: str, env: dict | None = None):
        self.proc = subprocess.Popen(
            ["ip", "netns", "exec", ns, sys.executable, "-c",
             "import sys; from switchml.cli import main; sys.exit(main())", "switch",
             "--host", host, "--port", str(port), "--log-level", "info", *flags],
            cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO), **(env or {})),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.address = f"{host}:{port}"
        line = self.proc.stdout.readline()  # "listening on ...", or nothing: it failed
        if "listening" not in line:
            self.proc.wait(timeout=10)
            raise RuntimeError(f"the switch did not start: {line}{self.proc.stderr.read()}")

    def stats(self) -> dict:
        from switchml.cli import fetch_stats

        return fetch_stats(self.address)

    def close(self) -> str:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        return self.proc.stderr.read()


def run_job(switch: str, inputs: list, job: str, sparse: tuple = ()) -> list:
    """Every rank's allreduce of each of its arrays through ``switch``: per rank,
    the list of results; the arrays at the indices in ``sparse`` by sparse
    calls (``allreduce(..., sparse=True)``), the others by dense ones."""
    world = len(inputs)

    def rank(r):
        with switchml.Worker(switch, r, world_size=world, job=job, timeout=30) as w:
            return [w.allreduce(a.copy(), sparse=i in sparse) for i, a in enumerate(inputs[r])]

    return in_threads(rank, world, 120)


def in_threads(task, n: int, timeout: float) -> list:
    """``task(i)`` for each i < ``n``, each in a thread of its own, at once: their
    results in order, or the first one's error."""
    out: list = [None] * n
    errors: list = []

    def one(i):
        try:
            out[i] = task(i)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout)
    if errors:
        raise errors[0]
    return out


def inputs_for(world: int, seed: int = 3) -> list:
    rng = np.random.default_rng(seed)
    sizes = [1, 300, 5000, 70001]
    return [[rng.integers(-2**31, 2**31, n, dtype=np.int64).astype(np.int32) if i % 2 == 0
             else rng.standard_normal(n).astype(np.float32) * 10.0 ** (i - 2)
             for i, n in enumerate(sizes)] for _ in range(world)]


@needs_xdp
def test_jumbo_frames_past_one_page(veth):
    """Links of MTU 9000: the ranks' packets take 8320-byte datagrams (8 blocks of
    256 values), frames past one page, which come to the program in generic mode
    as several buffers (multi-buffer XDP); the sums are the exact ones and every
    contribution was added in the program."""
    ns, dev, host, here, _ = veth
    sh("ip", "link", "set", "dev", here, "mtu", "9000")
    sh("ip", "-n", ns, "link", "set", "dev", dev, "mtu", "9000")
    world = 3
    # the workers' veth passes runs whole (its offload on), but the switch's
    # native program has the kernel cut them there: the ranks send runs
    sh(sys.executable, str(REPO / "switchml" / "ethtool.py"), here,
       "tx-udp-segmentation", "on")
    stats, inputs = exact_sums_through_an_xdp_switch(ns, host, world, seed=4, job="jumbo",
                                                     sent_runs=True)
    assert stats["xdp_mode"] == "driver"
    ended = stats["ended_jobs"]["jumbo"]
    assert ended["packet_elements"] == 2048  # wire.frame_geometry(9000, 16128, 256)
    job = ended["counters"]
    assert job["results_completed"] >= sum(-(-a.size // 2048) for a in inputs[0])
    assert job["packets_in"] >= world * job["results_completed"]
    assert not {k for k in job if k.startswith("dropped_")} - {"dropped_stale"}, job
    assert "gso_passed_up" not in job, job  # every run cut before the program
    # results of several buffers, sent to every rank by the fan-out program
    assert job["results_fanned_out"] == world * job["results_completed"], job


def lose(here: str, loss: float):
    """Drop UDP datagrams with probability ``loss`` both ways on veth ``here`` (this
    namespace's end): before the program sees them (output) and after it answered
    (input; XDP runs before netfilter, so the loss goes where it can act).  Returns
    the nftables table to delete."""
    table = f"smlxdploss{os.getpid()}"
    threshold = round(loss * 1_000_000)
    rule = f"meta l4proto udp numgen random mod 1000000 < {threshold} counter drop"
    subprocess.run(["nft", "-f", "-"], check=True, text=True, input=(
        f"table inet {table} {{\n"
        f"  chain out {{ type filter hook output priority 0; oifname \"{here}\" {rule}; }}\n"
        f"  chain in {{ type filter hook input priority 0; iifname \"{here}\" {rule}; }}\n"
        f"}}\n"))
    return table


def dropped_by(table: str) -> int:
    """The datagrams the rules of ``lose``'s ``table`` dropped, both ways."""
    listing = sh("nft", "list", "table", "inet", table)
    return sum(int(n) for n in re.findall(r"counter packets (\d+)", listing))


@needs_xdp
@pytest.mark.parametrize("loss", [0.0, 0.05])
def test_workers_get_the_user_space_switchs_sums_bit_for_bit(veth, loss):
    """Without loss, and with 5% of the datagrams lost both ways (the program's
    answers to one rank, XDP_TX, then carry the recovery: resends, dones,
    stored results)."""
    ns, dev, host, here, _ = veth
    if loss and shutil.which("nft") is None:
        pytest.skip("no nft for the loss")
    world = 3
    inputs = inputs_for(world)
    reference = SwitchIn(ns, host, 7301, "--data-plane", "python")
    try:
        want = run_job(reference.address, inputs, "ref")
        ref_job = reference.stats()["ended_jobs"]["ref"]["counters"]
    finally:
        reference.close()
    if loss:  # results one frame each: nftables drops per skb, and runs of results (GRO
        # on the switch's end), like the workers' GSO runs, are lost whole or not at all
        sh("ip", "netns", "exec", ns, sys.executable, str(REPO / "switchml" / "ethtool.py"),
           dev, "tx-udp-segmentation", "off")
    switch = SwitchIn(ns, host, 7300, "--data-plane", "xdp")
    table = lose(here, loss) if loss else None
    try:
        # attached where the address is, in the veth's native mode: the dispatcher
        shown = sh("ip", "-n", ns, "link", "show", "dev", dev)
        assert "prog/xdp " in shown and "xdpgeneric" not in shown
        got = run_job(switch.address, inputs, "xdp")
        if table:  # before the stats query, which is UDP-free but keeps it simple
            assert dropped_by(table) > 0  # the loss happened
            subprocess.run(["nft", "delete", "table", "inet", table], check=True)
            table = None
        stats = switch.stats()
    finally:
        if table:
            subprocess.run(["nft", "delete", "table", "inet", table])
        log = switch.close()
    assert "XDP program attached (driver mode" in log
    assert stats["xdp_mode"] == "driver"
    for r in range(world):
        for a, b in zip(got[r], want[r]):
            assert a.dtype == b.dtype and a.tobytes() == b.tobytes()
    # the int32 sums, exactly, with wrap-around
    for i in (0, 2):
        total = sum(x[i].astype(np.int64) for x in inputs)
        assert got[0][i].tolist() == ((total + 2**31) % 2**32 - 2**31).tolist()
    # the aggregation ran in the program: every contribution counted in its maps
    assert stats["data_plane"] == "xdp"
    job = stats["ended_jobs"]["xdp"]["counters"]
    assert stats["ended_jobs"]["xdp"]["packet_elements"] == 352  # a frame of MTU 1500
    # as many sets completed as on the user-space switch, each once
    assert job["results_completed"] == ref_job["results_completed"] >= \
        sum(-(-a.size // 352) for a in inputs[0])
    assert job["packets_in"] >= world * job["results_completed"]
    assert not {k for k in job if k.startswith("dropped_")} - {"dropped_stale"}, job
    if loss:  # recovered through the program's answers to one rank
        assert job.get("resends_asked", 0) + job.get("retransmissions_answered", 0) + \
            job.get("queries_done", 0) > 0, job
    else:  # results reach every rank from the data plane: a timer is rare
        assert job.get("retransmissions_answered", 0) <= job["results_completed"] // 10, job
    # every completed result went to every rank from the fan-out program (the
    # ranks' frames come in by the interface served), none through the socket
    assert job["results_fanned_out"] == world * job["results_completed"], job
    assert "results_passed_up" not in job and "results_fanout_failed" not in job, job
    aggregated = {k: v for k, v in job.items() if k != "results_fanned_out"}
    timerless = {"packets_in", "results_completed", "results_out"}
    if not loss and not set(aggregated) - timerless and not set(ref_job) - timerless:
        # no timer fired in either run (one may, on a loaded machine: a probe,
        # answered): each rank added once, the result to every rank, on both
        assert aggregated == ref_job
        assert job["packets_in"] == job["results_out"] == world * job["results_completed"]
    assert stats["counters"].get("internal_errors", 0) == 0
    # stopped: detached
    assert "prog/xdp" not in sh("ip", "-n", ns, "link", "show", "dev", dev)


def exact_sums_through_an_xdp_switch(ns: str, host: str, world: int, *flags: str, seed=3,
                                     job="xdp", env=None, sent_runs=None,
                                     started=None) -> tuple[dict, list]:
    """A job of ``world`` ranks through an XDP switch in ``ns`` started with
    ``flags`` (and ``env``): the int32 sums exactly, with wrap-around, and every
    result the same on every rank; the switch's stats, and the inputs.
    ``sent_runs``: whether every rank sent runs of UDP GSO segments (``Worker.gso``)
    must be this; ``started()`` runs once the switch is, before the job."""
    inputs = inputs_for(world, seed=seed)
    switch = SwitchIn(ns, host, 7300, "--data-plane", "xdp", *flags, env=env)
    gso: list = []
    try:
        if started is not None:
            started()

        def rank(r):
            with switchml.Worker(switch.address, r, world_size=world, job=job,
                                 timeout=30) as w:
                gso.append(w.gso)
                return [w.allreduce(a.copy()) for a in inputs[r]]

        got = in_threads(rank, world, 120)
        stats = switch.stats()
    finally:
        switch.close()
    if sent_runs is not None:
        assert gso == [sent_runs] * world
    for i in (0, 2):
        total = sum(x[i].astype(np.int64) for x in inputs)
        assert got[0][i].tolist() == ((total + 2**31) % 2**32 - 2**31).tolist()
    for r in range(1, world):
        assert all(a.tobytes() == b.tobytes() for a, b in zip(got[r], got[0]))
    return stats, inputs


@needs_xdp
def test_simulated_drops_at_the_xdp_switch_are_recovered_exactly(veth):
    """``--drop-rate``: the program loses datagrams coming in and copies going
    out, as the user-space switch simulates it; the workers recover every
    one, and get the exact sums."""
    ns, _, host, _, _ = veth
    world = 3
    stats, _ = exact_sums_through_an_xdp_switch(ns, host, world, "--drop-rate", "0.05")
    job = stats["ended_jobs"]["xdp"]["counters"]
    assert stats["counters"]["dropped_ingress_simulated"] > 0
    assert job["dropped_egress_simulated"] > 0
    # a lost copy of a result is neither sent nor in results_out; an answer to
    # one rank (a stored result) is in it when it was not lost
    sent = job["results_fanned_out"] + job.get("results_fanout_failed", 0)
    assert sent < world * job["results_completed"]
    assert sent <= job["results_out"] <= sent + job.get("retransmissions_answered", 0)


@needs_xdp
def test_workers_send_datagrams_apart_where_gso_runs_would_reach_the_program_whole(veth):
    """In generic mode (``SWITCHML_XDP_MODE=generic``), with the workers' veth
    passing UDP GSO runs whole (its segmentation offload on, as a same-host
    peer's), the XDP switch's ``ready`` tells them to send each datagram
    apart: no run reaches the program (``gso_passed_up``), the exact sums.  (A
    run that comes anyway, from another sender, is passed up and cut by the
    kernel: tests/test_xdp.py.)"""
    ns, dev, host, here, _ = veth
    sh(sys.executable, str(REPO / "switchml" / "ethtool.py"), here,
       "tx-udp-segmentation", "on")
    stats, _ = exact_sums_through_an_xdp_switch(ns, host, 3, env={"SWITCHML_XDP_MODE": "generic"},
                                                sent_runs=False)
    assert stats["xdp_mode"] == "generic"
    job = stats["ended_jobs"]["xdp"]["counters"]
    assert job["results_completed"] > 0
    assert "gso_passed_up" not in job and "dropped_bad_length" not in job, job


def runs_through(switch: SwitchIn, job: str, world: int = 3, n: int = 300_000) -> list:
    """A job of ``world`` ranks through ``switch``, its sums checked: whether each
    rank sent runs (``Worker.gso``)."""
    def rank(r):
        with switchml.Worker(switch.address, r, world_size=world, job=job, timeout=30) as w:
            return w.gso, w.allreduce(np.arange(n, dtype=np.int32) * (r + 1))

    got = in_threads(rank, world, 60)
    want = (np.arange(n) * world * (world + 1) // 2).tolist()
    assert all(out.tolist() == want for _, out in got)
    return [gso for gso, _ in got]


@needs_xdp
@pytest.mark.parametrize("mtu", [1500, 9000])
def test_in_driver_mode_workers_send_runs_that_the_kernel_cuts_before_the_program(veth, mtu):
    """On a veth the switch attaches in the driver's native mode, and the kernel
    takes software GSO off the peer (the workers' end, offload on as the
    kernel leaves it): each run is cut as it leaves, so the switch's ``ready``
    says ``"gso": true`` and the ranks send runs, none reaching the program
    whole; the exact sums, every result fanned out from the kernel.  Its own
    end's offload on (the kernel's default), results leave in runs: GRO on
    there while the switch runs, off again after, every result's copies
    counted one a datagram."""
    ns, dev, host, here, _ = veth
    from switchml.ethtool import features
    for end, where in ((here, []), (dev, ["ip", "netns", "exec", ns])):
        sh(*where, "ip", "link", "set", "dev", end, "mtu", str(mtu))
    sh(sys.executable, str(REPO / "switchml" / "ethtool.py"), here,
       "tx-udp-segmentation", "on")
    assert features(here)["tx-udp-segmentation"]
    assert switch_end_feature(ns, dev, "rx-gro") == "off"  # a veth's default
    switch = SwitchIn(ns, host, 7300, "--data-plane", "xdp")
    try:
        assert not features(here)["tx-udp-segmentation"]  # the kernel cuts the runs here
        assert switch_end_feature(ns, dev, "rx-gro") == "on"
        world = 3
        gso = runs_through(switch, "runs", world)
        stats = switch.stats()
    finally:
        log = switch.close()
    assert "XDP program attached (driver mode" in log and "workers send runs" in log, log
    assert "in runs (GRO on)" in log, log
    assert stats["xdp_mode"] == "driver" and stats["xdp_results_in_runs"]
    assert gso == [True] * world
    job = stats["ended_jobs"]["runs"]["counters"]
    assert "gso_passed_up" not in job and "dropped_bad_length" not in job, job
    assert job["results_fanned_out"] == world * job["results_completed"], job
    assert 0 < job["result_runs_fanned_out"] < job["results_fanned_out"], job
    # detached: the kernel gives the peer its offload back, the switch GRO
    assert features(here)["tx-udp-segmentation"]
    assert switch_end_feature(ns, dev, "rx-gro") == "off"


@needs_xdp
def test_gro_goes_back_off_with_the_last_switch_on_the_interface(veth):
    """Switches sharing a veth in driver mode, results in runs: the first turns
    GRO on; it stays on when that one stops while another serves (whose
    results still leave in runs), and when a switch SIGKILLed leaves another;
    the last to stop turns it off.  GRO that was on before any switch came is
    left on."""
    ns, dev, host, _, _ = veth
    assert switch_end_feature(ns, dev, "rx-gro") == "off"  # a veth's default
    first = SwitchIn(ns, host, 7350, "--data-plane", "xdp")
    second = third = None
    try:
        assert switch_end_feature(ns, dev, "rx-gro") == "on"
        second = SwitchIn(ns, host, 7351, "--data-plane", "xdp")
        first.close()  # the one that turned it on
        assert switch_end_feature(ns, dev, "rx-gro") == "on"
        runs_through(second, "after")
        assert second.stats()["ended_jobs"]["after"]["counters"]["result_runs_fanned_out"] > 0
        third = SwitchIn(ns, host, 7352, "--data-plane", "xdp")
        third.proc.kill()
        third.proc.wait()
        second.close()  # the last one alive: the SIGKILLed one's port is swept
        assert switch_end_feature(ns, dev, "rx-gro") == "off"
    finally:
        for switch in (first, second, third):
            if switch is not None:
                switch.close()
    sh("ip", "netns", "exec", ns, sys.executable, str(REPO / "switchml" / "ethtool.py"), dev,
       "rx-gro", "on")
    SwitchIn(ns, host, 7350, "--data-plane", "xdp").close()
    assert switch_end_feature(ns, dev, "rx-gro") == "on"


def pseudo_header_sum(src: str, dst: str, udp_len: int) -> int:
    """The 16-bit one's-complement sum of a UDP pseudo-header, folded: the checksum
    field of a datagram whose checksum the kernel completes later."""
    words = struct.unpack("!4H", socket.inet_aton(src) + socket.inet_aton(dst))
    total = sum(words) + socket.IPPROTO_UDP + udp_len
    while total > 0xFFFF:
        total = (total & 0xFFFF) + (total >> 16)
    return total


@needs_xdp
def test_a_run_of_results_reaches_a_rank_with_the_checksum_the_kernel_completes(veth):
    """A run of results leaves the fan-out program with its checksum field the
    pseudo-header's sum of its new addresses (from which the kernel, or a NIC,
    makes each datagram's checksum as it cuts the run), a result alone with no
    checksum: every result frame the workers' end receives is one or the
    other, and some are runs."""
    ns, _, host, here, worker_ip = veth
    capture = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0003))
    capture.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 20)
    capture.bind((here, 0))
    capture.setblocking(False)
    try:
        stats, _ = exact_sums_through_an_xdp_switch(ns, host, 3)
        frames = []
        with contextlib.suppress(BlockingIOError):
            while True:
                frames.append(capture.recv(1 << 17))
    finally:
        capture.close()
    assert stats["xdp_results_in_runs"]
    seeded = alone = 0
    for frame in frames:
        ip, udp = frame[14:34], frame[34:42]
        if frame[12:14] != b"\x08\x00" or ip[9] != socket.IPPROTO_UDP or len(frame) < 46:
            continue
        sport, _, length, check = struct.unpack("!4H", udp)
        if sport != 7300 or frame[42 + 3] != wire.KIND_RESULT:
            continue
        src, dst = socket.inet_ntoa(ip[12:16]), socket.inet_ntoa(ip[16:20])
        assert (src, dst) == (host, worker_ip)
        if check == 0:
            alone += 1
        else:
            assert check == pseudo_header_sum(src, dst, length), (check, length)
            seeded += 1
    assert seeded > 0, (seeded, alone, len(frames))


SEND_A_RUN = """
import socket, sys
host, port, size, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
    s.sendmsg([bytes(size * n)], [(socket.SOL_UDP, 103, size.to_bytes(2, sys.byteorder))],
              0, (host, port))
"""


@needs_xdp
def test_a_run_that_reaches_the_switchs_socket_is_cut_into_its_datagrams(veth):
    """Where results leave in runs the switch's socket takes UDP_GRO, so a run
    sent to it from its own host comes to it whole: each of its datagrams goes
    through the program (8 from a stranger: 8 dropped, not one)."""
    ns, _, host, _, _ = veth
    switch = SwitchIn(ns, host, 7300, "--data-plane", "xdp")
    try:
        assert switch.stats()["xdp_results_in_runs"]
        sender = in_ns(ns, SEND_A_RUN, host, "7300", "200", "8")
        assert sender.wait(timeout=30) == 0, sender.stderr.read()
        deadline = time.monotonic() + 10
        while switch.stats()["counters"].get("dropped_unknown_source", 0) < 8:
            assert time.monotonic() < deadline, switch.stats()["counters"]
            time.sleep(0.05)
        assert switch.stats()["counters"]["dropped_unknown_source"] == 8
    finally:
        switch.close()


def switch_end_feature(ns: str, dev: str, feature: str) -> str:
    """``on`` or ``off``: an offload feature of device ``dev`` in namespace ``ns``."""
    out = sh("ip", "netns", "exec", ns, sys.executable, str(REPO / "switchml" / "ethtool.py"),
             dev)
    return next(line.split(": ")[1] for line in out.splitlines()
                if line.startswith(f"{dev} {feature}:"))


@needs_xdp
def test_results_leave_one_by_one_where_a_run_would_be_cut_as_it_leaves(veth):
    """The switch's end of the veth with its UDP segmentation offload off: a run
    of results would be cut into datagrams as each copy leaves, so the switch
    leaves GRO off there and sends each result's copies one by one; the exact
    sums."""
    ns, dev, host, _, _ = veth
    sh("ip", "netns", "exec", ns, sys.executable, str(REPO / "switchml" / "ethtool.py"), dev,
       "tx-udp-segmentation", "off")
    stats, _ = exact_sums_through_an_xdp_switch(ns, host, 3)
    assert stats["xdp_mode"] == "driver" and not stats["xdp_results_in_runs"]
    job = stats["ended_jobs"]["xdp"]["counters"]
    assert job["results_fanned_out"] == 3 * job["results_completed"], job
    assert "result_runs_fanned_out" not in job, job
    assert switch_end_feature(ns, dev, "rx-gro") == "off"


@needs_xdp
def test_a_switch_on_a_bridge_serves_its_ports_in_driver_mode(bridged):
    """A bridge has no driver mode, but its ports do: the switch on the bridge's
    address attaches to each port natively (the bridge runs no XDP program),
    its workers send runs, cut at their end (offload on), and with 5% of the
    datagrams lost in the program the answers to one rank (resends, stored
    results) reach the ranks: the exact sums, every result fanned out."""
    ns, bridge, port, host, here = bridged
    stats, _ = exact_sums_through_an_xdp_switch(ns, host, 3, "--drop-rate", "0.05",
                                                sent_runs=True)
    assert stats["xdp_mode"] == "driver"
    job = stats["ended_jobs"]["xdp"]["counters"]
    assert stats["counters"]["dropped_ingress_simulated"] > 0
    assert job.get("resends_asked", 0) + job.get("retransmissions_answered", 0) > 0, job
    assert "gso_passed_up" not in job and "results_passed_up" not in job, job
    assert job["results_fanned_out"] > 0
    assert stats["counters"].get("internal_errors", 0) == 0


@needs_xdp
def test_a_port_that_joins_the_bridge_after_the_switch_started_is_served_in_driver_mode(
        bridged):
    """A container started after the switch: its veth joins the bridge then (and
    the first port's container went).  The switch takes the new port within its
    sweep (the dispatcher in driver mode, the fan-out program), so its ranks'
    runs meet the program, not the switch's socket: the exact sums, nothing
    passed up, every result fanned out."""
    ns, bridge, port, host, here = bridged
    later, later_port = here[:-1] + "c", port[:-1] + "q"
    net = host.rsplit(".", 1)[0]

    def a_container_starts():
        sh("ip", "link", "del", here)  # the first port goes with its peer
        sh("ip", "link", "add", later, "type", "veth", "peer", "name", later_port)
        sh("ip", "link", "set", later_port, "netns", ns)
        sh("ip", "-n", ns, "link", "set", later_port, "master", bridge)
        sh("ip", "-n", ns, "link", "set", later_port, "up")
        sh("ip", "addr", "add", f"{net}.2/24", "dev", later)
        sh("ip", "link", "set", later, "up")
        deadline = time.monotonic() + 10
        while "prog/xdp" not in sh("ip", "-n", ns, "link", "show", "dev", later_port):
            assert time.monotonic() < deadline, "the new port got no XDP program"
            time.sleep(0.1)

    stats, _ = exact_sums_through_an_xdp_switch(ns, host, 2, sent_runs=True,
                                                started=a_container_starts)
    assert stats["xdp_mode"] == "driver"
    job = stats["ended_jobs"]["xdp"]["counters"]
    assert "gso_passed_up" not in job and "results_passed_up" not in job, job
    assert job["results_fanned_out"] > 0, job


ADOPT_PAST_THE_LIMIT = """
import sys
from switchml.switch.xdp import pipeline as xdp
xdp.XdpPipeline.max_bridge_ports = 1  # as if the bridge's first port filled its map
p = xdp.XdpPipeline(8, 16, block_elements=16, port=7361, switch_ip=sys.argv[1])
try:
    p.serve((sys.argv[1], 7361))
    print(p.mode, flush=True)
    sys.stdin.readline()  # a second port joined the bridge
    print(p.adopt_new_ports(), p.adopt_new_ports(), flush=True)
finally:
    p.close()
"""


@needs_xdp
def test_a_port_past_the_programs_limit_is_left_to_the_socket(bridged):
    """The program serves a fixed number of bridge ports (its map of them, sized
    at load): one more that joins the bridge is left to the switch's socket,
    logged once, never an error out of the switch's loop."""
    ns, bridge, port, host, here = bridged
    run = in_ns(ns, ADOPT_PAST_THE_LIMIT, host, stdin=subprocess.PIPE)
    assert run.stdout.readline().strip() == "driver"
    sh("ip", "-n", ns, "link", "add", f"{port}x", "type", "veth", "peer", "name", f"{port}y")
    sh("ip", "-n", ns, "link", "set", f"{port}x", "master", bridge)
    sh("ip", "-n", ns, "link", "set", f"{port}x", "up")
    out, err = run.communicate("\n", timeout=30)
    assert run.returncode == 0, err
    assert out.strip() == "[] []"
    assert err.count("is not served in driver mode (the switch serves 1 ports at most)") == 1


ADOPT_A_TAKEN_PORT = """
import subprocess, sys, time
import switchml
first = switchml.Switch("10.97.1.1", 7450, data_plane="xdp").start()   # the bridge's
second = switchml.Switch("10.97.2.1", 7450, data_plane="xdp").start()  # a veth's, same port
subprocess.run(["ip", "link", "set", "Y0", "master", "br0"], check=True)  # re-plugged
time.sleep(2.5)  # two sweeps
print(first._thread.is_alive(), first.failure, second._thread.is_alive(), flush=True)
first.stop()
second.stop()
"""


@needs_xdp
def test_a_port_another_live_switch_serves_that_joins_the_bridge_is_left_to_it():
    """A veth that another XDP switch serves, on the same UDP port, moves into the
    bridge a switch serves: that switch's sweep finds the port taken, leaves it
    (logged), and serves on (its serving thread ended with InterfaceTaken)."""
    ns = f"smlxa{os.getpid() % 100000}"
    sh("ip", "netns", "add", ns)
    try:
        for argv in (["link", "add", "br0", "type", "bridge"],
                     ["link", "add", "X0", "type", "veth", "peer", "name", "X1"],
                     ["link", "add", "Y0", "type", "veth", "peer", "name", "Y1"],
                     ["link", "set", "X0", "master", "br0"],
                     ["addr", "add", "10.97.1.1/24", "dev", "br0"],
                     ["addr", "add", "10.97.2.1/24", "dev", "Y0"],
                     *[["link", "set", dev, "up"] for dev in ("lo", "br0", "X0", "X1", "Y0",
                                                                "Y1")]):
            sh("ip", "-n", ns, *argv)
        run = in_ns(ns, ADOPT_A_TAKEN_PORT)
        out, err = run.communicate(timeout=60)
        assert run.returncode == 0, err
        assert out.split() == ["True", "None", "True"], err
        assert "port Y0 of the bridge is not served in driver mode" in err
    finally:
        remove(ns, "none")


@needs_xdp
def test_a_bridge_port_without_driver_mode_leaves_the_bridge_in_generic_mode(bridged):
    """A port with no driver mode (a VXLAN device, after the veth in the
    bridge's order) leaves the switch on the bridge itself, in generic mode,
    saying which port, with nothing of the attempt left on the veth; the
    workers send their runs apart."""
    ns, bridge, port, host, here = bridged
    sh("ip", "-n", ns, "link", "add", f"{port}z", "type", "vxlan", "id", "42", "dstport", "4789")
    sh("ip", "-n", ns, "link", "set", f"{port}z", "master", bridge)
    switch = SwitchIn(ns, host, 7300, "--data-plane", "xdp")
    try:
        assert "prog/xdp" not in sh("ip", "-n", ns, "link", "show", "dev", port)
        assert "xdpgeneric" in sh("ip", "-n", ns, "link", "show", "dev", bridge)

        def rank(r):
            with switchml.Worker(switch.address, r, world_size=2, job="g", timeout=30) as w:
                return w.gso, w.allreduce(np.arange(100_000, dtype=np.int32))

        got = in_threads(rank, 2, 60)
        stats = switch.stats()
    finally:
        log = switch.close()
    assert stats["xdp_mode"] == "generic"
    assert f"no driver mode on {port}z, a port of bridge {bridge}" in log, log
    assert [gso for gso, _ in got] == [False, False]
    assert all(out.tolist() == (2 * np.arange(100_000)).tolist() for _, out in got)


@needs_xdp
def test_a_switch_on_loopback_falls_back_to_generic_mode_and_says_why():
    """Loopback has no driver mode: generic, the kernel's reason in the log
    line's words, and ``ready`` keeps the workers' runs apart."""
    p = xdp.XdpPipeline(8, 352, block_elements=352, port=7350, switch_ip="127.0.0.1")
    try:
        p.serve(("127.0.0.1", 7350))
        assert p.mode == "generic" and not p.takes_gso_runs
        assert "no driver mode on lo" in p.mode_reason and "not supported" in p.mode_reason
        assert "xdpgeneric" in sh("ip", "link", "show", "dev", "lo")
        assert p.stats()["xdp_mode"] == "generic"
    finally:
        p.close()
    assert "prog/xdp" not in sh("ip", "link", "show", "dev", "lo")
    p = xdp.XdpPipeline(8, 352, block_elements=352)
    try:
        with pytest.raises(ValueError, match="'auto' or 'generic'"):
            p.serve(("127.0.0.1", 7350), mode="native")
    finally:
        p.close()


@needs_xdp
def test_a_port_another_switchs_sweep_took_out_is_put_back():
    """Maps have no compare-and-delete: another switch's sweep, having looked at a
    killed switch's entry of this port just before this switch took the port,
    removes this switch's.  Its own sweep puts it back within a second."""
    p = xdp.XdpPipeline(8, 16, block_elements=16, port=7352, switch_ip="127.0.0.1")
    other = None
    try:
        p.serve(("127.0.0.1", 7352))
        [mine] = p._dispatches
        other = xdp_dispatch.Dispatcher(mine.ifindex)  # a second switch's hold on it
        other._remove(7352)  # what its sweep did
        assert mine._owner(7352) is None
        p.sweep_gone_switches()
        owner = mine._owner(7352)
        assert owner is not None and (owner.pid, owner.prog_id) == (os.getpid(),
                                                                     p._prog.prog_id)
        assert not mine.reclaim()  # held: nothing to do
    finally:
        if other is not None:
            other._close_fds()
        p.close()
    assert "prog/xdp" not in sh("ip", "link", "show", "dev", "lo")


def test_a_cached_object_cut_short_is_built_again(tmp_path, monkeypatch):
    """The object cache names an object by what it was built from: one cut short
    or overwritten (a crash, a full disk) is built again, not loaded and refused
    by libbpf on every start until someone deletes it."""
    if shutil.which("clang") is None:
        pytest.skip("no clang")
    monkeypatch.setenv("SWITCHML_XDP_CACHE", str(tmp_path))
    built = xdp_loader.build_object(64)
    whole = built.read_bytes()
    for damaged in (b"", whole[:1000], b"garbage" * 100):
        built.write_bytes(damaged)
        assert xdp_loader.build_object(64) == built and built.read_bytes() == whole


@needs_xdp
def test_a_switch_host_given_by_name_is_served_by_its_address():
    """``localhost``: resolved once as the switch starts, so that what user space
    runs through the program (a probe it passed up) is framed to an address."""
    p = xdp.XdpPipeline(8, 16, block_elements=16, port=7351, switch_ip="127.0.0.1")
    try:
        p.serve(("localhost", 7351))
        assert p.address == ("127.0.0.1", 7351)
        member = ("127.0.0.1", 5001)
        p.install_job("j", 0x77, [member], 0, 4, tokens=[11])
        data = wire.encode(wire.KIND_CONTRIBUTION, 0, 0, 11, 1, 0, 0, np.zeros(1, wire.LANE),
                           np.ones(16, np.int32))
        assert [a for _, a in p.passed_up(data, member)] == [member]  # a job of one: done
        assert [a for _, a in p.passed_up(wire.probe_of(data), member)] == [member]
    finally:
        p.close()


@needs_xdp
@pytest.mark.parametrize("joined", [False, True])
def test_an_answer_to_one_rank_leaves_by_the_stack_where_the_peer_has_no_napi(veth, joined):
    """In a veth's native mode XDP_TX reaches the peer only where it polls with
    NAPI, which a veth (GRO off, as the kernel leaves it) does not: the
    program's answer to one rank (a stored result for a retransmission)
    leaves through fan_out_results, back out of the veth, and the rank gets
    it; nothing reaches the switch's socket.  Also for a switch asking for
    generic mode that joins (``joined``) a dispatcher another switch attached
    in driver mode."""
    ns, dev, peer, here, me = veth
    port = 7307
    tokens = [0x10, 0x20]
    members = [(peer, 5000), (peer, 5001)]
    ranks = contributions(tokens)
    result = reference_sends(members, tokens, ranks)[0][0]
    assert "rx-gro: off" in sh("ip", "netns", "exec", ns, sys.executable,
                               str(REPO / "switchml" / "ethtool.py"), dev)
    with contextlib.ExitStack() as held:
        if joined:  # another switch's dispatcher, in driver mode
            first = xdp.XdpPipeline(8, 352, block_elements=352, port=7308, switch_ip=me)
            held.callback(first.close)
            first.serve((me, 7308))
        p, udp = held.enter_context(
            switch_here((me, port), members, tokens, "generic" if joined else "auto"))
        assert p.mode == "driver" and p.takes_gso_runs
        if joined:
            assert "the dispatcher there runs in driver mode" in p.mode_reason
        run = peer_run(ns, peer, (me, port), [(5000, ranks[0]), (5001, ranks[1]),
                                              (5000, ranks[0])])  # again: its result
        out, err = run.communicate(timeout=30)
        udp.settimeout(0.5)
        with pytest.raises(socket.timeout):
            udp.recvfrom(65536)
        switch = (me, port)
        assert received(out) == [(5000, switch, result), (5000, switch, result),
                                 (5001, switch, result)], err
        assert job_counters(p) == {"packets_in": 3, "results_completed": 1, "results_out": 3,
                                   "retransmissions_answered": 1, "results_fanned_out": 2}


@needs_xdp
def test_workers_send_runs_where_their_interface_cuts_them_before_they_leave(veth):
    """With the workers' veth cutting UDP GSO runs as they leave (its segmentation
    offload off, as a NIC without it), the runs reach the XDP switch as frames:
    its workers send runs though its ``ready`` says ``"gso": false`` (generic
    mode; one send a run, not one a datagram), and no run reaches the program
    whole.  With the
    offload on they send apart; to this host's own address, never runs."""
    from switchml.netutil import runs_leave_cut
    ns, _, host, here, local = veth
    assert runs_leave_cut(local, host)
    assert not runs_leave_cut(local, local)  # this host: through loopback
    switch = SwitchIn(ns, host, 7300, "--data-plane", "xdp", env={"SWITCHML_XDP_MODE": "generic"})
    try:
        def rank(r):
            with switchml.Worker(switch.address, r, world_size=2, job="runs",
                                 timeout=30) as w:
                return w.gso, w.allreduce(np.arange(200_000, dtype=np.int32))

        got = in_threads(rank, 2, 60)
        stats = switch.stats()
    finally:
        switch.close()
    assert [gso for gso, _ in got] == [True, True]
    assert all(out.tolist() == (2 * np.arange(200_000)).tolist() for _, out in got)
    job = stats["ended_jobs"]["runs"]["counters"]
    assert "gso_passed_up" not in job and "dropped_bad_length" not in job, job
    sh(sys.executable, str(REPO / "switchml" / "ethtool.py"), here,
       "tx-udp-segmentation", "on")
    assert not runs_leave_cut(local, host)


@needs_xdp
def test_a_host_no_interface_holds_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="no interface holds 192.0.2.1"):
        xdp_serving.interface_of("192.0.2.1")


def test_data_plane_setting_is_checked():
    with pytest.raises(ValueError, match="data_plane must be one of"):
        config.SwitchConfiguration(data_plane="ebpf")
    with pytest.raises(ValueError, match="contradicts"):
        config.SwitchConfiguration(data_plane="xdp", fastpath=True)
    with pytest.raises(ValueError, match="rack switch"):
        config.SwitchConfiguration(data_plane="xdp", upstream="127.0.0.1:7300")
    assert config.SwitchConfiguration.from_env(environ={"SWITCHML_DATA_PLANE": "python"}) \
        .data_plane == "python"


def test_an_unknown_xdp_mode_is_a_clear_error(monkeypatch):
    from switchml.switch.server import Switch

    monkeypatch.setenv("SWITCHML_XDP_MODE", "native")
    with pytest.raises(ValueError, match="SWITCHML_XDP_MODE='native': auto .* or generic"):
        Switch(data_plane="xdp", packet_elements=512)


def test_xdp_unavailable_is_a_clear_error(monkeypatch):
    from switchml.switch.server import Switch

    monkeypatch.setattr(xdp, "unavailable", lambda: "no clang (test)")
    with pytest.raises(DataPlaneUnavailableError, match="data_plane='xdp' cannot run here: "
                                                        "no clang"):
        Switch(data_plane="xdp", packet_elements=512)


def sparse_inputs_for(world: int, seed: int = 5) -> list:
    """inputs_for's arrays with most of their 352-value blocks (a packet's, at
    MTU 1500) zero, as sparse gradients are; a rank's own blocks, so that a
    result holds blocks from some ranks only."""
    rng = np.random.default_rng(seed)
    out = []
    for arrays in inputs_for(world, seed):
        for a in arrays:
            blocks = -(-a.size // 352)
            for b in np.nonzero(rng.random(blocks) > 0.15)[0]:
                a[b * 352:(b + 1) * 352] = 0
        out.append(arrays)
    return out


@needs_xdp
@pytest.mark.parametrize("loss", [0.0, 0.05])
def test_sparse_and_dense_calls_get_the_user_space_switchs_sums_bit_for_bit(veth, loss):
    """A job alternating sparse and dense calls, on the same slots: the program
    passes the sparse contributions up (``sparse_passed_up``), the switch
    aggregates them in user space on the sets in the program's maps (logged
    once for the job), the program keeps the dense ones; every rank gets, bit
    for bit, what a user-space switch (Python data plane) gives; with 5% of the
    datagrams lost both ways, recovered through the program's answers and the
    sparse path's."""
    ns, dev, host, here, _ = veth
    if loss and shutil.which("nft") is None:
        pytest.skip("no nft for the loss")
    world, sparse = 3, (0, 2, 3)
    inputs = sparse_inputs_for(world)
    reference = SwitchIn(ns, host, 7301, "--data-plane", "python")
    try:
        want = run_job(reference.address, inputs, "ref", sparse)
        ref_job = reference.stats()["ended_jobs"]["ref"]["counters"]
    finally:
        reference.close()
    switch = SwitchIn(ns, host, 7300, "--data-plane", "xdp")
    table = lose(here, loss) if loss else None
    try:
        got = run_job(switch.address, inputs, "mixed", sparse)
        if table:
            subprocess.run(["nft", "delete", "table", "inet", table], check=True)
            table = None
        stats = switch.stats()
    finally:
        if table:
            subprocess.run(["nft", "delete", "table", "inet", table])
        log = switch.close()
    for r in range(world):
        for a, b in zip(got[r], want[r]):
            assert a.dtype == b.dtype and a.tobytes() == b.tobytes()
    for i in (0, 2):  # the int32 sums, exactly, with wrap-around
        total = sum(x[i].astype(np.int64) for x in inputs)
        assert got[0][i].tolist() == ((total + 2**31) % 2**32 - 2**31).tolist()
    assert stats["ended_jobs"]["mixed"]["state"] == "ended"
    job = stats["ended_jobs"]["mixed"]["counters"]
    assert job["sparse_passed_up"] >= job["sparse_blocks_in"] > 0  # a block a datagram
    # the dense calls' sets completed in the program: results it fanned out
    assert 0 < job["results_fanned_out"] < world * job["results_completed"], job
    assert not {k for k in job if k.startswith("dropped_")} - {"dropped_stale"}, job
    assert stats["counters"].get("internal_errors", 0) == 0
    if not loss:  # each rank's blocks in once, as on the user-space switch
        assert job["sparse_blocks_in"] == ref_job["sparse_blocks_in"]
        assert job["results_completed"] == ref_job["results_completed"]
    assert log.count("makes sparse calls") == 1, log


# Members in the namespace: sends the datagrams given (hex, each from its own
# port) one after the other, then prints, a line each, what came back to them
# until none came for half a second (the lines of each port together, in the
# order the ports were given): the port it came to, the address it came from and
# the datagram in hex.
PEER = """
import select, socket, sys, time
host, switch, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
socks = {}
for item in sys.argv[4:]:
    src, data = item.split(":")
    s = socks.get(src)
    if s is None:
        s = socks[src] = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.bind((host, int(src)))
    if data:
        s.sendto(bytes.fromhex(data), (switch, port))
        time.sleep(0.05)
lines = {src: [] for src in socks}
quiet_until = time.monotonic() + 0.5
while (left := quiet_until - time.monotonic()) > 0:
    ready, _, _ = select.select(list(socks.values()), [], [], left)
    for src, s in socks.items():
        if s in ready:
            data, (a, p) = s.recvfrom(65536)
            lines[src].append(f"{src} {a}:{p} {data.hex()}")
            quiet_until = time.monotonic() + 0.5
for src in socks:
    for line in lines[src]:
        print(line, flush=True)
"""


def peer_run(ns: str, peer: str, switch: tuple, sends: list) -> subprocess.Popen:
    """PEER in namespace ``ns`` on address ``peer``: ``sends``, (port, datagram)
    each (an empty datagram: only listen on that port)."""
    return subprocess.Popen(
        ["ip", "netns", "exec", ns, sys.executable, "-c", PEER, peer, switch[0],
         str(switch[1])] + [f"{port}:{data.hex()}" for port, data in sends],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def received(out: str) -> list:
    """PEER's lines: (port it came to, (host, port) it came from, datagram)."""
    got = []
    for line in out.split("\n"):
        if line.strip():
            port, source, data = line.split()
            host, source_port = source.split(":")
            got.append((int(port), (host, int(source_port)), bytes.fromhex(data)))
    return got


@contextlib.contextmanager
def switch_here(address: tuple, members: list, tokens: list, mode: str = "auto"):
    """An XdpPipeline in this process serving ``address`` (an address of this
    namespace; attach ``mode``), with its UDP socket, and job 0x77 of
    ``members`` installed: (pipeline, socket); both closed afterwards."""
    p = xdp.XdpPipeline(8, 352, block_elements=352, port=address[1], switch_ip=address[0])
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        udp.bind(address)
        udp.settimeout(5)
        assert p.serve(address, mode=mode) == xdp_serving.interface_of(address[0])
        p.install_job("job", 0x77, members, 0, 4, 352, 352, tokens=tokens)
        yield p, udp
    finally:
        udp.close()
        p.close()


def job_counters(p) -> dict:
    """Job 0x77's counters, what the program counted included."""
    p.sync_counters()
    return without_zeros(p.jobs[0x77].counters)


def qdisc_sent_bytes(dev: str) -> int:
    """The bytes the root qdisc of ``dev`` (in this namespace) has sent."""
    import json

    qdiscs = json.loads(sh("tc", "-s", "-j", "qdisc", "show", "dev", dev))
    return sum(q["bytes"] for q in qdiscs if q.get("root"))


def contributions(tokens: list, values: int = 352) -> list:
    """One contribution a rank to slot 0, message 1: rank r adds r + 1 in each
    value and r - 5 in the exponent register, so that both the sum and the
    register's max show which ranks were added."""
    out = []
    for r, token in enumerate(tokens):
        lanes = np.zeros(1, wire.LANE)
        lanes["exp"] = r - 5
        out.append(wire.encode(wire.KIND_CONTRIBUTION, wire.DTYPE_INT32, 1, token, 1, 0, 0,
                               lanes, np.arange(values, dtype=np.int32) * (r + 1)))
    return out


def reference_sends(members: list, tokens: list, datagrams: list) -> list:
    """What the Python pipeline (the reference) sends for ``datagrams``, from
    the members in order: (datagram, destination) each."""
    ref = Pipeline(8, 352, block_elements=352)
    ref.install_job("ref", 0x77, members, 0, 4, 352, 352, tokens=tokens)
    sends = []
    for addr, data in zip(members, datagrams):
        sends += ref.receive_datagram(data, addr)
    return sends


@needs_xdp
def test_every_rank_gets_its_result_from_the_data_plane_as_the_reference_sends_it(veth):
    """Three ranks behind one port (one host, three UDP ports): the rank whose
    contribution completes the set gets no special treatment, and the
    switch's socket gets nothing.  The fan-out program sends each rank one
    copy, from the switch's address and port, bit for bit the datagram the
    Python pipeline sends that rank; counted as results_fanned_out."""
    ns, _, peer, here, me = veth
    port = 7304
    tokens = [0x10, 0x20, 0x30]
    members = [(peer, 5000 + r) for r in range(3)]
    ranks = contributions(tokens)
    want = reference_sends(members, tokens, ranks)
    assert sorted(a for _, a in want) == members  # the reference: one copy each
    # a qdisc on the switch's interface: the copies must go through it (where
    # the links are shaped, as on the testbed's bridge ports)
    sh("tc", "qdisc", "add", "dev", here, "root", "tbf", "rate", "1gbit", "burst", "256kb",
       "limit", "256kb")
    with switch_here((me, port), members, tokens) as (p, udp):
        assert p.fans_out and p.ifindex == socket.if_nametoindex(here)
        before = qdisc_sent_bytes(here)
        run = peer_run(ns, peer, (me, port), [(5000 + r, ranks[r]) for r in range(3)])
        out, err = run.communicate(timeout=30)  # (half a second after the last result)
        udp.settimeout(0.2)
        with pytest.raises(socket.timeout):  # nothing came up to the switch's socket
            udp.recvfrom(65536)
        got = received(out)
        assert sorted(got) == sorted((a[1], (me, port), d) for d, a in want), err
        frame = 14 + 20 + 8 + len(want[0][0])
        assert qdisc_sent_bytes(here) - before >= 3 * frame
        assert job_counters(p) == {"packets_in": 3, "results_completed": 1, "results_out": 3,
                                   "results_fanned_out": 3}


# From a member's host: a later IP fragment (offset 8 bytes) to the switch whose
# data begins as a UDP header from the member's port to the switch's, then a result.
FRAGMENT = """
import socket, struct, sys
import numpy as np
from switchml import wire
peer, switch, port, member = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
result = wire.encode(wire.KIND_RESULT, 0, 1, 0xDEAD, 1, 0, 0, np.zeros(1, wire.LANE),
                     np.arange(352, dtype=np.int32))
data = struct.pack("!HHHH", member, port, 8 + len(result), 0) + result
ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(data), 0x4242, 1, 64, 17, 0,
                 socket.inet_aton(peer), socket.inet_aton(switch))
socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW).sendto(ip + data, (switch, 0))
"""


@needs_xdp
def test_a_later_fragment_that_reads_as_a_result_is_not_fanned_out(veth):
    """The fan-out program sends a result the XDP program completed to every rank.
    A later IP fragment carries no UDP header, but its data may read as one: it
    is the host's (reassembly), never a result sent to each rank and counted as
    fanned out, which anyone could forge from a member's address."""
    ns, _, peer, here, me = veth
    port = 7309
    tokens = [0x10, 0x20]
    members = [(peer, 5000), (peer, 5001)]
    probes = [wire.probe_of(c) for c in contributions(tokens)[:2]]
    with switch_here((me, port), members, tokens) as (p, udp):
        assert p.fans_out
        run = peer_run(ns, peer, (me, port), [(5000, probes[0]), (5001, probes[1])])
        run.communicate(timeout=30)  # answered: each rank's Ethernet address learnt
        forge = in_ns(ns, FRAGMENT, peer, me, str(port), "5000")
        _, err = forge.communicate(timeout=30)
        assert forge.returncode == 0, err
        time.sleep(0.3)
        counters = job_counters(p)
        assert "results_fanned_out" not in counters and "results_out" not in counters, counters


@needs_xdp
def test_a_rank_the_data_plane_cannot_reach_gets_its_result_from_user_space(veth):
    """A rank on the switch's own host sends by the loopback device: the program
    never sees its frames, so the fan-out program has no Ethernet address for
    it and passes the completed result up; the switch's socket sends it to
    every rank (``passed_up``, counted as results_passed_up), each getting the
    reference's datagram."""
    ns, _, peer, here, me = veth
    port = 7305
    tokens = [0x10, 0x20, 0x30]
    members = [(me, 5003), (peer, 5000), (peer, 5001)]
    ranks = contributions(tokens)
    want = reference_sends(members, tokens, ranks)
    local = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    with switch_here((me, port), members, tokens) as (p, udp), local:
        local.bind(members[0])
        local.settimeout(5)
        assert p.fans_out
        local.sendto(ranks[0], (me, port))
        data, addr = udp.recvfrom(65536)  # by the loopback device: not through XDP
        assert addr == members[0] and p.passed_up(data, addr) == []
        run = peer_run(ns, peer, (me, port), [(5000, ranks[1]), (5001, ranks[2])])
        result, addr = udp.recvfrom(65536)  # completed in the program, passed up
        assert addr == members[2] and result[3] == wire.KIND_RESULT
        sends = p.passed_up(result, addr)
        assert sorted(sends) == sorted(want)
        for data, dest in sends:
            udp.sendto(data, dest)
        out, err = run.communicate(timeout=30)
        assert sorted(received(out)) == sorted((a[1], (me, port), d) for d, a in want
                                               if a != members[0]), err
        assert local.recvfrom(65536) == (want[[a for _, a in want].index(members[0])][0],
                                         (me, port))
        assert job_counters(p) == {"packets_in": 3, "results_completed": 1, "results_out": 3,
                                   "results_passed_up": 1}


@needs_xdp
def test_results_go_through_user_space_where_the_kernel_refuses_the_fan_out(veth, monkeypatch,
                                                                            caplog):
    """A kernel without tcx (before 6.6) refuses the fan-out program's attach:
    the switch serves all the same, logs why, and its socket sends each result
    to every rank."""
    import errno

    def refused(self, ifindex):
        raise OSError(errno.EINVAL, "attaching the fan-out program: Invalid argument")

    monkeypatch.setattr(xdp_loader.Program, "attach_fan_out", refused)
    ns, _, peer, _, me = veth
    port = 7306
    tokens = [0x10, 0x20]
    members = [(peer, 5000), (peer, 5001)]
    ranks = contributions(tokens)
    want = reference_sends(members, tokens, ranks)
    with switch_here((me, port), members, tokens) as (p, udp):
        assert not p.fans_out and "not the kernel" in caplog.text
        run = peer_run(ns, peer, (me, port), [(5000, ranks[0]), (5001, ranks[1])])
        result, addr = udp.recvfrom(65536)  # completed in the program, passed up
        sends = p.passed_up(result, addr)
        assert sorted(sends) == sorted(want)
        for data, dest in sends:
            udp.sendto(data, dest)
        out, err = run.communicate(timeout=30)
        assert sorted(received(out)) == sorted((a[1], (me, port), d) for d, a in want), err
        assert job_counters(p) == {"packets_in": 2, "results_completed": 1, "results_out": 2,
                                   "results_passed_up": 1}


@needs_xdp
def test_a_probe_its_frame_has_no_room_to_answer_is_answered_through_user_space(veth):
    """A frame as the kernel hands it over (a veth's in native mode, as here; in
    generic mode the skb it came in) has no room past a 32-byte probe of a
    complete set for the result.  The program passes it up
    (``probes_passed_up``), the switch runs it through the program in a page
    (``passed_up``) and sends the answer: the member gets its result again.
    The switch here is this process, on this namespace's end of the veth."""
    ns, _, peer, here, me = veth
    port = 7302
    tokens = [0x10, 0x20]
    members = [(peer, 5000), (peer, 5001)]
    ranks = contributions(tokens)
    result = reference_sends(members, tokens, ranks)[0][0]
    probe = wire.probe_of(ranks[0])
    with switch_here((me, port), members, tokens) as (p, udp):
        assert p.ifindex == socket.if_nametoindex(here)
        run = peer_run(ns, peer, (me, port), [(5000, ranks[0]), (5001, ranks[1]),
                                              (5000, probe)])
        data, addr = udp.recvfrom(65536)  # the probe, passed up: no room in its frame
        assert (data, addr) == (probe, members[0])
        answers = p.passed_up(data, addr)
        assert answers == [(result, members[0])]
        udp.sendto(*answers[0])
        out, err = run.communicate(timeout=30)
        switch = (me, port)
        assert received(out) == [(5000, switch, result), (5000, switch, result),
                                 (5001, switch, result)], err
        assert job_counters(p) == {
            "packets_in": 2, "results_completed": 1, "results_out": 3, "probes_in": 1,
            "probes_passed_up": 1, "retransmissions_answered": 1, "results_fanned_out": 2}


def without_zeros(counter) -> dict:
    return {k: v for k, v in counter.items() if v}


@needs_xdp
def test_the_switch_detaches_on_stop_and_when_its_start_fails(veth):
    """Attached from start() on; detached by stop(), and by a start that fails
    after the attach (here the metrics port is taken)."""
    from switchml.switch.server import Switch

    _, _, _, here, me = veth

    def attached() -> bool:
        return "prog/xdp" in sh("ip", "link", "show", "dev", here)

    sw = Switch(me, 7303, data_plane="xdp", packet_elements=512)
    assert not attached()
    sw.start()
    try:
        assert attached() and sw.stats()["data_plane"] == "xdp"
    finally:
        sw.stop()
    assert not attached()
    taken = socket.socket()
    try:
        taken.bind((me, 0))
        taken.listen()
        sw = Switch(me, 7303, data_plane="xdp", packet_elements=512,
                    metrics_port=taken.getsockname()[1])
        with pytest.raises(OSError):
            sw.start()
        assert not attached()
    finally:
        taken.close()


# Several switches with data_plane="xdp" in one process, in a namespace: the
# ports given, on the address given; "stop I" on stdin stops the I-th.
SWITCHES = """
import sys, switchml
host = sys.argv[1]
switches = [switchml.Switch(host, int(p), data_plane="xdp").start() for p in sys.argv[2:]]
print("ready", flush=True)
for line in sys.stdin:
    i = int(line.split()[1])
    switches[i].stop()
    print("stopped", i, flush=True)
for s in switches:
    s.stop()
"""


def in_ns(ns: str, code: str, *args: str, **kw) -> subprocess.Popen:
    """Python ``code`` run in namespace ``ns`` with this checkout's switchml."""
    return subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-c", code, *args],
                            env=dict(os.environ, PYTHONPATH=str(REPO)), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)


def hooks(ns: str, dev: str) -> tuple[list, int]:
    """What runs on interface ``dev`` of namespace ``ns``: the names of its XDP
    programs (``ip link``) and the number of its tcx programs (the kernel's
    query of the hook)."""
    import re

    shown = sh("ip", "-n", ns, "-d", "link", "show", "dev", dev)
    xdp_names = re.findall(r"prog/xdp id \d+ name (\S+)", shown)
    run = in_ns(ns, "import sys, socket; from switchml.switch.xdp import loader as L; "
                    "print(len(L.tcx_programs(socket.if_nametoindex(sys.argv[1]))))", dev)
    out, err = run.communicate(timeout=30)
    assert run.returncode == 0, err
    return xdp_names, int(out)


def served_by_the_kernel(stats: dict, job: str, world: int) -> dict:
    """Job ``job``'s counters, checked to say that its datagrams were aggregated
    by its switch's program and every result sent to every rank by its fan-out
    program (none through the switch's socket)."""
    assert stats["data_plane"] == "xdp"
    counters = stats["ended_jobs"][job]["counters"]
    assert counters["results_completed"] >= 1, counters
    assert counters["packets_in"] >= world * counters["results_completed"], counters
    assert counters["results_fanned_out"] == world * counters["results_completed"], counters
    assert "results_passed_up" not in counters and "results_fanout_failed" not in counters, \
        counters
    assert not {k for k in counters if k.startswith("dropped_")} - {"dropped_stale"}, counters
    return counters


def same_bits(got: list, want: list) -> None:
    for g, w in zip(got, want):
        for a, b in zip(g, w):
            assert a.dtype == b.dtype and a.tobytes() == b.tobytes()


def jobs_through_the_python_switch(ns: str, host: str, world: int, jobs: int,
                                   seed: int) -> tuple[list, list]:
    """The inputs of ``jobs`` jobs of ``world`` ranks (seeds from ``seed``), and
    the results a Python switch gives each: what an XDP switch must give."""
    inputs = [inputs_for(world, seed=seed + i) for i in range(jobs)]
    reference = SwitchIn(ns, host, 7309, "--data-plane", "python")
    try:
        return inputs, [run_job(reference.address, inputs[i], f"ref{i}") for i in range(jobs)]
    finally:
        reference.close()


def run_jobs(jobs: list) -> list:
    """``run_job(*job)`` of each of ``jobs`` at once; their results, in order."""
    return in_threads(lambda i: run_job(*jobs[i]), len(jobs), 180)


@needs_xdp
def test_xdp_switches_of_one_process_share_an_interface(veth):
    """Three switches with data_plane="xdp" in one process on one interface, each
    serving its own job at once: the dispatcher is the interface's one XDP
    program, each switch's fan-out program is on its tcx hook, and each job's
    ranks get the Python switch's sums bit for bit, aggregated and sent to
    every rank by the kernel (its switch's counters).  A switch that stops takes
    out its programs alone: the others serve on; the last one leaves no XDP
    and no tcx program on the interface."""
    ns, dev, host, _, _ = veth
    world, ports = 2, [7310, 7311, 7312]
    inputs, want = jobs_through_the_python_switch(ns, host, world, 3, 10)
    switches = in_ns(ns, SWITCHES, host, *map(str, ports), stdin=subprocess.PIPE)
    try:
        assert switches.stdout.readline().strip() == "ready", switches.stderr.read()
        assert hooks(ns, dev) == (["switchml_dispat"], 3)
        addresses = [f"{host}:{p}" for p in ports]
        got = run_jobs([(addresses[i], inputs[i], f"job{i}") for i in range(3)])
        for i in range(3):
            same_bits(got[i], want[i])
            served_by_the_kernel(fetch_stats(addresses[i]), f"job{i}", world)
        # the first one stops: the two others serve on, through the kernel
        switches.stdin.write("stop 0\n")
        switches.stdin.flush()
        assert switches.stdout.readline().strip() == "stopped 0"
        assert hooks(ns, dev) == (["switchml_dispat"], 2)
        got = run_jobs([(addresses[i], inputs[i], f"again{i}") for i in (1, 2)])
        for i, g in zip((1, 2), got):
            same_bits(g, want[i])
            served_by_the_kernel(fetch_stats(addresses[i]), f"again{i}", world)
        switches.stdin.write("stop 2\n")
        switches.stdin.flush()
        assert switches.stdout.readline().strip() == "stopped 2"
        assert hooks(ns, dev) == (["switchml_dispat"], 1)
        switches.stdin.close()  # the last one stops
        assert switches.wait(timeout=30) == 0, switches.stderr.read()
        assert hooks(ns, dev) == ([], 0)
    finally:
        switches.kill()
        switches.wait()


def fetch_stats(address: str) -> dict:
    from switchml.cli import fetch_stats as fetch

    return fetch(address)


@needs_xdp
def test_xdp_switches_of_several_processes_share_an_interface_and_a_killed_one_leaves_nothing(
        veth):
    """Two ``switchml switch --data-plane xdp`` processes on one interface, each
    serving its job through the kernel.  The first (which attached the
    dispatcher) is killed with SIGKILL: the second serves on; a new switch on
    the dead one's port takes its place (the dead one's program, which the
    dispatcher still held, is taken out) and serves through the kernel; when
    the last process stops, no XDP and no tcx program is left on the
    interface."""
    ns, dev, host, _, _ = veth
    world = 2
    inputs, want = jobs_through_the_python_switch(ns, host, world, 2, 20)
    first = SwitchIn(ns, host, 7320, "--data-plane", "xdp")
    second = third = None
    try:
        second = SwitchIn(ns, host, 7321, "--data-plane", "xdp")
        assert hooks(ns, dev) == (["switchml_dispat"], 2)
        got = run_jobs([(first.address, inputs[0], "a"), (second.address, inputs[1], "b")])
        same_bits(got[0], want[0])
        same_bits(got[1], want[1])
        served_by_the_kernel(first.stats(), "a", world)
        served_by_the_kernel(second.stats(), "b", world)
        first.proc.kill()
        first.proc.wait()
        assert hooks(ns, dev) == (["switchml_dispat"], 1)  # its fan-out went with it
        time.sleep(1.5)  # the second looks for switches gone every second
        same_bits(run_job(second.address, inputs[1], "b2"), want[1])
        served_by_the_kernel(second.stats(), "b2", world)
        third = SwitchIn(ns, host, 7320, "--data-plane", "xdp")  # the dead one's port
        same_bits(run_job(third.address, inputs[0], "c"), want[0])
        served_by_the_kernel(third.stats(), "c", world)
        third.close()
        assert hooks(ns, dev) == (["switchml_dispat"], 1)
        log = second.close()
        assert hooks(ns, dev) == ([], 0)
        # the second took the dead one's port out on its own, before the third came
        assert "XDP switch of port 7320 on this interface is gone" in log
    finally:
        for s in (first, second, third):
            if s is not None:
                s.close()


@needs_xdp
def test_a_program_on_the_interface_alone_or_a_port_served_is_not_taken(veth):
    """An XDP switch attached alone (driver mode, as bench/xdp_driver.py does)
    is left alone: a switch that would share the interface is refused, naming
    it, and the other way round; and a port of the interface that a live switch
    serves is refused to a second one."""
    ns, _, _, here, me = veth

    def attached() -> list:
        import re

        return re.findall(r"prog/xdp id (\d+) name (\S+)", sh("ip", "-d", "link", "show",
                                                                "dev", here))

    alone = xdp.XdpPipeline(8, 352, block_elements=352, port=7330, switch_ip=me)
    try:
        alone.serve((me, 7330), driver=True)
        before = attached()
        assert [name for _, name in before] == ["xdp_pipeline"]
        shared = xdp.XdpPipeline(8, 352, block_elements=352, port=7331, switch_ip=me)
        try:
            with pytest.raises(DataPlaneUnavailableError,
                               match=f"interface {here} runs XDP program 'xdp_pipeline'.*"
                                     f"driver mode"):
                shared.serve((me, 7331))
            assert attached() == before
        finally:
            shared.close()
    finally:
        alone.close()
    assert attached() == []
    first = xdp.XdpPipeline(8, 352, block_elements=352, port=7330, switch_ip=me)
    second = xdp.XdpPipeline(8, 352, block_elements=352, port=7330, switch_ip=me)
    try:
        first.serve((me, 7330))
        with pytest.raises(DataPlaneUnavailableError,
                           match=f"port 7330 of interface {here} is served by another XDP "
                                 f"switch \\(process {os.getpid()}\\)"):
            second.serve((me, 7330))
        with pytest.raises(DataPlaneUnavailableError, match=f"interface {here} already runs"):
            second.serve((me, 7330), driver=True)
        assert [name for _, name in attached()] == ["switchml_dispat"]
        assert first.fans_out
    finally:
        second.close()
        first.close()
    assert attached() == []


@needs_xdp
def test_a_switch_that_loses_the_race_to_attach_joins_the_winner(veth, monkeypatch):
    """Two switches that find the interface free at once both try to attach a
    dispatcher: the kernel takes one, and the other switch joins it instead of
    failing.  Here the second switch is made to see no program twice (before
    joining, and before attaching), as if the first had attached just after."""
    _, _, _, here, me = veth
    real, stale = xdp_dispatch.xdp_attached, [2]

    def looked_too_early(ifindex):
        got = real(ifindex)
        if stale[0]:
            stale[0] -= 1
            got.prog_id = 0
        return got

    first = xdp.XdpPipeline(8, 352, block_elements=352, port=7340, switch_ip=me)
    second = xdp.XdpPipeline(8, 352, block_elements=352, port=7341, switch_ip=me)
    try:
        first.serve((me, 7340))
        monkeypatch.setattr(xdp_dispatch, "xdp_attached", looked_too_early)
        second.serve((me, 7341))
        assert stale == [0]
        assert len(second._dispatches) == 1 and second._dispatches[0]._obj is None  # joined
        shown = sh("ip", "-d", "link", "show", "dev", here)
        assert shown.count("prog/xdp") == 1 and "switchml_dispat" in shown
        first.detach()  # the winner goes: the dispatcher stays for the other
        assert "switchml_dispat" in sh("ip", "-d", "link", "show", "dev", here)
    finally:
        second.close()
        first.close()
    assert "prog/xdp" not in sh("ip", "link", "show", "dev", here)
