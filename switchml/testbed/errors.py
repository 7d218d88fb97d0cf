"""Errors of the emulated-cluster testbed; all derive from ``TestbedError``."""

from __future__ import annotations

from ..errors import SwitchMLError


class TestbedError(SwitchMLError):
    """Base class of every testbed error."""

    __test__ = False  # not a pytest test class, despite the name


class NotRootError(TestbedError):
    """Network namespaces, veths and qdiscs need root (CAP_NET_ADMIN and CAP_SYS_ADMIN)."""


class ToolMissingError(TestbedError):
    """A command the testbed needs (ip, tc, nft) is not installed."""


class TestbedExistsError(TestbedError):
    """A testbed with this prefix is already up (or left over from a crash)."""

    __test__ = False


class CommandError(TestbedError):
    """A command of the testbed (ip, tc, nft, ...) failed; the message has its stderr."""

    def __init__(self, argv, returncode: int, stderr: str):
        self.argv = list(argv)
        self.returncode = returncode
        self.stderr = stderr
        super().__init__(f"`{' '.join(self.argv)}` failed with exit status {returncode}: "
                         f"{stderr.strip() or '(no output)'}")
