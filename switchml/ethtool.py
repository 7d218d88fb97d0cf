"""Read and switch a network device's offload features, as ``ethtool -k/-K`` does.

A worker reads whether its device cuts UDP GSO runs in software before they leave
(``tx-udp-segmentation`` off), and the testbed turns that feature off; machines
may have no ``ethtool``, so this speaks the ethtool ioctl (SIOCETHTOOL) itself:
the feature names (ETHTOOL_GSTRINGS of the string set ETH_SS_FEATURES), their
state (ETHTOOL_GFEATURES) and a change (ETHTOOL_SFEATURES).  The ioctl acts on
the caller's network namespace, so the testbed runs this file as a script inside
one (``ip netns exec NS python ethtool.py DEV FEATURE off``): it imports nothing
of switchml.

    python ethtool.py DEV[,DEV...]                        # every feature: on/off
    python ethtool.py DEV[,DEV...] FEATURE on|off [...]   # change some, print them
"""

from __future__ import annotations

import ctypes
import fcntl
import socket
import struct
import sys

SIOCETHTOOL = 0x8946
ETHTOOL_GSTRINGS = 0x1B
ETHTOOL_GSSET_INFO = 0x37
ETHTOOL_GFEATURES = 0x3A
ETHTOOL_SFEATURES = 0x3B
ETH_SS_FEATURES = 4
ETH_GSTRING_LEN = 32
IFNAMSIZ = 16


def _ioctl(sock: socket.socket, dev: str, data: ctypes.Array) -> None:
    """SIOCETHTOOL on ``dev`` with ``data`` (the command's struct) as ifr_data."""
    ifreq = struct.pack(f"{IFNAMSIZ}sP", dev.encode(), ctypes.addressof(data))
    ifreq += bytes(40 - len(ifreq))  # sizeof(struct ifreq)
    fcntl.ioctl(sock.fileno(), SIOCETHTOOL, ifreq)


def _names(sock: socket.socket, dev: str) -> list:
    info = ctypes.create_string_buffer(struct.pack("IIQI", ETHTOOL_GSSET_INFO, 0,
                                                   1 << ETH_SS_FEATURES, 0))
    _ioctl(sock, dev, info)
    count = struct.unpack_from("I", info, 16)[0]
    strings = ctypes.create_string_buffer(struct.pack("III", ETHTOOL_GSTRINGS, ETH_SS_FEATURES,
                                                      count) + bytes(count * ETH_GSTRING_LEN))
    _ioctl(sock, dev, strings)
    raw = strings.raw[12:12 + count * ETH_GSTRING_LEN]
    return [raw[i:i + ETH_GSTRING_LEN].split(b"\0", 1)[0].decode()
            for i in range(0, len(raw), ETH_GSTRING_LEN)]


def features(dev: str) -> dict:
    """Each feature of ``dev`` by name: whether it is active now."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        names = _names(sock, dev)
        blocks = (len(names) + 31) // 32
        got = ctypes.create_string_buffer(struct.pack("II", ETHTOOL_GFEATURES, blocks)
                                          + bytes(16 * blocks))
        _ioctl(sock, dev, got)
        active = [struct.unpack_from("IIII", got, 8 + 16 * b)[2] for b in range(blocks)]
    return {name: bool(active[i // 32] >> (i % 32) & 1) for i, name in enumerate(names) if name}


def set_features(dev: str, wanted: dict) -> dict:
    """Ask for each feature in ``wanted`` (name: on) on ``dev``; return every feature's state.

    A feature the device cannot change keeps its state: check the result.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        names = _names(sock, dev)
        unknown = sorted(set(wanted) - set(names))
        if unknown:
            raise ValueError(f"{dev} has no feature {', '.join(unknown)}")
        blocks = (len(names) + 31) // 32
        valid, requested = [0] * blocks, [0] * blocks
        for name, on in wanted.items():
            i = names.index(name)
            valid[i // 32] |= 1 << (i % 32)
            if on:
                requested[i // 32] |= 1 << (i % 32)
        change = ctypes.create_string_buffer(
            struct.pack("II", ETHTOOL_SFEATURES, blocks)
            + b"".join(struct.pack("II", v, r) for v, r in zip(valid, requested)))
        _ioctl(sock, dev, change)
    return features(dev)


def main(argv: list) -> int:
    if not argv or len(argv) % 2 == 0 or any(v not in ("on", "off") for v in argv[2::2]):
        print("usage: ethtool.py DEV[,DEV...] [FEATURE on|off ...]", file=sys.stderr)
        return 2
    pairs = argv[1:]
    wanted = {pairs[i]: pairs[i + 1] == "on" for i in range(0, len(pairs), 2)}
    failed = 0
    for dev in argv[0].split(","):
        try:
            state = set_features(dev, wanted) if wanted else features(dev)
        except (OSError, ValueError) as exc:
            print(f"{dev}: {exc}", file=sys.stderr)
            failed = 1
            continue
        for name in (wanted or state):
            print(f"{dev} {name}: {'on' if state[name] else 'off'}")
        stuck = [n for n, on in wanted.items() if state[n] != on]
        if stuck:
            turns = ", ".join(f"{n} {'on' if wanted[n] else 'off'}" for n in stuck)
            print(f"{dev}: the device refused to turn {turns}", file=sys.stderr)
            failed = 1
    return failed


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
