"""Defaults and names the manual states are the code's: each is read from the code
here, not kept beside it (as tests/test_environment_table.py does for variables).

docs/testbed.md: ``Testbed``'s signature, ``--slots-per-job``'s default and the
UDP segmentation offload's; README.md: the extras table against pyproject.toml.
"""

import ast
import inspect
import pathlib
import re

import pytest

from switchml import config
from switchml.cli import build_parser
from switchml.testbed import Testbed
from switchml.testbed.core import OFFLOAD

ROOT = pathlib.Path(__file__).resolve().parent.parent
TESTBED_DOC = (ROOT / "docs" / "testbed.md").read_text()
README = (ROOT / "README.md").read_text()


def stated_value(text: str):
    """A default as the docs write it: a Python literal, or a size in KiB."""
    size = re.fullmatch(r"(\d+) KiB", text.strip())
    return int(size.group(1)) * 1024 if size else ast.literal_eval(text.strip())


def test_the_testbed_signature_the_docs_state_is_the_codes():
    (signature,) = re.findall(r"^`Testbed\((hosts=[^`]*)\)`:", TESTBED_DOC, re.M)
    stated = dict(part.split("=", 1) for part in
                  (p.strip() for p in signature.replace("\n", " ").split(","))
                  if part != "*")
    parameters = inspect.signature(Testbed).parameters
    assert list(stated) == list(parameters)  # every parameter, in order
    for name, text in stated.items():
        assert stated_value(text) == parameters[name].default, name


def parse_testbed_up(*argv):
    return build_parser().parse_args(["testbed", "up", *argv])


def test_the_slots_per_job_default_the_docs_state_is_the_switchs():
    (stated,) = re.findall(r"`--slots-per-job` slots per job\s+\(by default the switch's own "
                           r"default, (\d+)", TESTBED_DOC)
    assert parse_testbed_up().slots_per_job is None  # nothing passed: the switch's own
    assert int(stated) == config.DEFAULT_SLOTS_PER_JOB
    assert config.SwitchConfiguration().slots_per_job == int(stated)


def test_the_udp_offload_default_the_docs_state_is_the_codes(monkeypatch):
    assert re.search(r"`auto` \(None\), the default, turns it on without loss \(as the kernel "
                     r"leaves a\s+veth\) and off with loss, whatever the switches' data plane",
                     TESTBED_DOC)
    assert parse_testbed_up().udp_offload == "auto" and OFFLOAD["auto"] is None
    assert inspect.signature(Testbed).parameters["udp_offload"].default is None
    monkeypatch.setenv("SWITCHML_DATA_PLANE", "xdp")
    assert Testbed(hosts=1, prefix="zzdoc").udp_offload is True
    assert Testbed(hosts=1, prefix="zzdoc", loss=0.01).udp_offload is False


@pytest.fixture(scope="module")
def extras() -> set:
    """The extras pyproject.toml defines (its keys; read without tomllib, which
    Python 3.10 lacks)."""
    text = (ROOT / "pyproject.toml").read_text()
    section = text.split("[project.optional-dependencies]")[1].split("\n[")[0]
    return set(re.findall(r"^([a-z]+) = \[", section, re.M))


def test_the_readme_extras_table_names_every_extra_and_no_other(extras):
    table = README.split("| extra | adds |")[1].split("\n\n")[0]
    named = {name for row in table.splitlines()[2:]
             for name in re.findall(r"`([a-z]+)`", row.split("|")[1])}
    assert named == extras
