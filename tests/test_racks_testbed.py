"""Racks on the emulated cluster (``Testbed(racks=R)``): each rack a bridge with its own
switch, wired to the spine's bridge by a shaped uplink; a two-level job across them.

The layout's names and addresses are checked anywhere; the test that builds
namespaces needs root and iproute2 (it skips elsewhere, saying why).
"""

import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import needs_root, reference_sum

from switchml import wire
from switchml.testbed import Testbed
from switchml.testbed import racks as rack_layout

HELPERS = os.path.join(os.path.dirname(__file__), "testbed_helpers.py")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))



def test_rack_layout_names_addresses_and_uplink_rates():
    tb = Testbed(hosts=5, link="100mbit", racks=2, oversubscription=4, prefix="abcdefgh",
                 subnet="10.9.0.0/24")
    assert [tb.rack_of(h) for h in range(5)] == [0, 0, 0, 1, 1]
    assert tb.namespace("r1") == "abcdefgh-r1" and tb.port_namespace(4) == "abcdefgh-r1"
    assert tb.address("r0") == "10.9.0.253" and tb.address("r1") == "10.9.0.252"
    assert tb.switch == "10.9.0.254:7300"  # the spine, on the bridge
    assert tb.env(3)["SWITCHML_SWITCH"] == "10.9.0.252:7300"  # a host's own rack switch
    assert tb.env("r0") == {"SWITCHML_HOST": "10.9.0.253", "SWITCHML_PORT": "7300",
                            "SWITCHML_UPSTREAM": "10.9.0.254:7300"}
    # three hosts' 100 Mbit/s at 4:1, two hosts' at 4:1
    assert rack_layout.uplink_bps(tb, 0) == 75e6 and rack_layout.uplink_bps(tb, 1) == 50e6
    assert max(len(f"{tb.prefix}-{name}") for name in ("rb9", "pu9", "u9")) <= 15
    with pytest.raises(ValueError, match="r0..r1"):
        tb.namespace("r2")
    with pytest.raises(ValueError, match="racks"):
        Testbed(hosts=2, racks=3, prefix="abc")
    with pytest.raises(ValueError, match="racks"):
        Testbed(hosts=4, racks=2, switches=1, prefix="abc")
    with pytest.raises(ValueError, match="oversubscription"):
        Testbed(hosts=4, racks=2, oversubscription=0.5, prefix="abc")
    flat = Testbed(hosts=4, prefix="abc")
    assert flat.rack_of(0) is None and flat.port_namespace(0) == "abc-sw"


@needs_root
def test_a_two_level_job_across_racks_gives_the_flat_sums_and_one_partial_up(tmp_path):
    size, world = 60_000, 4
    with Testbed(hosts=world, link="200mbit", racks=2, oversubscription=2,
                 prefix=f"t{os.getpid() % 100000}r") as tb:
        for node in ["switch", "r0", "r1"]:
            argv = [sys.executable, "-m", "switchml.cli", "switch", "--host", tb.address(node),
                    "--port", "7300", "--packet-elements", "1024", "--log-level", "warning"]
            if node != "switch":
                argv += ["--upstream", tb.switch]
            sw = tb.popen(node, argv, stdout=subprocess.PIPE, text=True, cwd=ROOT)
            assert "listening on" in sw.stdout.readline()
        procs = [tb.popen(h, [sys.executable, HELPERS, "worker", tb.env(h)["SWITCHML_SWITCH"],
                              str(h), str(world), str(size), "float32", str(tmp_path / f"{h}")],
                          stderr=subprocess.PIPE, text=True) for h in range(world)]
        for proc in procs:
            assert proc.wait(timeout=60) == 0, proc.stderr.read()
        sys.path.insert(0, os.path.dirname(HELPERS))
        from testbed_helpers import make_input

        results = [np.load(tmp_path / f"{h}.npy") for h in range(world)]
        inputs = [make_input(r, size, "float32") for r in range(world)]
        # the job's packets fit one 1500-byte frame
        expected = reference_sum(inputs, wire.frame_geometry(1500, 1024, 256)[0])
        for result in results:
            assert result.tobytes() == expected.tobytes()
        # each rack sent one partial sum per slot message up: about what one host
        # sent, not what its two hosts sent together
        host_sent = tb.link_counters(0)["tx_bytes"]
        for k in range(2):
            up = rack_layout.uplink_counters(tb, k)["tx_bytes"]
            assert 0.8 * host_sent < up < 1.3 * host_sent, (up, host_sent)
