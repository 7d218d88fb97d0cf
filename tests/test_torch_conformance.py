"""Half a minute of torch's own DistributedTest on switchml: every test here passes
on gloo, and must on switchml (``make conformance`` runs the whole suite on both
and compares them; docs/conformance.md)."""

import importlib.util
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch", reason="the torch extra is not installed")

HERE = os.path.dirname(os.path.abspath(__file__))
RUN = os.path.join(HERE, "conformance", "run.py")
_spec = importlib.util.spec_from_file_location("conformance_run", RUN)
assert _spec is not None and _spec.loader is not None
_harness = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_harness)
parse_junit = _harness.parse_junit

#: Chosen to cover what the backend does itself and what it hands to gloo.
SUBSET = {
    3: [
        # allreduce: through the switch (sum, async, the whole group), and each form
        # it delegates (max, complex, coalesced, sparse COO, ops complex refuses)
        "test_all_reduce_sum", "test_all_reduce_sum_async",
        "test_all_reduce_max", "test_all_reduce_sum_complex", "test_all_reduce_coalesced_sum",
        "test_sparse_all_reduce_sum", "test_all_reduce_complex_unsupported_ops",
        # DDP: plain, no_sync with a comm hook, static graph, requires_grad
        "test_DistributedDataParallelCPU", "test_DistributedDataParallel_requires_grad",
        "test_accumulate_gradients_no_sync_allreduce_hook", "test_static_graph_api_cpu",
        "test_grads_same_across_ranks_with_no_sync",
        # subgroups at this size: object collectives on one, destroying one
        "test_all_gather_object_subgroup", "test_destroy_group",
        # barrier; async work and futures; point to point; the rest through gloo
        # (broadcast and all_gather: test_torch.py's every-collective test)
        "test_barrier", "test_barrier_timeout_full_group",
        "test_get_future", "test_isend", "test_batch_isend_irecv_gloo",
        "test_reduce_sum", "test_scatter_object_list",
    ],
    # torch runs its [1, 2]-subgroup tests from 8 ranks on
    8: ["test_all_reduce_group_sum", "test_all_reduce_group_max",
        "test_all_reduce_coalesced_group_sum", "test_broadcast_group", "test_barrier_group"],
}


@pytest.mark.parametrize("world", sorted(SUBSET))
def test_distributed_test_subset_passes_on_switchml(world, tmp_path):
    proc = subprocess.run([sys.executable, RUN, "--world", str(world), "--out", str(tmp_path),
                           "--backends", "switchml", "--tests", *SUBSET[world]],
                          capture_output=True, text=True, timeout=900)
    outcomes = {name: outcome
                for name, (outcome, _) in parse_junit(str(tmp_path / "switchml.xml")).items()}
    assert outcomes == {name: "pass" for name in SUBSET[world]}, (
        {n: o for n, o in outcomes.items() if o != "pass"},
        (tmp_path / "switchml.log").read_text()[-4000:], proc.stdout + proc.stderr)
    assert proc.returncode == 0, proc.stdout + proc.stderr
