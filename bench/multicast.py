"""Results to n workers: one IP multicast datagram against n unicast ones.

    python bench/multicast.py --receivers 4 --mib 64 --size 8320            # loopback
    python bench/multicast.py --testbed --receivers 4 --link 1gbit --mtu 9000 --size 8320

A switch sends every result to each of the job's n workers.  Unicast costs the
sender n system calls and n copies per result; IP multicast costs one, and the
network replicates it: on loopback the kernel, on the testbed the Linux bridge
(as a switch's multicast engine does).  Here a sender streams ``--mib`` of
``--size``-byte datagrams to n receivers either way, paced by nothing (loopback)
or by the links (testbed), and we report the sender's CPU per MiB delivered to
each receiver, the time, and what each receiver got.  Prints a table and writes
JSON (--json).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import struct
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from switchml.bench.common import at_least, within  # noqa: E402

GROUP = "239.77.0.1"
PORT = 7399


def receiver(bind_ip: str, group: str | None, port: int, expected: int, idle: float) -> None:
    """Count datagrams until ``expected`` arrived or ``idle`` seconds pass without one."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 32 << 20)
    if group:
        s.bind((group, port))
        s.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP,
                     struct.pack("4s4s", socket.inet_aton(group), socket.inet_aton(bind_ip)))
    else:
        s.bind((bind_ip, port))
    print("ready", flush=True)
    s.settimeout(idle)
    got = nbytes = 0
    buf = bytearray(65536)
    start = None
    try:
        while got < expected:
            n = s.recv_into(buf)
            start = start or time.monotonic()
            got += 1
            nbytes += n
    except TimeoutError:
        pass
    print(json.dumps({"datagrams": got, "bytes": nbytes}), flush=True)


def sender(mode: str, targets: list, size: int, count: int, iface_ip: str | None) -> dict:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 32 << 20)
    if mode == "multicast":
        s.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_TTL, 1)
        s.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_LOOP, 1)
        if iface_ip:
            s.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF, socket.inet_aton(iface_ip))
        targets = [(GROUP, PORT)]
    payload = bytes(size)
    cpu0, t0 = time.process_time(), time.monotonic()
    sent = 0
    for _ in range(count):
        for target in targets:
            while True:
                try:
                    s.sendto(payload, target)
                    break
                except BlockingIOError:  # the queue is full: wait for room, as a switch would
                    time.sleep(0.0001)
            sent += 1
    return {"cpu_s": time.process_time() - cpu0, "wall_s": time.monotonic() - t0,
            "datagrams_sent": sent}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--receivers", type=at_least(1), default=4)
    p.add_argument("--mib", type=within(0, above_low=True), default=64.0,
                   help="data each receiver gets")
    p.add_argument("--size", type=at_least(1), default=8320, help="datagram bytes")
    p.add_argument("--testbed", action="store_true", help="receivers in host namespaces")
    p.add_argument("--link", default="1gbit")
    p.add_argument("--mtu", type=at_least(68), default=None)
    p.add_argument("--json", default=None)
    p.add_argument("--role", choices=["receiver", "sender"], help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.role == "receiver":
        spec = json.loads(args.spec)
        receiver(spec["bind"], spec["group"], spec["port"], spec["expected"], spec["idle"])
        return 0
    if args.role == "sender":
        spec = json.loads(args.spec)
        print(json.dumps(sender(spec["mode"], [tuple(t) for t in spec["targets"]],
                                spec["size"], spec["count"], spec["iface"])), flush=True)
        return 0

    if args.size > 65507:
        p.error(f"--size {args.size}: a UDP datagram holds 65507 bytes at most")
    count = int(args.mib * 2**20) // args.size
    if count < 1:
        p.error(f"--mib {args.mib:g}: less than one datagram of {args.size} bytes")
    rows = []
    if args.testbed:
        from switchml.testbed import Testbed
        tb = Testbed(args.receivers, args.link, mtu=args.mtu, prefix="smlmcast").up()
    else:
        tb = None
    try:
        for mode in ("unicast", "multicast"):
            procs = []
            targets = []
            for r in range(args.receivers):
                ip = tb.address(r) if tb else "127.0.0.1"
                port = PORT if tb else PORT + 1 + r
                targets.append((ip, port))
                spec = {"bind": ip, "group": GROUP if mode == "multicast" else None,
                        "port": PORT if mode == "multicast" else port, "expected": count,
                        "idle": 2.0}
                cmd = [sys.executable, __file__, "--role", "receiver", "--spec", json.dumps(spec)]
                if tb:
                    if mode == "multicast":  # the group is reached through the host's veth
                        subprocess.run(tb.command(r, ["ip", "route", "replace", "224.0.0.0/4",
                                                      "dev", tb.ifname(r)]), check=True)
                    procs.append(tb.popen(r, cmd, stdout=subprocess.PIPE, text=True))
                else:
                    procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True))
            for proc in procs:
                proc.stdout.readline()  # ready
            spec = {"mode": mode, "targets": targets, "size": args.size, "count": count,
                    "iface": tb.switch_address if tb else "127.0.0.1"}
            cmd = [sys.executable, __file__, "--role", "sender", "--spec", json.dumps(spec)]
            if tb:
                if mode == "multicast":
                    subprocess.run(tb.command("switch", ["ip", "route", "replace", "224.0.0.0/4",
                                                         "dev", tb.bridge]), check=True)
                out = subprocess.run(tb.command("switch", cmd), capture_output=True, text=True,
                                     check=True).stdout
            else:
                out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            sent = json.loads(out.strip().splitlines()[-1])
            got = [json.loads(proc.communicate()[0].strip().splitlines()[-1]) for proc in procs]
            delivered_mib = min(g["bytes"] for g in got) / 2**20
            rows.append({"mode": mode, **sent, "received_datagrams": [g["datagrams"] for g in got],
                         "sender_cpu_ms_per_mib_each": 1e3 * sent["cpu_s"] / max(delivered_mib,
                                                                                 1e-9),
                         "delivered_share": min(g["datagrams"] for g in got) / count})
    finally:
        if tb:
            tb.down()
    where = f"testbed {args.link} mtu {args.mtu or 1500}" if tb else "loopback"
    print(f"{where}: {args.receivers} receivers, {args.mib:g} MiB each in {args.size}-byte "
          f"datagrams")
    for r in rows:
        print(f"{r['mode']:>9}: sender CPU {r['cpu_s'] * 1e3:8.1f} ms "
              f"({r['sender_cpu_ms_per_mib_each']:.2f} ms per MiB delivered to each), "
              f"wall {r['wall_s']:.3f} s, "
              f"delivered {r['delivered_share']:.1%} to the worst receiver")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": "python bench/multicast.py " + " ".join(sys.argv[1:]),
                       "where": where, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    from switchml.testbed.core import signals_end_the_run

    with signals_end_the_run():  # TERM or HUP: the testbed goes, as on Ctrl-C
        sys.exit(main())
