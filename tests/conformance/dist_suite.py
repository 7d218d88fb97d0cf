"""torch's own ``DistributedTest`` against a backend named by ``BACKEND``.

This is how third-party backends run it (torch_ucc's ``test/torch_tests.py``,
torch's ``test/distributed/test_distributed_spawn.py``): declare the backend in
``DistTestCases.backend_feature`` *before* ``distributed_test`` is imported (its
decorators read the sets at import), then run ``TestDistBackend`` with
``DistributedTest._DistTestBase`` as a unittest class.  Environment: ``BACKEND``
(gloo or switchml), ``WORLD_SIZE`` (3), ``TEMP_DIR`` (set by the runner),
``INIT_METHOD`` (torch's default, env://; each test really uses a file:// store).

Not collected by ``pytest tests/`` (no ``test_`` prefix): ``tests/conformance/run.py``
runs it once per backend, and ``tests/test_torch_conformance.py`` runs a subset.

``SWITCHML_CONFORMANCE_START=fork`` forks the three ranks of each test instead of
spawning them (torch's choice): the same tests, about three times faster on a small
machine because no rank imports torch again.
"""

import functools
import os

import torch
import torch.distributed as dist
from torch.testing._internal.common_distributed import DistTestCases

BACKEND = os.environ.setdefault("BACKEND", "gloo")
os.environ.setdefault("WORLD_SIZE", "3")

if BACKEND == "switchml":
    import switchml.torch  # noqa: F401  registers the backend (again in each spawned rank)

    # What the backend implements, as torch_ucc declares "ucc": DDP and subgroups
    # (every collective of a subgroup works: the switch's or the inner gloo's).
    DistTestCases.backend_feature["ddp"].add("switchml")
    DistTestCases.backend_feature["subgroup"].add("switchml")
    # A registered third-party backend: require_backend_is_available takes it as available.
    DistTestCases.backend_feature["plugin"].add("switchml")

from torch.testing._internal.common_utils import run_tests  # noqa: E402
from torch.testing._internal.distributed import distributed_test  # noqa: E402
from torch.testing._internal.distributed.distributed_test import (  # noqa: E402
    DistributedTest,
    TestDistBackend,
)

torch.backends.cuda.matmul.allow_tf32 = False

#: Tests torch skips for any backend not named in a hard-coded set (mostly
#: ``BACKEND != "gloo"``), and that pass on gloo here (their other conditions, CUDA
#: or world size, hold: WORLD_SIZE 3 or 8).  The switchml backend claims gloo's
#: behaviour for them, so
#: it runs them too: only their skip marks (which skip_but_pass_in_sandcastle sets
#: as attributes on the function) go; their bodies are torch's, with BACKEND as set.
GATED_BY_NAME = (
    "test_accumulate_gradients_no_sync",
    "test_accumulate_gradients_no_sync_allreduce_hook",
    "test_accumulate_gradients_no_sync_allreduce_with_then_hook",
    "test_accumulate_gradients_no_sync_grad_is_view",
    "test_all_gather_object_default_pg",
    "test_all_gather_object_subgroup",
    "test_all_reduce_coalesced_full_group_max",
    "test_all_reduce_coalesced_full_group_min",
    "test_all_reduce_coalesced_full_group_product",
    "test_all_reduce_coalesced_full_group_sum",
    "test_all_reduce_coalesced_max",
    "test_all_reduce_coalesced_min",
    "test_all_reduce_coalesced_product",
    "test_all_reduce_coalesced_sum",
    "test_barrier_timeout_full_group",
    "test_batch_isend_irecv_gloo",
    "test_batch_isend_irecv_gloo_tags",
    "test_get_future",
    "test_grads_same_across_ranks_with_no_sync",
    "test_monitored_barrier_gloo",
    "test_monitored_barrier_gloo_rank_0_timeout",
    "test_monitored_barrier_gloo_subgroup",
    "test_scatter_object_list",
    "test_sparse_all_reduce_sum",
    # run from WORLD_SIZE=8 on (torch's [1, 2]-subgroup tests)
    "test_all_reduce_coalesced_group_max",
    "test_all_reduce_coalesced_group_min",
    "test_all_reduce_coalesced_group_product",
    "test_all_reduce_coalesced_group_sum",
    "test_barrier_timeout_group",
    "test_monitored_barrier_failure_order",
    "test_monitored_barrier_wait_all_ranks",
)

#: Tests whose bodies pick their model and device by the backend's name (gloo and
#: mpi: CPU; nccl: CUDA) and have no branch for any other name: on switchml their
#: bodies see BACKEND == "gloo" (the group they run on is switchml's all the same:
#: init_process_group has run with the real name).
BODY_AS_GLOO = (
    "test_accumulate_gradients_no_sync",
    "test_accumulate_gradients_no_sync_allreduce_hook",
    "test_accumulate_gradients_no_sync_allreduce_with_then_hook",
    "test_accumulate_gradients_no_sync_grad_is_view",
)


def _body_as_gloo(func):
    @functools.wraps(func)
    def test(self, *args, **kwargs):
        assert dist.get_backend() == "switchml"
        distributed_test.BACKEND = "gloo"
        try:
            return func(self, *args, **kwargs)
        finally:
            distributed_test.BACKEND = BACKEND

    return test


if BACKEND == "switchml":
    for _name in BODY_AS_GLOO:
        setattr(DistributedTest._DistTestBase, _name,
                _body_as_gloo(getattr(DistributedTest._DistTestBase, _name)))
    for _name in GATED_BY_NAME:
        _func = getattr(DistributedTest._DistTestBase, _name)
        for _mark in ("__unittest_skip__", "__unittest_skip_why__"):
            if hasattr(_func, _mark):
                delattr(_func, _mark)


class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):
    def setUp(self):
        super().setUp()
        if os.environ.get("SWITCHML_CONFORMANCE_START", "spawn") == "fork":
            self._start_processes(torch.multiprocessing.get_context("fork").Process)
        else:
            self._spawn_processes()
        torch.backends.cudnn.flags(enabled=True, allow_tf32=False).__enter__()


if __name__ == "__main__":
    run_tests()
