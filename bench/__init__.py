"""Benchmarks of switchml against torch gloo: ``python -m bench`` (suite.py) and allreduce.py.

Not part of the installed package: they run from a source checkout's root."""
