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

import os
import sys

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
from torch.testing._internal.distributed.distributed_test import (  # noqa: E402
    DistributedTest,
    TestDistBackend,
)

torch.backends.cuda.matmul.allow_tf32 = False


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
