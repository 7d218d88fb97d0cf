"""The opt-in 16-bit wire: two biased 16-bit values a 32-bit word.

Half the bytes each way; the switch's ordinary 32-bit adds sum both halves at
once and no half can carry into the other (``quant.scale_bits16``).  Results
are bit-identical on every rank and within ``quant.error_bound16`` of the exact
sum, under loss, duplication and reordering; the same switch serves 32-bit and
16-bit calls of one job.
"""

import numpy as np
import pytest
from conftest import run_ranks
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import switchml
from switchml import quant, wire
from switchml.sim.network import Faults, Simulation

SETTINGS = settings(max_examples=80, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
finite = st.floats(width=32, allow_nan=False, allow_infinity=False, allow_subnormal=True)


def test_n_biased_contributions_fit_a_half_word():
    for n in (1, 2, 3, 4, 5, 8, 31, 32, 100):
        b = quant.scale_bits16(n)
        assert n * 2 ** (b + 1) <= 0xFFFF < n * 2 ** (b + 2)


@SETTINGS
@given(world=st.integers(1, 6), size=st.integers(0, 3000), seed=st.integers(0, 2**16),
       scale=st.sampled_from([1e-30, 1e-3, 1.0, 1e3, 1e30]),
       loss=st.sampled_from([0.0, 0.05]), dup=st.sampled_from([0.0, 0.05]),
       reorder=st.booleans())
def test_sums_within_the_bound_and_identical_on_every_rank(world, size, seed, scale, loss, dup,
                                                           reorder):
    rng = np.random.default_rng(seed)
    arrays = [(rng.standard_normal(size) * scale).astype(np.float32) for _ in range(world)]
    if size:
        arrays[0][rng.integers(size)] = 0.0
    sim = Simulation(world, slots=4, packet_elements=128, seed=seed,
                     faults=Faults(loss=loss, duplicate=dup, jitter=200e-6 if reorder else 0.0))
    outs = sim.allreduce(arrays, wire_bits=16)
    for out in outs:
        assert out.tobytes() == outs[0].tobytes()
    exact = np.sum([a.astype(np.float64) for a in arrays], axis=0)
    bound = quant.error_bound16(arrays, 256)
    assert np.all(np.abs(outs[0].astype(np.float64) - exact) <= bound)


@SETTINGS
@given(arrays=st.integers(1, 4).flatmap(lambda n: st.integers(1, 700).flatmap(
    lambda size: st.lists(hnp.arrays(np.float32, size, elements=finite), min_size=n,
                          max_size=n))))
def test_any_finite_floats_subnormal_to_huge(arrays):
    outs = Simulation(len(arrays), slots=2, packet_elements=64).allreduce(arrays, wire_bits=16)
    exact = np.sum([a.astype(np.float64) for a in arrays], axis=0)
    assert np.all(np.abs(outs[0].astype(np.float64) - exact) <= quant.error_bound16(arrays, 128))


def test_half_the_bytes_of_the_32_bit_wire():
    arrays = [np.ones(128 * 40, np.float32) * (r + 1) for r in range(3)]
    narrow, wide = Simulation(3, packet_elements=128), Simulation(3, packet_elements=128)
    assert (narrow.allreduce(arrays, wire_bits=16)[0] == 6).all()
    assert (wide.allreduce(arrays)[0] == 6).all()
    # the same header and lane table a packet, half as many packets
    assert narrow.datagrams < 0.6 * wide.datagrams


def test_non_finite_values_element_by_element_as_on_the_32_bit_wire():
    a = np.ones(1000, np.float32)
    b = np.ones(1000, np.float32)
    b[5], a[700], b[700] = np.inf, np.inf, -np.inf
    out = Simulation(2, packet_elements=128).allreduce([a, b], wire_bits=16)[0]
    assert out[5] == np.inf and np.isnan(out[700])
    rest = np.ones(1000, bool)
    rest[[5, 700]] = False
    assert (out[rest] == 2).all()


def test_the_bound_is_half_a_16_bit_step_a_contribution():
    arrays = [np.full(10, 1.0 + 2.0**-20, np.float32)] * 4  # chunk exponent E = 1
    step = 2.0 ** (1 - quant.scale_bits16(4))
    b16, b32 = quant.error_bound16(arrays, 128), quant.error_bound(arrays, 128)
    assert np.all(b16 >= 4 * step / 2) and np.all(b16 <= 4 * step / 2 + 1e-6)
    assert np.all(b32 < b16 / 1000)  # 16 bits are coarser: the bound says so


@pytest.mark.parametrize("fastpath", [False, True])
def test_through_a_switch_with_32_and_16_bit_calls(fastpath):
    from switchml.switch.dataplane import fastpipeline
    if fastpath and not fastpipeline.available():
        pytest.skip("the C switch is not built")
    x = [np.linspace(-1, 1, 100_000, dtype=np.float32) * (r + 1) for r in range(3)]
    with switchml.Switch(packet_elements=1024, slots=64, slots_per_job=16,
                         fastpath=fastpath) as sw:
        def body(rank):
            with switchml.Worker(sw.address, rank, 3, timeout=20) as w:
                a = w.allreduce(x[rank], bits=16)
                b = w.allreduce(x[rank])
                h = w.allreduce(x[rank].astype(np.float16), bits=16)
                with pytest.raises(ValueError):
                    w.allreduce(np.ones(3, np.int32), bits=16)
                with pytest.raises(ValueError):
                    w.allreduce(x[rank], sparse=True, bits=16)
                return a, b, h, w.counters["bytes_sent"]

        results = run_ranks(3, body)
    exact = np.sum([a.astype(np.float64) for a in x], axis=0)
    for a, b, h, _ in results:
        assert a.tobytes() == results[0][0].tobytes()
        assert np.all(np.abs(a - exact) <= quant.error_bound16(x, 2048))
        assert np.all(np.abs(b - exact) <= quant.error_bound(x, 1024))
        halves = [v.astype(np.float16) for v in x]
        exact16 = np.sum([v.astype(np.float64) for v in halves], axis=0)
        assert h.dtype == np.float16
        assert np.all(np.abs(h - exact16) <= quant.error_bound_float16(halves, 2048,
                                                                        wire_bits=16))


def test_wire_bits_from_the_environment(switch, monkeypatch):
    monkeypatch.setenv("SWITCHML_WIRE_BITS", "16")
    with switchml.Worker(switch.address, 0, 1) as w:
        out = w.allreduce(np.full(5000, 0.5, np.float32))
        assert (out == 0.5).all()
        assert w.counters["bytes_sent"] < 5000 * 4 * 0.6  # two values a word
    monkeypatch.setenv("SWITCHML_WIRE_BITS", "8")
    with pytest.raises(ValueError):
        switchml.Worker(switch.address, 0, 1)
    assert wire.DTYPE_FLOAT16_WIRE == 2


def test_the_c_engine_carries_the_16_bit_wire_as_python_does():
    from switchml.worker.engine import compiled
    if compiled._fastengine is None:
        pytest.skip("the C engine is not built")
    rng = np.random.default_rng(3)
    arrays = [rng.standard_normal(128 * 2 * 9 + 5).astype(np.float32) for _ in range(3)]
    runs = []
    for on_c in (False, True):
        sim = Simulation(3, slots=4, packet_elements=128, seed=4, compiled=on_c,
                         faults=Faults(loss=0.1, duplicate=0.1, jitter=0.001))
        runs.append(sim.allreduce(arrays, wire_bits=16, max_time=1e9))
        assert isinstance(sim.call_ops[0], compiled.CompiledDenseAllreduce) == on_c
    assert [o.tobytes() for o in runs[0]] == [o.tobytes() for o in runs[1]]
