"""How long a call works before its first datagrams can go out: time the links
wait for at the start of every call.

In one process, no sockets: the simulator's memberships of a ``--workers`` job
(frame-sized packets of ``--packet-elements`` values, ``--block-elements`` a
block, ``--slots`` slots), rank 0 starts a ``--mib`` MiB float32 call, dense
and sparse at ``--density`` (the bench's tensors), on the C engine, and the time
until its first datagrams are ready is taken ``--repeats`` times (median).  A
dense call reads a chunk's exponent when it announces it; a sparse call makes
its pass over the whole input first (the seed needs the map, the exponent round
every chunk of its slot).  Then the exponent pass's int32 max alone, over the
whole input, in each build of it (``_fastengine.magnitude_peak``: the baseline
x86-64 one, and AVX2 where the CPU has it).

    python bench/first_send.py --mib 64 --density 0.1 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from switchml.bench.common import at_least, make_tensor, within  # noqa: E402


def first_send_s(args, values, sparse: bool) -> list:
    """Seconds from a call's start to its first datagrams, ``args.repeats`` times."""
    import numpy as np

    from switchml.sim.network import Simulation

    out = np.empty_like(values)
    times = []
    for _ in range(args.repeats):
        sim = Simulation(args.workers, slots=args.slots, packet_elements=args.packet_elements,
                         block_elements=args.block_elements)
        start = time.perf_counter()
        op = sim.memberships[0].allreduce(values, out, 0.0, sparse=sparse, compiled=True)
        sent = op.datagrams_to_send()
        times.append(time.perf_counter() - start)
        assert sent, "the call sent nothing"
    return times


def peak_s(values, build: str, repeats: int) -> float | None:
    """Median seconds of one build's max over ``values`` (None: no such build here)."""
    from switchml.worker.engine.compiled import _fastengine

    view = memoryview(values).cast("B")
    if _fastengine.magnitude_peak(view[:4], build) is None:
        return None
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        _fastengine.magnitude_peak(view, build)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=within(0, above_low=True), default=64)
    parser.add_argument("--density", type=within(0, 1), default=0.1)
    parser.add_argument("--workers", type=at_least(1), default=4)
    parser.add_argument("--slots", type=at_least(1), default=32)
    parser.add_argument("--packet-elements", type=at_least(1), default=2048)
    parser.add_argument("--block-elements", type=at_least(1), default=256)
    parser.add_argument("--repeats", type=at_least(1), default=20)
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    from switchml.worker.engine.compiled import _fastengine
    if _fastengine is None:
        raise SystemExit("first_send: the C engine is not built")
    elements = int(args.mib * 2**20) // 4
    dense = make_tensor(0, elements)
    sparse = make_tensor(0, elements, args.density, args.block_elements)
    calls = {"dense": statistics.median(first_send_s(args, dense, False)),
             "sparse": statistics.median(first_send_s(args, sparse, True))}
    peaks = {build: peak_s(dense, build, args.repeats) for build in ("baseline", "avx2")}
    for kind, s in calls.items():
        print(f"{args.mib:g} MiB {kind} call: first datagrams after {s * 1e3:.2f} ms")
    for build, s in peaks.items():
        print(f"exponent pass's max, {build} build: "
              + ("not built here" if s is None else
                 f"{s * 1e3:.2f} ms over {args.mib:g} MiB ({args.mib * 2**20 / s / 1e9:.1f} GB/s)"))
    given = sys.argv[1:] if argv is None else argv
    result = {"command": " ".join(["python bench/first_send.py"] + given),
              "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                          "python": platform.python_version()},
              "settings": vars(args), "first_send_s": calls, "magnitude_peak_s": peaks}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.json}")
    return result


if __name__ == "__main__":
    main()
