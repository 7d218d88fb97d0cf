"""The worker's C engine is laid out as the switch's is: a Python-free engine in
files named after their Python twins, and a binding (_fastengine.c) apart.

The engine's files must compile without Python's headers, and the stream's
state machine (stream.c) reaches the dense and the sparse call only through
their operations (struct CallOps), as Stream reaches its subclasses' methods.
"""

import pathlib
import re
import shutil
import subprocess

import pytest

import switchml

ENGINE = pathlib.Path(switchml.__file__).parent / "worker" / "engine"
#: The engine's parts, in the binding's order, and each one's Python twin.
PARTS = {"quant.c": "../../quant.py", "recovery.c": "recovery.py", "stream.c": "stream.py",
         "dense.c": "dense.py", "sparse.c": "sparse.py", "stream_io.c": None}
CC = shutil.which("cc") or shutil.which("gcc")


def test_each_part_is_included_by_the_binding_and_has_its_python_twin():
    binding = (ENGINE / "_fastengine.c").read_text()
    included = re.findall(r'^#include "(\w+\.c)"', binding, re.M)
    assert included == list(PARTS)
    for part, twin in PARTS.items():
        assert (ENGINE / part).exists(), part
        if twin:
            assert (ENGINE / twin).exists(), twin


def test_the_stream_reaches_the_calls_only_through_their_operations():
    stream = (ENGINE / "stream.c").read_text()
    code = re.sub(r"/\*.*?\*/", "", stream, flags=re.S)
    assert not re.search(r"\b(sparse|dense)_\w+\(", code), "a call's function named in stream.c"
    assert "c->sp" not in code


@pytest.mark.skipif(CC is None, reason="no C compiler")
def test_the_engine_compiles_without_python(tmp_path):
    unit = tmp_path / "engine_alone.c"
    unit.write_text('#include "stream.h"\n'
                    + "".join(f'#include "{part}"\n' for part in PARTS))
    done = subprocess.run([CC, "-fsyntax-only", "-std=c11", "-D_GNU_SOURCE", "-Wall",
                           "-Wno-unused-function", "-Wno-unused-variable", "-Werror",
                           f"-I{ENGINE}", str(unit)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    for part in ["stream.h", *PARTS]:
        assert "Python.h" not in (ENGINE / part).read_text(), part


@pytest.mark.skipif(CC is None, reason="no C compiler")
def test_the_check_sees_python_in_a_part(tmp_path):
    unit = tmp_path / "with_python.c"
    unit.write_text('#include "stream.h"\nstatic PyObject *leak(void) { return NULL; }\n')
    done = subprocess.run([CC, "-fsyntax-only", "-std=c11", f"-I{ENGINE}", str(unit)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0


def test_both_batched_senders_are_one_sender():
    """The switch's results and the worker's contributions leave through
    udp_batch.c's sender (udp_batch_add, udp_batch_send); neither file builds
    its own messages for sendmmsg or defines a GSO constant."""
    package = ENGINE.parent.parent
    dataplane = package / "switch" / "dataplane"
    for sender in (dataplane / "fastpath_io.c", ENGINE / "stream_io.c"):
        text = sender.read_text()
        assert '#include "../../udp_batch.h"' in text or "udp_batch.h" in (
            dataplane / "fastpath_io.h").read_text(), sender.name
        assert "udp_batch_add(" in text and "udp_batch_send(" in text, sender.name
        assert "sendmmsg(" not in text and "UDP_SEGMENT" not in text, sender.name
        assert not re.search(r"#define (GSO_MAX_\w+|UDP_SEGMENT|SOL_UDP)\b", text), sender.name
