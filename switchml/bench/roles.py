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
- ``switchml_torch``: one rank of torch.distributed on the "switchml" backend
  (``switchml.torch``), its tensors on the spec's ``device`` (cpu, or cuda: the
  GPU ``LOCAL_RANK`` mod the GPUs, every rank of a one-GPU host on cuda:0), each
  call ``dist.all_reduce`` and, on CUDA, the wait for the tensor's stream; cases
  and report as ``switchml``'s.
- ``gloo``: one torch.distributed gloo rank; same cases, same tensors (on the
  spec's ``device``: gloo sums CUDA tensors too).
- ``tcp_sink`` and ``tcp_send``: a bulk TCP flow with plain sockets (the
  namespace's default congestion control, CUBIC on Linux), the competing traffic
  of bench/beside_tcp.py.  The sink prints ``listening``, counts what it reads and
  prints ``samples`` (monotonic time, bytes so far, every 10 ms) when the flow
  ends; the sender (with the congestion control its spec names, if any: Linux
  lets root pick any the kernel has) prints ``connected`` with its congestion
  control and sends until a ``stop`` line (or end of input).

Every job role reports the ``span`` of their timed calls in ``time.monotonic()``
seconds (one clock for every namespace of the machine), so that a launcher can
say what another flow carried meanwhile.

Rank 0 checks every result against the exact sum of all ranks' inputs, which it
rebuilds from their seeds; every rank prints a digest so that the launcher can
check they agree bit for bit.

The job roles also count the minor page faults (``getrusage``) of their timed
calls: a steady-state call that allocates its staging anew faults once per page
of fresh memory.  numpy's huge pages are off in them, so that a fresh page
counts as one fault, not one in 512 (as tests/fresh_pages_job.py does).
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import sys
import time

import numpy as np

from .common import make_tensor


def no_numpy_huge_pages() -> None:
    """numpy's large arrays without huge pages (it asks for them by default): a
    fresh array then faults once for each of its 4 KiB pages, not once in 2 MiB,
    and the faults a call counts say how much fresh memory it touched."""
    try:
        from numpy._core.multiarray import (  # type: ignore[attr-defined]
            _set_madvise_hugepage,
        )
    except ImportError:  # numpy < 2
        from numpy.core.multiarray import _set_madvise_hugepage  # type: ignore[no-redef]
    _set_madvise_hugepage(False)


def minor_faults() -> int:
    """This process's minor page faults so far (first touches of fresh pages)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


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


def _time(fn, warmup, repeats, before=None, faults=None):
    """Each timed call's seconds (``before`` runs ahead of each, untimed); each
    call's minor page faults appended to ``faults`` when given."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        faulted = minor_faults()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
        if faults is not None:
            faults.append(minor_faults() - faulted)
    return times


def faults_per_call(faults: list) -> float | None:
    return sum(faults) / len(faults) if faults else None


#: The counters that say how a call met losses and queues (per call, per rank).
RECOVERY = ("retransmissions", "fast_retransmissions", "probe_retransmissions",
            "spurious_retransmissions", "window_decreases", "random_losses", "resends",
            "results_lost", "local_refusals")


def window_state(membership) -> dict:
    """The window and RTT estimate a membership holds (seconds, messages)."""
    window, rtt = membership.window, membership.rtt
    return {"cwnd": window.cwnd, "ssthresh": window.ssthresh, "min_rtt": rtt.min_rtt,
            "srtt": rtt.srtt}


def within_bound(spec, case, out, worker, bits) -> bool | None:
    """Rank 0's check of a switchml sum ``out`` against the exact sum of every
    rank's input, within the bound of the path that summed it (None: no stated
    bound, as for the 16-bit wire's two stages)."""
    from switchml.config import DEFAULT_BLOCK_ELEMENTS, DEFAULT_PACKET_ELEMENTS
    from switchml.quant import error_bound, error_bound16, error_bound_two_stage

    membership = worker.membership  # None where this rank sends nothing through a switch
    block = membership.block_elements if membership is not None else DEFAULT_BLOCK_ELEMENTS
    local = getattr(worker, "placement", None)  # the local stage's, where ranks combine
    inputs = inputs_of_all(spec, case, block)
    exact = np.sum(np.array(inputs, np.float64), axis=0)
    err = np.abs(out.astype(np.float64) - exact)
    k = membership.packet_elements if membership is not None else DEFAULT_PACKET_ELEMENTS
    if local is None:
        bound = error_bound16(inputs, 2 * k) if bits == 16 else error_bound(inputs, k)
    elif bits == 32:
        bound = error_bound_two_stage([[inputs[r] for r in g] for g in local.groups], k)
    else:  # no stated bound for the 16-bit wire's two stages: unchecked
        return None
    return bool(np.all(err <= bound))


def _switchml_report(spec, case, rank, out, times, faults, worker, counters, links, sched,
                     span, windows=(), bits=32) -> None:
    """A switchml rank's ``case`` line: times, faults, counters and the check."""
    (c0, c1), (l0, l1), (s0, s1) = counters, links, sched
    ok = None
    if spec.get("check") and rank == 0 and out.size:
        ok = within_bound(spec, case, out, worker, bits)
    n = spec["repeats"]
    emit(event="case", id=case["id"], rank=rank, times=times, ok=ok,
         local_calls=c1.get("local_calls", 0) - c0.get("local_calls", 0),
         digest=hashlib.sha256(out.tobytes()).hexdigest(),
         bytes_sent=(c1.get("bytes_sent", 0) - c0.get("bytes_sent", 0)) / n,
         bytes_received=(c1.get("bytes_received", 0) - c0.get("bytes_received", 0)) / n,
         retransmissions=(c1.get("retransmissions", 0) - c0.get("retransmissions", 0)) / n,
         recovery={k: (c1.get(k, 0) - c0.get(k, 0)) / n for k in RECOVERY},
         windows=list(windows), faults_per_call=faults_per_call(faults),
         link_tx=(l1[0] - l0[0]) / n if l0 else None,
         link_rx=(l1[1] - l0[1]) / n if l0 else None, span=span,
         **per_call(s0, s1, n))


def switchml_role(spec) -> None:
    import switchml
    from switchml.config import DEFAULT_BLOCK_ELEMENTS

    no_numpy_huge_pages()
    rank, world = spec["rank"], spec["world"]
    per_host = spec.get("ranks_per_host", 1)
    # ranks of one host: one namespace on the testbed, one group on loopback
    os.environ.setdefault("SWITCHML_LOCAL_GROUP", str(rank // per_host))
    with switchml.Worker(spec["switch"], rank, world, job=spec["job"],
                         timeout=spec.get("timeout", 60)) as w:
        membership = w.membership  # None where this rank sends nothing through a switch
        block = (membership.block_elements if membership is not None
                 else DEFAULT_BLOCK_ELEMENTS)
        for case in spec["cases"]:
            data = make_tensor(rank, case["elements"], case.get("density"), block, spec["seed"])
            out = np.empty_like(data)
            sparse, bits = case["sparse"], case.get("bits", 32)
            for _ in range(spec["warmup"]):
                w.allreduce(data, out=out, sparse=sparse, bits=bits)
            c0, l0, s0 = w.counters, link_bytes(spec.get("ifname")), scheduling()
            t0 = time.monotonic()
            windows: list = []  # each call's window at its end: how it met the network
            faults: list = []

            def call(data=data, out=out, sparse=sparse, bits=bits, windows=windows):
                before = w.counters
                w.allreduce(data, out=out, sparse=sparse, bits=bits)
                if membership is not None:
                    after = w.counters
                    windows.append(dict(window_state(membership), **{
                        k: after.get(k, 0) - before.get(k, 0) for k in RECOVERY}))

            times = _time(call, 0, spec["repeats"], faults=faults)
            t1 = time.monotonic()
            c1, l1, s1 = w.counters, link_bytes(spec.get("ifname")), scheduling()
            _switchml_report(spec, case, rank, out, times, faults, w, (c0, c1), (l0, l1),
                             (s0, s1), [t0, t1], windows, bits)
    emit(event="done", rank=rank)


def torch_device(spec):
    """The rank's torch device: the CPU, or the GPU its local rank (its place among
    its host's ranks) mod the GPUs names (cuda:0 for every rank of a one-GPU host)."""
    import torch

    if spec.get("device", "cpu") == "cpu":
        return torch.device("cpu")
    local_rank = spec["rank"] % spec.get("ranks_per_host", 1)
    device = torch.device("cuda", local_rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device


def _settled(device) -> None:
    """Wait for the device's queued work (a CUDA call's copy back): a call's time
    is until its result is in the tensor."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def switchml_torch_role(spec) -> None:
    """A switchml rank as a torch user has one: ``dist.all_reduce`` on the
    "switchml" process group.  The job's switch is ``spec["switch"]`` (the
    launcher's) where its ranks span hosts; on one host the backend starts none,
    as it does for ``torchrun --standalone``."""
    import torch
    import torch.distributed as dist

    no_numpy_huge_pages()
    rank, world = spec["rank"], spec["world"]
    per_host = spec.get("ranks_per_host", 1)
    os.environ.update(MASTER_ADDR=spec["master_addr"], MASTER_PORT=str(spec["master_port"]),
                      SWITCHML_TIMEOUT=str(spec.get("timeout", 60)))
    os.environ.setdefault("SWITCHML_LOCAL_GROUP", str(rank // per_host))
    if spec.get("switch"):
        os.environ["SWITCHML_SWITCH"] = spec["switch"]
    else:
        os.environ.pop("SWITCHML_SWITCH", None)
    if spec.get("ifname"):
        os.environ["GLOO_SOCKET_IFNAME"] = spec["ifname"]
    torch.set_num_threads(1)  # as gloo's ranks: the ranks share the host's cores
    device = torch_device(spec)
    import switchml.torch  # noqa: F401  registers the "switchml" backend

    dist.init_process_group("switchml", rank=rank, world_size=world)
    # the group's switchml worker: its counters, its placement for the check
    w = dist.distributed_c10d._get_default_group()._worker  # type: ignore[attr-defined]
    for case in spec["cases"]:
        host = torch.from_numpy(make_tensor(rank, case["elements"], case.get("density"),
                                            spec["block"], spec["seed"]))
        data = host.to(device)
        x = data.clone()  # summed in place; its input put back before every call

        def refill(x=x, data=data):
            x.copy_(data)
            _settled(device)
            dist.barrier()

        def once(x=x):
            dist.all_reduce(x)
            _settled(device)

        for _ in range(spec["warmup"]):
            refill()
            once()
        c0, l0, s0 = w.counters, link_bytes(spec.get("ifname")), scheduling()
        t0 = time.monotonic()
        faults: list = []
        times = _time(once, 0, spec["repeats"], before=refill, faults=faults)
        t1 = time.monotonic()
        c1, l1, s1 = w.counters, link_bytes(spec.get("ifname")), scheduling()
        out = (x if spec["repeats"] else data).cpu().numpy()
        _switchml_report(spec, case, rank, out, times, faults, w, (c0, c1), (l0, l1),
                         (s0, s1), [t0, t1])
    dist.barrier()
    dist.destroy_process_group()
    emit(event="done", rank=rank)


def gloo_role(spec) -> None:
    import torch
    import torch.distributed as dist

    no_numpy_huge_pages()
    rank, world = spec["rank"], spec["world"]
    os.environ.update(MASTER_ADDR=spec["master_addr"], MASTER_PORT=str(spec["master_port"]))
    if spec.get("ifname"):
        os.environ["GLOO_SOCKET_IFNAME"] = spec["ifname"]
    # gloo at its best: one intra-op thread (its reduction loop competes with the
    # other ranks for the cores otherwise), and only the all_reduce timed.
    torch.set_num_threads(1)
    device = torch_device(spec)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    for case in spec["cases"]:
        data = torch.from_numpy(make_tensor(rank, case["elements"], case.get("density"),
                                            spec["block"], spec["seed"])).to(device)
        holder: dict = {}

        def fresh_copy(holder=holder, data=data):  # the input, outside the timed call
            holder["x"] = data.clone()
            _settled(device)
            dist.barrier()

        fp16 = case.get("fp16")

        def once(holder=holder, fp16=fp16):
            if fp16:  # fp16_compress_hook: cast, allreduce, cast back
                half = holder["x"].to(torch.float16)
                dist.all_reduce(half)
                holder["x"].copy_(half)
            else:
                dist.all_reduce(holder["x"])
            _settled(device)

        for _ in range(spec["warmup"]):
            fresh_copy()
            once()
        l0 = link_bytes(spec.get("ifname"))
        # (the fresh copies and barriers between calls count too: a few per cent)
        s0 = scheduling()
        t0 = time.monotonic()
        faults: list = []
        times = _time(once, 0, spec["repeats"], before=fresh_copy, faults=faults)
        t1 = time.monotonic()
        l1, s1 = link_bytes(spec.get("ifname")), scheduling()
        out = (holder["x"] if spec["repeats"] else data).cpu().numpy()
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
             faults_per_call=faults_per_call(faults),
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


ROLES = {"switch": switch_role, "switchml": switchml_role,
         "switchml_torch": switchml_torch_role, "gloo": gloo_role,
         "tcp_sink": tcp_sink_role, "tcp_send": tcp_send_role}

if __name__ == "__main__":
    ROLES[sys.argv[1]](json.loads(sys.argv[2]))
