"""Programs the testbed tests run inside namespaces: ``python testbed_helpers.py ROLE ARGS``.

- ``worker SWITCH RANK WORLD SIZE DTYPE OUT``: one switchml rank; saves its result to
  OUT.npy and its counters to OUT.json.
- ``repeat SWITCH RANK WORLD SIZE COUNT OUT``: COUNT allreduces of fresh inputs
  (``repeated_input``), dense and sparse in turn; saves the SHA-256 of all results
  and the counters to OUT.json.
- ``idle SWITCH RANK WORLD``: join a job, allreduce once, print "ready", wait for a
  line on stdin, allreduce again and print the outcome as JSON.
- ``sink HOST PORT``: accept one TCP connection, print bytes received and seconds
  from first to last byte.
- ``source HOST PORT BYTES``: connect and send BYTES.
- ``gso_receive HOST PORT RUNS``: count UDP datagrams per run (the first 4 bytes of
  each), from "ready" until 1 s passes without one; print the counts and the
  socket's drops (RcvbufErrors) as JSON.
- ``gso_send HOST PORT RUNS PER_RUN PAYLOAD``: send RUNS runs of PER_RUN datagrams
  of PAYLOAD bytes, each run one ``send`` with UDP_SEGMENT (as switchml sends).
- ``udp_count HOST PORT SECONDS``: print "ready", then the UDP bytes that arrive
  from each source port over SECONDS, as JSON.
- ``udp_offer HOST PORT SPORT SECONDS RATE``: send 1400-byte datagrams from source
  port SPORT for SECONDS, at RATE bits/s (0: as fast as the process can), with a
  send buffer larger than a link's queue.
- ``gloo RANK WORLD SIZE``: one torch gloo rank (MASTER_ADDR, MASTER_PORT and
  GLOO_SOCKET_IFNAME from the environment); prints its all_reduce result's sum.
"""

import json
import socket
import sys
import time

import numpy as np

SO_SNDBUFFORCE = 32  # Linux; the socket module does not name it


def make_input(rank, size, dtype):
    rng = np.random.default_rng([7, rank, size])
    if dtype == "int32":
        return rng.integers(-(2**20), 2**20, size, dtype=np.int32)
    return rng.standard_normal(size).astype(np.float32)


def worker(switch, rank, world, size, dtype, out):
    import switchml

    with switchml.Worker(switch, int(rank), int(world), job="testbed", timeout=30) as w:
        result = w.allreduce(make_input(int(rank), int(size), dtype))
        counters = w.counters
    np.save(out + ".npy", result)
    with open(out + ".json", "w") as f:
        json.dump(counters, f)


def idle(switch, rank, world):
    import switchml

    with switchml.Worker(switch, int(rank), int(world), job="idle", timeout=30) as w:
        w.allreduce(np.ones(1000, np.float32))
        print("ready", flush=True)
        sys.stdin.readline()
        try:
            w.allreduce(np.ones(1000, np.float32))
            outcome = {"error": None}
        except switchml.SwitchMLError as exc:
            outcome = {"error": type(exc).__name__, "message": str(exc),
                       "missing": getattr(exc, "missing_ranks", None)}
        print(json.dumps(outcome), flush=True)


def repeated_input(rank, size, i):
    """Input ``i`` of a rank: normal floats, with most blocks zeroed on odd ``i``."""
    rng = np.random.default_rng([11, rank, size, i])
    x = rng.standard_normal(size).astype(np.float32) * np.float32(2.0 ** rng.integers(-6, 6))
    if i % 2:
        keep = rng.random(-(-size // 256)) < 0.3
        x[np.repeat(~keep, 256)[:size]] = 0
    return x


def repeat(switch, rank, world, size, count, out):
    import hashlib

    import switchml

    digest = hashlib.sha256()
    with switchml.Worker(switch, int(rank), int(world), job="repeat", timeout=30) as w:
        for i in range(int(count)):
            digest.update(w.allreduce(repeated_input(int(rank), int(size), i),
                                      sparse=bool(i % 2)).tobytes())
        counters = w.counters
    with open(out + ".json", "w") as f:
        json.dump({"sha256": digest.hexdigest(), "counters": counters}, f)


def sink(host, port):
    with socket.create_server((host, int(port))) as srv:
        print("listening", flush=True)
        conn, _ = srv.accept()
        total, first, last = 0, None, None
        with conn:
            while True:
                data = conn.recv(1 << 20)
                if not data:
                    break
                last = time.perf_counter()
                first = first or last
                total += len(data)
    print(json.dumps({"bytes": total, "seconds": (last - first) if total else 0.0}), flush=True)


def source(host, port, nbytes):
    chunk = b"x" * (1 << 16)
    left = int(nbytes)
    with socket.create_connection((host, int(port)), timeout=30) as conn:
        while left > 0:
            conn.sendall(chunk[:left])
            left -= len(chunk)


def _rcvbuf_errors():
    with open("/proc/net/snmp") as f:
        lines = [line.split() for line in f if line.startswith("Udp:")]
    return int(lines[1][lines[0].index("RcvbufErrors")])


def gso_receive(host, port, runs):
    from switchml.netutil import enlarge_buffers

    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    enlarge_buffers(sock, 64 << 20)  # holds every run: no drop of its own
    sock.bind((host, int(port)))
    errors = _rcvbuf_errors()
    got = [0] * int(runs)
    buf = bytearray(1 << 16)
    print("ready", flush=True)
    sock.settimeout(30)
    try:
        while True:
            if sock.recv_into(buf) >= 4:
                run = int.from_bytes(buf[:4], "big")
                if run < len(got):
                    got[run] += 1
            sock.settimeout(1.0)
    except TimeoutError:
        pass
    print(json.dumps({"got": got, "rcvbuf_errors": _rcvbuf_errors() - errors}), flush=True)


def gso_send(host, port, runs, per_run, payload):
    from switchml.netutil import enlarge_buffers

    per_run, payload = int(per_run), int(payload)
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    enlarge_buffers(sock, 64 << 20)
    sock.setsockopt(socket.IPPROTO_UDP, 103, payload)  # UDP_SEGMENT
    sock.connect((host, int(port)))
    body = bytearray(per_run * payload)
    for run in range(int(runs)):
        for i in range(per_run):
            body[i * payload:i * payload + 4] = run.to_bytes(4, "big")
        sock.send(body)
        time.sleep(0.0005)  # the receiver, one Python process, keeps up


def udp_count(host, port, seconds):
    received: dict = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind((host, int(port)))
        sock.settimeout(0.1)
        print("ready", flush=True)
        end = time.monotonic() + float(seconds)
        while time.monotonic() < end:
            try:
                data, (_, sport) = sock.recvfrom(2048)
            except TimeoutError:
                continue
            received[sport] = received.get(sport, 0) + len(data)
    print(json.dumps(received), flush=True)


def udp_offer(host, port, sport, seconds, rate):
    payload, rate = b"x" * 1400, float(rate)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        # a send buffer larger than the queue: the sender is never held back by
        # its own socket, so the queue, not the buffer, decides (root: FORCE)
        sock.setsockopt(socket.SOL_SOCKET, SO_SNDBUFFORCE, 4 << 20)
        sock.bind(("", int(sport)))
        start = time.monotonic()
        sent = 0
        while (now := time.monotonic()) < start + float(seconds):
            if rate and sent * 8 > rate * (now - start):
                time.sleep(0.001)
                continue
            try:
                sock.sendto(payload, (host, int(port)))
            except OSError:  # ENOBUFS: the queue is full, which is the point
                pass
            sent += len(payload)


def gloo(rank, world, size):
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=int(rank), world_size=int(world))
    t = torch.arange(int(size), dtype=torch.float32) * (int(rank) + 1)
    dist.all_reduce(t)
    dist.barrier()
    dist.destroy_process_group()
    print(json.dumps({"sum": float(t.double().sum())}), flush=True)


if __name__ == "__main__":
    {"worker": worker, "repeat": repeat, "idle": idle, "sink": sink, "source": source,
     "gloo": gloo, "gso_receive": gso_receive, "gso_send": gso_send,
     "udp_count": udp_count, "udp_offer": udp_offer}[sys.argv[1]](*sys.argv[2:])
