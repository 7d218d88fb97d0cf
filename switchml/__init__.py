"""switchml: in-network allreduce through a software switch (SwitchML, OmniReduce).

    with switchml.Switch() as sw:              # or: switchml switch --port 7300
        ...
    with switchml.Worker("127.0.0.1:7300", rank, world_size) as w:
        total = w.allreduce(np.ones(1000, np.float32))
"""

from .errors import (
                     AuthenticationError,
                     CallMismatchError,
                     JoinRefusedError,
                     LimitExceededError,
                     MetricsUnavailableError,
                     ProtocolVersionError,
                     SecretMismatchError,
                     SwitchMLError,
                     SwitchMLTimeoutError,
                     SwitchUnreachableError,
)
from .switch.server import Switch
from .worker.client import AllreduceHandle, Worker

__all__ = ["Switch", "Worker", "AllreduceHandle", "SwitchMLError", "SwitchMLTimeoutError",
           "JoinRefusedError", "LimitExceededError", "MetricsUnavailableError",
           "SwitchUnreachableError", "CallMismatchError", "ProtocolVersionError",
           "AuthenticationError", "SecretMismatchError"]

#: The package's version: the one place it is written (pyproject.toml reads it).
__version__ = "0.9.0"
