"""An emulated cluster on one machine: host namespaces, a switch namespace, shaped links.

    with Testbed(hosts=4, link="1gbit", mtu=9000, loss=0.0) as tb:
        sw = tb.popen("switch", ["switchml", "switch", "--host", tb.switch_address])
        tb.run(0, ["python", "train.py"])           # inside host 0's namespace

Layout, for prefix P (default ``smltb``):

    namespace P-h<i>   device P-h<i>  (veth; address host_address(i); tbf = uplink)
          |
    namespace P-sw     device P-p<i>  (veth peer, bridge port; tbf = downlink)
                       device P-br    (bridge; address switch_address: the switch)

With ``switches=K`` there are also K switch servers, each wired to the bridge as a
host is (``server_address(k)``, counting down from below the bridge's; tbf both
ways), for switch processes on servers of their own, as a cluster without a
programmable switch runs them; ``switch`` is then their K addresses, the one job
spread over them (docs/protocol.md, "One job, K switches"):

    namespace P-s<k>   device P-s<k>  (veth; address server_address(k); tbf = uplink)
          |
    namespace P-sw     device P-ps<k> (veth peer, bridge port; tbf = downlink)

Nothing is created in the machine's own namespace, and every name starts with the
prefix, so ``down`` finds leftovers of a crashed run and two testbeds with
different prefixes coexist.  A worker's traffic leaves through its uplink, is
switched (or received by the switch process on the bridge address) and reaches
other hosts through their downlinks: the switch process itself is not behind a
shaped link, as an aggregating switch is not.  With loss, every veth has its UDP
segmentation offload off (``udp_offload``): a sender's UDP GSO run leaves a link
as its datagrams, one frame each, so the loss rule (``loss``) drops datagrams,
not whole runs.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import json
import os
import re
import shutil
import signal
import site
import socket
import subprocess
import sys
import threading
import time

from . import netns
from . import racks as rack_layout
from .errors import TestbedError, TestbedExistsError
from .netns import parse_rate, parse_size, sh

DEFAULT_PREFIX = "smltb"
DEFAULT_SUBNET = "10.77.0.0/24"
#: Port the switch uses inside the testbed (its namespace is private: no clash).
SWITCH_PORT = 7300
#: tbf bucket: enough for a few jumbo frames and a 64 KiB GSO segment at once.
DEFAULT_BURST = 256 * 1024
#: tbf queue of every link: about what a real switch's port buffers (a shared
#: buffer of a few MB over dozens of ports), not sized to fit any protocol's window.
DEFAULT_QUEUE = 256 * 1024
#: The veth offload that carries a run of UDP GSO datagrams as one packet. Off
#: (``Testbed(udp_offload=False)``; by default with loss or an XDP switch), the
#: kernel cuts each run into its datagrams when it leaves through a link (as for
#: a NIC without UDP segmentation offload): the wire, the link counters and the
#: loss rule see one frame per datagram.
UDP_SEGMENTATION = "tx-udp-segmentation"
#: Where ``up`` records a testbed's settings for ``status``, ``run`` and ``down``.
STATE_DIR = "/run/switchml-testbed"
#: ``ip netns exec NS`` mounts each file in NETNS_ETC/NS over /etc's of that name.
NETNS_ETC = "/etc/netns"
SWITCH = "switch"


#: The directory this switchml is imported from: a source tree (PYTHONPATH, an
#: editable install) or an environment's site-packages.
PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def interpreter_env(environ=None) -> dict:
    """PATH and PYTHONPATH that make a command in a namespace run with switchml's own
    environment: ``python``, ``switchml`` and ``torchrun`` are the ones beside the
    interpreter running switchml (its bin directory first on PATH), and that
    interpreter imports this switchml whatever the current directory (its parent
    directory first on PYTHONPATH, unless it is installed in site-packages).

    ``environ``: the environment the command would otherwise get (os.environ).
    """
    environ = os.environ if environ is None else environ
    added: dict = {}
    if sys.executable:
        bindir = os.path.dirname(sys.executable)  # a venv's bin: not its symlink's target
        rest = environ.get("PATH", os.defpath).split(os.pathsep)
        added["PATH"] = os.pathsep.join([bindir] + [d for d in rest if d and d != bindir])
    installed = {os.path.realpath(d) for d in
                 [*site.getsitepackages(), site.getusersitepackages()]}
    if os.path.realpath(PACKAGE_PARENT) not in installed:
        rest = [d for d in environ.get("PYTHONPATH", "").split(os.pathsep)
                if d and os.path.realpath(d) != os.path.realpath(PACKAGE_PARENT)]
        added["PYTHONPATH"] = os.pathsep.join([PACKAGE_PARENT, *rest])
    return added


def _check_prefix(prefix: str) -> str:
    # Interface names hold 15 characters: prefix + "-h" + up to 3 digits.
    if not re.fullmatch(r"[a-z][a-z0-9]{0,7}", prefix or ""):
        raise ValueError(f"prefix must be 1-8 lowercase letters or digits, starting with a "
                         f"letter, got {prefix!r}")
    return prefix


def find_testbeds() -> dict:
    """Prefixes of testbeds whose namespaces exist, each with its namespace names."""
    found: dict = {}
    for name in netns.list_namespaces():
        match = re.fullmatch(r"([a-z][a-z0-9]{0,7})-(sw|h\d+|s\d+|r\d+)", name)
        if match:
            found.setdefault(match.group(1), []).append(name)
    return found


def teardown(prefix: str = DEFAULT_PREFIX) -> list:
    """Remove every namespace (and so every device) of testbed ``prefix``; return their names.

    Works without the ``Testbed`` object, for instance after a crash: processes still
    inside the namespaces are ended first, since they would keep the devices alive.
    """
    _check_prefix(prefix)
    netns.require_root()
    netns.require_tool("ip")
    names = find_testbeds().get(prefix, [])
    # Hosts first, then the switch: a host's deletion takes its veth pair with it.
    for name in sorted(names, key=lambda n: n.endswith("-sw")):
        netns.delete_namespace(name)
    etc = os.listdir(NETNS_ETC) if os.path.isdir(NETNS_ETC) else []
    for name in etc:  # the namespaces' /etc/hosts, also where the namespace is gone
        if re.fullmatch(re.escape(prefix) + r"-(sw|h\d+|s\d+|r\d+)", name):
            shutil.rmtree(os.path.join(NETNS_ETC, name), ignore_errors=True)
    logs = [r for r in (os.listdir(STATE_DIR) if os.path.isdir(STATE_DIR) else [])
            if re.fullmatch(re.escape(prefix) + r"-[sr]\d+-switch\.log", r)]
    for record in [f"{prefix}.json", f"{prefix}-switch.log", *logs]:
        try:
            os.unlink(os.path.join(STATE_DIR, record))
        except FileNotFoundError:
            pass
    return names


def read_state(prefix: str = DEFAULT_PREFIX) -> dict | None:
    """The settings ``up`` recorded for testbed ``prefix``, or None."""
    try:
        with open(os.path.join(STATE_DIR, f"{_check_prefix(prefix)}.json")) as f:
            return json.load(f)
    except FileNotFoundError:
        return None


def _owner_gone(prefix: str) -> bool:
    """Whether testbed ``prefix`` lived in a process's ``with`` block (a bench's)
    and that process is gone: killed, its testbed left behind."""
    owner = (read_state(prefix) or {}).get("owner")
    if not isinstance(owner, int):
        return False
    try:
        os.kill(owner, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        return False
    return False


#: ``--udp-offload`` (the CLI's and the bench's) as ``Testbed(udp_offload=...)``.
OFFLOAD = {"auto": None, "on": True, "off": False}

#: How a host's uplink may queue (``Testbed(host_queue=...)``).
HOST_QUEUES = ("fifo", "flows")


def add_host_queue_argument(parser, what: str = "") -> None:
    """``--host-queue``, as every command that builds a testbed takes it;
    ``what``: a word before the help (\"testbed: \")."""
    parser.add_argument("--host-queue", choices=HOST_QUEUES, default="flows",
                        help=f"{what}how each host's uplink queues: a FIFO of --queue bytes "
                             f"per flow served in turn, as fq_codel keeps a host's NIC queue "
                             f"(flows, the default), or one FIFO of --queue bytes (fifo)")


class Testbed:
    """N host namespaces wired to a bridge in a switch namespace, links shaped with tbf.

    ``hosts``: number of host namespaces.  ``link``: rate of every link in each
    direction ('1gbit', '200mbit', bits/s; None: unshaped).  ``mtu``: of every veth
    and the bridge (None: 1500).  ``loss``: probability that a UDP datagram is
    dropped when it arrives in a namespace (hosts and switch; needs nft).
    ``prefix``: start of every namespace and device name.  ``subnet``: hosts get
    its first addresses, the switch (bridge) its last usable one.  ``burst``: tbf
    bucket; ``queue``: bytes a link holds waiting for the wire (tbf ``limit``;
    256 KiB by default, a switch port's buffer), beyond which it drops.
    ``host_queue``: how a host's own uplink queues, where its senders meet
    before the wire: "flows" (the default), a FIFO of ``queue`` bytes per flow
    served in turn, as fq_codel (most distributions' default qdisc) keeps a
    host's NIC queue (``netns.shape_per_flow``); "fifo", one tbf FIFO of
    ``queue`` bytes as a switch port's.  Switch ports stay FIFOs either way.
    ``udp_offload``: the veths' UDP segmentation offload.  On, a sender's UDP GSO
    run (up to 64 datagrams in one ``sendmsg``) crosses the links as one packet,
    as it leaves a NIC that segments it (rate and queue still count every byte:
    tbf is exact either way), and meets the loss rule as one packet, dropped or
    kept whole.  Off, the kernel cuts it into its datagrams at the first link, as
    for a NIC without that offload, and every hop of the emulated wire (tbf,
    veth, bridge) handles each frame on this machine's cores, which a real
    switch's fabric does not, so the machine's cores, not the links, can bound
    a run at small MTUs.  None (the default): on, as the kernel leaves a veth,
    without loss, and off with loss, where per-datagram loss needs it.  (An XDP
    switch on the bridge attaches to its ports in their driver mode, which has
    the kernel cut the hosts' runs at their veths, offload on or off; one in
    generic mode, whose program would see a run as one frame, asks its workers
    at join to send their datagrams apart, ``protocol.Ready.gso``.)
    ``switches``: switch servers (0: none, the switch on the bridge as before);
    each is a namespace ``"s<k>"`` behind a shaped link like a host's.
    ``racks``: R racks under the spine on the bridge, each a namespace ``"r<k>"``
    with a bridge and a rack switch of its own, joined to the spine by an uplink
    of the rack's hosts' rate over ``oversubscription`` (``racks.py``).
    ``ranks_per_host``: the ranks a job runs in each host (``run_torchrun``
    starts them, ``switchml testbed run --torchrun``): ranks of a host share its
    link and its memory, and combine there first (the local stage).
    """

    __test__ = False  # not a pytest test class, despite the name
    UDP_SEGMENTATION = UDP_SEGMENTATION

    def __init__(self, hosts: int = 4, link="1gbit", *, mtu: int | None = None,
                 loss: float = 0.0, prefix: str = DEFAULT_PREFIX, subnet: str = DEFAULT_SUBNET,
                 burst=DEFAULT_BURST, queue=None, install_nft: bool = True,
                 udp_offload: bool | None = None, switches: int = 0, racks: int = 0,
                 oversubscription: float = 1.0, ranks_per_host: int = 1,
                 host_queue: str = "flows"):
        self.prefix = _check_prefix(prefix)
        if not 1 <= ranks_per_host <= 256:
            raise ValueError(f"ranks_per_host must be between 1 and 256, got {ranks_per_host}")
        self.ranks_per_host = ranks_per_host
        net = ipaddress.ip_network(subnet)
        if not 1 <= hosts <= min(255, net.num_addresses - 3):
            raise ValueError(f"hosts must be between 1 and {min(255, net.num_addresses - 3)} "
                             f"for subnet {subnet}, got {hosts}")
        if not 0 <= switches <= net.num_addresses - 3 - hosts:
            raise ValueError(f"switches must be between 0 and {net.num_addresses - 3 - hosts} "
                             f"beside {hosts} hosts in subnet {subnet}, got {switches}")
        self.switches = switches
        if racks and (switches or not 1 <= racks <= min(hosts, 99)
                      or racks > net.num_addresses - 3 - hosts):
            raise ValueError(f"racks must be between 1 and the number of hosts ({hosts}), "
                             f"at most 99, without switch servers; got {racks}")
        if not oversubscription >= 1.0:
            raise ValueError(f"oversubscription must be 1 (1:1) or more, got "
                             f"{oversubscription}")
        self.racks = racks
        self.oversubscription = float(oversubscription)
        if not 0.0 <= loss < 1.0:
            raise ValueError(f"loss must be in [0, 1), got {loss}")
        if mtu is not None and not 68 <= mtu <= 65535:
            raise ValueError(f"mtu must be between 68 and 65535, got {mtu}")
        self.hosts = hosts
        self.link = link
        self.link_bps = parse_rate(link) if link not in (None, "", "none") else None
        self.mtu = mtu
        self.loss = float(loss)
        self.subnet = net
        self.burst = parse_size(burst)
        self.queue = parse_size(DEFAULT_QUEUE if queue is None else queue)
        if self.queue < 2 * 9000:
            raise ValueError(f"queue must hold at least two jumbo frames (18000 bytes), "
                             f"got {self.queue}")
        if host_queue not in HOST_QUEUES:
            raise ValueError(f"host_queue must be one of {', '.join(HOST_QUEUES)}, "
                             f"got {host_queue!r}")
        self.host_queue = host_queue
        self.install_nft = install_nft
        self.udp_offload = self.loss == 0 if udp_offload is None else bool(udp_offload)
        self._procs: list = []
        self._up = False
        #: The process whose ``with`` block the testbed lives in (None: it outlives
        #: the process that made it, as ``switchml testbed up``'s): a testbed whose
        #: owner is gone (SIGKILLed) is removed by the next ``up`` of its prefix.
        self._owner: int | None = None
        self._signals = contextlib.ExitStack()  # _catch_signals' signals_end_the_run

    # ------------------------------------------------------------------ names
    @property
    def switch_namespace(self) -> str:
        return f"{self.prefix}-sw"

    @property
    def bridge(self) -> str:
        return f"{self.prefix}-br"

    @property
    def switch_address(self) -> str:
        """The bridge's address, where the switch process listens."""
        return str(self.subnet.network_address + self.subnet.num_addresses - 2)

    @property
    def switch(self) -> str:
        """'host:port' of a switch started on the bridge with ``SWITCH_PORT``; with
        switch servers, theirs, commas between (one job over all of them); with
        racks, the spine's (each host's own switch is its rack's: ``env``)."""
        if self.switches:
            return ",".join(f"{self.server_address(k)}:{SWITCH_PORT}"
                            for k in range(self.switches))
        return f"{self.switch_address}:{SWITCH_PORT}"

    def server_address(self, k: int) -> str:
        """Switch server ``k``'s address: below the bridge's, counting down."""
        return self.address(f"s{k}")

    def _server(self, host) -> int | None:
        """Switch server ``k`` for ``"s<k>"``, or None for anything else."""
        match = re.fullmatch(r"s(\d+)", host) if isinstance(host, str) else None
        if match is None:
            return None
        k = int(match.group(1))
        if not 0 <= k < self.switches:
            raise ValueError(f"switch servers are s0..s{self.switches - 1}, got {host!r}"
                             if self.switches else
                             f"this testbed has no switch servers (switches=0), got {host!r}")
        return k

    def _rack(self, host) -> int | None:
        """Rack ``k`` for ``"r<k>"``, or None for anything else."""
        return rack_layout.parse_rack(self, host)

    def rack_of(self, host) -> int | None:
        """The rack of host ``i``, or None without racks."""
        return rack_layout.rack_of(self, host) if self.racks else None

    def port_namespace(self, host) -> str:
        """The namespace where host ``i``'s link ends: its rack's, or the switch's."""
        rack = self.rack_of(host) if self._server(host) is None else None
        return (rack_layout.rack_namespace(self, rack) if rack is not None
                else self.switch_namespace)

    def _index(self, host) -> int:
        if isinstance(host, str) and re.fullmatch(r"h?\d+", host):
            host = int(host.lstrip("h"))
        if not isinstance(host, int) or not 0 <= host < self.hosts:
            raise ValueError(f"host must be 0..{self.hosts - 1} or 'switch', got {host!r}")
        return host

    def namespace(self, host) -> str:
        """Namespace of host ``i`` (0-based), or of the switch for 'switch'."""
        if host in (SWITCH, "sw"):
            return self.switch_namespace
        rack = self._rack(host)
        if rack is not None:
            return rack_layout.rack_namespace(self, rack)
        server = self._server(host)
        if server is not None:
            return f"{self.prefix}-s{server}"
        return f"{self.prefix}-h{self._index(host)}"

    def address(self, host) -> str:
        if host in (SWITCH, "sw"):
            return self.switch_address
        rack = self._rack(host)
        if rack is not None:
            return rack_layout.rack_address(self, rack)
        server = self._server(host)
        if server is not None:
            return str(self.subnet.network_address + self.subnet.num_addresses - 3 - server)
        return str(self.subnet.network_address + 1 + self._index(host))

    def ifname(self, host) -> str:
        """Host ``i``'s (or server ``"s<k>"``'s) veth inside its namespace
        (GLOO_SOCKET_IFNAME), or the bridge."""
        if host in (SWITCH, "sw"):
            return self.bridge
        server = self._server(host)
        if server is not None:
            return f"{self.prefix}-s{server}"
        return f"{self.prefix}-h{self._index(host)}"

    def port(self, host) -> str:
        """The bridge port (in the switch namespace) of host ``i``'s (or server
        ``"s<k>"``'s) link."""
        server = self._server(host)
        if server is not None:
            return f"{self.prefix}-ps{server}"
        return f"{self.prefix}-p{self._index(host)}"

    @property
    def nodes(self) -> list:
        """Every namespace behind a link: hosts 0..N-1, then servers "s0".."s<K-1>"."""
        return list(range(self.hosts)) + [f"s{k}" for k in range(self.switches)]

    def env(self, host) -> dict:
        """Environment variables that point programs in ``host`` at the testbed."""
        if host in (SWITCH, "sw") or self._server(host) is not None:
            return {"SWITCHML_HOST": self.address(host), "SWITCHML_PORT": str(SWITCH_PORT)}
        if self._rack(host) is not None:  # a rack switch, under the spine
            return {"SWITCHML_HOST": self.address(host), "SWITCHML_PORT": str(SWITCH_PORT),
                    "SWITCHML_UPSTREAM": self.switch}
        rack = self.rack_of(host)
        switch = self.switch if rack is None else f"{self.address(f'r{rack}')}:{SWITCH_PORT}"
        return {"SWITCHML_SWITCH": switch, "GLOO_SOCKET_IFNAME": self.ifname(host),
                "MASTER_ADDR": self.address(0)}

    # ------------------------------------------------------------------ running
    def command(self, host, argv) -> list:
        """``argv`` wrapped to run inside ``host``'s namespace."""
        return ["ip", "netns", "exec", self.namespace(host), *argv]

    def popen(self, host, argv, *, env=None, **kwargs) -> subprocess.Popen:
        """Start ``argv`` in ``host``'s namespace; ``down`` ends it if it still runs."""
        proc = subprocess.Popen(self.command(host, argv), env=self._env(host, env), **kwargs)
        self._procs.append(proc)
        return proc

    def run(self, host, argv, *, env=None, check=True, **kwargs) -> subprocess.CompletedProcess:
        """Run ``argv`` in ``host``'s namespace to completion (subprocess.run's keywords)."""
        return subprocess.run(self.command(host, argv), env=self._env(host, env), check=check,
                              **kwargs)

    def torchrun_command(self, host: int, argv, port: int = 29500) -> list:
        """torchrun's command line for ``host``'s ranks of a job over every host:
        ``--nnodes`` hosts, this one's ``--node-rank``, ``ranks_per_host`` processes
        (ranks host·k .. host·k+k-1), the rendezvous on host 0."""
        return [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(self.hosts),
                "--node-rank", str(host), "--nproc-per-node", str(self.ranks_per_host),
                "--master-addr", self.address(0), "--master-port", str(port), *argv]

    def run_torchrun(self, argv, *, env=None, **kwargs) -> list:
        """Start ``argv`` (a script and its arguments) under torchrun in every host,
        ``ranks_per_host`` ranks each; the processes, one a host."""
        return [self.popen(h, self.torchrun_command(h, argv), env=env, **kwargs)
                for h in range(self.hosts)]

    def _env(self, host, extra) -> dict:
        return {**os.environ, **interpreter_env(), **self.env(host), **(extra or {})}

    def link_counters(self, host) -> dict:
        """Bytes and packets host ``i``'s veth sent (uplink) and received (downlink)."""
        return netns.link_counters(self.namespace(host), self.ifname(host))

    def udp_counters(self, host) -> dict:
        """The UDP counters of ``host``'s namespace (or the switch's): InDatagrams
        (datagrams its sockets read), InErrors, RcvbufErrors, NoPorts, ..."""
        return netns.udp_counters(self.namespace(host))

    def loss_drops(self) -> dict:
        """Datagrams the loss rules dropped so far, per namespace."""
        names = ([self.namespace(h) for h in self.nodes] + [self.switch_namespace]
                 + [self.namespace(f"r{k}") for k in range(self.racks)])
        return {ns: netns.udp_loss_drops(ns, self._loss_table) for ns in names}

    @property
    def _loss_table(self) -> str:
        return f"{self.prefix}_loss"

    # ------------------------------------------------------------------ life cycle
    def __enter__(self) -> Testbed:
        self._catch_signals()
        self._owner = os.getpid()
        try:
            return self.up()
        except BaseException:
            self._restore_signals()
            raise

    def __exit__(self, *exc) -> None:
        try:
            self.down()
        finally:
            self._restore_signals()

    def up(self) -> Testbed:
        """Create everything; on any failure (or Ctrl-C) remove what was made and raise."""
        netns.require_root()
        netns.require_tool("ip")
        if self.link_bps is not None:
            netns.require_tool("tc")
        if self.loss > 0:
            netns.ensure_nft(self.install_nft)
        # Held from the look for one of this prefix to the end of the making (one
        # file for every prefix, which stays): two runs of one prefix at once, the
        # second finds the first's, and its failure, which removes every namespace
        # of the prefix, cannot take the first's.
        os.makedirs(STATE_DIR, exist_ok=True)
        with open(os.path.join(STATE_DIR, "up.lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if self.prefix in find_testbeds() and _owner_gone(self.prefix):
                print(f"testbed: removing testbed '{self.prefix}', left by process "
                      f"{(read_state(self.prefix) or {}).get('owner')}, which is gone",
                      file=sys.stderr)
                teardown(self.prefix)
            if self.prefix in find_testbeds():
                raise TestbedExistsError(
                    f"a testbed with prefix '{self.prefix}' is already up (or left over from "
                    f"a crash): remove it with `switchml testbed down --prefix {self.prefix}` "
                    f"or choose another prefix")
            self._up = True  # from here on, down() has something to remove
            try:
                self._create()
            except BaseException:
                self.down()
                raise
        return self

    def down(self) -> None:
        """End processes started in the testbed and remove its namespaces; idempotent."""
        if not self._up:
            return
        # A second Ctrl-C or TERM must not cut the clean-up short.
        blocked = self._ignore_signals()
        try:
            for proc in self._procs:
                if proc.poll() is None:
                    proc.terminate()
            teardown(self.prefix)
            for proc in self._procs:
                try:
                    proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            self._procs.clear()
            self._up = False
        finally:
            self._unignore_signals(blocked)

    def _create(self) -> None:
        sw = self.switch_namespace
        prefix_len = self.subnet.prefixlen
        for ns in ([sw] + [self.namespace(f"r{k}") for k in range(self.racks)]
                   + [self.namespace(h) for h in self.nodes]):
            sh(["ip", "netns", "add", ns])
            # No IPv6: its router solicitations and MLD reports would add stray
            # bytes to the link counters.
            sh(["ip", "netns", "exec", ns, "sysctl", "-q", "-w",
                "net.ipv6.conf.all.disable_ipv6=1", "net.ipv6.conf.default.disable_ipv6=1"],
               check=False)
            sh(["ip", "-n", ns, "link", "set", "lo", "up"])
        self._write_hosts_files()
        sh(["ip", "-n", sw, "link", "add", self.bridge, "type", "bridge"])
        rack_layout.create(self)  # racks' bridges and uplinks, before their hosts' links
        for h in self.nodes:  # a switch server is wired as a host is
            ns, dev, port = self.namespace(h), self.ifname(h), self.port(h)
            sw = self.port_namespace(h)  # where the link ends: its rack, or the switch
            rack = self.rack_of(h) if self._server(h) is None else None
            bridge = self.bridge if rack is None else rack_layout.rack_bridge(self, rack)
            # Both ends are created inside their namespaces: the machine's own
            # namespace never sees a testbed device.
            sh(["ip", "-n", ns, "link", "add", dev, "type", "veth", "peer", "name", port,
                "netns", sw])
            if self.mtu:
                sh(["ip", "-n", ns, "link", "set", dev, "mtu", str(self.mtu)])
                sh(["ip", "-n", sw, "link", "set", port, "mtu", str(self.mtu)])
            if not self.udp_offload:
                netns.set_offloads(ns, [dev], {UDP_SEGMENTATION: False})
            sh(["ip", "-n", sw, "link", "set", port, "master", bridge])
            sh(["ip", "-n", ns, "addr", "add", f"{self.address(h)}/{prefix_len}", "dev", dev])
            sh(["ip", "-n", sw, "link", "set", port, "up"])
            sh(["ip", "-n", ns, "link", "set", dev, "up"])
            if self.link_bps is not None:
                if self.host_queue == "flows":
                    netns.shape_per_flow(ns, dev, self.link_bps, self.burst,
                                         self.queue)  # uplink
                else:
                    netns.shape(ns, dev, self.link_bps, self.burst, self.queue)  # uplink
                netns.shape(sw, port, self.link_bps, self.burst, self.queue)   # downlink
            if self.loss > 0:
                netns.add_udp_loss(ns, self._loss_table, self.loss)
        if not self.udp_offload:  # downlinks: the bridge ports
            for h in self.nodes:
                netns.set_offloads(self.port_namespace(h), [self.port(h)],
                                   {UDP_SEGMENTATION: False})
        sw = self.switch_namespace
        if self.mtu:
            sh(["ip", "-n", sw, "link", "set", self.bridge, "mtu", str(self.mtu)])
        sh(["ip", "-n", sw, "addr", "add", f"{self.switch_address}/{prefix_len}",
            "dev", self.bridge])
        sh(["ip", "-n", sw, "link", "set", self.bridge, "up"])
        if self.loss > 0:
            netns.add_udp_loss(sw, self._loss_table, self.loss)
        self._write_state()

    def hosts_entries(self) -> dict:
        """A name for every address of the testbed: its namespace's (``P-h0``, ``P-sw``)."""
        nodes = [SWITCH] + [f"r{k}" for k in range(self.racks)] + self.nodes
        return {self.address(node): self.namespace(node) for node in nodes}

    def _write_hosts_files(self) -> None:
        """/etc/hosts inside each namespace (NETNS_ETC/NS/hosts, which ``ip netns exec``
        mounts over it): the machine's entries, a name for every testbed address, and
        the machine's host name for the namespace's own address where the machine's
        file has none.  Look-ups then answer from the file: the namespaces reach no
        DNS server, and torch's store looks up the name of every peer's address."""
        try:
            with open("/etc/hosts") as f:
                machine = f.read()
        except FileNotFoundError:
            machine = ""
        named = {word for line in machine.splitlines()
                 for word in line.split("#")[0].split()[1:]}
        hostname = socket.gethostname()
        entries = self.hosts_entries()
        for node in [SWITCH] + [f"r{k}" for k in range(self.racks)] + self.nodes:
            ns = self.namespace(node)
            # IPv4-mapped too: a dual-stack socket (torch's store) sees its peers so
            lines = [f"{form}{address}\t{name}" for form in ("", "::ffff:")
                     for address, name in entries.items()]
            if hostname and hostname not in named:
                lines.append(f"{self.address(node)}\t{hostname}")
            os.makedirs(os.path.join(NETNS_ETC, ns), exist_ok=True)
            with open(os.path.join(NETNS_ETC, ns, "hosts"), "w") as f:
                f.write(machine.rstrip("\n") + f"\n# switchml testbed {self.prefix}\n"
                        + "\n".join(lines) + "\n")

    def _write_state(self) -> None:
        os.makedirs(STATE_DIR, exist_ok=True)
        state = {"prefix": self.prefix, "hosts": self.hosts, "link": self.link,
                 "link_bps": self.link_bps, "mtu": self.mtu, "loss": self.loss,
                 "subnet": str(self.subnet), "burst": self.burst, "queue": self.queue,
                 "udp_offload": self.udp_offload, "switches": self.switches,
                 "racks": self.racks, "oversubscription": self.oversubscription,
                 "ranks_per_host": self.ranks_per_host, "host_queue": self.host_queue,
                 "switch": self.switch, "owner": self._owner,
                 "created": time.time()}
        with open(os.path.join(STATE_DIR, f"{self.prefix}.json"), "w") as f:
            json.dump(state, f, indent=2)

    @classmethod
    def from_state(cls, prefix: str = DEFAULT_PREFIX) -> Testbed:
        """A handle on a testbed that ``switchml testbed up`` left running (not owned:
        leaving a ``with`` block does not remove it)."""
        state = read_state(prefix)
        if state is None or prefix not in find_testbeds():
            raise TestbedError(f"no testbed with prefix '{prefix}' is up "
                               f"(start one with `switchml testbed up`)")
        return cls(state["hosts"], state["link"], mtu=state["mtu"], loss=state["loss"],
                   prefix=prefix, subnet=state["subnet"], burst=state["burst"],
                   queue=state["queue"], udp_offload=state.get("udp_offload", False),
                   switches=state.get("switches", 0), racks=state.get("racks", 0),
                   oversubscription=state.get("oversubscription", 1.0),
                   ranks_per_host=state.get("ranks_per_host", 1),
                   host_queue=state.get("host_queue", "fifo"))

    # ------------------------------------------------------------------ signals
    def _catch_signals(self) -> None:
        """TERM and HUP clean up like Ctrl-C does (``signals_end_the_run``), until
        ``_restore_signals``."""
        self._signals.enter_context(signals_end_the_run())

    def _restore_signals(self) -> None:
        self._signals.close()

    @staticmethod
    def _ignore_signals() -> dict:
        if threading.current_thread() is not threading.main_thread():
            return {}
        return {sig: signal.signal(sig, signal.SIG_IGN)
                for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}

    @staticmethod
    def _unignore_signals(saved: dict) -> None:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def _exit_on_signal(signum, _frame):
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def signals_end_the_run():
    """TERM and HUP end what runs inside as Ctrl-C does: SystemExit in the main
    thread, so that ``with`` blocks (processes, a testbed) undo what they made.
    Handlers that are not the default are left as they are."""
    saved = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(sig) is signal.SIG_DFL:
                saved[sig] = signal.signal(sig, _exit_on_signal)
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
