"""The C cores' wire constants (switchml/wire.h) are wire.py's, and defined once.

wire.h is the one C definition of the datagram format that both compiled cores
include; each ``WIRE_X`` must equal ``wire.X`` (``quant.X`` for the exponents),
and no other C file may define a constant of those names with a value of its own.
"""

import pathlib
import re

import switchml
from switchml import quant, wire

PACKAGE = pathlib.Path(switchml.__file__).parent
DEFINE = re.compile(r"^#define\s+(\w+)\s+\(?(-?(?:0x[0-9A-Fa-f]+|\d+))u?\)?", re.M)


def header_constants(text: str) -> dict:
    return {name[len("WIRE_"):]: int(value, 0) for name, value in DEFINE.findall(text)
            if name.startswith("WIRE_")}


def redefinitions(names, files) -> list:
    """``#define [PREFIX_]NAME literal`` of a wire.h name in ``files``."""
    found = []
    for path in files:
        for name, _ in DEFINE.findall(path.read_text()):
            bare = re.sub(r"^(FP_|WIRE_)", "", name)
            if bare in names and path.name != "wire.h":
                found.append(f"{path.relative_to(PACKAGE.parent)}: {name}")
    return found


def test_the_header_is_wire_py():
    constants = header_constants((PACKAGE / "wire.h").read_text())
    assert {"MAGIC", "VERSION", "HEADER_SIZE", "KIND_DONE", "MODE_MAX"} <= constants.keys()
    wrong = {name: (value, getattr(wire, name, getattr(quant, name, None)))
             for name, value in constants.items()
             if getattr(wire, name, getattr(quant, name, None)) != value}
    assert wrong == {}, "wire.h (left) against wire.py/quant.py (right): " + repr(wrong)


def test_the_check_sees_a_wrong_value():
    assert header_constants("#define WIRE_VERSION 4\n#define OTHER 1\n") == {"VERSION": 4}
    assert wire.VERSION != 4


def test_no_c_file_defines_a_wire_constant_of_its_own():
    names = set(header_constants((PACKAGE / "wire.h").read_text()))
    files = sorted(p for p in PACKAGE.rglob("*") if p.suffix in (".c", ".h"))
    assert redefinitions(names, files) == []
