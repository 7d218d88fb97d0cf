"""Builds the compiled parts; everything else is in pyproject.toml.

One Extension per line of EXTENSIONS: merging branches that each add one is
a matter of keeping both lines.
"""

from setuptools import Extension, setup

EXTENSIONS = [
    # optional: without a C compiler the package installs, on the Python engine
    Extension("switchml.worker._fastengine", ["switchml/worker/_fastengine.c"], optional=True,
              extra_compile_args=["-O3", "-std=c11", "-D_GNU_SOURCE", "-ffp-contract=off",
                                  "-fno-trapping-math"]),
]

setup(ext_modules=EXTENSIONS)
