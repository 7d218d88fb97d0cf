"""``switchml demo``: a local switch, n worker processes, checked sums, a table.
The processes act as hosts of their own (``local_stage=False``), so that every
array crosses the switch.

Each rank makes its inputs from a seed, so every rank can also compute the exact
sum of all ranks' inputs and check its result: int32 exactly, float32 within the
bound of ``quant.error_bound``; the ranks' result digests show they agree bit
for bit.  The block-sparse cases also check that the sparse path gives exactly
the dense path's result.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import statistics
import time

import numpy as np

from . import auth
from .config import DEFAULT_PACKET_ELEMENTS
from .quant import error_bound
from .switch.server import Switch
from .worker.client import Worker

#: Block density of the demo's block-sparse inputs (random blocks per rank).
SPARSE_DENSITY = 0.1


def make_input(rank: int, size: int, dtype: str, seed: int, sparse: bool = False,
               block: int = 256) -> np.ndarray:
    rng = np.random.default_rng([seed, rank, size])
    if dtype == "int32":
        x = rng.integers(-(2**20), 2**20, size, dtype=np.int32)
    else:
        x = rng.standard_normal(size).astype(np.float32) * np.float32(2.0 ** rng.integers(-8, 8))
    if sparse:
        keep = rng.random(-(-size // block)) < SPARSE_DENSITY
        x[np.repeat(~keep, block)[:size]] = 0
    return x


def expected_sum(world: int, size: int, dtype: str, seed: int, sparse: bool = False):
    inputs = [make_input(r, size, dtype, seed, sparse) for r in range(world)]
    if dtype == "int32":
        return np.sum(inputs, axis=0, dtype=np.int32), None
    return np.sum(np.array(inputs, np.float64), axis=0), inputs


def _rank_main(address, rank, world, cases, repeats, seed, results, timeout, secret):
    try:
        # each process as a host of its own: every array crosses the switch (on one
        # machine the local stage would otherwise sum them in shared memory)
        with Worker(address, rank, world, job="demo", timeout=timeout,
                    local_stage=False, secret=secret) as worker:
            block = worker.membership.block_elements
            for size, dtype, sparse in cases:
                data = make_input(rank, size, dtype, seed, sparse, block)
                times = []
                for _ in range(repeats):
                    start = time.perf_counter()
                    out = worker.allreduce(data, sparse=sparse)
                    times.append(time.perf_counter() - start)
                ok = True
                worst = 0.0
                if sparse:  # the sparse path must give exactly what the dense path gives
                    ok = worker.allreduce(data).tobytes() == out.tobytes()
                if rank == 0:
                    exact, inputs = expected_sum(world, size, dtype, seed, sparse)
                    if dtype == "int32":
                        ok &= bool(np.array_equal(out, exact))
                    elif size:
                        err = np.abs(out.astype(np.float64) - exact)
                        bound = error_bound(inputs, worker.membership.packet_elements)
                        ok &= bool(np.all(err <= bound))
                        worst = float(err.max())
                results.put((rank, (size, dtype, sparse),
                             hashlib.sha256(out.tobytes()).hexdigest(), times, ok, worst))
            results.put((rank, "counters", worker.counters))
    except Exception as exc:  # report, never hang the parent
        results.put((rank, "error", f"{type(exc).__name__}: {exc}"))


def run_demo(workers: int = 4, sizes=(0, 1, 1000, 1_000_003), repeats: int = 3,
             drop_rate: float = 0.0, seed: int = 0, timeout: float = 30.0,
             packet_elements: int = DEFAULT_PACKET_ELEMENTS, echo=print) -> bool:
    """Run the demo; print a table; return True when every check passed."""
    cases = [(size, dtype, False) for size in sizes for dtype in ("float32", "int32")]
    cases += [(max(sizes), dtype, True) for dtype in ("float32", "int32")]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with Switch(drop_rate=drop_rate, seed=seed, packet_elements=packet_elements) as switch:
        assert switch.address is not None
        echo(f"switch on {switch.address[0]}:{switch.address[1]}, {workers} worker processes, "
             f"drop rate {drop_rate:g}; each process a host of its own (the local stage off), "
             "so every array crosses the switch")
        secret = auth.new_secret_if_available()  # as a real job has one
        procs = [ctx.Process(target=_rank_main, args=(switch.address, r, workers, cases, repeats,
                                                        seed, results, timeout, secret))
                 for r in range(workers)]
        for p in procs:
            p.start()
        rows: dict = {}
        errors = []
        expected = workers * (len(cases) + 1)
        deadline = time.monotonic() + timeout * (len(cases) * repeats + 2)
        received = 0
        while received < expected and time.monotonic() < deadline:
            try:
                item = results.get(timeout=1.0)
            except Exception:
                if not any(p.is_alive() for p in procs) and results.empty():
                    break
                continue
            received += 1
            if item[1] == "error":
                errors.append(f"rank {item[0]}: {item[2]}")
                received += expected  # one failure ends the run
            elif item[1] != "counters":
                rows.setdefault(item[1], []).append(item)
        for p in procs:
            p.join(timeout=timeout)
            if p.is_alive():
                p.terminate()
        stats = switch.stats()

    all_ok = not errors
    echo(f"{'elements':>10} {'dtype':>8} {'path':>18} {'median s':>10} {'MB/s/worker':>12} "
         f"{'max |err|':>10} {'check':>6} {'ranks agree':>12}")
    for (size, dtype, sparse), items in sorted(rows.items()):
        per_iter = np.max([it[3] for it in items], axis=0)
        median = statistics.median(per_iter)
        digests = {it[2] for it in items}
        ok = all(it[4] for it in items)
        agree = len(digests) == 1 and len(items) == workers
        all_ok &= ok and agree
        rate = size * 4 / median / 1e6 if median > 0 else 0.0
        path = f"sparse (d={SPARSE_DENSITY:g})" if sparse else "dense"
        echo(f"{size:>10} {dtype:>8} {path:>18} {median:>10.4f} {rate:>12.1f} "
             f"{max(it[5] for it in items):>10.2e} {'ok' if ok else 'FAIL':>6} "
             f"{'yes' if agree else 'NO':>12}")
    if len(rows) != len(cases):
        all_ok = False
    counters = stats["ended_jobs"].get("demo", {}).get("counters", {})
    echo("switch counters: " + ", ".join(f"{k}={v}" for k, v in sorted(counters.items())))
    for e in errors:
        echo("error: " + e)
    echo("demo " + ("passed: every sum checked" if all_ok else "FAILED"))
    return all_ok
