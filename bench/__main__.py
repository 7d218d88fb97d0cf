"""``python -m bench ARGS``: ``switchml bench ARGS`` (switchml/bench/suite.py);
``python -m bench campaign ...``: the campaign (bench/campaign.py)."""

import sys

if sys.argv[1:2] == ["campaign"]:
    from bench.campaign import main

    sys.exit(main(sys.argv[2:]))

from switchml.bench.suite import cli  # noqa: E402

sys.exit(cli(prog="python -m bench"))
