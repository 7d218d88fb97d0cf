"""Development benchmarks of switchml, run from a source checkout's root.

The side-by-side suite users run (``switchml bench``) is :mod:`switchml.bench`;
``python -m bench`` runs it too, and ``python -m bench campaign`` the campaign
that regenerates every figure the documentation cites.
"""
