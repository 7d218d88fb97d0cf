"""The compiled switch core (switchml.switch._fastpath); everything else is in pyproject.toml.

It is optional: where it cannot be built (no C compiler), the switch runs its pure
Python pipeline, as with SWITCHML_PURE_PYTHON=1.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension(
    "switchml.switch._fastpath",
    sources=["switchml/switch/_fastpath.c", "switchml/switch/fastpath_core.c",
             "switchml/switch/fastpath_io.c"],
    depends=["switchml/switch/fastpath.h", "switchml/switch/fastpath_io.h"],
    extra_compile_args=["-O2", "-std=gnu11", "-Wall", "-Wno-declaration-after-statement"],
    optional=True,
)])
