"""Every shell command and Python snippet in README.md and docs/*.md works as written,
from a directory outside the repository.

Each fenced ``sh`` or ``python`` block carries a mark on the line before it, an
HTML comment readers do not see; a block without one fails the test, so none
goes unchecked by accident:

- ``<!-- doc-check: run -->``: run as written (Python as a script, sh with
  ``bash -e``) in a temporary directory, with switchml importable from this
  tree and its environment's bin directory first on PATH, as after ``pip
  install``, and no SWITCHML_* variable set.
- ``<!-- doc-check: ranks N -->``: a job's script for N machines: run as N
  processes on this one, against a switch on loopback standing in for
  ``switch-host:7300``, each with its own ``rank = ...``.
- ``<!-- doc-check: root -->``: run as ``run`` does, as root with the testbed's
  tools (skipped elsewhere, saying why); ``parse-only: WORD ...`` after it
  leaves the lines holding one of those words (long-running ones) to ``parse``.
- ``<!-- doc-check: parse -->``: long-running, or for several machines: Python
  is compiled; sh is checked by ``bash -n`` and each command by what it names:
  switchml's arguments by its own parsers, scripts (Python and shell) and modules
  exist in the tree, make targets in the Makefile, pip extras in pyproject.toml.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import needs_root

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARK = re.compile(r"<!-- doc-check: (run|root|parse|ranks (\d+))(?:; parse-only: ([^>]*?))? -->")
RUN_TIMEOUT = 60


@dataclass
class Block:
    doc: str
    line: int
    language: str
    code: str
    mark: str | None
    ranks: int = 0
    parse_only: tuple = ()

    @property
    def name(self) -> str:
        return f"{self.doc}:{self.line}"


def blocks() -> list[Block]:
    found = []
    for path in DOCS:
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            fence = re.fullmatch(r"```(sh|python)", line)
            if not fence:
                continue
            end = lines.index("```", i + 1)
            mark = MARK.search(lines[i - 1]) if i else None
            found.append(Block(
                path.name, i + 1, fence.group(1), "\n".join(lines[i + 1:end]) + "\n",
                mark and ("ranks" if mark.group(2) else mark.group(1)),
                int(mark.group(2) or 0) if mark else 0,
                tuple((mark.group(3) or "").split()) if mark else ()))
    return found


BLOCKS = blocks()


def environment() -> dict:
    """As after ``pip install``: switchml importable and its scripts on PATH; no
    SWITCHML_* setting of the test suite's."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWITCHML_")}
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
    env["PYTHONPATH"] = str(ROOT)
    return env


def test_every_block_is_marked():
    unmarked = [b.name for b in BLOCKS if b.mark is None]
    assert not unmarked, f"code blocks without a doc-check mark: {unmarked}"
    assert len(BLOCKS) > 10


# ---------------------------------------------------------------- parse
def commands(code: str) -> list[list[str]]:
    """The simple commands of a shell block: continuations joined, comments gone,
    split at ; && || |, loops' for/do/done and VAR=value prefixes and sudo dropped."""
    out = []
    for line in code.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        command: list[str] = []
        for word in [*words, ";"]:
            if word in (";", "&&", "||", "|") or word.endswith(";"):
                if word.endswith(";") and word != ";":
                    command.append(word[:-1])
                while command and (re.fullmatch(r"[A-Z_]+=\S*", command[0])
                                   or command[0] in ("do", "sudo")):
                    command.pop(0)
                if command and command[0] not in ("for", "done"):
                    out.append(command)
                command = []
            else:
                command.append(word)
    return out


def extras() -> set:
    section = (ROOT / "pyproject.toml").read_text().split(
        "[project.optional-dependencies]")[1].split("\n[")[0]
    return set(re.findall(r"^([a-z]+) = \[", section, re.M))


def check_command(argv: list[str]) -> None:
    """What a command names exists; switchml's arguments parse (nothing runs)."""
    program = os.path.basename(argv[0])
    if program == "switchml":  # and the scripts it runs (testbed run --torchrun)
        assert all((ROOT / a).exists() for a in argv if a.endswith(".py")), argv
        if argv[1:2] == ["bench"]:
            from switchml.bench.suite import add_arguments
            parser = argparse.ArgumentParser(prog="switchml bench")
            add_arguments(parser)
            parser.parse_args(argv[2:])
        else:
            from switchml.cli import build_parser
            build_parser().parse_args(argv[1:])
    elif program.startswith("python"):
        if argv[1] == "-m":
            module = ROOT / argv[2].replace(".", "/")
            assert (module.is_dir() or module.with_suffix(".py").exists()
                    or importlib.util.find_spec(argv[2]) is not None), argv
        elif argv[1].endswith(".py"):
            assert (ROOT / argv[1]).exists(), argv
    elif program in ("bash", "sh"):  # a script of the tree's
        scripts = [a for a in argv[1:] if a.endswith(".sh")]
        assert scripts and all((ROOT / s).exists() for s in scripts), argv
    elif program == "torchrun":
        scripts = [a for a in argv if a.endswith(".py")]
        assert scripts and all((ROOT / s).exists() for s in scripts), argv
    elif program == "make":
        makefile = (ROOT / "Makefile").read_text()
        for target in (a for a in argv[1:] if not a.startswith("-")):
            assert re.search(rf"^{re.escape(target)}:", makefile, re.M), argv
    elif program == "pip" and argv[1:2] == ["install"]:
        for spec in argv[2:]:
            named = re.fullmatch(r"\.(?:\[([a-z,]+)\])?", spec)
            assert named, argv
            assert set(filter(None, (named.group(1) or "").split(","))) <= extras(), argv


def parse(block: Block, code: str) -> None:
    if block.language == "python":
        compile(code, block.name, "exec")
        return
    checked = subprocess.run(["bash", "-n"], input=code, capture_output=True, text=True)
    assert checked.returncode == 0, checked.stderr
    for argv in commands(code):
        try:
            check_command(argv)
        except SystemExit as exc:  # argparse's way of refusing arguments
            pytest.fail(f"{block.name}: {shlex.join(argv)} is refused (exit {exc.code})")


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.mark == "parse"],
                         ids=lambda b: b.name)
def test_long_running_blocks_parse(block):
    parse(block, block.code)


# ---------------------------------------------------------------- run
def run(block: Block, code: str, tmp_path, env=None) -> subprocess.CompletedProcess:
    if block.language == "python":
        script = tmp_path / "snippet.py"
        script.write_text(code)
        argv = [sys.executable, str(script)]
    else:
        argv = ["bash", "-e", "-c", code]
    done = subprocess.run(argv, cwd=tmp_path, env={**environment(), **(env or {})},
                          capture_output=True, text=True, timeout=RUN_TIMEOUT)
    assert done.returncode == 0, f"{block.name}:\n{done.stdout}\n{done.stderr}"
    return done


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.mark == "run"], ids=lambda b: b.name)
def test_blocks_run_as_written_outside_the_repository(block, tmp_path):
    done = run(block, block.code, tmp_path)
    assert "Warning" not in done.stderr and "WARNING" not in done.stderr, done.stderr


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.mark == "ranks"], ids=lambda b: b.name)
def test_a_jobs_script_runs_as_its_ranks_on_one_machine(block, tmp_path):
    import switchml

    assert "switch-host:7300" in block.code and re.search(r"^rank = 0\b", block.code, re.M)
    with switchml.Switch("127.0.0.1") as sw:
        address = "127.0.0.1:%d" % sw.address[1]
        procs = []
        for r in range(block.ranks):
            code = re.sub(r"^rank = 0\b", f"rank = {r}", block.code, flags=re.M)
            script = tmp_path / f"rank{r}.py"
            script.write_text(code.replace("switch-host:7300", address))
            procs.append(subprocess.Popen([sys.executable, str(script)], cwd=tmp_path,
                                          env=environment(), stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True))
        for proc in procs:
            out, err = proc.communicate(timeout=RUN_TIMEOUT)
            assert proc.returncode == 0, f"{block.name}:\n{out}\n{err}"


def skip_where_the_docs_testbed_is_up() -> None:
    from switchml.testbed import find_testbeds

    if "smltb" in find_testbeds():
        pytest.skip("a testbed with the docs' prefix smltb is up on this machine")


@pytest.mark.alone  # the docs' testbed has the one default name: one block at a time
@needs_root
@pytest.mark.parametrize("block", [b for b in BLOCKS if b.mark == "root"], ids=lambda b: b.name)
def test_root_blocks_run_as_written_outside_the_repository(block, tmp_path):
    skip_where_the_docs_testbed_is_up()
    lines = block.code.splitlines()
    long = [line for line in lines if block.language == "sh" and set(
        shlex.split(line, comments=True)) & set(block.parse_only)]
    parse(block, "\n".join(long) + "\n")
    try:
        run(block, "\n".join(line for line in lines if line not in long) + "\n", tmp_path)
    finally:
        if block.language == "sh":  # a failed block must not leave its testbed up
            subprocess.run([sys.executable, "-m", "switchml.cli", "testbed", "down"],
                           env=environment(), capture_output=True, timeout=60)
