"""Is the testbed's loss per datagram? And what does a link carry? (root, ~30 s)

    python bench/testbed_loss.py --loss 0.01 --mtu 1500     # loss per datagram
    python bench/testbed_loss.py --rate --link 1gbit --mtu 9000   # link throughput
    ... --udp-offload     # GSO runs cross the links whole (no per-datagram loss)

Loss: one host sends ``--batches`` runs of datagrams, each run one ``sendmsg``
with UDP_SEGMENT (as switchml's workers and switch send), to the switch
namespace (uplink) and back (downlink). The receiver counts, per run, the
datagrams that arrived. With loss per datagram the lost ones per run follow a
binomial distribution (dispersion index, variance / mean of the lost per run,
near 1); a rule that drops whole GSO runs gives an index near the run length
and lost datagrams far above the rule's counter.

Rate: a TCP stream and a UDP GSO stream, each way, through the shaped links;
the receiver's bytes over its own clock.
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

from switchml.netutil import enlarge_buffers

SOL_UDP = 17
UDP_SEGMENT = 103
PORT = 7391
HEADER = struct.Struct("!II")  # run, index in the run


def _snmp_udp(name: str) -> int:
    with open("/proc/net/snmp") as f:
        lines = [line.split() for line in f if line.startswith("Udp:")]
    return int(lines[1][lines[0].index(name)])


def receive(bind: str, runs: int, quiet: float) -> None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    enlarge_buffers(sock, 64 << 20)
    sock.bind((bind, PORT))
    errors0 = _snmp_udp("RcvbufErrors")
    print("ready", flush=True)
    got = [0] * runs
    buf = bytearray(1 << 16)
    sock.settimeout(10.0)  # the first datagram
    try:
        while True:
            n = sock.recv_into(buf)
            sock.settimeout(quiet)
            if n >= HEADER.size:
                run, _ = HEADER.unpack_from(buf)
                if run < runs:
                    got[run] += 1
    except TimeoutError:
        pass
    print(json.dumps({"got": got, "rcvbuf_errors": _snmp_udp("RcvbufErrors") - errors0}),
          flush=True)


def send(dest: str, runs: int, per_run: int, payload: int, gap: float) -> None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    enlarge_buffers(sock, 64 << 20)
    sock.setsockopt(SOL_UDP, UDP_SEGMENT, payload)
    sock.connect((dest, PORT))
    body = bytearray(per_run * payload)
    t0 = time.perf_counter()
    for run in range(runs):
        for i in range(per_run):
            HEADER.pack_into(body, i * payload, run, i)
        sock.send(body)
        # Pace: the receiver (one Python process) must keep up, or its socket's
        # drops would count as loss.
        deadline = t0 + (run + 1) * gap
        while time.perf_counter() < deadline:
            pass


def stream_receive(bind: str, proto: str, quiet: float) -> None:
    kind = socket.SOCK_STREAM if proto == "tcp" else socket.SOCK_DGRAM
    sock = socket.socket(socket.AF_INET, kind)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    enlarge_buffers(sock, 16 << 20)
    sock.bind((bind, PORT))
    if proto == "tcp":
        sock.listen(1)
        print("ready", flush=True)
        conn, _ = sock.accept()
    else:
        print("ready", flush=True)
        conn = sock
    conn.settimeout(10.0)
    buf = bytearray(1 << 20)
    total, first, last = 0, 0.0, 0.0
    try:
        while True:
            n = conn.recv_into(buf)
            if n == 0:
                break
            last = time.perf_counter()
            if not total:
                first = last
            total += n
            conn.settimeout(quiet)
    except TimeoutError:
        pass
    print(json.dumps({"bytes": total, "seconds": last - first}), flush=True)


def stream_send(dest: str, proto: str, seconds: float, payload: int) -> None:
    if proto == "tcp":
        sock = socket.create_connection((dest, PORT), timeout=30)
        data = bytes(1 << 16)
    else:
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.setsockopt(SOL_UDP, UDP_SEGMENT, payload)
        sock.connect((dest, PORT))
        data = bytes(min(64, 65507 // payload) * payload)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        sock.sendall(data) if proto == "tcp" else sock.send(data)
    sock.close()


def _pair(tb, rx_host, rx_argv, tx_host, tx_argv) -> dict:
    rx = tb.popen(rx_host, rx_argv, stdout=subprocess.PIPE, text=True)
    assert rx.stdout.readline().strip() == "ready"
    tb.run(tx_host, tx_argv, timeout=120)
    out = json.loads(rx.stdout.readline())
    rx.wait(timeout=30)
    return out


def measure_loss(tb, args, here) -> list:
    payload = (tb.mtu or 1500) - 28
    per_run = min(64, 65507 // payload)
    rows = []
    for name, rx_host, tx_host in (("uplink", "switch", 0), ("downlink", 0, "switch")):
        ns = tb.namespace(rx_host)
        before = tb.loss_drops()[ns]
        out = _pair(tb, rx_host, here + ["--role", "receive", "--peer", tb.address(rx_host),
                                         "--batches", str(args.batches)],
                    tx_host, here + ["--role", "send", "--peer", tb.address(rx_host),
                                     "--batches", str(args.batches), "--per-run", str(per_run),
                                     "--payload", str(payload), "--gap", str(args.gap)])
        counted = tb.loss_drops()[ns] - before
        lost = [per_run - g for g in out["got"]]
        sent = per_run * len(lost)
        mean = sum(lost) / len(lost)
        var = sum((x - mean) ** 2 for x in lost) / len(lost)
        p = sum(lost) / sent
        hist: dict = {}
        for x in lost:
            hist[x] = hist.get(x, 0) + 1
        dispersion = var / (per_run * p * (1 - p)) if 0 < p < 1 else None
        rows.append({"direction": name, "datagrams_per_run": per_run, "runs": len(lost),
                     "sent": sent, "lost": sum(lost), "rule_counter": counted,
                     "rcvbuf_errors": out["rcvbuf_errors"], "loss": p,
                     "dispersion": dispersion,
                     "runs_lost_whole": hist.get(per_run, 0),
                     "lost_per_run_histogram": dict(sorted(hist.items()))})
        print(f"{name:>8}: {sent} datagrams in {len(lost)} runs of {per_run}: lost "
              f"{sum(lost)} ({100 * p:.2f}%), rule counter {counted}, rcvbuf errors "
              f"{out['rcvbuf_errors']}, whole runs lost {hist.get(per_run, 0)}, "
              f"dispersion {dispersion if dispersion is None else round(dispersion, 2)}, "
              f"lost per run {dict(sorted(hist.items()))}", flush=True)
    return rows


def measure_rate(tb, args, here) -> list:
    payload = (tb.mtu or 1500) - 28
    rows = []
    for proto in ("tcp", "udp"):
        for name, rx_host, tx_host in (("uplink", "switch", 0), ("downlink", 0, "switch")):
            out = _pair(tb, rx_host, here + ["--role", "stream-receive", "--proto", proto,
                                             "--peer", tb.address(rx_host)],
                        tx_host, here + ["--role", "stream-send", "--proto", proto,
                                         "--peer", tb.address(rx_host),
                                         "--seconds", str(args.seconds),
                                         "--payload", str(payload)])
            bps = 8 * out["bytes"] / out["seconds"] if out["seconds"] else 0.0
            rows.append({"proto": proto, "direction": name, "bits_per_s": bps, **out})
            print(f"{proto} {name:>8}: {bps / 1e6:7.1f} Mbit/s "
                  f"({out['bytes']} bytes in {out['seconds']:.2f} s)", flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--loss", type=float, default=0.01)
    p.add_argument("--link", default=None, help="link rate (default: unshaped for loss, "
                                                "1gbit for --rate)")
    p.add_argument("--mtu", type=int, default=1500)
    p.add_argument("--batches", type=int, default=2000, help="GSO runs per direction")
    p.add_argument("--gap", type=float, default=0.0005, help="seconds between runs")
    p.add_argument("--rate", action="store_true", help="measure link throughput instead")
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--udp-offload", action="store_true",
                   help="leave the veths' UDP segmentation offload on (GSO runs cross whole)")
    p.add_argument("--prefix", default="losstb")
    p.add_argument("--out", default=None)
    p.add_argument("--role", help=argparse.SUPPRESS)
    p.add_argument("--peer", help=argparse.SUPPRESS)
    p.add_argument("--proto", default="tcp", help=argparse.SUPPRESS)
    p.add_argument("--per-run", type=int, help=argparse.SUPPRESS)
    p.add_argument("--payload", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.role == "receive":
        return receive(args.peer, args.batches, 1.0)
    if args.role == "send":
        return send(args.peer, args.batches, args.per_run, args.payload, args.gap)
    if args.role == "stream-receive":
        return stream_receive(args.peer, args.proto, 1.0)
    if args.role == "stream-send":
        return stream_send(args.peer, args.proto, args.seconds, args.payload)

    from switchml.testbed import Testbed
    here = [sys.executable, os.path.abspath(__file__)]
    link = args.link or ("1gbit" if args.rate else None)
    with Testbed(hosts=1, link=link, mtu=args.mtu, loss=0.0 if args.rate else args.loss,
                 prefix=args.prefix, udp_offload=args.udp_offload) as tb:
        rows = measure_rate(tb, args, here) if args.rate else measure_loss(tb, args, here)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": " ".join(["python", "bench/testbed_loss.py"] + sys.argv[1:]),
                       "link": link, "mtu": args.mtu, "udp_offload": args.udp_offload,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
