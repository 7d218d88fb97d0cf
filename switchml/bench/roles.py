"""The processes of a benchmark run, one role each:
``python -m switchml.bench.roles ROLE SPEC``.

Each runs where the launcher puts it (on loopback, or inside a testbed namespace
through ``ip netns exec``), reads its settings from the JSON ``SPEC`` and reports
on stdout, one JSON object per line:

- ``switch``: a switchml ``Switch``; prints ``listening`` with its address, then on
  a ``stop`` line (or end of input) prints its ``stats`` and exits.
- ``switchml``: one ``Worker`` rank; runs every case (warm-up, then timed repeats)
  and prints one ``case`` line per case: times, worker counters, link bytes, and
  the CPU and run-queue seconds of its threads a call (``scheduling``).
- ``gloo``: one torch.distributed gloo rank; same cases, same tensors.
- ``tcp_sink`` and ``tcp_send``: a bulk TCP flow with plain sockets (the
  namespace's default congestion control, CUBIC on Linux), the competing traffic
  of bench/beside_tcp.py.  The sink prints ``listening``, counts what it reads and
  prints ``samples`` (monotonic time, bytes so far, every 10 ms) when the flow
  ends; the sender (with the congestion control its spec names, if any: Linux
  lets root pick any the kernel has) prints ``connected`` with its congestion
  control and sends until a ``stop`` line (or end of input).

Both job roles report the ``span`` of their timed calls in ``time.monotonic()``
seconds (one clock for every namespace of the machine), so that a launcher can
say what another flow carried meanwhile.

Rank 0 checks every result against the exact sum of all ranks' inputs, which it
rebuilds from their seeds; every rank prints a digest so that the launcher can
check they agree bit for bit.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time

import numpy as np

from .common import make_tensor


def emit(**message) -> None:
    print(json.dumps(message), flush=True)


def link_bytes(ifname):
    """(sent, received) bytes of ``ifname`` in this network namespace, or None."""
    if not ifname:
        return None
    base = f"/sys/class/net/{ifname}/statistics/"
    with open(base + "tx_bytes") as tx, open(base + "rx_bytes") as rx:
        return int(tx.read()), int(rx.read())


def scheduling():
    """(CPU seconds, seconds runnable but waiting for a core) of this process's
    threads so far, from Linux's ``/proc/self/task/*/schedstat``; None elsewhere.
    Where two cores carry every host of a testbed, the second is the time a rank
    wanted to run and could not."""
    cpu = wait = 0
    try:
        for task in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{task}/schedstat") as f:
                    ran, waited, _ = f.read().split()
            except FileNotFoundError:  # a thread that ended meanwhile
                continue
            cpu, wait = cpu + int(ran), wait + int(waited)
    except OSError:
        return None
    return cpu / 1e9, wait / 1e9


def per_call(before, after, calls):
    """``{"cpu_s": ..., "runqueue_wait_s": ...}`` a call between two ``scheduling()``."""
    if before is None or after is None or not calls:
        return {"cpu_s": None, "runqueue_wait_s": None}
    return {"cpu_s": (after[0] - before[0]) / calls,
            "runqueue_wait_s": (after[1] - before[1]) / calls}


def inputs_of_all(spec, case, block):
    return [make_tensor(r, case["elements"], case.get("density"), block, spec["seed"])
            for r in range(spec["world"])]


def switch_role(spec) -> None:
    from .. import Switch

    with Switch(spec["host"], spec["port"], **spec.get("options", {})) as sw:
        assert sw.address is not None  # bound once started
        # the XDP programs' time, which no process's CPU time counts, counted by
        # the kernel while the switch serves (its stats' program_time_s)
        counting = None
        if sw.data_plane == "xdp":
            from ..switch.xdp import loader

            counting = loader.count_run_time()
        try:
            emit(event="listening", address=list(sw.address))
            for line in sys.stdin:
                if line.strip() == "stop":
                    break
            emit(event="stats", stats=sw.stats())
        finally:
            if counting is not None:
                os.close(counting)


def _time(fn, warmup, repeats, before=None):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


#: The counters that say how a call met losses and queues (per call, per rank).
RECOVERY = ("retransmissions", "fast_retransmissions", "probe_retransmissions",
            "spurious_retransmissions", "window_decreases", "random_losses", "resends",
            "results_lost", "local_refusals")


def window_state(membership) -> dict:
    """The window and RTT estimate a membership holds (seconds, messages)."""
    window, rtt = membership.window, membership.rtt
    return {"cwnd": window.cwnd, "ssthresh": window.ssthresh, "min_rtt": rtt.min_rtt,
            "srtt": rtt.srtt}


def switchml_role(spec) -> None:
    import switchml
    from switchml.config import DEFAULT_BLOCK_ELEMENTS, DEFAULT_PACKET_ELEMENTS
    from switchml.quant import error_bound, error_bound16, error_bound_two_stage

    rank, world = spec["rank"], spec["world"]
    per_host = spec.get("ranks_per_host", 1)
    # ranks of one host: one namespace on the testbed, one group on loopback
    os.environ.setdefault("SWITCHML_LOCAL_GROUP", str(rank // per_host))
    with switchml.Worker(spec["switch"], rank, world, job=spec["job"],
                         timeout=spec.get("timeout", 60)) as w:
        membership = w.membership  # None where this rank sends nothing through a switch
        block = (membership.block_elements if membership is not None
                 else DEFAULT_BLOCK_ELEMENTS)
        local = getattr(w, "placement", None)  # the local stage's, where ranks combine
        for case in spec["cases"]:
            data = make_tensor(rank, case["elements"], case.get("density"), block, spec["seed"])
            out = np.empty_like(data)
            sparse, bits = case["sparse"], case.get("bits", 32)
            for _ in range(spec["warmup"]):
                w.allreduce(data, out=out, sparse=sparse, bits=bits)
            c0, l0, s0 = w.counters, link_bytes(spec.get("ifname")), scheduling()
            t0 = time.monotonic()
            windows: list = []  # each call's window at its end: how it met the network

            def call(data=data, out=out, sparse=sparse, bits=bits, windows=windows):
                before = w.counters
                w.allreduce(data, out=out, sparse=sparse, bits=bits)
                if membership is not None:
                    after = w.counters
                    windows.append(dict(window_state(membership), **{
                        k: after.get(k, 0) - before.get(k, 0) for k in RECOVERY}))

            times = _time(call, 0, spec["repeats"])
            t1 = time.monotonic()
            c1, l1, s1 = w.counters, link_bytes(spec.get("ifname")), scheduling()
            ok = None
            if spec.get("check") and rank == 0 and data.size:
                inputs = inputs_of_all(spec, case, block)
                exact = np.sum(np.array(inputs, np.float64), axis=0)
                err = np.abs(out.astype(np.float64) - exact)
                k = (membership.packet_elements if membership is not None
                     else DEFAULT_PACKET_ELEMENTS)
                if local is None:
                    bound = error_bound16(inputs, 2 * k) if bits == 16 else error_bound(inputs, k)
                elif bits == 32:
                    bound = error_bound_two_stage([[inputs[r] for r in g] for g in local.groups],
                                                  k)
                else:  # no stated bound for the 16-bit wire's two stages: unchecked
                    bound = None
                ok = bool(np.all(err <= bound)) if bound is not None else None
            n = spec["repeats"]
            emit(event="case", id=case["id"], rank=rank, times=times, ok=ok,
                 local_calls=c1.get("local_calls", 0) - c0.get("local_calls", 0),
                 digest=hashlib.sha256(out.tobytes()).hexdigest(),
                 bytes_sent=(c1.get("bytes_sent", 0) - c0.get("bytes_sent", 0)) / n,
                 bytes_received=(c1.get("bytes_received", 0) - c0.get("bytes_received", 0)) / n,
                 retransmissions=(c1.get("retransmissions", 0) - c0.get("retransmissions", 0)) / n,
                 recovery={k: (c1.get(k, 0) - c0.get(k, 0)) / n for k in RECOVERY},
                 windows=windows,
                 link_tx=(l1[0] - l0[0]) / n if l0 else None,
                 link_rx=(l1[1] - l0[1]) / n if l0 else None, span=[t0, t1],
                 **per_call(s0, s1, n))
    emit(event="done", rank=rank)


def gloo_role(spec) -> None:
    import torch
    import torch.distributed as dist

    rank, world = spec["rank"], spec["world"]
    os.environ.update(MASTER_ADDR=spec["master_addr"], MASTER_PORT=str(spec["master_port"]))
    if spec.get("ifname"):
        os.environ["GLOO_SOCKET_IFNAME"] = spec["ifname"]
    # gloo at its best: one intra-op thread (its reduction loop competes with the
    # other ranks for the cores otherwise), and only the all_reduce timed.
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    for case in spec["cases"]:
        data = torch.from_numpy(make_tensor(rank, case["elements"], case.get("density"),
                                            spec["block"], spec["seed"]))
        holder: dict = {}

        def fresh_copy(holder=holder, data=data):  # the input, outside the timed call
            holder["x"] = data.clone()
            dist.barrier()

        fp16 = case.get("fp16")

        def once(holder=holder, fp16=fp16):
            if fp16:  # fp16_compress_hook: cast, allreduce, cast back
                half = holder["x"].to(torch.float16)
                dist.all_reduce(half)
                holder["x"].copy_(half)
            else:
                dist.all_reduce(holder["x"])

        for _ in range(spec["warmup"]):
            fresh_copy()
            once()
        l0 = link_bytes(spec.get("ifname"))
        # (the fresh copies and barriers between calls count too: a few per cent)
        s0 = scheduling()
        t0 = time.monotonic()
        times = _time(once, 0, spec["repeats"], before=fresh_copy)
        t1 = time.monotonic()
        l1, s1 = link_bytes(spec.get("ifname")), scheduling()
        out = holder["x"].numpy() if spec["repeats"] else data.numpy()
        ok = None
        if spec.get("check") and rank == 0 and out.size:
            inputs = inputs_of_all(spec, case, spec["block"])
            exact = np.sum(np.array(inputs, np.float64), axis=0)
            # float32 additions in ring order: at most n-1 roundings of partial sums
            eps = np.finfo(np.float16 if case.get("fp16") else np.float32).eps
            tol = (world + 1) * eps * np.sum(np.abs(inputs), axis=0, dtype=np.float64)
            ok = bool(np.all(np.abs(out.astype(np.float64) - exact) <= tol + 1e-30))
        n = spec["repeats"]
        emit(event="case", id=case["id"], rank=rank, times=times, ok=ok,
             digest=hashlib.sha256(out.tobytes()).hexdigest(),
             link_tx=(l1[0] - l0[0]) / n if l0 else None,
             link_rx=(l1[1] - l0[1]) / n if l0 else None, span=[t0, t1],
             **per_call(s0, s1, n))
    dist.barrier()
    dist.destroy_process_group()
    emit(event="done", rank=rank)


def congestion_control(sock=None) -> str:
    """The TCP congestion control of ``sock``, or this namespace's default."""
    import socket

    if sock is not None:
        return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16).split(b"\0")[0] \
            .decode()
    with open("/proc/sys/net/ipv4/tcp_congestion_control") as f:
        return f.read().strip()


def tcp_sink_role(spec) -> None:
    """Accept one connection, read it to its end, counting; then print the samples."""
    import socket
    import threading

    with socket.create_server((spec["host"], spec["port"])) as server:
        emit(event="listening", address=[spec["host"], spec["port"]],
             congestion_control=congestion_control())
        conn, _ = server.accept()
    total = [0]

    def read():
        buf = bytearray(1 << 20)
        view = memoryview(buf)
        with conn:
            while True:
                n = conn.recv_into(view)
                if not n:
                    return
                total[0] += n

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    samples = [[time.monotonic(), 0]]
    while reader.is_alive():
        reader.join(0.01)
        samples.append([time.monotonic(), total[0]])
    emit(event="samples", samples=samples)


def tcp_send_role(spec) -> None:
    """Send as fast as TCP lets until a ``stop`` line or the end of stdin."""
    import socket
    import threading

    stop = threading.Event()

    def watch():
        for line in sys.stdin:
            if line.strip() == "stop":
                break
        stop.set()

    threading.Thread(target=watch, daemon=True).start()
    chunk = bytes(1 << 20)
    with socket.socket() as sock:
        if spec.get("congestion_control"):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION,
                            spec["congestion_control"].encode())
        sock.connect((spec["host"], spec["port"]))
        emit(event="connected", congestion_control=congestion_control(sock))
        before = tcp_counters()
        states: list = []
        threading.Thread(target=watch_socket, args=(spec, stop, states), daemon=True).start()
        sent = 0
        while not stop.is_set():
            sock.sendall(chunk)
            sent += len(chunk)
        after = tcp_counters()
        sock.shutdown(socket.SHUT_WR)
    emit(event="sent", bytes=sent, counters={k: after[k] - before.get(k, 0) for k in after},
         states=states)


def watch_socket(spec, stop, states, every: float = 0.1) -> None:
    """Sample the flow's socket (``ss -tin``: its window, RTT, pacing and delivery
    rates) every ``every`` seconds until ``stop``, into ``states``."""
    import re
    import subprocess

    while not stop.wait(every):
        text = subprocess.run(["ss", "-tinH", "dst", f"{spec['host']}:{spec['port']}"],
                              capture_output=True, text=True).stdout
        fields = dict(re.findall(r"\b(cwnd|rtt|pacing_rate|delivery_rate|unacked|"
                                 r"notsent|retrans|ssthresh):(\S+)", text))
        states.append([time.monotonic(), fields])


#: The TCP counters of /proc/net/netstat and /proc/net/snmp (this network
#: namespace's) that say how the flow met its losses.
TCP_COUNTERS = ("RetransSegs", "TCPTimeouts", "TCPLossProbes", "TCPLossProbeRecovery",
                "TCPFastRetrans", "TCPLostRetransmit", "TCPSpuriousRTOs", "TCPSackRecovery")


def tcp_counters() -> dict:
    """The namespace's ``TCP_COUNTERS`` now."""
    found: dict = {}
    for path in ("/proc/net/snmp", "/proc/net/netstat"):
        with open(path) as f:
            lines = f.read().splitlines()
        for names, values in zip(lines[::2], lines[1::2]):
            for name, value in zip(names.split()[1:], values.split()[1:]):
                if name in TCP_COUNTERS:
                    found[name] = int(value)
    return found


ROLES = {"switch": switch_role, "switchml": switchml_role, "gloo": gloo_role,
         "tcp_sink": tcp_sink_role, "tcp_send": tcp_send_role}

if __name__ == "__main__":
    ROLES[sys.argv[1]](json.loads(sys.argv[2]))
