"""``python -m bench ARGS``: ``switchml bench ARGS`` (switchml/bench/suite.py);
``python -m bench campaign ...``: the campaign (bench/campaign.py)."""

import sys

if sys.argv[1:2] == ["campaign"]:
    from bench.campaign import main

    sys.exit(main(sys.argv[2:]))

from switchml.bench import suite  # noqa: E402
from switchml.cli import plain  # noqa: E402

sys.exit(suite.cli(prog="python -m bench", description=plain(suite.__doc__)))
