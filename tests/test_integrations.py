"""Real training frameworks on switchml, each launched as its users launch it.

Every run is compared with the same run on gloo (same seed, same data): the
weights must agree within the switch's error bound on every rank, and the
switchml run must have sent its gradients (or its scalar all_reduce) through
the switch.  The frameworks come with the ``integrations`` extra.
"""

import json
import os
import subprocess
import sys
from collections.abc import Callable

import pytest

torch = pytest.importorskip("torch", reason="the torch extra is not installed")
from rank_processes import run_as_torchrun  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples", "integrations")
WORLD = 2
#: Weights after 8 SGD steps: block floating point moves a float32 gradient by at
#: most a few ulps of its chunk's largest value, far below this.
ATOL = 1e-5


#: How a run starts: given the arguments to add (--json PATH) and the environment,
#: run the ranks to their end and return the outcome.
Launch = Callable[[list, dict], subprocess.CompletedProcess]


def run(tmp_path, launch: Launch, name: str) -> list:
    """Start ``launch`` (its script gets --json); return every rank's report.

    A run gets a second try only where torch's exit race struck: a rank aborted
    ("terminate called without an active exception": gloo's threads against the
    interpreter's shutdown, pytorch/pytorch#179291) after every rank had written
    its report.  gloo's own runs meet it too, once in many suites."""
    out = tmp_path / name
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWITCHML_")}
    env["OMP_NUM_THREADS"] = "1"
    for _attempt in range(2):
        for rank in range(WORLD):
            (tmp_path / f"{name}.rank{rank}").unlink(missing_ok=True)
        proc = launch(["--json", str(out)], env)
        exit_race = ("terminate called without an active exception" in proc.stderr
                     and all((tmp_path / f"{name}.rank{r}").exists() for r in range(WORLD)))
        if proc.returncode == 0 or not exit_race:
            break
    assert proc.returncode == 0, proc.stderr[-4000:]
    reports = []
    for rank in range(WORLD):
        path = tmp_path / f"{name}.rank{rank}"
        assert path.exists(), f"rank {rank} wrote no report: {proc.stderr[-2000:]}"
        reports.append(json.loads(path.read_text()))
    return reports


def command(*argv) -> Launch:
    """A command run as its user types it (it starts the ranks itself)."""
    def launch(extra: list, env: dict) -> subprocess.CompletedProcess:
        return subprocess.run([*map(str, argv), *extra], env=env, cwd=ROOT,
                              capture_output=True, text=True, timeout=240)
    return launch


def torchrun(script: str, *args) -> Launch:
    return command(sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc-per-node={WORLD}", os.path.join(EXAMPLES, script), *args)


def forked(script: str, *args) -> Launch:
    """The ranks torchrun would start, forked with its environment and no launcher
    (``rank_processes.run_as_torchrun``): gloo's runs, which only give the weights
    to compare with."""
    def launch(extra: list, env: dict) -> subprocess.CompletedProcess:
        return run_as_torchrun(os.path.join(EXAMPLES, script), [*args, *extra], WORLD, env,
                               timeout=240)
    return launch


def same_training(ours: list, theirs: list) -> None:
    """Replicas agree with each other and with gloo's; the switch carried data."""
    a = torch.tensor(ours[0]["params"])
    for r in ours[1:]:
        assert torch.equal(torch.tensor(r["params"]), a), "replicas differ"
    b = torch.tensor(theirs[0]["params"])
    assert torch.allclose(a, b, rtol=0, atol=ATOL), (a - b).abs().max()
    assert abs(ours[0]["loss"] - theirs[0]["loss"]) < 1e-5
    assert all(r["switch_results"] > 0 for r in ours), "nothing went through the switch"
    assert all(r["switch_results"] == 0 for r in theirs)


@pytest.fixture(scope="module")
def lightning_gloo(tmp_path_factory):
    pytest.importorskip("lightning", reason="the integrations extra is not installed")
    tmp = tmp_path_factory.mktemp("lightning")
    return run(tmp, command(sys.executable, os.path.join(EXAMPLES, "lightning_train.py"),
                            "--mode", "gloo", "--devices", WORLD), "gloo")


@pytest.mark.parametrize("mode", ["backend", "hook"])
def test_lightning_matches_gloo(mode, lightning_gloo, tmp_path):
    """``DDPStrategy(process_group_backend="switchml")`` and the comm hook (its state
    built before the process group), logging the loss with ``sync_dist=True``."""
    ours = run(tmp_path, command(sys.executable, os.path.join(EXAMPLES, "lightning_train.py"),
                                 "--mode", mode, "--devices", WORLD), mode)
    same_training(ours, lightning_gloo)


def test_accelerate_with_the_hook_matches_gloo(tmp_path):
    pytest.importorskip("accelerate", reason="the integrations extra is not installed")
    ours = run(tmp_path, torchrun("accelerate_train.py", "--hook"), "hook")
    theirs = run(tmp_path, forked("accelerate_train.py"), "gloo")
    same_training(ours, theirs)


def test_fsdp2_with_a_scalar_loss_reduction_matches_gloo(tmp_path):
    ours = run(tmp_path, torchrun("fsdp2_train.py", "--backend", "switchml"), "switchml")
    theirs = run(tmp_path, forked("fsdp2_train.py", "--backend", "gloo"), "gloo")
    same_training(ours, theirs)


def test_plain_ddp_under_torchrun_matches_gloo(tmp_path):
    ours = run(tmp_path, torchrun("ddp_torchrun.py", "--backend", "switchml"), "switchml")
    theirs = run(tmp_path, forked("ddp_torchrun.py", "--backend", "gloo"), "gloo")
    same_training(ours, theirs)
