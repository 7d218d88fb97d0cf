"""The Membership's RTT estimator and window cross into the C engine and back by
their field names (recovery.py's ``STATE``), not as positional tuples."""

import math

import numpy as np
import pytest

from switchml.sim.network import Simulation
from switchml.worker.engine import compiled
from switchml.worker.engine.recovery import CongestionWindow, RttEstimator

pytestmark = pytest.mark.skipif(compiled._fastengine is None, reason="the C engine is not built")


def one_call(rtt=None, window=None):
    """A one-rank compiled call's core, from a membership whose state is replaced."""
    sim = Simulation(1, slots=4, packet_elements=8, compiled=True)
    s = sim.memberships[0]
    if rtt is not None:
        s.rtt.state = lambda: rtt  # type: ignore[method-assign]
    if window is not None:
        s.window.state = lambda: window  # type: ignore[method-assign]
    data = np.arange(64, dtype=np.float32)
    return s, compiled.CompiledDenseAllreduce(s, data, np.empty_like(data), 0, 0.0)


def test_the_export_names_fields_recovery_py_has():
    s, call = one_call()
    state = call._core.export_state()
    assert set(state) == {"slot_msgs", "rtt", "window", "counters", "reordering"}
    assert set(state["rtt"]) <= set(RttEstimator.STATE)
    assert set(state["window"]) <= set(CongestionWindow.STATE)
    assert not any(name.isupper() for name in state["window"])  # settings are not written


def test_a_state_round_trips_through_the_engine():
    rtt = RttEstimator()
    rtt.add_sample(0.002)
    rtt.on_premature_timeout(0.0, 0.001)
    window = CongestionWindow(32)
    window.cwnd, window._undo, window._queue_at = 7.5, (1.0, 12.0, 6.0), 2.5
    s, call = one_call(rtt.state(), window.state())
    call.sync()
    for name in ("srtt", "rttvar", "min_rtt", "_rto", "kept_backoff", "_kept_since"):
        assert getattr(s.rtt, name) == getattr(rtt, name), name
    assert (s.window.cwnd, s.window._undo, s.window._queue_at) == (7.5, (1.0, 12.0, 6.0), 2.5)


def test_a_missing_field_is_named():
    state = RttEstimator().state()
    del state["_kept_since"]
    with pytest.raises(KeyError, match="_kept_since"):
        one_call(rtt=state)
    window = CongestionWindow(8).state()
    del window["QUEUE_MARGIN"]
    with pytest.raises(KeyError, match="QUEUE_MARGIN"):
        one_call(window=window)


def test_restore_refuses_a_field_recovery_py_lacks():
    with pytest.raises(KeyError, match="nonsense"):
        RttEstimator().restore({"nonsense": 1.0})
    with pytest.raises(KeyError, match="QUEUE_MARGIN"):
        CongestionWindow(8).restore({"QUEUE_MARGIN": 1.0})
    rtt = RttEstimator()
    rtt.restore({"srtt": None, "min_rtt": math.inf})
    assert rtt.srtt is None
