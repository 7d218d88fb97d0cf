"""``switchml bench``: switchml's dense and sparse allreduce beside torch gloo's, on
loopback or on an emulated cluster (:mod:`switchml.testbed`).

Needs the ``bench`` and ``torch`` extras (``pip install '.[bench,torch]'`` in a checkout: tqdm and
matplotlib; gloo needs torch). ``suite`` is the command, ``launch`` starts its
processes (``roles``), ``common`` holds the inputs and the link bounds, ``plots``
draws the PNGs, ``drops`` reads a testbed's drop counters.
"""
