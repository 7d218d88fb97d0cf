"""An emulated cluster on one machine (root only): see ``core.Testbed`` and docs/testbed.md."""

from .core import (
    DEFAULT_PREFIX,
    SWITCH_PORT,
    Testbed,
    find_testbeds,
    interpreter_env,
    read_state,
    teardown,
)
from .errors import CommandError, NotRootError, TestbedError, TestbedExistsError, ToolMissingError
from .netns import parse_rate

__all__ = ["Testbed", "teardown", "find_testbeds", "read_state", "parse_rate", "interpreter_env",
           "DEFAULT_PREFIX", "SWITCH_PORT", "TestbedError", "NotRootError",
           "ToolMissingError", "TestbedExistsError", "CommandError"]
