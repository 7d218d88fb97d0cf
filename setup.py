"""Builds the compiled parts; everything else is in pyproject.toml.

Both are optional: where they cannot be built (no C compiler), the package
installs and runs its pure Python reference (as with SWITCHML_PURE_PYTHON=1).
One Extension per entry of EXTENSIONS.
"""

from setuptools import Extension, setup

EXTENSIONS = [
    # the switch's data plane: per-packet pipeline and its GIL-free socket loop
    Extension("switchml.switch.dataplane._fastpath",
              sources=["switchml/switch/dataplane/" + name for name in (
                  "_fastpath.c", "fastpath_core.c", "fastpath_io.c")] + ["switchml/udp_batch.c"],
              depends=["switchml/switch/dataplane/fastpath.h",
                       "switchml/switch/dataplane/fastpath_io.h",
                       "switchml/wire.h", "switchml/udp_batch.h"],
              extra_compile_args=["-O2", "-std=gnu11", "-Wall",
                                  "-Wno-declaration-after-statement"],
              optional=True),
    # the worker's engine: _fastengine.c (the binding) includes its Python-free
    # parts, each named after its Python twin, and its GIL-free socket loop
    Extension("switchml.worker.engine._fastengine",
              ["switchml/worker/engine/_fastengine.c", "switchml/udp_batch.c"], optional=True,
              depends=["switchml/worker/engine/" + name for name in (
                  "dense.c", "quant.c", "recovery.c", "stream.c", "stream.h", "stream_io.c",
                  "sparse.c")] + ["switchml/wire.h", "switchml/udp_batch.h"],
              extra_compile_args=["-O3", "-std=c11", "-D_GNU_SOURCE", "-ffp-contract=off",
                                  "-fno-trapping-math"]),
    # the local stage's operations on a host's shared memory (worker/local/memory.py's twin)
    Extension("switchml.worker.local._memory", ["switchml/worker/local/_memory.c"], optional=True,
              extra_compile_args=["-O3", "-std=gnu11", "-ffp-contract=off"]),
]

setup(ext_modules=EXTENSIONS)
