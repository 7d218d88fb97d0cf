"""The local stage, sans-IO: hosts of ranks driven by a seeded scheduler that
interleaves them every way, a model switch between the hosts; the shared-memory
operations' C twin against the reference; the placement of ranks on hosts."""

import os
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from switchml.errors import CallMismatchError, JoinRefusedError, SwitchMLError
from switchml.worker.local import memory
from switchml.worker.local.hosts import HostRecord, Placement, auto_segment
from switchml.worker.local.memory import R_CALL, R_ELEMENTS, R_KIND, R_STATE, Layout
from switchml.worker.local.stage import SHARD_ALIGN, Finished, Launch, LocalStage, Wait, call_kind

SEGMENT = 2048  # elements: small, so that calls span several segments and slots


# ---------------------------------------------------------------- a host group in memory
class Host:
    """One host's ranks over one buffer, as the shared segment would hold them."""

    def __init__(self, ranks: int, shards: int, switched: bool, slots: int = 2):
        self.layout = Layout(ranks, shards, slots, SEGMENT)
        self.buf = np.zeros(self.layout.size, dtype=np.uint8)
        self.stages = [LocalStage(self.buf, self.layout, i, switched=switched)
                       for i in range(ranks)]

    def counter(self, index: int, field: int) -> int:
        offset = self.layout.record(index, field)
        return int(self.buf[offset:offset + 8].view(np.uint64)[0])


class DeviceArrays:
    """``stage.DeviceCopies`` over two arrays standing for a GPU's input and output;
    counts the segments that came in and went back.  A copy is made when it
    starts (``eager``: a copy in that starts too early overwrites what a peer
    has yet to sum) or when it is waited for (``lazy``: the stage reading an
    area before its copy is done reads the wrong values, and a result changed
    before its copy back is done goes back wrong)."""

    def __init__(self, src, out, lazy: bool = False):
        self.src, self.out, self.lazy = src, out, lazy
        self.segments_in = self.segments_out = 0
        self.started: dict = {}  # (direction, start) -> the copy, until waited for

    def _start(self, key, copy):
        assert key not in self.started, f"{key} started twice"
        if self.lazy:
            self.started[key] = copy
        else:
            copy()
            self.started[key] = lambda: None

    def into_host(self, area, start, stop):
        self._start(("in", start), lambda: np.copyto(area, self.src[start:stop]))

    def wait_into_host(self, start, stop):
        self.started.pop(("in", start))()
        self.segments_in += 1

    def from_host(self, result, start, stop):
        self._start(("out", start), lambda: np.copyto(self.out[start:stop], result))
        self.segments_out += 1

    def wait_from_host(self, start, stop):
        self.started.pop(("out", start))()

    def synchronize(self):
        """What a reader of the output waits for on the device: every copy started."""
        for copy in self.started.values():
            copy()
        self.started.clear()


class DevicePipelineArrays:
    """``stage.DevicePipeline`` over two arrays standing for a GPU's input and
    output: a segment of the host copy ``src`` is filled only when the stage says
    it is about to read it (before that it holds NaN), and the host copy ``out``
    is read into the device's output when the stage says a segment left."""

    def __init__(self, device_src, host_src, host_out, device_out):
        self.device_src, self.host_src = device_src, host_src
        self.host_out, self.device_out = host_out, device_out
        self.arrived: list = []
        self.departed: list = []

    def arrive(self, start, stop):
        np.copyto(self.host_src[start:stop], self.device_src[start:stop])
        self.arrived.append((start, stop))

    def depart(self, start, stop):
        np.copyto(self.device_out[start:stop], self.host_out[start:stop])
        self.departed.append((start, stop))


def run_hosts(sizes, calls, seed, switched=None, in_place=False, defer=False, device=None):
    """Drive hosts of ``sizes`` ranks through ``calls`` (per call, each rank's input
    arrays: calls[c][host][index]) in an order a seeded generator picks, with a
    model switch that sums each shard over the hosts, in float64 rounded once,
    whenever the scheduler lets it.  ``defer``: each call but the last leaves its
    last copy-out to the next (as a rank does when calls are queued).  ``device``:
    every call's input and output live "on a device": ``"direct"`` or
    ``"direct-lazy"`` (``DeviceArrays``, its copies made as they start or as
    they are waited for: the host arrays the stage is given hold NaN and must
    stay so) or ``"pipelined"`` (``DevicePipelineArrays``: each segment of the host
    copy filled as the stage asks for it, and sent back as it says).  Returns
    outputs[c][host][index]."""
    rng = np.random.default_rng(seed)
    shards = min(sizes)
    switched = len(sizes) > 1 if switched is None else switched
    hosts = [Host(k, shards, switched) for k in sizes]
    outputs = [[[a if in_place else np.empty_like(a) for a in host] for host in call]
               for call in calls]

    def rank_steps(h, i):
        stage = hosts[h].stages[i]
        copies = None
        for c, call in enumerate(calls):
            src = call[h][i]
            kind = call_kind(src.dtype, False, 32)
            more = (lambda c=c: c < len(calls) - 1) if defer else None
            segments = max(1, -(-src.size // SEGMENT))
            if device == "pipelined":
                host_src = np.full(src.size, np.nan, np.float32).view(src.dtype)
                host_out = np.empty_like(src)
                pipe = DevicePipelineArrays(src, host_src, host_out, outputs[c][h][i])
                yield from stage.allreduce(host_src, host_out, kind, more, pipe)
                bounds = [(t * SEGMENT, min(src.size, (t + 1) * SEGMENT))
                          for t in range(segments)]
                assert pipe.arrived == bounds  # each segment asked for once, in order
                if not (defer and c < len(calls) - 1):
                    assert pipe.departed == bounds
            elif device in ("direct", "direct-lazy"):
                host = np.full(src.size, np.nan, np.float32).view(src.dtype)
                last = copies
                copies = DeviceArrays(src, outputs[c][h][i], lazy=device == "direct-lazy")
                yield from stage.allreduce(host, host, kind, more, copies)
                assert last is None or not last.started  # waited for before the slot's reuse
                untouched = np.full(src.size, np.nan, np.float32).view(src.dtype)
                assert host.tobytes() == untouched.tobytes()
                assert copies.segments_in == copies.segments_out == segments or (
                    defer and c < len(calls) - 1)
                # every copy started was waited for but the last one back, the call
                # ends with it on its way (its reader waits on the device)
                assert set(copies.started) <= {("out", (segments - 1) * SEGMENT)}
            else:
                yield from stage.allreduce(src, outputs[c][h][i], kind, more)
        if copies is not None:
            copies.synchronize()

    runners = {(h, i): rank_steps(h, i) for h, k in enumerate(sizes) for i in range(k)}
    waiting: dict = {key: None for key in runners}  # the step each rank waits on
    launched: dict = {}  # (segment, shard) -> {host: view}
    done_launches: list = []  # (segment, shard) whose every host launched

    def ready(key):
        step = waiting[key]
        if step is None:
            return True
        h = key[0]
        return all(hosts[h].counter(j, step.field) >= step.target for j in step.ranks)

    while runners or done_launches:
        choices = [key for key in runners if ready(key)]
        if done_launches:
            choices.append("switch")
        assert choices, f"deadlock: every rank waits, nothing in flight: {waiting} {launched}"
        pick = choices[rng.integers(len(choices))]
        if pick == "switch":
            # a switch job ends its calls in order: the oldest of a shard first
            shard = done_launches[rng.integers(len(done_launches))][1]
            oldest = min(d for d in done_launches if d[1] == shard)
            done_launches.remove(oldest)
            segment = oldest[0]
            views = launched.pop((segment, shard))
            total = np.zeros(views[0].size, dtype=np.float64 if views[0].dtype == np.float32
                             else np.int64)
            for view in views.values():
                total += view
            for h, view in views.items():
                with np.errstate(over="ignore", invalid="ignore"):
                    np.copyto(view, total.astype(view.dtype) if view.dtype == np.int32
                              else total, casting="unsafe")
                memory.publish(hosts[h].buf, hosts[h].layout.record(shard, memory.R_REDUCED),
                                 segment + 1)
            continue
        try:
            step = next(runners[pick])
        except StopIteration:
            del runners[pick]
            continue
        if isinstance(step, Wait):
            waiting[pick] = step
        elif isinstance(step, Finished):
            waiting[pick] = None
        else:
            assert isinstance(step, Launch) and switched, step
            waiting[pick] = None
            views = launched.setdefault((step.segment, pick[1]), {})
            views[pick[0]] = step.shard
            if len(views) == len(sizes):
                done_launches.append((step.segment, pick[1]))
    return outputs


def two_stage_sum(arrays_by_host):
    """The model: each host's ranks summed in float64 and rounded to float32, then
    the hosts' sums added in float64 and rounded once (int32: modulo 2**32)."""
    if arrays_by_host[0][0].dtype == np.int32:
        return sum(a.astype(np.int64) for host in arrays_by_host for a in host).astype(np.int32)
    partial = [np.sum([a.astype(np.float64) for a in host], axis=0).astype(np.float32)
               for host in arrays_by_host]
    with np.errstate(over="ignore", invalid="ignore"):
        return np.sum([p.astype(np.float64) for p in partial], axis=0).astype(np.float32)


def inputs(rng, sizes, n, dtype):
    if dtype == np.int32:
        return [[rng.integers(-2**31, 2**31, n, dtype=np.int64).astype(np.int32) for _ in range(k)]
                for k in sizes]
    return [[(rng.standard_normal(n) * 10.0 ** rng.integers(-3, 4)).astype(np.float32)
             for _ in range(k)] for k in sizes]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sizes=st.lists(st.integers(1, 4), min_size=1, max_size=3),
       lengths=st.lists(st.integers(1, 3 * SEGMENT + 77), min_size=1, max_size=4),
       dtype=st.sampled_from([np.float32, np.int32]), seed=st.integers(0, 2**32 - 1),
       defer=st.booleans())
def test_every_interleaving_gives_every_rank_the_two_stage_sum(sizes, lengths, dtype, seed,
                                                                defer):
    """Hosts of unequal rank counts, calls of any length (several segments, more
    segments than slots, lengths shorter than the shards), any order of the ranks
    and the switch: every rank gets the two-stage sum, bit for bit the same."""
    rng = np.random.default_rng(seed)
    calls = [inputs(rng, sizes, n, dtype) for n in lengths]
    outputs = run_hosts(sizes, calls, seed, defer=defer)
    for call, out in zip(calls, outputs):
        expected = two_stage_sum(call)
        for host in out:
            for array in host:
                np.testing.assert_array_equal(array, expected)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sizes=st.lists(st.integers(1, 4), min_size=1, max_size=2),
       lengths=st.lists(st.integers(1, 3 * SEGMENT + 77), min_size=1, max_size=3),
       dtype=st.sampled_from([np.float32, np.int32]), seed=st.integers(0, 2**32 - 1),
       defer=st.booleans(), device=st.sampled_from(["direct", "direct-lazy", "pipelined"]))
def test_calls_whose_arrays_are_on_a_device_sum_alike(sizes, lengths, dtype, seed, defer,
                                                      device):
    """Input and output on a device (``copies``): straight, each segment comes
    into the rank's area and its sum goes back, once, the host arrays never
    touched, whether a copy is made as soon as it starts or only once waited
    for; pipelined, each segment of the host copy is read only once it
    arrived and sent back once summed, in order.  Every rank gets the two-stage
    sum, as from host arrays."""
    rng = np.random.default_rng(seed)
    calls = [inputs(rng, sizes, n, dtype) for n in lengths]
    outputs = run_hosts(sizes, calls, seed, defer=defer, device=device)
    for call, out in zip(calls, outputs):
        expected = two_stage_sum(call)
        for host in out:
            for array in host:
                np.testing.assert_array_equal(array, expected)


def test_in_place_calls_and_nonfinite_values():
    """``out`` may be ``src``; inf and NaN travel element by element."""
    rng = np.random.default_rng(1)
    n = 2 * SEGMENT + 5
    call = inputs(rng, [2, 2], n, np.float32)
    call[0][1][3] = np.inf
    call[1][0][7] = np.nan
    call[1][1][9] = -np.inf
    call[0][0][9] = np.inf
    expected = two_stage_sum(call)
    calls = [call]
    outputs = run_hosts([2, 2], calls, 5, in_place=True)
    for host in outputs[0]:
        for array in host:
            np.testing.assert_array_equal(array, expected)
    assert np.isposinf(expected[3]) and np.isnan(expected[7]) and np.isnan(expected[9])


@pytest.mark.parametrize("seed", range(8))
def test_a_call_that_reads_the_last_calls_output_waits_for_its_last_copy(seed):
    """Calls queued back to back, each in place on the same arrays: the next call
    must sum what the last one wrote, deferred last copy-out or not."""
    rng = np.random.default_rng(seed)
    first = inputs(rng, [2, 2], SEGMENT - 5, np.int32)  # one segment: all of it the tail
    keep = [[a.copy() for a in host] for host in first]
    calls = [first, first]  # the same arrays: call 2's input is call 1's output
    run_hosts([2, 2], calls, seed, in_place=True, defer=True)
    once = two_stage_sum(keep)
    twice = (once.astype(np.int64) * 4).astype(np.int32)
    for host in first:
        for array in host:
            np.testing.assert_array_equal(array, twice)


def test_a_host_alone_needs_no_switch():
    """One host: the owners publish their sums themselves, nothing is launched."""
    rng = np.random.default_rng(2)
    calls = [inputs(rng, [4], 5 * SEGMENT, np.float32)]
    outputs = run_hosts([4], calls, 3)  # run_hosts fails on a Launch with one host
    for array in outputs[0][0]:
        np.testing.assert_array_equal(array, two_stage_sum(calls[0]))


def test_ranks_that_disagree_raise_call_mismatch():
    """A host's ranks asking for different lengths: CallMismatchError naming both."""
    host = Host(2, 2, switched=False)
    a, b = np.ones(100, np.float32), np.ones(200, np.float32)
    steps = [host.stages[0].allreduce(a, a.copy(), call_kind(np.float32, False, 32)),
             host.stages[1].allreduce(b, b.copy(), call_kind(np.float32, False, 32))]
    assert isinstance(next(steps[0]), Wait) and isinstance(next(steps[1]), Wait)
    with pytest.raises(CallMismatchError, match="rank 1 asked for 200 float32.*rank 0 for 100"):
        next(steps[1])  # both copied in: the check


def test_a_peer_that_moves_on_during_the_check_is_no_mismatch(monkeypatch):
    """A rank checks call k against a peer that, done with call k (a shard's
    owner), writes its call k+1 of another size meanwhile: the look that read
    the peer's call number before the size finds it changed after, and the peer
    is left out (it checked call k itself).  The peer marks its number 0 while
    it writes the size and kind, so the look sees it change whenever they do."""
    host = Host(2, 2, switched=False)
    kind = call_kind(np.float32, False, 32)
    first = host.stages[0]
    first.calls = 1  # checking call 1, of 100 values
    host.stages[1].calls = 1
    peer = host.stages[1].allreduce(np.ones(200, np.float32), np.ones(200, np.float32), kind)
    original, moved = LocalStage._counter, []

    def counter(self, index, field):  # the peer writes its call 2 between two looks
        if field == R_ELEMENTS and index == 1 and not moved:
            moved.append(next(peer))  # its size, kind and number: 200 values, call 2
        return original(self, index, field)

    offset = host.layout.record(1, R_CALL)
    host.buf[offset:offset + 8].view(np.uint64)[0] = 1
    for field, value in ((R_ELEMENTS, 100), (R_KIND, kind)):
        at = host.layout.record(1, field)
        host.buf[at:at + 8].view(np.uint64)[0] = value
    monkeypatch.setattr(LocalStage, "_counter", counter)
    first._check_calls(1, 100, kind)  # no CallMismatchError
    assert host.counter(1, R_CALL) == 2 and host.counter(1, R_ELEMENTS) == 200
    with pytest.raises(CallMismatchError):  # a peer at call 2 of another size: checked
        first._check_calls(2, 100, kind)


# ---------------------------------------------------------------- the operations' C twin
needs_c = pytest.mark.skipif(memory.OPS is None, reason="the C twin (_memory) is not built")
REF = memory.REFERENCE


@needs_c
@settings(max_examples=200, deadline=None)
@given(count=st.integers(1, 9), n=st.integers(0, 3000), dtype=st.sampled_from(["f", "i"]),
       seed=st.integers(0, 2**32 - 1), specials=st.booleans(),
       kernel=st.sampled_from([None, "lanes", "blocks", "pair"]), in_place=st.booleans())
def test_reduce_into_c_equals_reference(count, n, dtype, seed, specials, kernel, in_place):
    """Every float32 kernel (the calibrated choice, or each by name: pair only
    takes two sources), in place or not: the reference's bits."""
    rng = np.random.default_rng(seed)
    if dtype == "i":
        srcs = [rng.integers(-2**31, 2**31, n, dtype=np.int64).astype(np.int32)
                for _ in range(count)]
    else:
        srcs = [(rng.standard_normal(n) * 10.0 ** rng.integers(-40, 39, n)).astype(np.float32)
                for _ in range(count)]
        if specials and n:
            for src in srcs:
                src[rng.integers(0, n, 3)] = rng.choice(
                    np.array([np.inf, -np.inf, np.nan, 3.4e38, -3.4e38], np.float32), 3)
    dtype_ = srcs[0].dtype
    ours, theirs = np.empty(n, dtype_), np.empty(n, dtype_)
    with np.errstate(all="ignore"):
        REF.reduce_into(ours, srcs)
    if in_place:  # the sum into its first source
        theirs = srcs[0] = srcs[0].copy()
    memory.OPS.reduce_into(theirs, srcs, 1, kernel)
    # the same bits, but for a NaN's sign and payload, which no rank may rely on
    nan = np.isnan(ours) if dtype == "f" else np.zeros(n, bool)
    np.testing.assert_array_equal(nan, np.isnan(theirs) if dtype == "f" else nan)
    np.testing.assert_array_equal(ours.view(np.uint32)[~nan], theirs.view(np.uint32)[~nan])


@needs_c
@pytest.mark.parametrize("ops", [REF, memory.OPS], ids=["reference", "c"])
@pytest.mark.parametrize("dtype", [np.float32, np.int32])
def test_a_destination_that_overlaps_a_source_in_part_is_refused(ops, dtype):
    """In place (the destination a source) or apart: a destination two elements
    into a source, whose sum the C kernels read after writing it, is refused by
    both twins alike (they gave different sums)."""
    a = np.arange(1, 41, dtype=dtype)
    with pytest.raises(ValueError, match="overlaps"):
        ops.reduce_into(a[2:], [a[:-2], np.ones(38, dtype)])
    ops.reduce_into(a, [a, np.ones(40, dtype)])  # in place: taken
    assert a[0] == 2


@needs_c
@settings(max_examples=60, deadline=None)
@given(count=st.integers(1, 5), n=st.integers(0, 400_000), threads=st.integers(1, 6),
       dtype=st.sampled_from(["f", "i"]), seed=st.integers(0, 2**32 - 1))
def test_copies_and_sums_cut_over_threads_equal_reference(count, n, threads, dtype, seed):
    """reduce_into and copy_into over several threads (parts of at least 64 KiB,
    on cache lines): the reference's result, whatever the cut."""
    rng = np.random.default_rng(seed)
    srcs = [rng.integers(-2**31, 2**31, n, dtype=np.int64).astype(np.int32)
            for _ in range(count)]
    if dtype == "f":
        srcs = [(s.astype(np.float64) * 1e-3).astype(np.float32) for s in srcs]
    ours, theirs = np.empty(n, srcs[0].dtype), np.full(n, 7, srcs[0].dtype)
    REF.reduce_into(ours, srcs)
    memory.OPS.reduce_into(theirs, srcs, threads)
    np.testing.assert_array_equal(ours.view(np.uint32), theirs.view(np.uint32))
    raw = srcs[0].view(np.uint8)[:max(0, srcs[0].nbytes - seed % 4)]  # odd byte counts
    copied = np.zeros_like(raw)
    memory.OPS.copy_into(copied, raw, threads)
    np.testing.assert_array_equal(copied, raw)
    with pytest.raises(ValueError, match="differ in size"):
        memory.OPS.copy_into(copied[:-1] if raw.size else np.empty(1, np.uint8), raw, threads)


@needs_c
@pytest.mark.parametrize("seed", range(3))
def test_a_float32_addition_rounds_as_the_float64_sum_does(seed):
    """The pair kernel adds two float32 arrays in float32: the float64 sum rounded
    once gives the same bits (double rounding is innocuous at more than twice the
    precision), for operands of every exponent apart, subnormals, overflow, inf."""
    rng = np.random.default_rng(seed)
    n = 300_000
    a, b = (rng.standard_normal(n) * 10.0 ** rng.integers(-45, 39, n) for _ in range(2))
    with np.errstate(over="ignore"):  # (some overflow to inf: cases too)
        a, b = a.astype(np.float32), b.astype(np.float32)
        b[::7] = -a[::7] * np.float32(1 + 2**-20)  # near cancellation
    a[::11] = rng.choice(np.array([np.inf, -np.inf, 3.4e38, -3.4e38, 1e-45], np.float32),
                         a[::11].size)
    ours, theirs = np.empty(n, np.float32), np.empty(n, np.float32)
    with np.errstate(all="ignore"):
        REF.reduce_into(ours, [a, b])
    memory.OPS.reduce_into(theirs, [a, b], 1, "pair")
    nan = np.isnan(ours)
    np.testing.assert_array_equal(nan, np.isnan(theirs))
    np.testing.assert_array_equal(ours.view(np.uint32)[~nan], theirs.view(np.uint32)[~nan])


@needs_c
def test_the_kernels_in_use_are_named():
    chosen = memory.OPS.kernels()
    assert chosen["pair"] in ("lanes", "blocks", "pair") and chosen["more"] in ("lanes", "blocks")
    with pytest.raises(ValueError, match="no kernel named"):
        memory.OPS.reduce_into(np.empty(4, np.float32), [np.ones(4, np.float32)], 1, "fast")


def test_local_threads_follow_the_cores_over_the_ranks(monkeypatch):
    from switchml.config import auto_local_threads
    from switchml.worker.local.worker import local_threads

    assert [auto_local_threads(k, cores=16) for k in (1, 2, 4, 8, 16, 32)] == [4, 4, 4, 2, 1, 1]
    assert auto_local_threads(2, cores=2) == 1
    monkeypatch.setenv("SWITCHML_LOCAL_THREADS", "3")
    assert local_threads(8) == 3
    monkeypatch.setenv("SWITCHML_LOCAL_THREADS", "0")
    with pytest.raises(ValueError, match="SWITCHML_LOCAL_THREADS=0"):
        local_threads(2)


def _header(ranks=3):
    layout = Layout(ranks, 1, 1, 1024)
    return layout, np.zeros(layout.header_bytes, np.uint8)


@needs_c
@pytest.mark.parametrize("ops", [REF, memory.OPS], ids=["reference", "c"])
def test_a_counter_past_the_header_is_refused_whatever_its_offset(ops):
    """An offset whose end wraps around (2**63 - 8 + 8): refused as any offset past
    the header, by the C twin as by the reference (it wrote past the memory)."""
    _, header = _header()
    for offset in (len(header), 2**63 - 8):
        with pytest.raises(ValueError):
            ops.publish(header, offset, 1)
        with pytest.raises(ValueError):
            ops.wait_for(header, [offset], 0, 1, 0.01, [])


@needs_c
@given(ops=st.lists(st.tuples(st.sampled_from(["publish", "attach", "fail"]),
                              st.integers(0, 2), st.integers(0, 4), st.integers(0, 2**40)),
                    max_size=20))
def test_counter_operations_c_equal_reference(ops):
    """publish (a counter only grows), attach and fail leave the same bytes and
    return the same values."""
    layout, ours = _header()
    theirs = ours.copy()
    for op, rank, field, value in ops:
        offset = layout.record(rank, 8 * field)
        if op == "publish":
            REF.publish(ours, offset, value)
            memory.OPS.publish(theirs, offset, value)
        elif op == "attach":
            assert REF.attach(ours) == memory.OPS.attach(theirs)
        else:
            reason = f"rank {rank} failed {value}".encode()
            assert (REF.fail(ours, field + 1, rank, reason)
                    == memory.OPS.fail(theirs, field + 1, rank, reason))
        np.testing.assert_array_equal(ours, theirs)


@needs_c
@pytest.mark.parametrize("ops", [REF, memory.OPS], ids=["reference", "c"])
def test_wait_for_says_why_it_returned(ops):
    import os
    import subprocess
    layout, header = _header()
    records = [layout.record(j, 0) for j in range(3)]
    field = memory.R_COPIED_IN
    for j in range(3):
        REF.publish(header, records[j] + field, 5)
    assert ops.wait_for(header, records, field, 5, 1.0, []) == (memory.REACHED, 0)
    assert ops.wait_for(header, records, field, 6, 0.01, []) == (memory.TIMED_OUT, 0)
    REF.publish(header, records[0] + field, 6)
    assert ops.wait_for(header, records, field, 6, 0.01, []) == (memory.TIMED_OUT, 1)
    REF.publish(header, records[2] + R_STATE, memory.LEFT)
    assert ops.wait_for(header, records, field, 6, 1.0, []) == (memory.CLOSED, 2)
    header[records[2] + R_STATE] = memory.ATTACHED
    child = subprocess.Popen(["true"])
    fd = os.pidfd_open(child.pid)
    child.wait()
    try:
        assert ops.wait_for(header, records, field, 6, 1.0, [-1, fd]) == (memory.EXITED, 1)
    finally:
        os.close(fd)
    REF.fail(header, memory.FAILED_OTHER, 1, b"x")
    assert ops.wait_for(header, records, field, 6, 1.0, []) == (memory.FAILED, 0)


#: A wait for peers that never come, in a process's main thread (where Python runs
#: signal handlers), SIGINT 0.2 s in: how it ended, and when.
CTRL_C_WAIT = """
import signal, sys, threading, time
from switchml.worker.local import memory
from test_local import _header
ops = memory.OPS if sys.argv[1] == "c" else memory.REFERENCE
# Ctrl-C's own handler, whatever this process inherited (a background job's shell
# starts its children with SIGINT ignored)
signal.signal(signal.SIGINT, signal.default_int_handler)
layout, header = _header()
records = [layout.record(j, 0) for j in range(2)]
threading.Timer(0.2, signal.raise_signal, (signal.SIGINT,)).start()
start = time.monotonic()
try:
    ops.wait_for(header, records, memory.R_COPIED_IN, 1, 10.0, [])
    print("returned", time.monotonic() - start)
except KeyboardInterrupt:
    print("interrupted", time.monotonic() - start)
"""


@needs_c
@pytest.mark.parametrize("ops", ["reference", "c"])
def test_ctrl_c_ends_a_wait_at_once(ops):
    """SIGINT while the main thread waits for its peers: KeyboardInterrupt at once,
    as the reference's sleep lets through (the C wait slept on to its timeout, 30 s
    by default, before Ctrl-C took).  In a process of its own: a test runner's
    worker may run the test off the main thread, where no handler runs."""
    import subprocess
    import sys
    here = os.path.dirname(os.path.abspath(__file__))
    done = subprocess.run([sys.executable, "-c", CTRL_C_WAIT, ops], capture_output=True,
                          text=True, timeout=60, cwd=here,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join(
                              [here, os.path.dirname(here), os.environ.get("PYTHONPATH", "")])))
    how, seconds = done.stdout.split()
    assert how == "interrupted" and float(seconds) < 3.0, done.stdout + done.stderr


# ---------------------------------------------------------------- who shares a host
def record(memory, machine="m", pid=1, segment=SEGMENT):
    return HostRecord(memory, machine, pid, segment)


def test_placement_groups_by_memory_and_shards_by_the_smallest_host():
    records = [record("b", pid=10), record("a", pid=11), record("b", pid=12),
               record("c", "n", 13), record("a", pid=14), record("b", pid=15)]
    p = Placement.of(records, 5)
    assert p.groups == ((0, 2, 5), (1, 4), (3,))
    assert (p.hosts, p.shards, p.group, p.index, p.shard) == (3, 1, 0, 2, None)
    assert p.shard_members(0) == (0, 1, 3)
    assert Placement.of(records, 2).shard == None  # noqa: E711  (index 1 >= 1 shard)
    assert Placement.of(records, 4).shard is None and Placement.of(records, 1).shard == 0
    # machine "m" holds groups a and b that cannot share memory: said, kept apart
    assert Placement.of(records, 0).apart() == [(0, 1, 2, 4, 5)]


def test_placement_refuses_ranks_that_cut_segments_differently():
    with pytest.raises(JoinRefusedError, match="SWITCHML_LOCAL_SEGMENT"):
        Placement.of([record("a"), record("a", segment=2 * SEGMENT)], 0)
    with pytest.raises(JoinRefusedError, match="on every rank, or on none"):
        Placement.of([record("a"), record("a", segment=0)], 0)  # told, and not told


MIB = 2**20 // 4  # elements


def test_a_segment_is_2_mib_a_local_thread_as_shared_memory_allows():
    """Unasked, a segment is 2 MiB for each thread a rank copies and sums with (the
    host's cores over its ranks, 1 to 4), halved down to 2 MiB while the host's
    shared memory would take more than half of what /dev/shm has free."""
    assert auto_segment(2, 2) == auto_segment(4, 2) == 2 * MIB  # this machine's shape
    assert auto_segment(2, 16) == auto_segment(4, 16) == 8 * MIB
    assert auto_segment(8, 16) == 4 * MIB and auto_segment(1, 64) == 8 * MIB
    # 4 ranks of 8 MiB: 2 slots of 5 areas, 80 MiB; 64 MiB free (docker's default)
    assert auto_segment(4, 16, free_shm=64 * 2**20) == 2 * MIB
    assert auto_segment(4, 16, free_shm=150 * 2**20) == 4 * MIB
    assert auto_segment(4, 16, free_shm=2**20) == 2 * MIB  # never below 2 MiB


def test_a_job_told_no_segment_takes_the_smallest_its_hosts_choose():
    """Every host cuts its calls alike: told (alike), the job's segment is that;
    else the smallest ``auto_segment`` of its hosts, from their records."""
    def told_nothing(memory, cores, free_shm=0, pid=1):
        return HostRecord(memory, "m", pid, 0, cores, free_shm)

    big = [told_nothing("a", 16, pid=1), told_nothing("a", 16, pid=2)]
    assert Placement.of(big, 0).segment == 8 * MIB
    # a host of one rank on 2 cores: 2 threads, 4 MiB
    assert Placement.of(big + [told_nothing("b", 2, pid=3)], 0).segment == 4 * MIB
    # a rank that may run on fewer cores, or a host with less room, speaks for its host
    assert Placement.of(big + [told_nothing("a", 4, pid=3)], 0).segment == 2 * MIB
    tight = told_nothing("a", 16, free_shm=50 * 2**20, pid=3)  # 3 ranks: 2 slots of 4 areas
    assert Placement.of(big + [tight], 0).segment == 2 * MIB
    assert Placement.of([record("a", segment=3 * 1024)] * 2, 0).segment == 3 * 1024


@given(st.text(max_size=40))
def test_host_records_decode_only_what_encode_writes(text):
    try:
        decoded = HostRecord.decode(text)
    except ValueError:
        return
    assert HostRecord.decode(decoded.encode()) == decoded


def test_shards_start_at_whole_pages():
    host = Host(3, 3, switched=True)
    bounds = host.stages[0].shard_bounds(10 * SHARD_ALIGN + 3)
    assert [b[0] % SHARD_ALIGN for b in bounds] == [0, 0, 0]
    assert bounds[-1][1] == 10 * SHARD_ALIGN + 3


def test_a_host_gives_its_shard_job_up_naming_the_rank_it_lost():
    """The switch job of a host's shard has hosts for ranks: a rank of this host
    that died is no rank of it, so the host gives it up naming that rank as the
    culprit the other hosts hear (the switch passes ``culprits`` on), blaming no
    host; the other hosts name it to their ranks as the one that failed."""
    from switchml.errors import CallMismatchError, SwitchMLTimeoutError
    from switchml.worker.local.worker import LocalStageWorker

    given = LocalStageWorker._in_shard_ranks(SwitchMLTimeoutError("rank 1 died", [1]))
    assert isinstance(given, SwitchMLTimeoutError)
    assert given.missing_ranks == [] and given.culprits == [1] and str(given) == "rank 1 died"
    other = CallMismatchError("ranks disagree")
    assert LocalStageWorker._in_shard_ranks(other) is other


def test_a_shard_jobs_failure_names_the_culprits_else_the_hosts_senders():
    """A failure of a shard's switch job, told in this job's ranks: the culprits a
    host that gave up named, where there are; else each host the switch names by
    its rank that sends the shard."""
    from types import SimpleNamespace

    from switchml.errors import SwitchMLTimeoutError
    from switchml.worker.local.worker import LocalStageWorker

    me = SimpleNamespace(job="local", placement=SimpleNamespace(
        shard=0, shard_members=lambda shard: [0, 2]))  # host 0 sends by rank 0, host 1 by 2
    gave_up = SwitchMLTimeoutError("rank 0 of job 'local.shard0' gave up: rank 1 died",
                                   culprits=[1])
    told = LocalStageWorker._in_job_ranks(me, gave_up)
    assert told.missing_ranks == [1] and str(told).startswith("job 'local': rank 1 failed")
    gone = SwitchMLTimeoutError("rank 1 of job 'local.shard0' disconnected", [1])
    assert LocalStageWorker._in_job_ranks(me, gone).missing_ranks == [2]


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
def test_a_host_overlaps_device_copies_with_its_sums_and_never_races_them(lazy):
    """One host (the case the overlap is for): the next segment's input comes in
    and the last one's sum goes back while this one is summed.  Over many
    interleavings of 2 to 4 ranks, an input copied in before every owner summed
    what the area held (``eager``), or read before its copy is done (``lazy``),
    shows as a wrong sum."""
    for seed in range(150):
        rng = np.random.default_rng(seed)
        sizes = [int(rng.integers(2, 5))]
        lengths = [int(rng.integers(2 * SEGMENT, 5 * SEGMENT)) for _ in range(2)]
        calls = [inputs(rng, sizes, n, np.float32) for n in lengths]
        outputs = run_hosts(sizes, calls, seed, defer=bool(seed % 2),
                            device="direct-lazy" if lazy else "direct")
        for call, out in zip(calls, outputs):
            expected = two_stage_sum(call)
            for array in out[0]:
                np.testing.assert_array_equal(array, expected, err_msg=f"seed {seed}")


@pytest.mark.parametrize("content", [
    b"", b"x" * 10,
    struct.pack("<QIIIIQ", memory.MAGIC, memory.VERSION, 0, 1, 2, 1024) + bytes(4096),
    struct.pack("<QIIIIQ", memory.MAGIC, memory.VERSION, 2, 1, 2, 0) + bytes(4096),
    struct.pack("<QIIIIQ", memory.MAGIC, memory.VERSION, 2, 0, 0, 1024) + bytes(4096),
    struct.pack("<QIIIIQ", memory.MAGIC, memory.VERSION - 1, 2, 1, 2, 1024) + bytes(4096),
], ids=["empty", "short", "no-ranks", "no-segment", "no-slots", "old-version"])
def test_a_segment_file_no_rank_wrote_is_a_clear_error(content):
    """A file under a segment's name that is not one of this layout (cut short, a
    header no rank writes): SwitchMLError saying so, not mmap's or struct's."""
    name = f"switchml-test-foreign-{os.getpid()}"
    path = os.path.join(memory.SHM_DIR, name)
    with open(path, "wb") as f:
        f.write(content)
    try:
        with pytest.raises(SwitchMLError, match="shared memory"):
            memory.Segment.open(name)
    finally:
        os.unlink(path)
