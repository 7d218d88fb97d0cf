"""Socket buffers: root gets what it asks for, beyond net.core.rmem_max."""

import os
import socket
import sys

import pytest

from switchml.netutil import enable_keepalive, enlarge_buffers


def rmem_max():
    with open("/proc/sys/net/core/rmem_max") as f:
        return int(f.read())


@pytest.mark.skipif(not sys.platform.startswith("linux") or os.geteuid() != 0,
                    reason="SO_RCVBUFFORCE needs Linux and CAP_NET_ADMIN (root)")
def test_root_gets_a_receive_buffer_beyond_rmem_max():
    # Python 3.11 has no socket.SO_RCVBUFFORCE; without Linux's value the request
    # fell back to SO_RCVBUF and was capped at rmem_max, window cuts and drops followed.
    want = 4 * rmem_max()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        assert enlarge_buffers(s, want) >= want
        assert s.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) >= want


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux TCP keepalive options")
@pytest.mark.parametrize("seconds, idle, interval", [(20, 11, 3), (4, 1, 1), (1, 1, 1),
                                                     (60, 30, 10)])
def test_keepalive_gives_up_within_the_asked_seconds(seconds, idle, interval):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        enable_keepalive(s, seconds)
        got = [s.getsockopt(socket.IPPROTO_TCP, getattr(socket, name))
               for name in ("TCP_KEEPIDLE", "TCP_KEEPINTVL", "TCP_KEEPCNT", "TCP_USER_TIMEOUT")]
        assert s.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
    assert got == [idle, interval, 3, (idle + 3 * interval) * 1000]
    assert idle + 3 * interval == max(4, seconds)  # silence plus three probes: the bound


@pytest.mark.parametrize("seconds", [0, -5, float("inf"), float("nan"), 40000])
def test_keepalive_outside_what_the_kernel_takes_is_a_clear_error(seconds):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        with pytest.raises(ValueError, match="keepalive"):
            enable_keepalive(s, seconds)
