"""The DDP examples, launched by torchrun exactly as the README says, on both backends."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch", reason="the torch extra is not installed")
# (found, not imported: the ranks import it, and importing it here costs every
# collection of the suite 3 s)
if importlib.util.find_spec("sklearn") is None:
    pytest.skip("the examples extra (scikit-learn) is not installed", allow_module_level=True)
from rank_processes import run_as_torchrun  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def torchrun(tmp_path, script, workers, *args, local_stage=True, launcher=True):
    """Run examples/<script> under torchrun; return rank 0's JSON summary.
    ``local_stage=False``: the ranks, all on this machine, go through the switch.
    ``launcher=False``: the ranks torchrun would start, forked with its environment
    (``rank_processes.run_as_torchrun``), for gloo's runs compared against."""
    out = tmp_path / f"{script}-{len(list(tmp_path.iterdir()))}.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWITCHML_")}
    env["OMP_NUM_THREADS"] = "1"
    if not local_stage:
        env["SWITCHML_LOCAL_STAGE"] = "0"
    argv = [os.path.join(ROOT, "examples", script), "--json", str(out), "--quiet",
            *map(str, args)]
    if launcher:
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                               f"--nproc-per-node={workers}", *argv],
                              env=env, capture_output=True, text=True, timeout=240)
    else:
        proc = run_as_torchrun(argv[0], argv[1:], workers, env, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


def test_digits_on_switchml_reaches_gloo_accuracy(tmp_path):
    ours = torchrun(tmp_path, "train_ddp.py", 2, "--backend", "switchml", "--epochs", 4,
                    "--hidden", 256)
    theirs = torchrun(tmp_path, "train_ddp.py", 2, "--backend", "gloo", "--epochs", 4,
                      "--hidden", 256, launcher=False)
    assert ours["workers"] == theirs["workers"] == 2, (ours, theirs)
    assert ours["test_accuracy"] > 0.85  # it learned (20 epochs reach ~97%)
    assert abs(ours["test_accuracy"] - theirs["test_accuracy"]) <= 0.005, (ours, theirs)
    # one host: its ranks combined in shared memory, nothing crossed a switch
    assert ours["switchml_local_calls"] >= ours["steps"] and ours["switchml_mb_sent_per_step"] == 0
    assert theirs["switchml_mb_sent_per_step"] == 0


def test_digits_with_the_comm_hook_on_a_gloo_group(tmp_path):
    prefix = tmp_path / "timeline"
    hooked = torchrun(tmp_path, "train_ddp.py", 2, "--backend", "gloo", "--hook",
                      "--epochs", 2, "--hidden", 128, "--timeline", prefix, local_stage=False)
    assert hooked["backend"] == "gloo+switchml-hook"
    assert hooked["switchml_mb_sent_per_step"] > 0
    assert hooked["test_accuracy"] > 0.8
    for rank in range(2):  # every step's phases in order, every bucket's call ended
        timeline = tmp_path / f"timeline.gloo-hook.rank{rank}.json"
        events = json.loads(timeline.read_text())["events"]
        steps = [i for i, e in enumerate(events) if e[0] == "step"]
        assert len(steps) == hooked["steps"]
        for start, end in zip(steps, steps[1:] + [len(events)]):
            step = events[start:end]
            kinds = [e[0] for e in step if e[0] in ("forward", "backward", "optimizer")]
            assert kinds == ["forward", "backward", "optimizer"], step
            calls = {e[1]: e[3] for e in step if e[0] == "call"}
            ends = {e[1]: e[3] for e in step if e[0] == "done"}
            assert calls and calls.keys() == ends.keys(), step
            assert all(calls[b] <= ends[b] for b in calls)
            assert sum(e[2] for e in step if e[0] == "call") > 0  # the gradients' elements


def test_embedding_gradients_take_the_sparse_path(tmp_path):
    vocab, dim = 50_000, 64
    common = ["--epochs", 1, "--vocab", vocab, "--dim", dim, "--train-docs", 2048,
              "--test-docs", 512]
    sparse = torchrun(tmp_path, "train_sparse.py", 2, "--backend", "switchml", "--sparse",
                      "true", *common, local_stage=False)
    gloo = torchrun(tmp_path, "train_sparse.py", 2, "--backend", "gloo", *common, launcher=False)
    table_mb = vocab * dim * 4 / 1e6
    assert sparse["switchml_sparse_blocks_sent"] > 0
    # a batch touches a few percent of the table: far less than the table goes up
    assert sparse["switchml_mb_sent_per_step"] < 0.2 * table_mb
    assert abs(sparse["test_accuracy"] - gloo["test_accuracy"]) <= 0.005
    assert sparse["test_accuracy"] > 1.5 / 8  # better than chance over 8 classes
