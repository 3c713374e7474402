"""PyTorch's distributed test suite, run the way PyTorch's own test/distributed/test_distributed_spawn.py
runs it: every test of ``DistributedTest._DistTestBase`` (in the torch wheel) in a ``TestDistBackend``
(a ``MultiProcessTestCase``) that spawns one process per rank.

The environment chooses the run, as PyTorch's run_test.py sets it: ``BACKEND`` (gloo, nccl),
``WORLD_SIZE``, ``TEMP_DIR`` and ``INIT_METHOD``; benchmarks/peers/run_peers.py sets them.
"""

from __future__ import annotations

import torch
from torch.testing._internal.distributed.distributed_test import DistributedTest, TestDistBackend

torch.backends.cuda.matmul.allow_tf32 = False


class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):  # type: ignore[misc]
    def setUp(self) -> None:
        super().setUp()
        self._spawn_processes()
        torch.backends.cudnn.flags(enabled=True, allow_tf32=False).__enter__()
