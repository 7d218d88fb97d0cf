"""Resuming a call on a restarted switch (worker/resume.py), on the simulator:
a call cut at random points of a lossy run, where ranks stand a message apart
on some slots and some ranks may have returned from the call already, is
settled by the two exchanges and the resummed rest, and every rank's result is
bit-identical to an undisturbed run's."""

import numpy as np
import pytest

from switchml.sim.network import Faults, Simulation, _step
from switchml.worker.resume import (
    CallLedger,
    Kept,
    ResumeError,
    ahead_slots,
    positions,
    take_transfer,
    transfer,
)

WORLD, SLOTS, PACKET = 3, 4, 64


def inputs(dtype, size, seed):
    rng = np.random.default_rng(seed)
    if dtype == np.int32:
        return [rng.integers(-2**31, 2**31, size, dtype=np.int64).astype(np.int32)
                for _ in range(WORLD)]
    scale = np.float32(2.0) ** rng.integers(-30, 30, -(-size // PACKET)).repeat(PACKET)[:size]
    return [(rng.standard_normal(size) * scale).astype(np.float32) for _ in range(WORLD)]


def undisturbed(arrays, wire_bits):
    sim = Simulation(WORLD, slots=SLOTS, packet_elements=PACKET)
    return sim.allreduce([a.copy() for a in arrays], wire_bits=wire_bits)[0]


def cut_call(arrays, wire_bits, steps, seed, in_place):
    """Run the call on a lossy simulator for ``steps`` events, then lose the switch:
    each rank's (ledger or None, out, nonfinite, kept, message numbers)."""
    sim = Simulation(WORLD, slots=SLOTS, packet_elements=PACKET,
                     faults=Faults(loss=0.1), seed=seed)
    srcs = [a.copy() for a in arrays]
    outs = [s if in_place else np.zeros_like(s) for s in srcs]
    starts = [list(m.slot_msgs) for m in sim.memberships]
    extra = {"wire_bits": wire_bits} if wire_bits != 32 else {}
    sim.ops = [m.allreduce(s, o, sim.now, **extra)
               for m, s, o in zip(sim.memberships, srcs, outs)]
    for addr, op in zip(sim.addresses, sim.ops):
        sim._send_all(op, addr)
    # steps None: until the first rank returns
    for _ in (range(steps) if steps is not None else iter(int, 1)):
        if sim.finished or steps is None and any(op.done for op in sim.ops):
            break
        _step([sim], float("inf"), float("inf"))
    ranks = []
    for r, op in enumerate(sim.ops):
        ledger = CallLedger.of(op, srcs[r], starts[r])
        numbers = list(sim.memberships[r].slot_msgs)
        if op.done:  # returned: only its copy of the last messages' chunks is left
            kept = Kept.of(ledger, outs[r], op.nonfinite_chunks)
            ranks.append([None, None, set(), kept, numbers, srcs[r], outs[r]])
        else:
            ranks.append([ledger, outs[r], set(op.nonfinite_chunks), None, numbers,
                          srcs[r], outs[r]])
    return ranks


def resume(ranks, wire_bits):
    """Worker._resume_call on every rank, the sums of the new session done by numpy
    and its re-run by a fresh simulator; returns the slots settled."""
    sums = sum(positions(numbers, False) for _, _, _, _, numbers, _, _ in ranks)
    behind = ahead_slots(sums, WORLD)
    if behind:
        parts = [transfer(numbers, behind, ledger, out, nonfinite, kept)
                 for ledger, out, nonfinite, kept, numbers, _, _ in ranks]
        total = sum(p.astype(np.int64) for p in parts).astype(np.int32)
        for ledger, out, nonfinite, kept, numbers, _, _ in ranks:
            take_transfer(total, numbers, behind, ledger, out, nonfinite, kept)
    assert len({tuple(numbers) for *_, numbers, _, _ in ranks}) == 1  # level now
    lefts = {tuple(ledger.remaining(numbers)) for ledger, _, _, _, numbers, _, _ in ranks
             if ledger is not None}
    assert len(lefts) <= 1
    left = list(lefts.pop()) if lefts else []
    if left:
        ledger = next(r[0] for r in ranks if r[0] is not None)
        spans = [ledger.span(c) for c in left]
        gathered = [np.concatenate([src[s] for s in spans]) for *_, src, _ in ranks]
        sim = Simulation(WORLD, slots=SLOTS, packet_elements=PACKET, session=0xBEEF)
        sums = sim.allreduce(gathered, wire_bits=wire_bits)
        for (*_, out), part in zip(ranks, sums):
            at = 0
            for span in spans:
                out[span] = part[at:at + span.stop - span.start]
                at += span.stop - span.start
    return len(behind)


@pytest.mark.parametrize("dtype,wire_bits", [(np.float32, 32), (np.int32, 32),
                                             (np.float32, 16)])
@pytest.mark.parametrize("in_place", [True, False])
def test_a_call_cut_anywhere_resumes_bit_identically(dtype, wire_bits, in_place):
    size = 40 * PACKET + 17
    arrays = inputs(dtype, size, 7)
    want = undisturbed(arrays, wire_bits)
    settled = returned = 0
    for seed in range(24):
        steps = 20 + 37 * seed if seed % 3 else None
        ranks = cut_call(arrays, wire_bits, steps, seed, in_place)
        returned += any(r[0] is None for r in ranks) and not all(r[0] is None for r in ranks)
        settled += resume(ranks, wire_bits)
        for *_, out in ranks:
            assert np.array_equal(out.view(np.uint32), want.view(np.uint32))
    assert settled  # cuts where ranks stood a message apart were met
    assert returned  # and cuts where some rank had returned from the call


def test_positions_that_no_run_gives_are_refused():
    apart = [positions([5], False), positions([7], False), positions([5], False)]
    with pytest.raises(ResumeError, match="two apart"):
        ahead_slots(sum(apart), 3)
    with pytest.raises(ResumeError, match="sparse"):
        ahead_slots(positions([1], True) + positions([1], False), 2)


def test_a_message_number_and_its_successor_across_the_wrap():
    sums = positions([2**32 - 1], False) + positions([0], False) + positions([0], False)
    assert ahead_slots(sums, 3) == {0: (0, 2)}
