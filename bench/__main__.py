"""``python -m bench ARGS``: ``switchml bench ARGS`` (switchml/bench/suite.py)."""

import sys

from switchml.bench.suite import cli

sys.exit(cli(prog="python -m bench"))
