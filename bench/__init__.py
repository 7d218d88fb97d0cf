"""Benchmarks of switchml against torch gloo: ``switchml bench`` (suite.py) and allreduce.py."""
