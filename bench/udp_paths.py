"""What a byte costs on each way of moving UDP datagrams, in CPU, sender and receiver.

    python bench/udp_paths.py --mib 256                      # loopback
    python bench/udp_paths.py --mib 256 --testbed --mtu 9000  # two namespaces, root

The switch and the workers spend most of their busy time in ``sendto`` and
``recv``. This measures the ways those calls could move the
same bytes, one sender process to one receiver process, unshaped:

* ``datagram``: 65300-byte datagrams, one per call (IP-fragmented where the
  MTU is smaller);
* ``mtu``: datagrams of one MTU's payload, one per call;
* ``gso``: the same MTU-sized datagrams, as many as fit in 65300 bytes per
  ``sendto`` with the UDP_SEGMENT option, received with UDP_GRO (several per
  ``recvmsg``).

It reports each side's CPU time (user + system, from ``getrusage``) per MiB, the
share of the bytes that arrived (UDP drops what the receiver cannot keep up
with) and the calls per MiB on each side. JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import socket
import subprocess
import sys
import time

from switchml import wire
from switchml.bench.common import at_least, within
from switchml.netutil import enlarge_buffers

SOL_UDP = 17
UDP_SEGMENT = 103  # linux/udp.h; Python's socket module has no name for them
UDP_GRO = 104
PORT = 7390
#: switchml's own datagram: a header, 63 lane records and 16128 int32 values.
BIG = wire.packet_size(63, 16128)


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def receive(bind: str, mode: str, expected: int, quiet: float) -> None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    enlarge_buffers(sock, 256 << 20)  # as the switch and workers do: fewer drops
    if mode == "gso":
        sock.setsockopt(SOL_UDP, UDP_GRO, 1)
    sock.bind((bind, PORT))
    sock.settimeout(quiet)
    buf = bytearray(1 << 16)
    print("ready", flush=True)
    got = calls = 0
    cpu0 = _cpu()
    try:
        while got < expected:
            if mode == "gso":
                n, _, _, _ = sock.recvmsg_into([buf], socket.CMSG_SPACE(4))
            else:
                n = sock.recv_into(buf)
            got += n
            calls += 1
    except TimeoutError:
        pass  # the rest was dropped: nothing more comes
    print(json.dumps({"bytes": got, "calls": calls, "cpu_s": _cpu() - cpu0}), flush=True)


def send(dest: str, mode: str, total: int, mtu: int) -> None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    enlarge_buffers(sock, 256 << 20)
    payload = mtu - 28  # IPv4 and UDP headers
    if mode == "gso":
        sock.setsockopt(SOL_UDP, UDP_SEGMENT, payload)
        size = BIG // payload * payload
    else:
        size = BIG if mode == "datagram" else payload
    data = bytes(size)
    sock.connect((dest, PORT))
    sent = calls = 0
    cpu0, t0 = _cpu(), time.perf_counter()
    while sent < total:
        sent += sock.send(data)
        calls += 1
    print(json.dumps({"bytes": sent, "calls": calls, "cpu_s": _cpu() - cpu0,
                      "wall_s": time.perf_counter() - t0}), flush=True)


def run_pair(receiver_cmd, sender_cmd) -> tuple[dict, dict]:
    rx = subprocess.Popen(receiver_cmd, stdout=subprocess.PIPE, text=True)
    try:
        if rx.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the receiver failed (exit code {rx.wait(30)})")
        done = subprocess.run(sender_cmd, capture_output=True, text=True)
        if done.returncode:  # its own error, not a CalledProcessError that hides it
            raise RuntimeError(f"the sender failed (exit code {done.returncode}): "
                               f"{done.stderr.strip()[-2000:]}")
        tx = json.loads(done.stdout)
        got = json.loads(rx.stdout.readline())
        rx.wait(timeout=30)
    finally:  # (a failure, TERM or Ctrl-C) the receiver does not wait on
        if rx.poll() is None:
            rx.kill()
            rx.wait()
    return tx, got


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=within(0, above_low=True), default=256)
    p.add_argument("--modes", nargs="+", choices=["datagram", "mtu", "gso"],
                   default=["datagram", "mtu", "gso"])
    p.add_argument("--testbed", action="store_true", help="two namespaces over a veth pair")
    p.add_argument("--mtu", type=at_least(68), default=None,
                   help="MTU (testbed: the links'; loopback: the segment size; default 9000)")
    p.add_argument("--repeats", type=at_least(1), default=3)
    p.add_argument("--out", default=None)
    p.add_argument("--role", choices=["send", "receive"], help=argparse.SUPPRESS)
    p.add_argument("--peer", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.mtu and args.mtu > 65535:
        p.error(f"--mtu {args.mtu}: give 68 to 65535")
    total = int(args.mib * 2**20)
    mtu = args.mtu or 9000
    here = [sys.executable, os.path.abspath(__file__)]
    if args.role == "receive":
        return receive(args.peer, args.modes[0], total, 2.0)
    if args.role == "send":
        return send(args.peer, args.modes[0], total, mtu)

    rows = []
    if args.testbed:
        from switchml.testbed import Testbed
        bed = Testbed(hosts=2, link=None, mtu=args.mtu, prefix="udppaths").up()
        def where(host, argv): return bed.command(host, argv)
        rx_addr = bed.address(1)
    else:
        bed = None
        def where(host, argv): return argv
        rx_addr = "127.0.0.1"
    try:
        for mode in args.modes:
            for _ in range(args.repeats):
                common = ["--mib", str(args.mib), "--modes", mode, "--mtu", str(mtu)]
                tx, got = run_pair(
                    where(1, here + common + ["--role", "receive", "--peer", rx_addr]),
                    where(0, here + common + ["--role", "send", "--peer", rx_addr]))
                rows.append({"mode": mode, "sender": tx, "receiver": got})
                mib_sent, mib_got = tx["bytes"] / 2**20, max(got["bytes"], 1) / 2**20
                print(f"{mode:>9}  sender {1e6 * tx['cpu_s'] / mib_sent:8.0f} us/MiB "
                      f"{tx['calls'] / mib_sent:7.1f} calls/MiB   receiver "
                      f"{1e6 * got['cpu_s'] / mib_got:8.0f} us/MiB "
                      f"{got['calls'] / mib_got:7.1f} calls/MiB   arrived "
                      f"{100 * got['bytes'] / tx['bytes']:5.1f}%", flush=True)
    finally:
        if bed is not None:
            bed.down()
    result = {"command": " ".join(["python", "bench/udp_paths.py"] + sys.argv[1:]),
              "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
              "mib": args.mib, "mtu": mtu, "testbed": args.testbed, "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    from switchml.testbed.core import signals_end_the_run

    with signals_end_the_run():  # TERM or HUP: the testbed goes, as on Ctrl-C
        main()
