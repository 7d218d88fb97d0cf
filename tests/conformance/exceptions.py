"""Tests of torch's DistributedTest that pass on gloo and not on switchml, each with
its reason.  ``run.py`` fails on any other difference, and on an entry here that no
longer differs.  docs/conformance.md explains them."""

EXCEPTIONS: dict[str, str] = {
}
