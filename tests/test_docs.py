"""The Markdown docs' links and repository paths resolve (docs/check_links.py,
which ``make docs`` runs beside the API reference's build)."""

import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("check_links", ROOT / "docs" / "check_links.py")
check_links = importlib.util.module_from_spec(spec)
spec.loader.exec_module(check_links)


def test_the_checker_finds_each_kind_of_broken_link(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "switchml").mkdir()
    (tmp_path / "switchml" / "here.py").write_text("")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text("def test_there():\n    pass\n")
    (tmp_path / "docs" / "other.md").write_text("# A heading\n\n## `Code` and more!\n")
    doc = tmp_path / "README.md"
    doc.write_text("\n".join([
        "[ok](docs/other.md) [ok](docs/other.md#a-heading) [ok](docs/other.md#code-and-more)",
        "[web](https://example.com) `switchml/here.py` `bench/results/NAME/summary.json`",
        "[gone](docs/gone.md)", "[no heading](docs/other.md#nothing)",
        "`switchml/moved.py`", "```", "`switchml/in_a_fence.py` [x](nowhere.md)", "```",
        "`tests/test_x.py::test_there[a-case]` `tests/test_x.py::test_renamed`"]))
    assert check_links.problems(doc, tmp_path) == [
        "README.md:3: link to a missing file: docs/gone.md",
        "README.md:4: link to a missing heading: docs/other.md#nothing",
        "README.md:5: names a path that does not exist: switchml/moved.py",
        "README.md:9: names a test that tests/test_x.py does not have: test_renamed"]


def test_the_docs_links_resolve():
    found = [p for doc in check_links.documents() for p in check_links.problems(doc)]
    assert found == []
