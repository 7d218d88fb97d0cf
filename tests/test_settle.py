"""Settling a local stage's half-summed calls through gloo (switchml/torch/settle.py),
rank by rank in threads over an exchange that stands in for the gloo group: every
rank still in the call ends with the exact sum, whatever each held, and a part
nobody can give is an error on every rank, never a wrong sum.  And what gloo sums
of each call of a job over several switches, once their parts are settled."""

import threading

import numpy as np
import pytest

pytest.importorskip("torch", reason="the torch extra is not installed")

from switchml.errors import SwitchMLError  # noqa: E402
from switchml.torch.settle import (  # noqa: E402
    KEPT_SEGMENTS,
    PartsPlan,
    Ranks,
    settle_segments,
)

SEGMENT, SIZE, WORLD = 8, 37, 4  # 5 segments, the last of 5 elements


class Hub:
    """What every rank put in, once all did: the collectives of a group of threads."""

    def __init__(self, size):
        self.slots = [None] * size
        self.barrier = threading.Barrier(size)

    def exchange(self, rank, value):
        self.slots[rank] = value
        self.barrier.wait()
        everyone = list(self.slots)
        self.barrier.wait()
        return everyone


class ThreadRanks(Ranks):
    def __init__(self, hub, rank, size):
        super().__init__(None, rank, size)
        self.hub = hub

    def rows(self, values):
        return [list(v) for v in self.hub.exchange(self.rank, list(values))]

    def sum(self, array):
        array[:] = np.sum(self.hub.exchange(self.rank, array.copy()), axis=0)

    def broadcast(self, array, source):
        array[:] = self.hub.exchange(self.rank, array.copy())[source]


def inputs():
    rng = np.random.default_rng(3)
    return [rng.integers(-1000, 1000, SIZE).astype(np.float32) for _ in range(WORLD)]


def run(states):
    """Every rank's settlement at once; ``states[r]``: ("in", copied) for a rank in the
    call, which holds the sum in its first ``copied`` segments, or ("ended", kept
    segments) for one that ended it.  Each rank's array, or its error."""
    arrays = inputs()
    total = np.sum(arrays, axis=0)
    hub = Hub(WORLD)
    results = [None] * WORLD

    def rank(r):
        kind, held = states[r]
        try:
            if kind == "in":
                flat = arrays[r]
                flat[:held * SEGMENT] = total[:held * SEGMENT]
                settle_segments(ThreadRanks(hub, r, WORLD), "job", 7, SEGMENT, flat, held,
                                {}, -1)
                results[r] = flat
            else:
                kept = {t: total[t * SEGMENT:(t + 1) * SEGMENT].copy() for t in held}
                settle_segments(ThreadRanks(hub, r, WORLD), "job", 7, SEGMENT, None, 0,
                                kept, SIZE if kept else -1)
                results[r] = "ended"
        except SwitchMLError as exc:
            results[r] = exc

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(WORLD)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    return results, total


@pytest.mark.parametrize("states", [
    [("in", 0)] * 4,  # nothing held: gloo sums all of it
    [("in", 5)] * 4,  # all held: nothing to do
    [("in", 2), ("in", 0), ("in", 4), ("in", 2)],  # each a prefix of its own
    # ranks that ended the call give their last two segments
    [("ended", [3, 4]), ("ended", [3, 4]), ("in", 3), ("in", 4)],
    # one that kept nothing of it (a later call's segments displaced them)
    [("ended", []), ("ended", [3, 4]), ("in", 3), ("in", 3)],
])
def test_every_rank_in_the_call_ends_with_the_exact_sum(states):
    results, total = run(states)
    assert KEPT_SEGMENTS == 2
    for (kind, _), result in zip(states, results):
        if kind == "in":
            assert np.array_equal(result, total), result
        else:
            assert result == "ended"


def test_a_segment_no_rank_holds_whose_inputs_are_gone_is_an_error_everywhere():
    """A rank ended the call and kept only its last segment; a rank in the call lacks
    segment 3: its sum is nowhere and one rank's input for it is gone."""
    results, _ = run([("ended", [4]), ("in", 3), ("in", 3), ("in", 3)])
    for result in results:
        assert isinstance(result, SwitchMLError) and "segment 3" in str(result), result


def test_over_several_switches_gloo_sums_what_no_rank_holds_of_each_call_once():
    """Switch 0 stopped at call 5, which a rank had ended (its part filled on every
    rank from what that rank kept); switch 1 at call 4, of which chunks 10-19 and
    30-39 of the part were held nowhere; switch 2 at call 6, untouched.  Earlier
    parts are sums on every rank; later ones are inputs: summed whole."""
    plan = PartsPlan(behind=[5, 4, 6], filled=[True, False, False],
                     left=[None, [slice(10, 20), slice(30, 40)], None],
                     firsts=[4, 4, 5], through=7)

    def parts(n):  # three switches, 100 values each, the last part shorter
        return [(k, 100 * k, min(n, 100 * (k + 1))) for k in range(3) if 100 * k < n]

    assert plan.spans(3, parts(300)) == []
    assert plan.spans(4, parts(300)) == [slice(110, 120), slice(130, 140)]
    assert plan.spans(5, parts(300)) == [slice(100, 200)]  # switch 0's part: filled
    assert plan.spans(6, parts(250)) == [slice(0, 100), slice(100, 200), slice(200, 250)]
    assert plan.spans(7, parts(150)) == [slice(0, 100), slice(100, 150)]  # two switches'
