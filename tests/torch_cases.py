"""One rank of a job that runs ``dist.all_reduce`` cases on switchml and on gloo.

Run by tests/test_torch_tensors.py (RANK etc. from env) with a JSON file of cases;
each case names a dtype, shape, memory layout, op, value scale and ``async_op``.
Every rank builds every rank's input from the case's seed, so it knows the exact
sum.  The default group is "switchml"; a gloo group of the same ranks gives the
reference.  Prints ``RESULT {"failures": [...], "switched": k}``.
"""

import json
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

import switchml.torch  # noqa: F401  registers the "switchml" backend
from switchml import quant
from switchml.config import DEFAULT_PACKET_ELEMENTS

DTYPES = {name: getattr(torch, name) for name in (
    "float32", "int32", "float64", "float16", "bfloat16", "int64", "int8", "uint8", "bool")}
SWITCHED = ("float32", "int32", "float16", "bfloat16")
#: (significand bits, frexp exponent of the least normal) of the 16-bit floats.
SIXTEEN_BITS = {"float16": (11, -13), "bfloat16": (8, -125)}
OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "max": dist.ReduceOp.MAX,
       "min": dist.ReduceOp.MIN, "product": dist.ReduceOp.PRODUCT}


def values(case: dict, rank: int, shape) -> torch.Tensor:
    """Rank ``rank``'s values for ``case``, contiguous, in ``shape``."""
    gen = torch.Generator().manual_seed(case["seed"] * 1009 + rank)
    dtype = DTYPES[case["dtype"]]
    if dtype.is_floating_point:
        base = torch.randn(shape, generator=gen, dtype=torch.float64) * 10.0 ** case["scale"]
        flat = base.reshape(-1)
        for who, where, value in case.get("specials", []):  # inf and NaN, element by element
            if who == rank and flat.numel():
                flat[where % flat.numel()] = float(value)
        return base.to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    low = 0 if dtype == torch.uint8 else -50
    return torch.randint(low, 50, shape, generator=gen).to(dtype)


def build(case: dict, rank: int):
    """(tensor passed to all_reduce, its base storage) laid out as the case says."""
    shape = tuple(case["shape"])
    layout = case["layout"]
    if layout == "transposed":
        base = values(case, rank, shape[::-1]).contiguous()
        tensor = base.permute(*reversed(range(len(shape))))
    elif layout == "strided":  # every other row of a larger tensor
        base = values(case, rank, (2 * shape[0],) + shape[1:])
        tensor = base[::2]
    elif layout == "offset":  # a view at a storage offset, with values before and after
        n = int(np.prod(shape))
        base = values(case, rank, (n + 10,))
        tensor = base[7:7 + n].view(shape)
    elif layout == "channels_last":
        base = values(case, rank, shape).contiguous(memory_format=torch.channels_last)
        tensor = base
    elif layout == "requires_grad":
        base = values(case, rank, shape).requires_grad_(True)
        tensor = base
    elif layout == "inference":  # made under torch.inference_mode(), summed there too
        with torch.inference_mode():
            base = tensor = values(case, rank, shape)
    else:
        base = tensor = values(case, rank, shape)
    return tensor, base


def layout_of(t: torch.Tensor):
    return (tuple(t.shape), t.stride(), t.storage_offset(), t.dtype, t.requires_grad,
            t.is_leaf)


def outside(tensor: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """The base's elements that ``tensor`` does not view (must stay untouched)."""
    mask = torch.ones(base.numel(), dtype=torch.bool)
    flat_index = torch.arange(base.numel()).view(base.shape)
    if tensor.data_ptr() == base.data_ptr() and tensor.shape == base.shape:
        return base.detach().reshape(-1)[:0]
    viewed = flat_index.as_strided(tensor.shape, tensor.stride(),
                                   tensor.storage_offset() - base.storage_offset())
    mask[viewed.reshape(-1)] = False
    return base.detach().reshape(-1)[mask]


def same_elements(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal element by element, a NaN equal to a NaN (torch.equal says NaN != NaN:
    an inf or NaN outside a view, left untouched, read as changed)."""
    if a.is_floating_point() and a.shape == b.shape:
        return torch.equal(a.isnan(), b.isnan()) and torch.equal(
            a.nan_to_num(0.0, posinf=float("inf"), neginf=float("-inf")),
            b.nan_to_num(0.0, posinf=float("inf"), neginf=float("-inf")))
    return torch.equal(a, b)


def switched(case: dict) -> bool:
    """Whether the backend should send this case through the switch."""
    return (case["dtype"] in SWITCHED and case["op"] in ("sum", "avg")
            and int(np.prod(case["shape"])) > 0)


def run(case: dict, group, rank: int, detach: bool = False):
    tensor, base = build(case, rank)
    if detach:
        # gloo's AVG fails on a requires_grad leaf (an in-place division), and gloo
        # sums a non-contiguous tensor wrongly: the reference takes a plain copy
        tensor = base = tensor.detach().contiguous()
    before = layout_of(tensor), outside(tensor, base).clone()
    op = OPS[case["op"]]
    # (inference mode is a thread's: the result is written on another one)
    with torch.inference_mode(case["layout"] == "inference"):
        work = dist.all_reduce(tensor, op=op, group=group, async_op=case["async"])
        if case["async"]:
            work.wait()
    after = layout_of(tensor), outside(tensor, base)
    return tensor.detach().clone(), before, after


def switched_calls(worker) -> int:
    """Results this rank's switchml worker produced: through the switch, or summed
    on its host by the local stage."""
    counters = worker.counters
    return counters.get("results_in", 0) + counters.get("local_calls", 0)


def check(case: dict, ref_group, world: int, rank: int, worker) -> str | None:
    """None when the switchml result is what it must be, else what went wrong."""
    results_before = switched_calls(worker)
    int_avg = case["op"] == "avg" and not DTYPES[case["dtype"]].is_floating_point
    # gloo refuses integer AVG: so must the backend, of the dtypes it leaves to gloo
    # (those it sums it averages, empty tensors too: a rank whose shard is empty
    # does what the others do)
    if int_avg and case["dtype"] not in SWITCHED:
        try:
            run(case, None, rank)
        except RuntimeError:
            return None
        return "integer AVG on gloo's dtypes did not raise as gloo does"
    ours, before, after = run(case, None, rank)
    # gloo's reference call before any verdict: every rank makes it, whatever its
    # own findings (a rank that returned early left the others waiting in it)
    ref_case = dict(case, op="sum") if int_avg else case
    theirs = run(ref_case, ref_group, rank, detach=True)[0]
    went_through = switched_calls(worker) > results_before
    if went_through != switched(case):
        return f"switch used: {went_through}, expected {switched(case)}"
    if before[0] != after[0]:
        return f"tensor metadata changed: {before[0]} -> {after[0]}"
    if not same_elements(before[1], after[1]):
        return "elements outside the tensor's view changed"
    if int_avg:  # gloo refuses; switchml averages integers as NCCL does (truncated)
        theirs = torch.div(theirs, world, rounding_mode="trunc")
    if ours.dtype != theirs.dtype or ours.shape != theirs.shape:
        return f"result {ours.dtype}{tuple(ours.shape)} vs gloo {theirs.dtype}{tuple(theirs.shape)}"
    if case["dtype"] in ("float32", "float16", "bfloat16") and switched(case):
        inputs = [build(case, r)[0].detach().float().contiguous().reshape(-1).numpy()
                  for r in range(world)]
        placement = getattr(worker, "placement", None)  # the local stage's, on one host
        if placement is None:
            bound = quant.error_bound(inputs, worker.membership.packet_elements)
        else:
            chunk = (worker.membership.packet_elements if worker.membership is not None
                     else DEFAULT_PACKET_ELEMENTS)
            bound = quant.error_bound_two_stage(
                [[inputs[r] for r in group] for group in placement.groups], chunk)
        exact = np.sum([a.astype(np.float64) for a in inputs], axis=0)
        got = ours.float().contiguous().reshape(-1).numpy().astype(np.float64)
        if case["op"] == "avg":
            exact, bound = exact / world, bound / world + np.spacing(np.abs(got).astype(np.float32))
        if case["dtype"] in SIXTEEN_BITS:  # the float32 result rounded to 16 bits once
            bits, least = SIXTEEN_BITS[case["dtype"]]
            _, e = np.frexp(np.abs(exact) + bound)
            bound = bound + np.ldexp(1.0, np.maximum(e, least) - bits - 1)
            with np.errstate(invalid="ignore"):  # 16-bit overflow: inf, as gloo gives
                bound = np.where(np.isinf(got) & np.isinf(theirs.float().reshape(-1).numpy()),
                                 np.inf, bound)
        special = ~np.isfinite(exact)  # where a rank gave inf or NaN: gloo's IEEE sum
        if not np.array_equal(got[special], theirs.float().reshape(-1).numpy()[special],
                              equal_nan=True):
            return f"inf/NaN elements differ from gloo at {np.flatnonzero(special)[:5]}"
        got, exact, bound = got[~special], exact[~special], bound[~special]
        excess = np.abs(got - exact) - bound
        if excess.size and excess.max() > 0:
            i = int(excess.argmax())
            return f"element {i}: {got[i]} vs exact {exact[i]}, bound {bound[i]}"
        return None
    differs = ours != theirs
    if ours.is_floating_point():
        differs &= ~(ours.isnan() & theirs.isnan())  # NaN is NaN
    if differs.any():
        diff = differs.reshape(-1).nonzero()[:3].reshape(-1).tolist()
        return f"differs from gloo at flat indices {diff}"
    return None


def leave_together(world: int, rank: int, timeout: float = 60.0) -> None:
    """Every rank past its last collective before any closes its connections, and
    the store's own rank (0) the last to go.  A rank that returns from a gloo call
    and closes while another still reads its part fails that one's call
    ("Connection closed by peer"), even in a final barrier; the store, which
    serves the counts, lives in rank 0."""
    store = dist.distributed_c10d._get_default_store()
    deadline = time.monotonic() + timeout
    store.add("leave/done", 1)
    while store.add("leave/done", 0) < world:  # everyone is past their collectives
        if time.monotonic() > deadline:
            raise TimeoutError("the other ranks did not finish their collectives")
        time.sleep(0.005)
    if rank == 0:  # the others' last word to the store came in before it goes
        while store.add("leave/left", 0) < world - 1:
            if time.monotonic() > deadline:
                raise TimeoutError("the other ranks did not leave")
            time.sleep(0.005)
    else:
        store.add("leave/left", 1)


def main():
    cases = json.load(open(sys.argv[1]))
    dist.init_process_group("switchml")
    rank, world = dist.get_rank(), dist.get_world_size()
    ref_group = dist.new_group(backend="gloo")
    worker = dist.distributed_c10d._get_default_group()._worker
    failures = []
    for case in cases:
        problem = check(case, ref_group, world, rank, worker)
        if problem is not None:
            failures.append({"case": case, "problem": problem})
    print("RESULT " + json.dumps({"failures": failures,
                                  "switched": sum(map(switched, cases))}), flush=True)
    leave_together(world, rank)
    dist.destroy_process_group()
    # The result is out and the group is down: skip the interpreter's teardown,
    # where torch 2.13's gloo threads now and then abort ("terminate called
    # without an active exception") or hang, with the plain gloo backend too.
    os._exit(0)


if __name__ == "__main__":
    main()
