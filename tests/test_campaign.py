"""The figures README.md and docs/performance.md cite are the campaign's.

bench/campaign.py declares every case; its results are bench/results/campaign/.
The docs' tables between ``<!-- campaign:NAME -->`` markers must be what
``python -m bench campaign --report`` writes from those results, a figure
outside them must name the case it comes from, and no result is kept that no
case produces.
"""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench import campaign  # noqa: E402

#: What reads as a measured figure: a speedup (1.48x), a share (97%), a time or
#: a rate with decimals (0.553 s, 14.5 Gbit/s), samples a second.
FIGURE = re.compile(r"\b\d+\.\d+x\b|\b\d+(\.\d+)?\s?%|\b\d+\.\d+ ?(ms|s|Gbit/s)\b"
                    r"|\b\d+ samples/s")
#: How a line names the case its figure comes from.
MARKER = re.compile(r"\(#([\w-]+)\)|performance\.md#([\w-]+)|bench campaign ([\w-]+)")


def read(doc):
    with open(os.path.join(ROOT, doc)) as f:
        return f.read()


def outside_blocks(text):
    """The lines of ``text`` outside generated blocks and code fences."""
    text = campaign.BLOCK.sub("", text)
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced:
            yield number, line


@pytest.mark.parametrize("doc", campaign.DOCUMENTS)
def test_the_docs_tables_are_what_the_results_give(doc):
    text = read(doc)
    assert campaign.BLOCK.search(text), f"{doc} has no campaign block"
    assert campaign.render(text) == text, (
        f"{doc}'s figures differ from bench/results/campaign: run "
        "`python -m bench campaign --report` (or the campaign)")


def test_a_changed_result_changes_the_table(tmp_path):
    """The comparison can fail: a median that moved shows in the rendered doc."""
    results = tmp_path / "results"
    shutil.copytree(os.path.join(ROOT, campaign.RESULTS), results)
    summary = results / "tb-n4-mtu9000" / "summary.json"
    data = json.loads(summary.read_text())
    for row in data["rows"]:
        if row["system"] == "switchml-dense":
            row["median_s"] *= 2
    summary.write_text(json.dumps(data))
    text = read("README.md")
    assert campaign.render(text, str(results)) != text


@pytest.mark.parametrize("doc", campaign.DOCUMENTS)
def test_every_figure_outside_the_tables_names_its_case(doc):
    unnamed = []
    for number, line in outside_blocks(read(doc)):
        if FIGURE.search(line):
            named = [m for groups in MARKER.findall(line) for m in groups if m]
            if not named:
                unnamed.append(f"{doc}:{number}: {line.strip()}")
            for case in named:
                assert case in campaign.BY_ID or case in campaign.GROUPS or not re.match(
                    r"(tb|lo|lat|train|two|switch)-", case), f"{doc}:{number}: no case {case}"
    assert unnamed == [], "figures that name no campaign case:\n" + "\n".join(unnamed)


def test_the_figure_check_sees_an_unnamed_figure():
    assert FIGURE.search("it ran 1.48x faster") and FIGURE.search("at 97% of the bound")
    assert not MARKER.search("it ran 1.48x faster")
    assert MARKER.search("1.48x ([`tb-n4-mtu9000`](#tb-n4-mtu9000))")


def test_the_cases_docs_name_are_declared():
    for doc in campaign.DOCUMENTS + ("docs/protocol.md",):
        for groups in MARKER.findall(read(doc)):
            for name in filter(None, groups):
                if re.match(r"(tb|lo|lat|train|two|switch)-", name):
                    assert name in campaign.BY_ID, f"{doc} names {name}, which is no case"


def kept_results() -> list:
    """The repository's files under bench/results/ (git's, where this is a clone)."""
    listed = subprocess.run(["git", "ls-files", "bench/results"], capture_output=True,
                            text=True, cwd=ROOT)
    if listed.returncode == 0 and listed.stdout:
        return listed.stdout.split()
    return [os.path.relpath(os.path.join(d, f), ROOT)
            for d, _, files in os.walk(os.path.join(ROOT, "bench", "results")) for f in files]


def test_every_case_has_its_results_and_nothing_else_is_kept():
    files = kept_results()
    outside = [f for f in files if not f.startswith(campaign.RESULTS + "/")]
    assert outside == [], "results no campaign case produces"
    kept = {f[len(campaign.RESULTS) + 1:].split("/")[0] for f in files}
    produced = {os.path.basename(campaign.output(c)) for c in campaign.CASES}
    extra = {"machine.json", *campaign.PLOTS}
    assert produced <= kept, f"cases without results: {sorted(produced - kept)}"
    assert kept <= produced | extra, f"results of no case: {sorted(kept - produced - extra)}"


def test_the_campaign_lists_its_commands_and_refuses_unknown_names():
    listed = subprocess.run([sys.executable, "-m", "bench", "campaign", "--list", "core"],
                            capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert listed.returncode == 0, listed.stderr
    lines = listed.stdout.splitlines()
    assert [line.split()[0] for line in lines] == ["tb-n4-mtu9000", "tb-n4-mtu1500"]
    assert ("bench/invocations.py --runs 3 --out bench/results/campaign/tb-n4-mtu9000 -- "
            "--testbed --link 1gbit --mtu 9000") in lines[0]
    unknown = subprocess.run([sys.executable, "-m", "bench", "campaign", "--list", "nothing"],
                             capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert unknown.returncode != 0 and "no case or group nothing" in unknown.stderr
    case = campaign.BY_ID["train-testbed-bag-of-words"]
    assert campaign.command(case, "R")[-2:] == ["--out", "R/train-testbed-bag-of-words.json"]


def test_a_case_for_more_cores_is_skipped_and_leaves_the_machine_file(tmp_path, capsys,
                                                                    monkeypatch):
    """A fast-link case on a machine of fewer cores than it needs runs nothing and
    says so; machine.json, the machine of the figures that state none, stays."""
    fast = campaign.BY_ID["tb-n4-10gbit"]
    assert fast.cores == 16 and "--check-first-only" in campaign.command(fast)
    monkeypatch.setattr(os, "cpu_count", lambda: fast.cores - 1)
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("ran a command"))
    assert campaign.run([fast], str(tmp_path), sys.executable) == 0
    assert "tb-n4-10gbit skipped: it needs 16 cores" in capsys.readouterr().err
    assert not (tmp_path / "machine.json").exists()
