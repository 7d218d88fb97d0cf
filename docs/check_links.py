"""Fail on a broken link in the Markdown documentation (``make docs`` runs it).

Checked in README.md, CHANGELOG.md and docs/*.md:

- a relative link ``[text](path)`` or ``[text](path#anchor)`` names a file of
  the repository, and the anchor a heading of that file (GitHub's slugs);
- a repository path written as code (```switchml/config.py```, ```bench/x.py```)
  names a file or folder that exists: a pointer left behind by a move fails;
- a test named as ``tests/test_x.py::test_name`` (a guarantee's proof) is a
  function of that file: a test renamed or removed leaves no claim unproven.

    python docs/check_links.py            # exit status 1 and one line a problem
"""

from __future__ import annotations

import ast
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
#: The repository's top folders whose paths, written as code, must exist.
TOP = ("switchml/", "bench/", "docs/", "examples/", "tests/")
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
CODE_PATH = re.compile(r"`((?:%s)[\w./-]*)`" % "|".join(re.escape(t) for t in TOP))
FENCE = re.compile(r"^(```|~~~)")
TEST_ID = re.compile(r"(tests/[\w/]+\.py)::(\w+)")


def documents(root: pathlib.Path = ROOT) -> list:
    return [p for p in [root / "README.md", root / "CHANGELOG.md",
                        *sorted((root / "docs").glob("*.md"))] if p.exists()]


def slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    text = re.sub(r"[`*_]|<[^>]+>", "", heading.strip().lower())
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: pathlib.Path) -> set:
    found, fenced = set(), False
    for line in path.read_text().splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            if line.startswith("#"):
                found.add(slug(line.lstrip("#")))
            found.update(re.findall(r'<a (?:id|name)="([^"]+)"', line))
    return found


def test_names(path: pathlib.Path) -> set:
    """The names of the functions (and classes) a test file defines."""
    tree = ast.parse(path.read_text())
    return {node.name for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}


def problems(path: pathlib.Path, root: pathlib.Path = ROOT) -> list:
    """One line per broken link or path of the Markdown file ``path``."""
    out, fenced = [], False
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if fenced:  # code: neither links nor paths are the document's
            continue
        where = f"{path.relative_to(root)}:{number}"
        for match in LINK.finditer(line):
            target = match.group(1) or match.group(2)
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            name, _, anchor = target.partition("#")
            file = (path.parent / name).resolve() if name else path
            if not file.exists():
                out.append(f"{where}: link to a missing file: {target}")
            elif anchor and file.suffix == ".md" and anchor not in anchors(file):
                out.append(f"{where}: link to a missing heading: {target}")
        for match in CODE_PATH.finditer(line):
            name = match.group(1).rstrip(".")
            if "*" in name or "<" in name or re.search(r"(?<![a-z])[A-Z]{3,}(?![a-z])", name):
                continue  # a pattern or a placeholder (bench/results/NAME/...)
            if not (root / name).exists():
                out.append(f"{where}: names a path that does not exist: {name}")
        for match in TEST_ID.finditer(line):
            file, test = root / match.group(1), match.group(2)
            if file.exists() and test not in test_names(file):
                out.append(f"{where}: names a test that {match.group(1)} does not have: "
                           f"{test}")
    return out


def main() -> int:
    found = [p for doc in documents() for p in problems(doc)]
    print("\n".join(found) if found else f"links: {len(documents())} documents, all resolve")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
