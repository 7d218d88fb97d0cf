"""Settling a local stage's half-summed calls through gloo (switchml/torch/settle.py),
rank by rank in threads over an exchange that stands in for the gloo group: every
rank still in the call ends with the exact sum, whatever each held, and a part
nobody can give is an error on every rank, never a wrong sum."""

import threading

import numpy as np
import pytest

pytest.importorskip("torch", reason="the torch extra is not installed")

from switchml.errors import SwitchMLError  # noqa: E402
from switchml.torch.settle import KEPT_SEGMENTS, Ranks, settle_segments  # noqa: E402

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
