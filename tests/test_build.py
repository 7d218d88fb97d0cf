"""The compiled cores are built wherever a C compiler is.

setup.py marks them optional, so that a machine without a compiler still
installs the pure Python package; the price is that a C file that no longer
compiles fails quietly, and the tests that compare the cores with the Python
reference skip "not built".  Here, with a compiler on the PATH, both cores must
import and be no older than their sources (a stale in-tree build from before an
edit that broke the C would otherwise pass for the new one).
"""

import pathlib
import shutil

import pytest

from switchml.switch.dataplane import fastpipeline
from switchml.worker.engine import compiled

pytestmark = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                reason="no C compiler: the pure Python package is what installs")


@pytest.mark.parametrize("module", [fastpipeline._fastpath, compiled._fastengine],
                         ids=["switch", "worker"])
def test_the_compiled_core_is_built_from_its_current_sources(module):
    assert module is not None, "the C core did not build: run python setup.py build_ext " \
                               "--inplace to see the compiler's error"
    built = pathlib.Path(module.__file__)
    # (*.bpf.c: the XDP program, which switch/xdp/pipeline.py builds with clang, not setup.py)
    sources = [p for p in built.parent.iterdir()
               if p.suffix in (".c", ".h") and not p.name.endswith(".bpf.c")]
    # (none beside it: installed from a wheel, nothing to compare)
    stale = [p.name for p in sources if p.stat().st_mtime > built.stat().st_mtime]
    assert not stale, f"{built.name} is older than {stale}: it did not rebuild"
