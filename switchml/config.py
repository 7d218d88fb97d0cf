"""Settings from SWITCHML_* environment variables, as NCCL_* configure NCCL.

==========================  =======================================  ==========
variable                    meaning                                  default
==========================  =======================================  ==========
SWITCHML_SWITCH             switch control address, host:port        (none)
SWITCHML_TIMEOUT            seconds without progress before error    30
SWITCHML_JOB                job name shared by a job's workers       default
SWITCHML_HOST               ``switchml switch`` bind address         127.0.0.1
SWITCHML_PORT               ``switchml switch`` port                 7300
SWITCHML_SLOTS              slots in the switch's pool               256
SWITCHML_PACKET_ELEMENTS    the switch's limit on values per packet  16128
                            (a job's packets fit one frame of its
                            path: see SWITCHML_MTU)
SWITCHML_MTU                a worker's path MTU to the switch        the route's
SWITCHML_BLOCK_ELEMENTS     values per block of the sparse path      256
SWITCHML_SLOTS_PER_JOB      slots a job gets (the most its           32
                            adaptive window may use)
SWITCHML_MAX_JOBS           jobs a switch runs at once               64
SWITCHML_METRICS_PORT       ``switchml switch`` Prometheus port      (none)
SWITCHML_WAIT_FOR_SLOTS     seconds a worker waits for room          0
SWITCHML_DROP_RATE          simulated drop probability               0
SWITCHML_SPARSE_AUTO_UNION  ``sparse="auto"`` goes sparse when the   0.5
                            union of non-zero blocks is at most
                            this share of the tensor
SWITCHML_SPARSE_AUTO_MIN_   ``sparse="auto"`` stays dense when a     8 (C),
  LANES                     packet holds fewer blocks (the rounds     32
                            cost more than the bytes they save)       (Python)
SWITCHML_SPARSE_AUTO_EVERY  ``sparse="auto"`` measures again after   20
                            this many calls of one size and dtype
SWITCHML_WIRE_BITS          16: float allreduces on the 16-bit wire  32
                            (half the bytes; dense; quant's
                            error_bound16)
SWITCHML_PURE_PYTHON        1: the Python data plane and engine      0
                            even where the C ones are built
==========================  =======================================  ==========
"""

from __future__ import annotations

import os

DEFAULT_PORT = 7300
DEFAULT_SLOTS = 256
DEFAULT_PACKET_ELEMENTS = 16128  # 63 blocks of 256: the most one UDP datagram holds
DEFAULT_BLOCK_ELEMENTS = 256
DEFAULT_SLOTS_PER_JOB = 32
DEFAULT_MAX_JOBS = 64
DEFAULT_TIMEOUT = 30.0
#: Seconds within which a control connection's peer that vanished without
#: closing it (host down, cable cut) is noticed, by TCP keepalive probes.
DEFAULT_KEEPALIVE = 20.0
#: sparse="auto" goes sparse when the union of non-zero blocks (what every worker
#: receives) is at most this share of all blocks; see Worker._sparse_pays.
DEFAULT_SPARSE_AUTO_UNION = 0.5
#: ... and measures again after this many calls of the same size and dtype.
DEFAULT_SPARSE_AUTO_EVERY = 20
#: ... and stays dense with fewer blocks than this per packet (Worker._sparse_pays):
#: on the Python engine, and on the C engine.
DEFAULT_SPARSE_AUTO_MIN_LANES = 32
DEFAULT_SPARSE_AUTO_MIN_LANES_COMPILED = 8


def pure_python() -> bool:
    """SWITCHML_PURE_PYTHON=1: the Python data plane and engine even where the C
    ones are built."""
    return env("PURE_PYTHON", "0") == "1"


def env(name: str, default, cast=str):
    """Value of SWITCHML_<name>, cast, or ``default`` when unset or empty."""
    raw = os.environ.get("SWITCHML_" + name, "")
    if raw == "":
        return default
    try:
        return cast(raw)
    except ValueError:
        raise ValueError(f"SWITCHML_{name}={raw!r} is not a valid {cast.__name__}") from None


def parse_address(address) -> tuple[str, int]:
    """'host:port' or (host, port) to a (host, port) tuple, with a clear error."""
    if isinstance(address, (tuple, list)) and len(address) == 2:
        return str(address[0]), int(address[1])
    if isinstance(address, str) and ":" in address:
        host, _, port = address.rpartition(":")
        if port.isdigit() and host:
            return host.strip("[]"), int(port)
    raise ValueError(f"switch address must be 'host:port' or (host, port), got {address!r}")
