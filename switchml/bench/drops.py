"""Where on the testbed datagrams were lost: a snapshot of the drop counters.

Per host namespace (then per switch server's): its uplink's queue (the tbf on
its veth, a NIC's queue) and UDP's send-buffer errors (a datagram its own queue
refused: Linux counts a local qdisc drop of a UDP datagram there); per switch
port: the downlink's queue (a switch port's buffer); per veth pair: its ends'
drops (a receiving CPU's backlog full); in every namespace: UDP's receive-buffer
errors (a socket that did not read fast enough) and the loss rule's drops.
``delta`` of two snapshots says where one run's losses were.  On loopback,
``host_snapshot`` and ``host_delta`` do the same for the one host: its CPUs'
backlogs and its UDP error counters.
"""

from __future__ import annotations

import json

from ..testbed import netns
from ..testbed.netns import sh


def _qdisc_drops(ns: str, dev: str) -> int:
    return sum(int(q.get("drops", 0)) for q in netns.qdisc(ns, dev))


def _udp(ns: str) -> dict:
    """UDP's counters in ``ns`` (/proc/net/snmp)."""
    return _udp_counters(sh(["ip", "netns", "exec", ns, "cat", "/proc/net/snmp"]).stdout)


def _udp_counters(snmp: str) -> dict:
    """UDP's counters in the text of a /proc/net/snmp: its names line, its values line."""
    lines = [line.split() for line in snmp.splitlines() if line.startswith("Udp:")]
    return dict(zip(lines[0][1:], map(int, lines[1][1:])))


def snapshot(tb) -> dict:
    """Every drop counter of testbed ``tb`` now."""
    hosts = []
    for h in getattr(tb, "nodes", range(tb.hosts)):  # hosts, then any switch servers
        ns = tb.namespace(h)
        udp = _udp(ns)
        host_end = netns.link_counters(ns, tb.ifname(h))
        # the link's far end: on the spine's bridge, or on its rack's
        port_ns = tb.port_namespace(h) if getattr(tb, "racks", 0) else tb.switch_namespace
        switch_end = netns.link_counters(port_ns, tb.port(h))
        hosts.append({"uplink_queue": _qdisc_drops(ns, tb.ifname(h)),
                      "downlink_queue": _qdisc_drops(port_ns, tb.port(h)),
                      # a veth's drops: a receiver's backlog full (netdev_max_backlog)
                      "veth_dropped": host_end["rx_dropped"] + host_end["tx_dropped"]
                      + switch_end["rx_dropped"] + switch_end["tx_dropped"],
                      "udp_sndbuf_errors": udp.get("SndbufErrors", 0),
                      "udp_rcvbuf_errors": udp.get("RcvbufErrors", 0)})
    racks = []
    for k in range(getattr(tb, "racks", 0)):  # each rack's uplink to the spine, both ways
        ns = tb.namespace(f"r{k}")
        udp = _udp(ns)
        racks.append({"uplink_queue": _qdisc_drops(ns, f"{tb.prefix}-u{k}"),
                      "downlink_queue": _qdisc_drops(tb.switch_namespace, f"{tb.prefix}-pu{k}"),
                      "udp_sndbuf_errors": udp.get("SndbufErrors", 0),
                      "udp_rcvbuf_errors": udp.get("RcvbufErrors", 0)})
    udp = _udp(tb.switch_namespace)
    return {"hosts": hosts, "racks": racks,
            "switch": {"udp_sndbuf_errors": udp.get("SndbufErrors", 0),
                       "udp_rcvbuf_errors": udp.get("RcvbufErrors", 0)},
            "loss_rule": sum(tb.loss_drops().values()) if tb.loss else 0}


def delta(before: dict, after: dict) -> dict:
    """What ``after`` counted since ``before``: totals over hosts, and per host."""
    per_host = [{k: a[k] - b[k] for k in a} for a, b in zip(after["hosts"], before["hosts"])]
    totals = {k: sum(h[k] for h in per_host) for k in per_host[0]} if per_host else {}
    racks = [{k: a[k] - b[k] for k in a}
             for a, b in zip(after.get("racks", []), before.get("racks", []))]
    if racks:
        totals["per_rack"] = racks
    return {**totals,
            "switch_udp_sndbuf_errors": after["switch"]["udp_sndbuf_errors"]
            - before["switch"]["udp_sndbuf_errors"],
            "switch_udp_rcvbuf_errors": after["switch"]["udp_rcvbuf_errors"]
            - before["switch"]["udp_rcvbuf_errors"],
            "loss_rule": after["loss_rule"] - before["loss_rule"], "per_host": per_host}


def host_snapshot() -> dict:
    """This host's drop counters now (a job on loopback): datagrams its CPUs'
    backlogs dropped (``/proc/net/softnet_stat``'s second column: a receiving
    CPU's queue full, netdev_max_backlog) and UDP's error counters."""
    backlog = 0
    with open("/proc/net/softnet_stat") as f:
        for line in f:
            backlog += int(line.split()[1], 16)
    with open("/proc/net/snmp") as f:
        udp = _udp_counters(f.read())
    return {"backlog_dropped": backlog, "udp_rcvbuf_errors": udp.get("RcvbufErrors", 0),
            "udp_sndbuf_errors": udp.get("SndbufErrors", 0),
            "udp_in_errors": udp.get("InErrors", 0)}


def host_delta(before: dict, after: dict) -> dict:
    """What ``after`` counted since ``before`` (``host_snapshot``'s)."""
    return {k: after[k] - before[k] for k in after}


if __name__ == "__main__":  # a testbed's drops: python -m switchml.bench.drops PREFIX
    import sys

    from ..testbed import Testbed

    print(json.dumps(snapshot(Testbed.from_state(*sys.argv[1:2])), indent=2))

