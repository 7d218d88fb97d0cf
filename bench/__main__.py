"""``python -m bench``: switchml dense, switchml sparse and gloo side by side
(bench/suite.py; ``switchml bench`` runs the same from a source checkout)."""

import sys

from bench.suite import cli

sys.exit(cli())
