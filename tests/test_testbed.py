"""The emulated cluster: namespaces come and go cleanly, links are shaped, loss drops,
and switchml and gloo run across host namespaces through the switch namespace.

Tests that build namespaces need root and ip/tc (nft for loss); elsewhere they skip.
Each uses its own prefix, so they never touch a testbed someone else has up.
"""

import hashlib
import importlib.util
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest
from conftest import interruptible, needs_root, reference_sum

import switchml
from switchml import wire
from switchml.switch.xdp import pipeline as xdp
from switchml.testbed import (
    NotRootError,
    Testbed,
    TestbedExistsError,
    ToolMissingError,
    netns,
    parse_rate,
    teardown,
)

HELPERS = os.path.join(os.path.dirname(__file__), "testbed_helpers.py")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLI = [sys.executable, "-m", "switchml.cli"]
PACKET = 1024
#: The switch's limit is PACKET; a job's packets fit one frame of its 1500-byte links.
JOB_PACKET = wire.frame_geometry(1500, PACKET, 256)[0]
#: Whether the XDP data plane can run here (root, clang, libbpf)
XDP = xdp.unavailable() is None

needs_nft = pytest.mark.skipif(shutil.which("nft") is None,
                               reason="needs nft for loss (apt-get install nftables)")


def prefix(tag):
    """A prefix of this test process alone: concurrent runs do not collide."""
    return f"t{os.getpid() % 100000}{tag}"


def machine_state():
    """What a testbed must leave as it found it: namespaces, devices, state files."""
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    return (sorted(netns.list_namespaces()),
            sorted(line.split(":")[1].strip() for line in links.splitlines()))


def running(pid):
    """Whether ``pid`` runs (a zombie awaiting its reaper does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def assert_gone(p):
    spaces, links = machine_state()
    assert not [n for n in spaces if n.startswith(p + "-")]
    assert not [dev for dev in links if dev.startswith(p + "-")]
    assert not os.path.exists(f"/run/switchml-testbed/{p}.json")
    assert not os.path.exists(f"/run/switchml-testbed/{p}-switch.log")
    etc = os.listdir("/etc/netns") if os.path.isdir("/etc/netns") else []
    assert not [name for name in etc if name.startswith(p + "-")]  # the namespaces' hosts


# ---------------------------------------------------------------- anywhere
def test_rates_parse_as_tc_reads_them():
    assert parse_rate("1gbit") == 1e9
    assert parse_rate("200mbit") == 200e6
    assert parse_rate("500kbit") == 500e3
    assert parse_rate(123456) == 123456
    for bad in ("fast", "1gbps", "-5mbit", 0):
        with pytest.raises(ValueError):
            parse_rate(bad)


def test_names_fit_linux_interface_names_and_prefixes_are_checked():
    tb = Testbed(hosts=250, prefix="abcdefgh", subnet="10.9.0.0/24")
    assert max(len(tb.ifname(249)), len(tb.port(249)), len(tb.bridge)) <= 15  # IFNAMSIZ - 1
    assert tb.address(0) == "10.9.0.1" and tb.address(249) == "10.9.0.250"
    assert tb.switch_address == "10.9.0.254"
    assert tb.env(3)["GLOO_SOCKET_IFNAME"] == "abcdefgh-h3"
    assert tb.env(3)["SWITCHML_SWITCH"] == "10.9.0.254:7300"
    for bad in ("Upper", "9lead", "toolongprefix", "has-dash", ""):
        with pytest.raises(ValueError):
            Testbed(prefix=bad)
    with pytest.raises(ValueError):
        Testbed(hosts=300)  # more hosts than a /24 has addresses


def test_switch_servers_are_named_and_addressed_below_the_bridge():
    tb = Testbed(hosts=4, switches=2, prefix="abcdefgh", subnet="10.9.0.0/24")
    assert tb.nodes == [0, 1, 2, 3, "s0", "s1"]
    assert (tb.server_address(0), tb.server_address(1)) == ("10.9.0.253", "10.9.0.252")
    assert tb.namespace("s1") == "abcdefgh-s1" and tb.ifname("s1") == "abcdefgh-s1"
    assert max(len(tb.port("s1")), len(tb.ifname("s1"))) <= 15
    # workers find the one job spread over both servers' switches
    assert tb.switch == "10.9.0.253:7300,10.9.0.252:7300" == tb.env(3)["SWITCHML_SWITCH"]
    assert tb.env("s1") == {"SWITCHML_HOST": "10.9.0.252", "SWITCHML_PORT": "7300"}
    with pytest.raises(ValueError, match="s0..s1"):
        tb.namespace("s2")
    assert Testbed(hosts=4, prefix="abc").switch.count(",") == 0  # the bridge, by default
    with pytest.raises(ValueError, match="no switch servers"):
        Testbed(hosts=4, prefix="abc").namespace("s0")
    with pytest.raises(ValueError, match="switches"):
        Testbed(hosts=252, switches=2, subnet="10.9.0.0/24")  # no addresses left


def test_not_root_is_a_clear_error(monkeypatch, capsys):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(NotRootError, match="needs root"):
        Testbed(hosts=2, prefix="zzroot").up()
    from switchml.cli import main
    assert main(["testbed", "up", "--prefix", "zzroot"]) == 2
    assert "needs root" in capsys.readouterr().err


def test_a_missing_tool_is_a_clear_error_before_anything_is_made(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    real = shutil.which
    monkeypatch.setattr(shutil, "which", lambda name: None if name == "tc" else real(name))
    with pytest.raises(ToolMissingError, match="iproute2"):
        Testbed(hosts=2, link="1gbit", prefix="zztool").up()
    monkeypatch.setattr(shutil, "which", lambda name: None if name == "nft" else real(name))
    with pytest.raises(ToolMissingError, match="nftables"):
        Testbed(hosts=2, loss=0.01, prefix="zztool", install_nft=False).up()


def test_the_udp_offload_is_on_without_loss_and_off_with_it_unless_told(monkeypatch):
    """Per-datagram loss needs the runs cut into frames; without loss that only
    costs this machine's cores frame-by-frame work a real switch's fabric does not.
    The data plane does not change it: an XDP switch in driver mode has the
    kernel cut runs before its program, one in generic mode asks its workers
    for datagrams apart (test_xdp_serve.py)."""
    monkeypatch.setenv("SWITCHML_DATA_PLANE", "xdp")
    assert Testbed(hosts=1, prefix="zzoff").udp_offload is True
    assert Testbed(hosts=1, loss=0.01, prefix="zzoff").udp_offload is False
    assert Testbed(hosts=1, prefix="zzoff", udp_offload=False).udp_offload is False
    assert Testbed(hosts=1, loss=0.01, prefix="zzoff", udp_offload=True).udp_offload is True


# ---------------------------------------------------------------- root
@needs_root
def test_up_builds_the_layout_and_down_leaves_nothing_behind():
    before = machine_state()
    p, q = prefix("a"), prefix("b")
    with Testbed(hosts=3, link="100mbit", mtu=9000, prefix=p, udp_offload=False) as tb:
        assert set(netns.list_namespaces()) >= {f"{p}-sw", f"{p}-h0", f"{p}-h1", f"{p}-h2"}
        # nothing in the machine's own namespace
        assert not [dev for dev in machine_state()[1] if dev.startswith(p)]
        addr = json.loads(tb.run(1, ["ip", "-j", "addr", "show", "dev", tb.ifname(1)],
                                 capture_output=True, text=True).stdout)[0]
        assert addr["mtu"] == 9000
        assert addr["addr_info"][0]["local"] == tb.address(1)
        # a host's uplink queues each flow apart by default (an HTB class at the
        # link's rate over a bfifo a flow); a switch port is one tbf FIFO
        host_qdiscs = netns.qdisc(tb.namespace(1), tb.ifname(1))
        assert [q["kind"] for q in host_qdiscs].count("bfifo") == netns.FLOW_QUEUES + 1
        assert host_qdiscs[0]["kind"] == "htb"
        (port,) = netns.qdisc(tb.switch_namespace, tb.port(1))
        assert port["kind"] == "tbf" and port["options"]["rate"] == 100_000_000 // 8
        for ns, dev in ((tb.namespace(1), tb.ifname(1)), (tb.switch_namespace, tb.port(1))):
            # UDP GSO runs are cut into frames at every link (as with loss, by
            # default); TCP keeps its offload
            features = netns.offloads(ns, dev)
            assert not features["tx-udp-segmentation"] and features["tx-tcp-segmentation"]
        with pytest.raises(TestbedExistsError):
            Testbed(hosts=1, prefix=p).up()
        with Testbed(hosts=1, link=None, prefix=q):  # a second testbed coexists
            assert f"{q}-h0" in netns.list_namespaces()
        assert_gone(q)
        assert f"{p}-h0" in netns.list_namespaces()  # ... and removing it spared this one
    assert_gone(p)
    assert machine_state() == before


@needs_root
def test_an_error_inside_the_block_still_removes_everything():
    p = prefix("c")
    with pytest.raises(RuntimeError, match="boom"):
        with Testbed(hosts=2, prefix=p) as tb:
            tb.popen(0, ["sleep", "30"])  # a process inside keeps devices alive if not ended
            raise RuntimeError("boom")
    assert_gone(p)


SCRIPT = """
import sys, time
sys.path.insert(0, {root!r})
from switchml.testbed import Testbed
with Testbed(hosts=2, prefix={p!r}) as tb:
    tb.popen(0, ["sleep", "60"])
    print("up", flush=True)
    time.sleep(60)
"""


@needs_root
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["TERM", "INT"])
def test_a_signal_removes_everything(sig):
    p = prefix("s" if sig == signal.SIGTERM else "i")
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT.format(root=ROOT, p=p)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=interruptible)
    assert proc.stdout.readline().strip() == "up", proc.stderr.read()
    assert f"{p}-h1" in netns.list_namespaces()
    proc.send_signal(sig)
    proc.wait(timeout=20)
    assert proc.returncode != 0
    assert_gone(p)


@needs_root
def test_a_killed_runs_testbed_is_removed_by_the_next_run_of_its_prefix():
    """A bench's testbed lives in its ``with`` block: SIGKILLed, nothing can clean
    up, and the next run of the prefix finds the testbed of a process that is
    gone and removes it (only a testbed ``switchml testbed up`` left, which
    outlives its command, is refused until ``down``)."""
    p = prefix("k")
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT.format(root=ROOT, p=p)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "up", proc.stderr.read()
        proc.kill()
        proc.wait(timeout=20)
        assert f"{p}-h1" in netns.list_namespaces()  # left behind
        with Testbed(hosts=2, prefix=p) as tb:  # taken over, not refused
            assert tb.hosts == 2
    finally:
        teardown(p)
    assert_gone(p)
    # one that outlives the command that made it stays until `down`
    up = subprocess.run(CLI + ["testbed", "up", "--hosts", "2", "--link", "none", "--prefix", p],
                        capture_output=True, text=True, timeout=60)
    try:
        assert up.returncode == 0, up.stderr
        with pytest.raises(TestbedExistsError):
            Testbed(hosts=2, prefix=p).__enter__()
    finally:
        teardown(p)
    assert_gone(p)


RACER = """
import sys, time
sys.path.insert(0, {root!r})
from switchml.testbed import Testbed, TestbedExistsError
time.sleep(max(0.0, {start} - time.time()))
try:
    with Testbed(hosts=2, prefix={p!r}) as tb:
        print("up", flush=True)
        sys.stdin.readline()  # until the test has looked
except TestbedExistsError:
    print("exists", flush=True)
"""


@needs_root
def test_two_runs_of_one_prefix_at_once_one_is_refused_and_the_other_is_whole():
    """The look for a testbed of the prefix and the making are one step: the
    second run is refused, and its failure does not take the first's away."""
    p = prefix("r")
    start = time.time() + 1.5
    racers = [subprocess.Popen([sys.executable, "-c", RACER.format(root=ROOT, p=p, start=start)],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        said = sorted(r.stdout.readline().strip() for r in racers)
        assert said == ["exists", "up"], [r.stderr.read() for r in racers]
        assert {f"{p}-h0", f"{p}-h1", f"{p}-sw"} <= set(netns.list_namespaces())
        for r in racers:
            r.communicate("\n", timeout=30)
    finally:
        for r in racers:
            if r.poll() is None:
                r.kill()
        teardown(p)
    assert_gone(p)


@needs_root
def test_a_testbed_interrupted_while_its_switch_starts_leaves_nothing():
    p = prefix("w")
    up = subprocess.Popen(CLI + ["testbed", "up", "--hosts", "2", "--link", "none", "--switch",
                                 "--prefix", p],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(f"/run/switchml-testbed/{p}.json"):  # up, switch starting
            assert up.poll() is None and time.monotonic() < deadline, up.stderr.read()
            time.sleep(0.01)
        up.terminate()
        assert up.wait(timeout=30) != 0
        assert_gone(p)  # by the interrupted command itself, switch and all
    finally:
        if up.poll() is None:
            up.kill()
        teardown(p)


@needs_root
def test_down_removes_the_leftovers_of_a_crashed_run():
    p = prefix("d")
    crashed = subprocess.run([sys.executable, "-c", f"""
import os, subprocess, sys
sys.path.insert(0, {ROOT!r})
from switchml.testbed import Testbed
tb = Testbed(hosts=2, prefix={p!r}).up()
print(tb.popen(1, ["sleep", "60"], stdout=subprocess.DEVNULL,
               stderr=subprocess.DEVNULL).pid, flush=True)
os._exit(3)   # no clean-up at all
"""], capture_output=True, text=True, timeout=30)
    try:
        assert crashed.returncode == 3, crashed.stderr
        orphan = int(crashed.stdout.split()[0])
        assert {f"{p}-h0", f"{p}-h1", f"{p}-sw"} <= set(netns.list_namespaces())
    finally:
        down = subprocess.run(CLI + ["testbed", "down", "--prefix", p], capture_output=True,
                              text=True, timeout=30)
    assert down.returncode == 0, down.stderr
    assert f"{p}-h1" in down.stdout
    assert_gone(p)
    assert not running(orphan)  # the process left inside was ended


@needs_root
def test_cli_up_run_status_down():
    p = prefix("e")
    try:
        up = subprocess.run(CLI + ["testbed", "up", "--prefix", p, "--hosts", "2", "--link",
                                   "100mbit", "--switch", "--ranks-per-host", "2"] +
                            (["--data-plane", "xdp"] if XDP else []),
                            capture_output=True, text=True, timeout=60)
        assert up.returncode == 0, up.stderr
        assert "switch running on 10.77.0.254:7300" in up.stdout
        if XDP:  # the switch serves through its XDP program, the runs cut into frames
            shown = subprocess.run(["ip", "-n", f"{p}-sw", "-d", "link", "show"],
                                   capture_output=True, text=True).stdout
            assert "prog/xdp" in shown, shown
        # a worker started with `testbed run` finds the switch through SWITCHML_SWITCH
        code = ("import numpy as np, switchml; "
                "w = switchml.Worker(None, 0, 1, job='cli'); "
                "print(int(w.allreduce(np.arange(5000, dtype=np.int32)).sum())); w.close()")
        run = subprocess.run(CLI + ["testbed", "run", "--prefix", p, "1", "--",
                                    sys.executable, "-c", code], capture_output=True,
                             text=True, timeout=60)
        assert run.returncode == 0, run.stderr
        assert run.stdout.strip() == str(sum(range(5000)))
        if importlib.util.find_spec("torch") is not None:
            # a torchrun in each host, 2 ranks each, one rendezvous on host 0
            script = ("import os; e = os.environ; os.write(1, ' '.join(["  # one write a line
                      "e['RANK'], e['LOCAL_RANK'], e['WORLD_SIZE'], e['SWITCHML_SWITCH']])"
                      ".encode() + b'\\n')")
            with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
                f.write(script)
            ranks = subprocess.run(CLI + ["testbed", "run", "--prefix", p, "--torchrun", "--",
                                          f.name], capture_output=True, text=True, timeout=120)
            os.unlink(f.name)
            assert ranks.returncode == 0, ranks.stderr
            lines = sorted(line.split() for line in ranks.stdout.splitlines() if line.strip())
            assert lines == [[str(r), str(r % 2), "4", "10.77.0.254:7300"] for r in range(4)]
        status = subprocess.run(CLI + ["testbed", "status", "--prefix", p],
                                capture_output=True, text=True, timeout=30)
        assert f"namespace {p}-h1" in status.stdout and "100mbit" in status.stdout
    finally:
        down = subprocess.run(CLI + ["testbed", "down", "--prefix", p], capture_output=True,
                              text=True, timeout=30)
    assert down.returncode == 0, down.stderr
    assert_gone(p)


#: ``switchml testbed ...`` as an installed script runs it: switchml imported from
#: ROOT, not from the current directory, and nothing on PYTHONPATH.
SCRIPT_CLI = [sys.executable, "-c", f"import sys; sys.path.insert(0, {ROOT!r}); "
              "from switchml.cli import main; sys.exit(main())"]


@needs_root
def test_testbed_run_uses_switchmls_python_and_scripts_from_any_directory(tmp_path):
    """`testbed run 0 -- python ...` and `-- switchml ...` from a directory outside the
    source tree, with the environment's bin directory not on PATH: the command gets
    the interpreter and scripts switchml runs from, and imports this switchml; the
    namespaces name every testbed address, for the IPv4-mapped form too."""
    p = prefix("n")
    bindir = os.path.dirname(sys.executable)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PATH"] = os.pathsep.join(d for d in os.environ.get("PATH", os.defpath).split(os.pathsep)
                                  if d and d != bindir)
    probe = ("import socket, sys, switchml; print(sys.executable); print(switchml.__file__); "
             "print(socket.getnameinfo((sys.argv[1], 1), 0)[0]); "
             "print(socket.getnameinfo(('::ffff:' + sys.argv[1], 1, 0, 0), 0)[0])")
    with Testbed(hosts=2, link=None, prefix=p) as tb:
        def run(*command):
            done = subprocess.run(SCRIPT_CLI + ["testbed", "run", "--prefix", p, "0", "--",
                                                *command], cwd=tmp_path, env=env,
                                  capture_output=True, text=True, timeout=60)
            assert done.returncode == 0, done.stderr
            return done.stdout.split("\n")
        python, package, name, mapped = run("python", "-c", probe, tb.address(1))[:4]
        assert python == sys.executable
        assert package == os.path.join(ROOT, "switchml", "__init__.py")
        assert name == mapped == tb.namespace(1)
        assert run("switchml", "--version")[0] == f"switchml {switchml.__version__}"
        assert os.path.exists(f"/etc/netns/{p}-h0/hosts")
    assert_gone(p)


def start_switch(tb, *options):
    sw = tb.popen("switch", [sys.executable, "-m", "switchml.cli", "switch", "--host",
                             tb.switch_address, "--port", "7300", "--packet-elements",
                             str(PACKET), "--slots", "64", "--log-level", "warning", *options],
                  stdout=subprocess.PIPE, text=True, cwd=ROOT)
    assert "listening on" in sw.stdout.readline()
    return sw


def run_workers(tb, world, size, dtype, tmp_path):
    procs = [tb.popen(h, [sys.executable, HELPERS, "worker", tb.switch, str(h), str(world),
                          str(size), dtype, str(tmp_path / f"{dtype}-{h}")],
                      stderr=subprocess.PIPE, text=True) for h in range(world)]
    for proc in procs:
        assert proc.wait(timeout=60) == 0, proc.stderr.read()
    results = [np.load(tmp_path / f"{dtype}-{h}.npy") for h in range(world)]
    counters = [json.load(open(tmp_path / f"{dtype}-{h}.json")) for h in range(world)]
    return results, counters


def expected(world, size, dtype):
    sys.path.insert(0, os.path.dirname(HELPERS))
    from testbed_helpers import make_input
    return reference_sum([make_input(r, size, dtype) for r in range(world)], JOB_PACKET)


@needs_root
def test_allreduce_across_four_host_namespaces_through_the_switch_namespace(tmp_path):
    size = 100_003
    with Testbed(hosts=4, link="500mbit", prefix=prefix("f")) as tb:
        start_switch(tb)
        before = [tb.link_counters(h) for h in range(4)]
        for dtype in ("float32", "int32"):
            results, _ = run_workers(tb, 4, size, dtype, tmp_path)
            want = expected(4, size, dtype)
            for got in results:
                assert got.tobytes() == want.tobytes()
        after = [tb.link_counters(h) for h in range(4)]
    for b, a in zip(before, after):
        # both tensors went up and came back down through each host's own link
        assert a["tx_bytes"] - b["tx_bytes"] >= 2 * size * 4
        assert a["rx_bytes"] - b["rx_bytes"] >= 2 * size * 4


@needs_root
def test_two_ranks_a_host_put_the_tensor_on_each_host_link_once(tmp_path):
    """2 hosts of 2 ranks (the local stage): every rank gets the exact int32 sum,
    and each host's link carries the tensor about once each way, not twice."""
    size = 1_000_000
    with Testbed(hosts=2, link="1gbit", prefix=prefix("k"), ranks_per_host=2) as tb:
        start_switch(tb)
        before = [tb.link_counters(h) for h in range(2)]
        procs = [tb.popen(r // 2, [sys.executable, HELPERS, "worker", tb.switch, str(r), "4",
                                   str(size), "int32", str(tmp_path / f"r{r}")],
                          env={"SWITCHML_LOCAL_STAGE": "1"}, stderr=subprocess.PIPE, text=True)
                 for r in range(4)]
        for proc in procs:
            assert proc.wait(timeout=60) == 0, proc.stderr.read()
        after = [tb.link_counters(h) for h in range(2)]
    want = expected(4, size, "int32")
    for r in range(4):
        assert np.load(tmp_path / f"r{r}.npy").tobytes() == want.tobytes()
        local_calls = json.load(open(tmp_path / f"r{r}.json"))["local_calls"]
        assert local_calls == 1
    for b, a in zip(before, after):
        for key in ("tx_bytes", "rx_bytes"):
            assert size * 4 <= a[key] - b[key] < 1.5 * size * 4, (key, a[key] - b[key])


@needs_root
def test_a_multi_node_torchrun_of_two_ranks_a_host(tmp_path):
    """torchrun --nnodes 2 --nproc-per-node 2, one in each host namespace: the
    ranks find their hosts through the store and combine before the switch."""
    pytest.importorskip("torch")
    job = os.path.join(ROOT, "tests", "torch_job.py")
    with Testbed(hosts=2, link="1gbit", prefix=prefix("m"), ranks_per_host=2) as tb:
        start_switch(tb, "--slots", "256")
        procs = tb.run_torchrun([job, "local", "switchml"],
                                env={"SWITCHML_LOCAL_STAGE": "1", "PYTHONPATH": ROOT,
                                     "OMP_NUM_THREADS": "1", "RESULT_DIR": str(tmp_path)},
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        outs = [p.communicate(timeout=300) for p in procs]
    for proc, (_, err) in zip(procs, outs):
        assert proc.returncode == 0, err[-3000:]
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    for r in results:
        assert r["worker"] == "LocalStageWorker" and r["groups"] == [[0, 1], [2, 3]]
        assert r["local_calls"] > 0
    assert len({tuple(r["params"]) for r in results}) == 1


def test_torchrun_runs_ranks_per_host_processes_a_host():
    tb = Testbed(hosts=3, link="1gbit", prefix="tq", ranks_per_host=4)
    argv = tb.torchrun_command(2, ["train.py", "--epochs", "1"])
    assert argv[1:] == ["-m", "torch.distributed.run", "--nnodes", "3", "--node-rank", "2",
                        "--nproc-per-node", "4", "--master-addr", tb.address(0),
                        "--master-port", "29500", "train.py", "--epochs", "1"]
    with pytest.raises(ValueError, match="ranks_per_host"):
        Testbed(hosts=2, ranks_per_host=0)


def transfer_rate(tb, server, client, nbytes):
    """Bits/s of one TCP transfer from ``client`` to ``server`` (receiver's clock)."""
    sink = tb.popen(server, [sys.executable, HELPERS, "sink", tb.address(server), "5201"],
                    stdout=subprocess.PIPE, text=True)
    assert sink.stdout.readline().strip() == "listening"
    tb.run(client, [sys.executable, HELPERS, "source", tb.address(server), "5201",
                    str(nbytes)], timeout=60)
    got = json.loads(sink.stdout.readline())
    sink.wait(timeout=10)
    assert got["bytes"] == nbytes
    return got["bytes"] * 8 / got["seconds"]


@needs_root
def test_a_host_that_vanishes_without_closing_tcp_fails_its_job_within_the_keepalive(tmp_path):
    keepalive = 4
    with Testbed(hosts=2, link="500mbit", prefix=prefix("k")) as tb:
        sw = start_switch(tb, "--keepalive", str(keepalive))
        ranks = [tb.popen(h, [sys.executable, HELPERS, "idle", tb.switch, str(h), "2"],
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                 for h in range(2)]
        try:
            for rank in ranks:
                assert rank.stdout.readline().strip() == "ready"
            # Host 1 goes dark: with its link down no FIN or RST can leave it, and
            # its worker process lives on, so only keepalive can tell.
            tb.run(1, ["ip", "link", "set", "dev", tb.ifname(1), "down"])
            dark = time.monotonic()
            time.sleep(keepalive + 1)
            ranks[0].stdin.write("go\n")
            ranks[0].stdin.flush()
            outcome = json.loads(ranks[0].stdout.readline())
            waited = time.monotonic() - dark
        finally:
            for proc in ranks + [sw]:
                proc.kill()
                proc.wait(timeout=10)
    # The job had failed before rank 0 asked: its allreduce did not wait out its
    # own 30 s timeout, and the error names the rank that went dark.
    assert outcome["error"] == "SwitchMLTimeoutError", outcome
    assert outcome["missing"] == [1], outcome
    assert "rank 1" in outcome["message"] and "disconnected" in outcome["message"]
    assert waited < keepalive + 1 + 10


@needs_root
def test_a_full_host_queue_is_waited_for_not_lost_and_the_window_hears_of_it(tmp_path):
    """Each host's uplink queue (one FIFO, its own tbf, 72 KiB: more than a UDP GSO
    run, which enters it whole) is smaller than a window of datagrams (32 of 4 KiB): the
    kernel refuses what does not fit (ENOBUFS, IP_RECVERR on the worker's socket).
    Counted as ``local_refusals``, each datagram waits for room instead of
    vanishing, and the window comes down: the sums are exact and almost no
    message is sent twice for a gap in the results.  (Silently dropped, each such
    datagram costs a retransmission, most of them fast.)  The C engine's loop; the
    Python one's ``send_waiting`` is tested in test_runtime.py."""
    from switchml.worker.engine import compiled
    if compiled._fastengine is None:
        pytest.skip("the C engine is not built")
    size, world = 1_500_000, 2
    with Testbed(hosts=world, link="100mbit", mtu=9000, queue="72kb", prefix=prefix("q"),
                 host_queue="fifo") as tb:
        start_switch(tb)
        procs = [tb.popen(h, [sys.executable, HELPERS, "worker", tb.switch, str(h), str(world),
                              str(size), "float32", str(tmp_path / f"q-{h}")],
                          stderr=subprocess.PIPE, text=True) for h in range(world)]
        for proc in procs:
            assert proc.wait(timeout=120) == 0, proc.stderr.read()
    sys.path.insert(0, os.path.dirname(HELPERS))
    from testbed_helpers import make_input
    want = reference_sum([make_input(r, size, "float32") for r in range(world)], PACKET)
    messages = size // PACKET
    for h in range(world):
        assert np.load(tmp_path / f"q-{h}.npy").tobytes() == want.tobytes()
        counters = json.load(open(tmp_path / f"q-{h}.json"))
        assert counters["local_refusals"] > 0, counters
        assert counters["window_decreases"] > 0, counters
        # Silently dropped: 65-72 fast retransmissions, 81-96 in all.  Waited for: 0-2
        # fast ones; a busy machine's late timers may add a dozen timed out.
        assert counters["fast_retransmissions"] < 0.01 * messages, counters
        assert counters["retransmissions"] < 0.03 * messages, counters


@needs_root
def test_shaping_limits_the_rate_of_uplink_and_downlink():
    link = 40e6
    with Testbed(hosts=1, link="40mbit", prefix=prefix("g")) as tb:
        up = transfer_rate(tb, "switch", 0, 2_500_000)    # host 0's veth: its uplink
        down = transfer_rate(tb, 0, "switch", 2_500_000)  # the bridge port: its downlink
    # Unshaped, a veth moves gigabits here; the tbf bucket (256 KiB) may go out at
    # once, hence some slack above the rate.
    for rate in (up, down):
        assert 0.3 * link < rate < 1.3 * link, (up, down)


@needs_root
def test_a_host_queue_per_flow_keeps_a_modest_flow_its_share_beside_a_flood():
    """Host 0 floods its uplink from one port and offers 75% of the link from
    another.  In one FIFO the flood takes nearly all the room (the modest flow
    kept 2%); with a queue per flow served in turn, each flow gets half (48%).
    The two source ports' low bytes differ: different queues."""
    link, seconds, flood, modest = 20e6, 2.0, 40001, 40002
    with Testbed(hosts=2, link="20mbit", prefix=prefix("q"), host_queue="flows") as tb:
        assert sum(q["kind"] == "bfifo" for q in netns.qdisc(tb.namespace(0), tb.ifname(0))) \
            == netns.FLOW_QUEUES + 1
        count = tb.popen(1, [sys.executable, HELPERS, "udp_count", tb.address(1), "6000",
                             str(seconds + 1)], stdout=subprocess.PIPE, text=True)
        assert count.stdout.readline().strip() == "ready"
        senders = [tb.popen(0, [sys.executable, HELPERS, "udp_offer", tb.address(1), "6000",
                                str(sport), str(seconds), str(rate)])
                   for sport, rate in ((flood, 0), (modest, 0.75 * link))]
        for sender in senders:
            assert sender.wait(timeout=30) == 0
        got = {int(k): v for k, v in json.loads(count.stdout.readline()).items()}
        count.wait(timeout=10)
    total = got.get(flood, 0) + got.get(modest, 0)
    assert total > 0.6 * link * seconds / 8, got  # the link was full
    assert 0.40 < got.get(modest, 0) / total < 0.60, got


def assert_near_rate(drops, arrivals, loss, where=""):
    """``drops`` of ``arrivals`` datagrams is what dropping each one with probability
    ``loss`` gives: within 4.5 standard deviations of the binomial (a false alarm about
    once in 150,000). A rule that drops whole GSO runs counts one drop per run, far
    below; a missing rule none."""
    mean, sd = arrivals * loss, math.sqrt(arrivals * loss * (1 - loss))
    assert abs(drops - mean) <= 4.5 * sd, (
        f"{where}: {drops} of {arrivals} datagrams dropped, want {mean:.0f} +- {4.5 * sd:.0f}")


def udp_arrivals(before, after, dropped):
    """Datagrams that met a namespace's loss rule: those it dropped, plus those that
    passed (read by a socket, refused by a full one, or for no socket)."""
    return dropped + sum(after[k] - before[k] for k in ("InDatagrams", "InErrors", "NoPorts"))


@needs_root
@needs_nft
def test_loss_rule_drops_datagrams_and_switchml_still_sums_exactly(tmp_path):
    size, loss = 200_000, 0.05
    with Testbed(hosts=2, link="500mbit", loss=loss, prefix=prefix("h")) as tb:
        start_switch(tb)
        where = ["switch", 0, 1]
        before = {w: tb.udp_counters(w) for w in where}
        results, counters = run_workers(tb, 2, size, "float32", tmp_path)
        after = {w: tb.udp_counters(w) for w in where}
        stats = json.loads(tb.run("switch", [sys.executable, "-m", "switchml.cli", "stats",
                                             "--switch", tb.switch, "--json"],
                                  capture_output=True, text=True, cwd=ROOT).stdout)
        drops = tb.loss_drops()
        names = {w: tb.namespace(w) for w in where}
    want = expected(2, size, "float32")
    for got in results:
        assert got.tobytes() == want.tobytes()
    assert all(c["retransmissions"] > 0 for c in counters)
    # Each datagram that reached a namespace (some hundreds per host, twice that at
    # the switch) was dropped with probability `loss` on its own: the workers and the
    # switch send runs of datagrams with UDP GSO, and a rule that met a run as one
    # packet would drop a few runs whole and count a few drops (the flakiness of old).
    for w in where:
        assert_near_rate(drops[names[w]], udp_arrivals(before[w], after[w], drops[names[w]]),
                         loss, names[w])
    job = stats["ended_jobs"]["testbed"]["counters"]
    assert job.get("retransmissions_answered", 0) > 0  # lost results sent again from the copy


def gso_loss(tb, receiver, sender, runs, per_run, payload):
    """Send ``runs`` UDP GSO runs of ``per_run`` datagrams from ``sender`` to ``receiver``:
    the datagrams lost of each run, the loss rule's count and the receiver's own drops."""
    ns = tb.namespace(receiver)
    rx = tb.popen(receiver, [sys.executable, HELPERS, "gso_receive", tb.address(receiver),
                             "7399", str(runs)], stdout=subprocess.PIPE, text=True)
    try:
        assert rx.stdout.readline().strip() == "ready"
        counted = tb.loss_drops()[ns]
        tb.run(sender, [sys.executable, HELPERS, "gso_send", tb.address(receiver), "7399",
                        str(runs), str(per_run), str(payload)], timeout=60)
        out = json.loads(rx.stdout.readline())
        assert rx.wait(timeout=10) == 0
    finally:
        if rx.poll() is None:
            rx.kill()
    return [per_run - n for n in out["got"]], tb.loss_drops()[ns] - counted, out["rcvbuf_errors"]


def assert_loss_per_datagram(lost, per_run, counted, own_drops, loss):
    """The datagrams lost of each GSO run are what losing each with probability
    ``loss`` gives: the rule counted every one, their number is near the rate, and
    they spread over the runs as a binomial does (variance over mean near 1), not in
    whole runs (variance ``per_run`` times larger)."""
    total, n = sum(lost), per_run * len(lost)
    assert total == counted + own_drops, (total, counted, own_drops)
    assert_near_rate(total, n, loss, "datagrams of GSO runs")
    mean = total / len(lost)
    variance = sum((x - mean) ** 2 for x in lost) / len(lost)
    assert variance < 1.5 * per_run * loss * (1 - loss), (variance, sorted(lost)[-5:])
    assert max(lost) < per_run


@needs_root
@needs_nft
def test_loss_is_per_datagram_though_the_sender_sends_gso_runs():
    """44 datagrams per ``send`` (UDP_SEGMENT, 1500-byte frames), both ways: the veths
    cut each run into its frames, so the rule drops datagrams, not runs."""
    loss, runs, payload = 0.05, 400, 1500 - 28
    per_run = 65507 // payload
    with Testbed(hosts=1, link=None, loss=loss, prefix=prefix("d")) as tb:
        up = gso_loss(tb, "switch", 0, runs, per_run, payload)    # at the switch namespace
        down = gso_loss(tb, 0, "switch", runs, per_run, payload)  # at the host, via a port
    for lost, counted, own in (up, down):
        assert_loss_per_datagram(lost, per_run, counted, own, loss)


@needs_root
@needs_nft
def test_with_the_veths_udp_offload_on_the_rule_drops_whole_runs_and_the_checks_see_it():
    """What the testbed turns off (``udp_offload=False``): with the veths' UDP
    segmentation offload on, a GSO run crosses the link as one packet and the rule
    drops it whole or not at all. The checks above must fail on that."""
    loss, runs, payload = 0.05, 400, 1500 - 28
    per_run = 65507 // payload
    with Testbed(hosts=1, link=None, loss=loss, prefix=prefix("o"), udp_offload=True) as tb:
        lost, counted, own = gso_loss(tb, "switch", 0, runs, per_run, payload)
    assert sum(lost) == per_run * counted + own  # one count per run dropped whole
    with pytest.raises(AssertionError):
        assert_loss_per_datagram(lost, per_run, counted, own, loss)


@needs_root
@needs_nft
# 400 calls at 5%: 2600 datagrams dropped, twice the 1000 calls at 1% (1100), and
# every recovery path taken (fast, probe, resend, stale, spurious) in a third of the time
@pytest.mark.parametrize("loss,count", [(0.01, 1000), (0.05, 400)])
def test_hundreds_of_allreduces_under_loss_are_bit_identical_to_the_loss_free_sums(
        tmp_path, loss, count):
    world, size = 3, 3000
    with Testbed(hosts=world, link="none", loss=loss, prefix=prefix(f"l{int(loss * 100)}")) as tb:
        start_switch(tb)
        procs = [tb.popen(h, [sys.executable, HELPERS, "repeat", tb.switch, str(h), str(world),
                              str(size), str(count), str(tmp_path / f"repeat-{h}")],
                          stderr=subprocess.PIPE, text=True) for h in range(world)]
        for proc in procs:
            assert proc.wait(timeout=240) == 0, proc.stderr.read()  # no hang, no error
        drops = tb.loss_drops()
    sys.path.insert(0, os.path.dirname(HELPERS))
    from testbed_helpers import repeated_input
    want = hashlib.sha256()
    for i in range(count):
        want.update(reference_sum([repeated_input(r, size, i) for r in range(world)],
                                  JOB_PACKET).tobytes())
    outs = [json.load(open(tmp_path / f"repeat-{h}.json")) for h in range(world)]
    for out in outs:
        assert out["sha256"] == want.hexdigest()
    assert sum(drops.values()) > 0.5 * loss * count * world  # the loss did bite
    assert all(out["counters"]["retransmissions"] > 0 for out in outs)


@needs_root
def test_gloo_runs_inside_the_namespaces_over_their_links():
    pytest.importorskip("torch")
    size = 250_000
    with Testbed(hosts=2, link="500mbit", prefix=prefix("j")) as tb:
        before = tb.link_counters(1)
        procs = [tb.popen(h, [sys.executable, HELPERS, "gloo", str(h), "2", str(size)],
                          env={"MASTER_PORT": "29500"}, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True) for h in range(2)]
        outs = [p.communicate(timeout=120) for p in procs]
        after = tb.link_counters(1)
    for proc, (out, err) in zip(procs, outs):
        assert proc.returncode == 0, err
        assert json.loads(out)["sum"] == 3 * size * (size - 1) / 2  # (1 + 2) * sum(arange)
    # ring allreduce of n = 2: each rank sends and receives S through its own link
    assert after["tx_bytes"] - before["tx_bytes"] >= size * 4
    assert after["rx_bytes"] - before["rx_bytes"] >= size * 4


def fragments_made(tb, where) -> int:
    """IP fragments the namespace ``where`` has made (/proc/net/snmp, Ip FragCreates)."""
    text = tb.run(where, ["cat", "/proc/net/snmp"], capture_output=True, text=True).stdout
    lines = [line.split() for line in text.splitlines() if line.startswith("Ip:")]
    return int(lines[1][lines[0].index("FragCreates")])


@needs_root
@pytest.mark.parametrize("plane", ["c", "python", "xdp"])
def test_every_packet_is_one_frame_whatever_the_switchs_packet_limit(tmp_path, plane):
    """A job's packets fit its 1500-byte links both ways, with the switch's limit above
    a frame (PACKET values) or below it (256, the Tofino program's size): no host and
    no switch makes an IP fragment, and nothing needed the fragmenting fallback."""
    if plane == "xdp" and not XDP:
        pytest.skip(f"XDP: {xdp.unavailable()}")
    size = 20_000
    env = {"SWITCHML_PURE_PYTHON": "1" if plane == "python" else "0",
           "SWITCHML_DATA_PLANE": plane}
    with Testbed(hosts=2, link=None, prefix=prefix("m" + plane[0])) as tb:
        for packet in (256, PACKET):
            before = [fragments_made(tb, w) for w in ("switch", 0, 1)]
            sw = tb.popen("switch", [sys.executable, "-m", "switchml.cli", "switch", "--host",
                                     tb.switch_address, "--port", "7300", "--packet-elements",
                                     str(packet), "--slots", "64", "--log-level", "warning"],
                          stdout=subprocess.PIPE, text=True, cwd=ROOT, env=env)
            assert "listening on" in sw.stdout.readline()
            results, _ = run_workers(tb, 2, size, "int32", tmp_path)
            stats = json.loads(tb.run("switch", [sys.executable, "-m", "switchml.cli", "stats",
                                                 "--switch", tb.switch, "--json"],
                                      capture_output=True, text=True, cwd=ROOT).stdout)
            sw.terminate()
            sw.wait(timeout=10)
            for got in results:
                assert got.tobytes() == expected(2, size, "int32").tobytes()
            assert stats["data_plane"] == plane
            [job] = stats["ended_jobs"].values()
            assert job["packet_elements"] == min(packet, JOB_PACKET)
            counters = stats["totals"]
            assert counters["results_out"] > 0 and not counters.get("send_errors")
            assert not counters.get("send_fragmented")
            assert [fragments_made(tb, w) for w in ("switch", 0, 1)] == before


@needs_root
def test_a_job_runs_over_two_switch_servers_behind_links_of_their_own(tmp_path):
    """Issue 15, part 2: two switch processes in server namespaces, each behind a
    shaped link like a host's; one job of two hosts over both: the sums one switch
    gives, and each server's link carried about half of every host's bytes."""
    size = 100_003
    with Testbed(hosts=2, link="200mbit", switches=2, prefix=prefix("k")) as tb:
        for k in range(2):
            server = f"s{k}"
            sw = tb.popen(server, [sys.executable, "-m", "switchml.cli", "switch", "--host",
                                   tb.address(server), "--port", "7300", "--packet-elements",
                                   str(PACKET), "--slots", "64", "--log-level", "warning"],
                          stdout=subprocess.PIPE, text=True, cwd=ROOT)
            assert "listening on" in sw.stdout.readline()
        before = {node: tb.link_counters(node) for node in tb.nodes}
        results, counters = run_workers(tb, 2, size, "float32", tmp_path)
        after = {node: tb.link_counters(node) for node in tb.nodes}
        for got in results:
            assert got.tobytes() == expected(2, size, "float32").tobytes()
        assert all(c["results_in"] > 0 for c in counters)
    def moved(node, key):
        return after[node][key] - before[node][key]

    tensor = size * 4
    for host in (0, 1):  # S up and S down through each host's own link
        assert moved(host, "tx_bytes") >= tensor and moved(host, "rx_bytes") >= tensor
    # Every byte the hosts sent went to a server (none to the bridge), each server
    # getting about half: n·S/K = S each, and sending as much back.  (Bytes, not
    # exact: a worker's first call on a cold RTT estimate probes, the bridge's
    # switch alike: up to half as many again at this size.)
    up = moved(0, "tx_bytes") + moved(1, "tx_bytes")
    into_servers = moved("s0", "rx_bytes") + moved("s1", "rx_bytes")
    assert 0.95 * up <= into_servers <= 1.05 * up, (up, into_servers)
    for server in ("s0", "s1"):
        assert moved(server, "rx_bytes") >= 0.9 * tensor
        assert moved(server, "tx_bytes") >= 0.9 * tensor
        assert 0.35 <= moved(server, "rx_bytes") / into_servers <= 0.65


@needs_root
def test_cli_up_with_switch_servers_runs_a_job_over_them():
    p = prefix("l")
    try:
        up = subprocess.run(CLI + ["testbed", "up", "--prefix", p, "--hosts", "1", "--link",
                                   "100mbit", "--switches", "2", "--switch"],
                            capture_output=True, text=True, timeout=60)
        assert up.returncode == 0, up.stderr
        assert f"namespace {p}-s1" in up.stdout and "(switch running)" in up.stdout
        code = ("import numpy as np, switchml; "
                "w = switchml.Worker(None, 0, 1, job='cli'); "
                "print(len(w.channels), int(w.allreduce(np.arange(50000, dtype=np.int32))"
                ".sum())); w.close()")
        run = subprocess.run(CLI + ["testbed", "run", "--prefix", p, "0", "--",
                                    sys.executable, "-c", code], capture_output=True,
                             text=True, timeout=60)
        assert run.returncode == 0, run.stderr
        assert run.stdout.split() == ["2", str(sum(range(50000)))]
        status = subprocess.run(CLI + ["testbed", "status", "--prefix", p],
                                capture_output=True, text=True, timeout=30)
        assert "server 1: sent" in status.stdout
    finally:
        down = subprocess.run(CLI + ["testbed", "down", "--prefix", p], capture_output=True,
                              text=True, timeout=30)
    assert down.returncode == 0, down.stderr
    assert_gone(p)
    records = os.listdir("/run/switchml-testbed") if os.path.isdir("/run/switchml-testbed") else []
    assert not [f for f in records if f.startswith(p + "-")]  # the servers' switch logs
