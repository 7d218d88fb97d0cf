"""Racks on the emulated cluster: ``Testbed(racks=R)``, ``switchml testbed up --racks R``.

Each rack is a namespace with a bridge of its own, where its rack switch
listens; its hosts' links end there instead of on the spine's bridge; one
shaped uplink (a veth, tbf both ways) joins the rack's bridge to the spine's
bridge in the switch namespace, where the spine switch listens:

    namespace P-h<i>   device P-h<i>   (veth; tbf = the host's uplink)
          |
    namespace P-r<k>   device P-p<i>   (veth peer, port of P-rb<k>; tbf = downlink)
                       device P-rb<k>  (bridge; address rack_address(k): the rack switch)
                       device P-u<k>   (veth, port of P-rb<k>; tbf = the rack's uplink)
          |
    namespace P-sw     device P-pu<k>  (veth peer, port of P-br; tbf = the rack's downlink)
                       device P-br     (bridge; address switch_address: the spine switch)

Hosts go to racks in contiguous blocks (host i to rack i*R // N).  Everything is
one IP subnet bridged through: a host reaches its rack switch without crossing
the uplink, a rack switch reaches the spine across it, and traffic between
hosts of different racks (gloo's ring, say) crosses both racks' uplinks, as in
a cluster.  The uplink's rate is the rack's hosts' links together divided by
the oversubscription (1: as much as they, 4: a quarter).
"""

from __future__ import annotations

import re

from . import netns
from .netns import sh


def parse_rack(tb, host) -> int | None:
    """Rack ``k`` for ``"r<k>"``, or None for anything else."""
    match = re.fullmatch(r"r(\d+)", host) if isinstance(host, str) else None
    if match is None:
        return None
    k = int(match.group(1))
    if not 0 <= k < tb.racks:
        raise ValueError(f"racks are r0..r{tb.racks - 1}, got {host!r}" if tb.racks
                         else f"this testbed has no racks (racks=0), got {host!r}")
    return k


def rack_of(tb, host) -> int:
    """The rack of host ``i``."""
    return tb._index(host) * tb.racks // tb.hosts


def hosts_of(tb, rack: int) -> list:
    return [h for h in range(tb.hosts) if rack_of(tb, h) == rack]


def rack_namespace(tb, rack: int) -> str:
    return f"{tb.prefix}-r{rack}"


def rack_bridge(tb, rack: int) -> str:
    return f"{tb.prefix}-rb{rack}"


def rack_address(tb, rack: int) -> str:
    """Rack ``rack``'s bridge, where its rack switch listens: below the servers'."""
    return str(tb.subnet.network_address + tb.subnet.num_addresses - 3 - tb.switches - rack)


def uplink_bps(tb, rack: int) -> float | None:
    """The rate of the rack's uplink each way: its hosts' links over the oversubscription."""
    if tb.link_bps is None:
        return None
    return tb.link_bps * len(hosts_of(tb, rack)) / tb.oversubscription


def create(tb) -> None:
    """The racks' namespaces, bridges and uplinks (hosts' links are wired by the
    testbed, ending in ``tb.port_namespace(host)``)."""
    sw, prefix_len = tb.switch_namespace, tb.subnet.prefixlen
    for k in range(tb.racks):
        ns, bridge = rack_namespace(tb, k), rack_bridge(tb, k)
        up, down = f"{tb.prefix}-u{k}", f"{tb.prefix}-pu{k}"
        sh(["ip", "-n", ns, "link", "add", bridge, "type", "bridge"])
        sh(["ip", "-n", ns, "link", "add", up, "type", "veth", "peer", "name", down,
            "netns", sw])
        if tb.mtu:
            for where, dev in ((ns, bridge), (ns, up), (sw, down)):
                sh(["ip", "-n", where, "link", "set", dev, "mtu", str(tb.mtu)])
        sh(["ip", "-n", ns, "link", "set", up, "master", bridge])
        sh(["ip", "-n", sw, "link", "set", down, "master", tb.bridge])
        sh(["ip", "-n", ns, "addr", "add", f"{rack_address(tb, k)}/{prefix_len}",
            "dev", bridge])
        for where, dev in ((ns, up), (sw, down), (ns, bridge)):
            sh(["ip", "-n", where, "link", "set", dev, "up"])
        if not tb.udp_offload:
            netns.set_offloads(ns, [up], {tb.UDP_SEGMENTATION: False})
            netns.set_offloads(sw, [down], {tb.UDP_SEGMENTATION: False})
        rate = uplink_bps(tb, k)
        if rate is not None:
            netns.shape(ns, up, rate, tb.burst, tb.queue)      # the rack's uplink
            netns.shape(sw, down, rate, tb.burst, tb.queue)    # and its downlink
        if tb.loss > 0:
            netns.add_udp_loss(ns, tb._loss_table, tb.loss)


def uplink_counters(tb, rack: int) -> dict:
    """Bytes and packets rack ``rack`` sent up to the spine (tx) and got back (rx)."""
    return netns.link_counters(rack_namespace(tb, rack), f"{tb.prefix}-u{rack}")
