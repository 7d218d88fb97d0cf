"""A switchml job beside a bulk TCP flow on the same links: what share does each get?

    python bench/beside_tcp.py --hosts 4 --link 1gbit --mtu 9000 --mib 64 --repeats 8

On the testbed (every link shaped, port queues of ``--queue``), one invocation
measures, in this order: a bulk TCP flow from host 0 to host 1 alone (plain
sockets, CUBIC, Linux's default, set on the socket: this machine's default
may be another, ``--tcp-cc`` picks; gloo's sockets take the machine's default,
``--gloo-cc`` another), switchml's dense
allreduce loop of ``--hosts`` ranks alone, the same loop while the TCP flow
runs, then gloo's allreduce loop alone and beside the flow.  The flow starts
``--settle`` seconds before the job (CUBIC fills the queues by then) and stops
when the job is done.  The flow crosses host 0's uplink and host 1's downlink,
which the job's ranks 0 and 1 use too.

Shares are of host 0's uplink over the job's timed calls (rank 0's span, one
monotonic clock for every namespace): the flow's is the bytes its receiver read
in that span over what the link carries in it; the job's is the uplink's bytes
(the veth counter, rank 0's report) less the flow's, over the same.  A call's
time is its slowest rank's.  ``--runs N`` makes N invocations, each on a testbed
of its own, and reports the median of each figure over them.  Prints a table
and writes JSON (--json), which also holds, to see how the two met: each
switchml rank's window, RTT estimate and recovery counters after each call
(``windows``; ``local_refusals``: rank 0's datagrams its host's queue refused),
host 0's uplink queue over the phase (``uplink_queue``: packets, drops, that is
refusals of both senders, and overlimits of its tbf), and the flow's TCP
counters over the phase (``tcp_counters``: retransmissions, recoveries,
timeouts, from the sender's namespace) and its socket's state every 0.1 s
(``tcp_states``, ``ss -tin``).  Root only
(namespaces).
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from switchml.bench.launch import OnTestbed, Roles  # noqa: E402
from switchml.testbed.core import add_host_queue_argument  # noqa: E402

TCP_PORT = 5201
SYSTEMS = ("switchml", "gloo")


def bytes_at(samples, t: float) -> float:
    """The receiver's byte count at monotonic time ``t``, interpolated."""
    times = [s[0] for s in samples]
    i = bisect.bisect_left(times, t)
    if i <= 0:
        return samples[0][1]
    if i >= len(samples):
        return samples[-1][1]
    (ta, ba), (tb, bb) = samples[i - 1], samples[i]
    return ba + (bb - ba) * (t - ta) / (tb - ta) if tb > ta else bb


class Flow:
    """The bulk TCP flow host 0 -> host 1, started and stopped around a phase."""

    def __init__(self, roles, tb, port, congestion_control):
        self.roles = roles
        host = tb.address(1)
        self.sink = roles.start(f"sink{port}", 1, "tcp_sink", {"host": host, "port": port})
        self.wait_for(f"sink{port}", "listening")
        self.sender = roles.start(f"send{port}", 0, "tcp_send",
                                  {"host": host, "port": port,
                                   "congestion_control": congestion_control}, stdin=True)
        self.port = port
        self.congestion_control = self.wait_for(f"send{port}", "connected")["congestion_control"]
        self.started = time.monotonic()

    def wait_for(self, name, event) -> dict:
        return self.roles.wait_for(name, event)

    def stop(self) -> list:
        self.sender.stdin.write("stop\n")
        self.sender.stdin.flush()
        samples = self.wait_for(f"sink{self.port}", "samples")["samples"]
        sent = self.wait_for(f"send{self.port}", "sent")
        self.counters, self.states = sent["counters"], sent.get("states")
        return samples


class Phases(Roles):
    """Roles whose messages a phase did not wait for are kept for the next reader."""

    def __init__(self, cluster, timeout):
        super().__init__(cluster, timeout)
        self.held: list = []

    def next(self):
        if self.held:
            return self.held.pop(0)
        return super().next()

    def wait_for(self, name, event) -> dict:
        """``name``'s next ``event`` message; others wait for ``next``."""
        for i, (got, msg) in enumerate(self.held):
            if got == name and msg["event"] == event:
                return self.held.pop(i)[1]
        while True:
            got, msg = super().next()
            if got == name and msg["event"] == event:
                return msg
            self.held.append((got, msg))


def tcp_alone(tb, cluster, args, port) -> dict:
    with Phases(cluster, args.timeout) as roles:
        flow = Flow(roles, tb, port, args.tcp_cc)
        time.sleep(args.settle + args.tcp_seconds)
        samples = flow.stop()
    t0, t1 = flow.started + args.settle, flow.started + args.settle + args.tcp_seconds
    moved = bytes_at(samples, t1) - bytes_at(samples, t0)
    return {"throughput_Mbps": moved * 8 / (t1 - t0) / 1e6,
            "share": moved * 8 / (t1 - t0) / tb.link_bps,
            "congestion_control": flow.congestion_control}


def uplink_queue(tb) -> dict:
    """Host 0's uplink queue (its tbf): packets sent, dropped (refused) and over
    the rate, so far."""
    from switchml.testbed import netns

    stats = netns.qdisc(tb.namespace(0), tb.ifname(0))[0]
    return {k: stats.get(k, 0) for k in ("packets", "bytes", "drops", "overlimits")}


def job(system, tb, cluster, args, switch, phase, port, beside: bool) -> dict:
    """``system``'s allreduce loop on every host, alone or beside the flow."""
    elements = int(args.mib * 2**20) // 4
    queue_before = uplink_queue(tb)
    case = {"id": 0, "elements": elements, "density": None, "sparse": False}
    if system == "gloo" and args.gloo_cc:  # gloo's sockets take their namespace's default
        for host in range(args.hosts):
            tb.run(host, ["sysctl", "-qw", f"net.ipv4.tcp_congestion_control={args.gloo_cc}"])
    with Phases(cluster, args.timeout) as roles:
        flow = None
        if beside:
            flow = Flow(roles, tb, port, args.tcp_cc)
            time.sleep(args.settle)
        for rank in range(args.hosts):
            common = {"rank": rank, "world": args.hosts, "ifname": tb.ifname(rank),
                      "warmup": args.warmup, "repeats": args.repeats, "check": False,
                      "seed": 0, "timeout": args.timeout, "cases": [case]}
            if system == "switchml":
                spec = dict(common, switch=switch, job=f"{phase}")
            else:
                spec = dict(common, master_addr=tb.address(0), master_port=29500 + port % 100,
                            block=256)
            roles.start(rank, rank, system, spec)
        reports, done = {}, 0
        while done < args.hosts:
            name, msg = roles.next()
            if msg["event"] == "case":
                reports[msg["rank"]] = msg
            elif msg["event"] == "done":
                done += 1
        samples = flow.stop() if flow else None
    queue_after = uplink_queue(tb)
    slowest = [max(call) for call in zip(*(reports[r]["times"] for r in range(args.hosts)))]
    t0, t1 = reports[0]["span"]
    span = t1 - t0
    capacity = tb.link_bps / 8 * span  # bytes host 0's uplink can carry in the span
    uplink = reports[0]["link_tx"] * args.repeats
    tcp = bytes_at(samples, t1) - bytes_at(samples, t0) if samples else 0.0
    result = {"median_s": statistics.median(slowest), "times_s": slowest, "span_s": span,
              "uplink_bytes": uplink, "tcp_bytes": tcp,
              "share": (uplink - tcp) / capacity, "tcp_share": tcp / capacity,
              "tcp_Mbps": tcp * 8 / span / 1e6,
              # host 0's uplink queue over the phase: what it refused, of whom
              "uplink_queue": {k: queue_after[k] - queue_before[k] for k in queue_after}}
    if system == "switchml":
        result["recovery"] = {k: statistics.mean(reports[r]["recovery"][k]
                                                 for r in range(args.hosts))
                              for k in reports[0]["recovery"]}
        result["retransmissions"] = statistics.mean(reports[r]["retransmissions"]
                                                    for r in range(args.hosts))
        result["windows"] = [reports[r].get("windows") for r in range(args.hosts)]
        result["local_refusals"] = sum(w["local_refusals"] for w in result["windows"][0] or ())
    if system == "gloo":
        result["gloo_congestion_control"] = tb.run(
            0, ["sysctl", "-n", "net.ipv4.tcp_congestion_control"], capture_output=True,
            text=True).stdout.strip()
    if flow:
        result["congestion_control"] = flow.congestion_control
        result["tcp_counters"] = flow.counters
        result["tcp_states"] = flow.states
    return result


#: The figures ``--runs`` takes the median of, per phase.
FIGURES = ("median_s", "share", "tcp_share", "tcp_Mbps", "throughput_Mbps")


def medians(runs: list) -> dict:
    """Each phase's figures, the median over ``runs`` (one invocation each)."""
    out: dict = {}
    for phase, first in runs[0].items():
        if isinstance(first, dict):
            out[phase] = {k: statistics.median(r[phase][k] for r in runs)
                          for k in FIGURES if k in first}
            for key in ("congestion_control", "gloo_congestion_control"):
                if key in first:
                    out[phase][key] = first[key]
    return out


ALLOWED_CC = "/proc/sys/net/ipv4/tcp_allowed_congestion_control"


def run(args) -> dict:
    """One invocation; with ``--gloo-cc``, which a network namespace may only make
    its default where the machine allows it to everyone, allowed for its span."""
    with open(ALLOWED_CC) as f:
        allowed = f.read().strip()
    if args.gloo_cc and args.gloo_cc not in allowed.split():
        with open(ALLOWED_CC, "w") as f:
            f.write(f"{allowed} {args.gloo_cc}")
    try:
        return run_on_a_testbed(args)
    finally:
        with open(ALLOWED_CC, "w") as f:
            f.write(allowed)


def run_on_a_testbed(args) -> dict:
    from switchml.testbed import Testbed

    with Testbed(args.hosts, args.link, mtu=args.mtu, queue=args.queue,
                 host_queue=args.host_queue, prefix="smlbtcp") as tb:
        cluster = OnTestbed(tb)
        host, port = cluster.switch_bind
        out: dict = {}
        with Roles(cluster, args.timeout) as switch_roles:
            switch_roles.start("switch", "switch", "switch",
                               {"host": host, "port": port, "options": {}}, stdin=True)
            _, msg = switch_roles.next()
            address = "{}:{}".format(*msg["address"])
            out["tcp_alone"] = tcp_alone(tb, cluster, args, TCP_PORT)
            for k, system in enumerate(args.systems):
                out[f"{system}_alone"] = job(system, tb, cluster, args, address,
                                             f"{system}-alone", TCP_PORT + 10 * k + 1, False)
                out[f"{system}_beside_tcp"] = job(system, tb, cluster, args, address,
                                                  f"{system}-beside", TCP_PORT + 10 * k + 2, True)
    return out


def format_table(result) -> str:
    lines = ["| job beside the flow | job alone | job beside TCP | job's share of host 0's "
             "uplink | TCP alone | TCP beside the job |", "|---|---|---|---|---|---|"]
    alone = result["tcp_alone"]
    for system in result["settings"]["systems"]:
        a, b = result[f"{system}_alone"], result[f"{system}_beside_tcp"]
        lines.append(f"| {system} | {a['median_s']:.3f} s | {b['median_s']:.3f} s | "
                     f"{b['share']:.0%} | {alone['throughput_Mbps']:.0f} Mbit/s | "
                     f"{b['tcp_Mbps']:.0f} Mbit/s ({b['tcp_share']:.0%}) |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hosts", type=int, default=4)
    p.add_argument("--link", default="1gbit")
    p.add_argument("--mtu", type=int, default=9000)
    p.add_argument("--queue", default="256kb")
    add_host_queue_argument(p)
    p.add_argument("--mib", type=float, default=64.0)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=8)
    p.add_argument("--settle", type=float, default=2.0,
                   help="seconds the flow runs before the job starts")
    p.add_argument("--tcp-seconds", type=float, default=5.0,
                   help="seconds the flow alone is measured")
    p.add_argument("--tcp-cc", default="cubic",
                   help="the flow's TCP congestion control (default: cubic)")
    p.add_argument("--gloo-cc", default=None,
                   help="gloo's TCP congestion control (default: the machine's, "
                        "net.ipv4.tcp_congestion_control)")
    p.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--runs", type=int, default=1,
                   help="invocations, each on a testbed of its own (default: 1)")
    args = p.parse_args(argv)
    from switchml.testbed.netns import parse_rate

    runs = []
    for i in range(args.runs):
        runs.append(run(args))
        if args.runs > 1:
            print(f"run {i + 1} of {args.runs}:")
            print(format_table(dict(runs[-1], settings=vars(args))), flush=True)
    result = {"command": "python bench/beside_tcp.py " + " ".join(sys.argv[1:] if argv is None
                                                                   else argv),
              "settings": vars(args), "link_Gbps": parse_rate(args.link) / 1e9,
              **(runs[0] if args.runs == 1 else medians(runs))}
    if args.runs > 1:
        result["runs"] = runs
        print(f"median of {args.runs} runs:")
    print(f"TCP congestion control: the flow's {result['tcp_alone']['congestion_control']}"
          + (f", gloo's {result['gloo_beside_tcp'].get('gloo_congestion_control')}"
             if "gloo_beside_tcp" in result else ""))
    print(format_table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
