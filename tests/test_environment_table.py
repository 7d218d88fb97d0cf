"""Every SWITCHML_* variable the package reads is in config.py's table.

The reads are found in the sources, not in a list kept beside them: literal
names passed to ``os.environ``/``getenv`` (Python and C), names passed to
``config.env`` (which prefixes SWITCHML_), and the switch's settings in
``config.SWITCH_VARIABLES``.
"""

import pathlib
import re

import switchml
from switchml import config

PACKAGE = pathlib.Path(switchml.__file__).parent

#: os.environ.get("SWITCHML_X"), os.environ["SWITCHML_X"], getenv("SWITCHML_X"),
#: environ.setdefault / pop / in
LITERAL = re.compile(r"""(?:getenv|environ(?:\.get|\.setdefault|\.pop)?)\s*[(\[]\s*["']"""
                     r"""(SWITCHML_[A-Z0-9_]+)["']""")
#: config.env("X", ...) and env("X", ...): SWITCHML_X
THROUGH_ENV = re.compile(r"""(?<![\w.])(?:config\.)?env\(\s*["']([A-Z0-9_]+)["']""")


def reads(text: str) -> set:
    """The SWITCHML_* names ``text`` (Python or C source) reads."""
    return (set(LITERAL.findall(text))
            | {"SWITCHML_" + name for name in THROUGH_ENV.findall(text)})


def read_by_the_package() -> dict:
    """Variable -> the package's files that read it."""
    found: dict = {}
    for path in sorted(PACKAGE.rglob("*")):
        if path.suffix not in (".py", ".c", ".h") or "__pycache__" in path.parts:
            continue
        for name in reads(path.read_text()):
            found.setdefault(name, []).append(str(path.relative_to(PACKAGE.parent)))
    for variable, _ in config.SWITCH_VARIABLES.values():
        found.setdefault("SWITCHML_" + variable, []).append("switchml/config.py")
    return found


def table(doc: str) -> set:
    """The variables config.py's docstring table lists (a name too long for its
    column goes on in the next line's first column)."""
    rules = [i for i, line in enumerate(doc.splitlines()) if line.startswith("====")]
    width = len(doc.splitlines()[rules[0]].split()[0])
    names: list = []
    for line in doc.splitlines()[rules[1] + 1:rules[2]]:
        cell = line[:width].strip().replace("\\", "")  # SWITCHML_X\_: RST's escape
        if not cell:
            continue
        if names and names[-1].endswith("_"):
            names[-1] += cell
        else:
            names.append(cell)
    return set(names)


def test_the_scanner_finds_each_way_of_reading():
    text = """
        os.environ.get("SWITCHML_A")   os.environ["SWITCHML_B"]   getenv("SWITCHML_C")
        config.env("D", None)   env("E", 1, int)   self.env("NOT_ONE")   tb.env(host)
    """
    assert reads(text) == {"SWITCHML_A", "SWITCHML_B", "SWITCHML_C", "SWITCHML_D",
                           "SWITCHML_E"}
    rule = "===========  ====\n"
    assert table("x\n" + rule + "name        what\n" + rule + "SWITCHML_A   a\nSWITCHML\\_\n"
                 "  BB         b\n             more of b\n" + rule) == {
        "SWITCHML_A", "SWITCHML_BB"}


def test_the_table_holds_what_the_scan_finds_in_the_package():
    """What the scan finds includes what is known to be read (so it reads the
    sources at all), and every name it finds is in the table."""
    found = read_by_the_package()
    assert {"SWITCHML_SWITCH", "SWITCHML_SPARSE", "SWITCHML_UPSTREAM",
            "SWITCHML_WORKER_GSO", "SWITCHML_PURE_PYTHON"} <= found.keys()
    listed = table(config.__doc__)
    missing = {name: files for name, files in found.items() if name not in listed}
    assert missing == {}, "read but not in config.py's table: " + repr(missing)
