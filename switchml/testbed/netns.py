"""Thin wrappers over ``ip``, ``tc`` and ``nft``: the commands the testbed runs.

Every call goes through ``sh``, which turns a missing tool into ``ToolMissingError``
and a failed command into ``CommandError`` carrying its stderr.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

from .errors import CommandError, NotRootError, ToolMissingError

#: Debian package of each tool, for the messages (and for installing nft).
PACKAGES = {"ip": "iproute2", "tc": "iproute2", "nft": "nftables"}

_RATE_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}


def parse_rate(rate) -> float:
    """A tc-style rate ('1gbit', '200mbit', '500kbit', or bits/s as a number) in bits/s."""
    if isinstance(rate, (int, float)) and not isinstance(rate, bool):
        value = float(rate)
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*", str(rate).lower())
        if not match or match.group(2) not in ("",) + tuple(_RATE_UNITS):
            raise ValueError(f"link rate must look like 1gbit, 200mbit or 500kbit, got {rate!r}")
        value = float(match.group(1)) * _RATE_UNITS[match.group(2) or "bit"]
    if value <= 0:
        raise ValueError(f"link rate must be positive, got {rate!r}")
    return value


def parse_size(size) -> int:
    """A size in bytes: a number, or with a unit k/kb/m/mb (KiB, MiB, as tc reads them)."""
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*(\d+)\s*(|b|k|kb|m|mb)\s*", str(size).lower())
    if not match:
        raise ValueError(f"size must look like 256kb or 4mb, got {size!r}")
    return int(match.group(1)) * {"": 1, "b": 1, "k": 1024, "kb": 1024,
                                  "m": 1 << 20, "mb": 1 << 20}[match.group(2)]


def require_root() -> None:
    if os.geteuid() != 0:
        raise NotRootError("the testbed needs root: network namespaces, veths and tc qdiscs "
                           "need CAP_NET_ADMIN and CAP_SYS_ADMIN (run it as root, e.g. with sudo)")


def require_tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise ToolMissingError(f"`{name}` is not installed; the testbed needs it "
                               f"(Debian package {PACKAGES.get(name, name)}: "
                               f"apt-get install {PACKAGES.get(name, name)})")
    return path


def ensure_nft(install: bool = True) -> str:
    """The path of ``nft``, installing Debian's nftables package first when allowed."""
    path = shutil.which("nft")
    if path is not None or not install or shutil.which("apt-get") is None:
        return require_tool("nft")
    print("switchml testbed: loss emulation needs nft; installing the Debian package "
          "nftables with apt-get", file=sys.stderr, flush=True)
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    install_cmd = ["apt-get", "install", "-y", "--no-install-recommends", "nftables"]
    done = subprocess.run(install_cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0:  # the package lists may be missing: fetch them once and retry
        subprocess.run(["apt-get", "update"], capture_output=True, text=True, env=env)
        done = subprocess.run(install_cmd, capture_output=True, text=True, env=env)
    path = shutil.which("nft")
    if path is None:
        raise ToolMissingError("`nft` is not installed and `apt-get install nftables` failed: "
                               + (done.stderr.strip().splitlines() or ["(no output)"])[-1])
    return path


def sh(argv, *, check: bool = True, input: str | None = None,
       timeout: float = 30.0) -> subprocess.CompletedProcess:
    """Run a command; a missing program raises ToolMissingError, a failure CommandError."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, input=input, timeout=timeout)
    except FileNotFoundError:
        require_tool(argv[0])
        raise
    if check and done.returncode != 0:
        raise CommandError(argv, done.returncode, done.stderr)
    return done


def list_namespaces() -> list:
    """Names of the named network namespaces (``ip netns list``)."""
    out = sh(["ip", "netns", "list"]).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def namespace_pids(ns: str) -> list:
    out = sh(["ip", "netns", "pids", ns], check=False).stdout
    return [int(p) for p in out.split() if p.isdigit()]


def kill_namespace_processes(ns: str, grace: float = 2.0) -> None:
    """End every process inside ``ns`` (they keep its devices alive): TERM, then KILL."""
    pids = namespace_pids(ns)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace
        while pids and time.monotonic() < deadline:
            time.sleep(0.05)
            pids = [p for p in pids if _alive(p)]
        if not pids:
            return


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie child of ours: reap it
        done, _ = os.waitpid(pid, os.WNOHANG)
        return done == 0
    except ChildProcessError:  # not our child: alive unless it is a zombie
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False


def delete_namespace(ns: str) -> None:
    kill_namespace_processes(ns)
    sh(["ip", "netns", "delete", ns], check=False)


def link_counters(ns: str, dev: str) -> dict:
    """Bytes and packets a device sent and received (``ip -s -j link``)."""
    out = sh(["ip", "-n", ns, "-s", "-j", "link", "show", "dev", dev]).stdout
    stats = json.loads(out)[0]["stats64"]
    return {"tx_bytes": stats["tx"]["bytes"], "tx_packets": stats["tx"]["packets"],
            "rx_bytes": stats["rx"]["bytes"], "rx_packets": stats["rx"]["packets"],
            "tx_dropped": stats["tx"]["dropped"], "rx_dropped": stats["rx"]["dropped"]}


def udp_counters(ns: str) -> dict:
    """The UDP counters of namespace ``ns`` (/proc/net/snmp's Udp line: InDatagrams,
    NoPorts, InErrors, RcvbufErrors, OutDatagrams, ...), one per datagram."""
    text = sh(["ip", "netns", "exec", ns, "cat", "/proc/net/snmp"]).stdout
    names, values = [line.split()[1:] for line in text.splitlines()
                     if line.startswith("Udp:")][:2]
    return {name: int(value) for name, value in zip(names, values)}


def qdisc(ns: str, dev: str) -> list:
    """The qdiscs on a device, as ``tc -j`` reports them."""
    return json.loads(sh(["tc", "-n", ns, "-j", "-s", "qdisc", "show", "dev", dev]).stdout or "[]")


def shape(ns: str, dev: str, rate_bps: float, burst: int, limit: int) -> None:
    """A token bucket on ``dev``'s egress: ``rate``, bucket ``burst`` bytes, queue ``limit``."""
    sh(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf",
        "rate", f"{int(rate_bps)}bit", "burst", str(burst), "limit", str(limit)])


#: Flow queues of ``shape_per_flow``: u32 hashes one byte of a header, so at most 256.
FLOW_QUEUES = 256


#: Bytes a flow queue sends a turn: more than the largest packet a queue sees (a
#: TSO or UDP GSO packet of 64 KiB and its headers), since HTB sends a packet
#: whatever the turn's credit and charges it after: a quantum below the packet
#: size gives each flow a packet a turn, so bytes go by packet size.
FLOW_QUANTUM = 70000


def shape_per_flow(ns: str, dev: str, rate_bps: float, burst: int, limit: int) -> None:
    """``dev``'s egress at ``rate`` with a FIFO of ``limit`` bytes per flow, served in turn.

    A host's own queue as fq_codel (most distributions' default) keeps it:
    each flow waits in a queue of its own and the link takes from them in turn,
    ``FLOW_QUANTUM`` bytes each, so one sender cannot take the room another
    needs.  This kernel has no fq_codel, fq or sfq, so it is built from what it
    has: an HTB class at the link's rate whose 256 children (a bfifo each)
    share it by deficit round robin, and a u32 hash that picks a child by the
    low byte of the source port.  As in fq_codel, two flows whose ports hash
    alike share a queue; no AQM drops early.
    """
    rate = f"{int(rate_bps)}bit"
    child_rate = f"{max(int(rate_bps) // FLOW_QUEUES, 8)}bit"
    lines = [f"qdisc replace dev {dev} root handle 1: htb default 2",
             f"class add dev {dev} parent 1: classid 1:1 htb rate {rate} ceil {rate} "
             f"burst {burst} cburst {burst}",
             # a hash table of FLOW_QUEUES buckets, and the root's rule sending every
             # IPv4 packet to the bucket of its source port's low byte
             f"filter add dev {dev} parent 1: prio 1 handle 2: protocol ip u32 "
             f"divisor {FLOW_QUEUES}",
             f"filter add dev {dev} parent 1: prio 1 protocol ip u32 ht 800:: "
             f"match u32 0 0 hashkey mask 0x00ff0000 at 20 link 2:"]
    for i in range(FLOW_QUEUES + 1):  # the last: packets that are not IPv4
        classid = f"1:{0x100 + i:x}" if i < FLOW_QUEUES else "1:2"
        lines += [f"class add dev {dev} parent 1:1 classid {classid} htb rate {child_rate} "
                  f"ceil {rate} burst {burst} cburst {burst} quantum {FLOW_QUANTUM}",
                  f"qdisc add dev {dev} parent {classid} bfifo limit {limit}"]
        if i < FLOW_QUEUES:
            lines.append(f"filter add dev {dev} parent 1: prio 1 protocol ip u32 "
                         f"ht 2:{i:x}: match u32 0 0 flowid {classid}")
    sh(["tc", "-n", ns, "-batch", "-"], input="\n".join(lines) + "\n")


#: Run as a script inside a namespace: the ethtool ioctl acts on the caller's namespace.
OFFLOAD_SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                              "ethtool.py")


def set_offloads(ns: str, devs, wanted: dict) -> None:
    """Turn offload features (ethtool names: on) of devices in ``ns`` on or off.

    Through the ethtool ioctl (``switchml/ethtool.py``), since the machine may have no
    ``ethtool``; a device that keeps a feature as it was raises CommandError.
    """
    pairs = [word for name, on in wanted.items() for word in (name, "on" if on else "off")]
    sh(["ip", "netns", "exec", ns, sys.executable, OFFLOAD_SCRIPT, ",".join(devs), *pairs])


def offloads(ns: str, dev: str) -> dict:
    """Every offload feature of ``dev`` in ``ns``: whether it is on (``ethtool -k``)."""
    out = sh(["ip", "netns", "exec", ns, sys.executable, OFFLOAD_SCRIPT, dev]).stdout
    return {line.split()[1].rstrip(":"): line.split()[2] == "on" for line in out.splitlines()}


def add_udp_loss(ns: str, table: str, loss: float) -> None:
    """Drop each incoming UDP datagram with probability ``loss`` (nftables numgen).

    The rule decides per packet the hook sees: a UDP GSO run that reaches it
    uncut is one packet, dropped whole or kept. The testbed's veths cut runs
    into datagrams at transmit (``tx-udp-segmentation`` off), so it is per datagram.
    """
    threshold = round(loss * 1_000_000)
    ruleset = (f"table inet {table} {{\n"
               f"  chain input {{\n"
               f"    type filter hook input priority 0; policy accept;\n"
               f"    meta l4proto udp numgen random mod 1000000 < {threshold} counter drop\n"
               f"  }}\n}}\n")
    sh(["ip", "netns", "exec", ns, "nft", "-f", "-"], input=ruleset)


def udp_loss_drops(ns: str, table: str) -> int:
    """Datagrams the loss rule in ``ns`` dropped so far (0 if there is no rule)."""
    done = sh(["ip", "netns", "exec", ns, "nft", "-j", "list", "table", "inet", table],
              check=False)
    if done.returncode != 0:
        return 0
    for item in json.loads(done.stdout).get("nftables", []):
        for expr in item.get("rule", {}).get("expr", []):
            if "counter" in expr:
                return int(expr["counter"]["packets"])
    return 0
