"""inf and NaN element by element, on the dense and the sparse path, 32 and 16 bits.

Where some rank contributes an inf or a NaN the result is what IEEE addition
(and gloo) gives: NaN for a NaN or for both infinities, else the infinity's
sign; every other element, of the same packet too, is bit for bit the sum it
would be without them.  Any positions, any mix, any number of ranks, with loss
and reordering; the exchange that does it runs only when there is something to
repair.
"""

import numpy as np
from conftest import reference_sum
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from switchml import quant
from switchml.sim.network import Faults, Simulation

K = 64
SETTINGS = settings(max_examples=120, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
SPECIALS = [np.inf, -np.inf, np.nan]


@st.composite
def cases(draw):
    world = draw(st.integers(1, 4))
    size = draw(st.integers(1, 6 * K))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    arrays = [(rng.standard_normal(size) * 10.0 ** draw(st.integers(-3, 3))).astype(np.float32)
              for _ in range(world)]
    density = draw(st.sampled_from([1.0, 0.2]))  # block-sparse inputs for the sparse path
    if density < 1:
        for a in arrays:
            for b in range(0, size, 16):
                if rng.random() > density:
                    a[b:b + 16] = 0
    for _ in range(draw(st.integers(0, 6))):
        rank, index = draw(st.integers(0, world - 1)), draw(st.integers(0, size - 1))
        arrays[rank][index] = draw(st.sampled_from(SPECIALS))
    return arrays


@SETTINGS
@given(arrays=cases(), sparse=st.booleans(), wire_bits=st.sampled_from([32, 16]),
       faulty=st.booleans(), seed=st.integers(0, 99))
def test_ieee_where_specials_came_and_the_plain_sum_elsewhere(arrays, sparse, wire_bits, faulty,
                                                             seed):
    if wire_bits == 16:
        sparse = False  # the 16-bit wire is dense
    world = len(arrays)
    sim = Simulation(world, slots=4, packet_elements=K, block_elements=16, seed=seed,
                     faults=Faults(loss=0.05, duplicate=0.05, jitter=1e-4) if faulty else None)
    outs = sim.allreduce(arrays, max_time=1e9, sparse=sparse, wire_bits=wire_bits)
    special = np.any([~np.isfinite(a) for a in arrays], axis=0)
    with np.errstate(invalid="ignore"):
        ieee = np.sum([a.astype(np.float64) for a in arrays], axis=0).astype(np.float32)
    for out in outs:
        assert out.tobytes() == outs[0].tobytes()
        assert np.array_equal(out[special], ieee[special], equal_nan=True)
    finite = [np.where(np.isfinite(a), a, np.float32(0)) for a in arrays]
    if wire_bits == 32:  # bit for bit the dense sum of the finite values
        plain = reference_sum(finite, K)
        assert np.array_equal(outs[0][~special], plain[~special])
    else:
        bound = quant.error_bound16(finite, 2 * K)
        exact = np.sum([a.astype(np.float64) for a in finite], axis=0)
        assert np.all(np.abs(outs[0][~special] - exact[~special]) <= bound[~special])
    calls = 1 + 2 * bool(special.any())  # the follow-up runs only when needed
    assert sim.memberships[0].next_seq == calls
