"""The dispatcher that XDP switches on one interface share
(``switch/xdp/dispatch.bpf.c``), run with BPF_PROG_TEST_RUN: each frame reaches
the program of the switch at its UDP port, and that program's action is the
frame's; a frame for no switch passes untouched.  Serving through it for real
is tests/test_xdp_serve.py's.

Skips, saying why, where the XDP data plane cannot run (``xdp.unavailable``).
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from switchml import wire
from switchml.switch.xdp import dispatch as xdp_dispatch
from switchml.switch.xdp import loader as xdp_loader
from switchml.switch.xdp import pipeline as xdp

REASON = xdp.unavailable()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"XDP: {REASON}")

SWITCH = "10.255.0.1"


@pytest.fixture
def dispatcher():
    """Two switches' pipelines (ports 7400 and 7401, one job of two ranks each)
    in a dispatcher loaded, not attached: (its program's fd, the pipelines)."""
    lib = xdp_loader.libbpf()
    obj, prog = xdp_dispatch.load_dispatcher()
    pipelines = []
    try:
        progs = xdp_dispatch.dispatcher_map_fd(obj, "switchml_progs")
        for i, port in enumerate((7400, 7401)):
            p = xdp.XdpPipeline(8, 352, block_elements=352, port=port, switch_ip=SWITCH)
            pipelines.append(p)
            p.install_job(f"job{i}", 0x70 + i, [(f"10.0.{i}.1", 5000), (f"10.0.{i}.2", 5000)],
                          0, 4, 352, 352, tokens=[0x10, 0x20])
            key, fd = ctypes.c_uint32(port), ctypes.c_uint32(p._prog.prog_fd)
            assert lib.bpf_map_update_elem(progs, ctypes.byref(key), ctypes.byref(fd), 0) == 0
        yield prog, pipelines
    finally:
        lib.bpf_object__close(obj)
        for p in pipelines:
            p.close()


def contribution(token: int, rank: int) -> bytes:
    lanes = np.zeros(1, wire.LANE)
    return wire.encode(wire.KIND_CONTRIBUTION, wire.DTYPE_INT32, 1, token, 1, 0, 0, lanes,
                       np.full(352, rank + 1, np.int32))


def counted(p) -> dict:
    p.sync_counters()
    job = next(iter(p.jobs.values()))
    return {k: v for k, v in (p.counters + job.counters).items() if v}


def test_each_frame_reaches_the_switch_at_its_port(dispatcher):
    """A set completed through the dispatcher on each switch: the first rank's
    contribution consumed (XDP_DROP), the second's handed on as the result
    (XDP_PASS, the sum in it), each counted by its own switch alone."""
    prog, (a, b) = dispatcher
    for i, p in enumerate((a, b)):
        first = xdp.udp_frame((f"10.0.{i}.1", 5000), (SWITCH, p.port), contribution(0x10, 0))
        second = xdp.udp_frame((f"10.0.{i}.2", 5000), (SWITCH, p.port), contribution(0x20, 1))
        assert xdp_loader.run_xdp(prog, first)[0] == xdp.XDP_DROP
        action, out = xdp_loader.run_xdp(prog, second)
        assert action == xdp.XDP_PASS
        _, _, payload = xdp.parse_udp_frame(out)
        assert payload[3] == wire.KIND_RESULT
        values = np.frombuffer(payload[wire.HEADER_SIZE + wire.LANE_SIZE:], np.int32)
        assert values.tolist() == [3] * 352
    for p in (a, b):
        assert counted(p) == {"packets_in": 2, "results_completed": 1, "results_out": 2}


def test_what_no_switch_takes_passes_untouched(dispatcher):
    """A port no switch serves, a later IP fragment, a frame that is not UDP:
    XDP_PASS, the frame as it was, and no switch counts anything.  A frame with
    IP options to a switch's port reaches that switch (which drops it)."""
    prog, (a, b) = dispatcher
    other = xdp.udp_frame(("10.0.0.1", 5000), (SWITCH, 7402), contribution(0x10, 0))
    fragment = bytearray(xdp.udp_frame(("10.0.0.1", 5000), (SWITCH, 7400),
                                       contribution(0x10, 0)))
    fragment[20:22] = (185).to_bytes(2, "big")  # offset 185 * 8: a later fragment
    tcp = bytearray(other)
    tcp[23] = 6
    for frame in (other, bytes(fragment), bytes(tcp)):
        assert xdp_loader.run_xdp(prog, frame) == (xdp.XDP_PASS, frame)
    assert counted(a) == counted(b) == {}
    frame = xdp.udp_frame(("10.0.0.1", 5000), (SWITCH, 7401), contribution(0x10, 0))
    options = bytearray(frame[:14] + b"\x46" + frame[15:34] + b"\x01\x01\x01\x00" + frame[34:])
    options[16:18] = (int.from_bytes(options[16:18], "big") + 4).to_bytes(2, "big")
    assert xdp_loader.run_xdp(prog, bytes(options))[0] == xdp.XDP_DROP
    assert counted(a) == {}
    assert counted(b) == {"dropped_ip_options": 1}
