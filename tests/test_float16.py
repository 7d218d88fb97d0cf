"""float16 arrays through the switch: summed as float32, rounded to float16 once.

Every rank gets the same float16 bits, within ``quant.error_bound_float16`` of
the exact sum; it used to raise TypeError (only float32 and int32 were taken).
"""

import numpy as np
import pytest
from conftest import run_ranks
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import switchml
from switchml import quant

WORLD = 3
halves = hnp.arrays(np.float16, st.integers(0, 3000),
                    elements=st.floats(-2000, 2000, width=16, allow_subnormal=True))


@pytest.fixture(scope="module")
def workers():
    with switchml.Switch(packet_elements=1024, slots=64, slots_per_job=16) as sw:
        ws = run_ranks(WORLD, lambda r: switchml.Worker(sw.address, r, WORLD, timeout=20))
        yield ws, sw
        run_ranks(WORLD, lambda r: ws[r].close())


@settings(max_examples=25, deadline=None, suppress_health_check=[
    HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture])
@given(st.data())
def test_float16_sums_are_bit_identical_and_within_the_bound(workers, data):
    ws, sw = workers
    first = data.draw(halves)
    inputs = [first] + [data.draw(hnp.arrays(np.float16, first.shape, elements=st.floats(
        -2000, 2000, width=16, allow_subnormal=True))) for _ in range(WORLD - 1)]
    sparse = data.draw(st.sampled_from([False, True]))
    outs = run_ranks(WORLD, lambda r: ws[r].allreduce(inputs[r], sparse=sparse))
    for out in outs:
        assert out.dtype == np.float16 and out.shape == first.shape
        assert out.tobytes() == outs[0].tobytes()  # bit-identical on every rank
    exact = np.sum([a.astype(np.float64) for a in inputs], axis=0)
    chunk = ws[0].membership.packet_elements
    bound = quant.error_bound_float16(inputs, chunk)
    assert np.all(np.abs(outs[0].astype(np.float64) - exact) <= bound)


def test_float16_in_place_and_out_of_range(workers):
    ws, _ = workers
    big = [np.full(5, 30000, np.float16) for _ in range(WORLD)]  # 90000 > float16's max
    run_ranks(WORLD, lambda r: ws[r].allreduce(big[r], out=big[r]))
    for b in big:
        assert np.isposinf(b).all()  # rounded as float16 rounds: past its range, inf
    x = [np.full((2, 3), 0.5, np.float16) for _ in range(WORLD)]
    outs = run_ranks(WORLD, lambda r: ws[r].allreduce(x[r], out=x[r]))
    for r in range(WORLD):
        assert outs[r] is x[r] and (x[r] == 1.5).all()


def test_the_bound_is_tight_enough_to_fail():
    """A float16 result off by one ulp more than the rounding allows is caught."""
    inputs = [np.full(4, 1.0009765625, np.float16)] * 3  # 1 + 2**-10
    bound = quant.error_bound_float16(inputs, 1024)
    exact = 3 * 1.0009765625
    wrong = np.float16(exact) + 2 * np.spacing(np.float16(exact))
    assert np.all(abs(float(wrong) - exact) > bound)


def test_the_bound_is_inf_where_no_finite_one_holds():
    """A sum past float16's range is +inf (as float16 rounds), and an inf or NaN
    input makes its element's sum one: no finite bound holds there, and the
    bound says inf, as error_bound does (not NaN, which no error is within)."""
    over = [np.float16([60000, 1]), np.float16([5536, 1])]
    assert quant.error_bound_float16(over, 16).tolist()[0] == np.inf
    special = [np.float16([np.inf, 1, np.nan]), np.float16([1, 1, 1])]
    bound = quant.error_bound_float16(special, 16)
    assert np.isposinf(bound[[0, 2]]).all() and np.isfinite(bound[1])
