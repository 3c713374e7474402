"""PyTorch's distributed test suite, run the way PyTorch's own test/distributed/test_distributed_spawn.py
runs it: every test of ``DistributedTest._DistTestBase`` (in the torch wheel) in a ``TestDistBackend``
(a ``MultiProcessTestCase``) that spawns one process per rank.

The environment chooses the run, as PyTorch's run_test.py sets it: ``BACKEND`` (gloo, nccl),
``WORLD_SIZE``, ``TEMP_DIR`` and ``INIT_METHOD``; benchmarks/peers/run_peers.py sets them.

``PEERS_SHARE_GPU=1`` (ours): every rank uses GPU 0. PyTorch's driver gives each rank a GPU of its own
and, on a machine with fewer GPUs than ranks, every rank exits with the "multi-gpu" skip code, so on one
GPU the whole suite would skip. With it, gloo's CUDA-tensor tests run with two ranks sharing the GPU;
tests that need more GPUs (``skip_if_lt_x_gpu``) still skip. NCCL refuses two ranks on one GPU.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.testing._internal.distributed import distributed_test
from torch.testing._internal.distributed.distributed_test import DistributedTest, TestDistBackend

torch.backends.cuda.matmul.allow_tf32 = False
SHARE_GPU = os.environ.get("PEERS_SHARE_GPU") == "1"

if SHARE_GPU:
    # The tests ask this helper which GPUs a rank owns (rank_to_GPU[rank][0]); here all own GPU 0.
    distributed_test.init_multigpu_helper = lambda world_size, backend: {r: [0] for r in range(world_size)}


class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):  # type: ignore[misc]
    def setUp(self) -> None:
        super().setUp()
        self._spawn_processes()
        torch.backends.cudnn.flags(enabled=True, allow_tf32=False).__enter__()

    @classmethod
    def _run(cls, rank: int, test_name: str, file_name: str, pipe: Any, **kwargs: Any) -> None:
        if not SHARE_GPU:
            super()._run(rank, test_name, file_name, pipe, **kwargs)
            return
        # TestDistBackend._run without its exit when there are fewer GPUs than ranks.
        self = cls(test_name)
        self.rank = rank
        self.file_name = file_name
        seconds = distributed_test.CUSTOM_PG_TIMEOUT.get(test_name, distributed_test.default_pg_timeout)
        dist.init_process_group(init_method=self.init_method, backend=distributed_test.BACKEND,
                                world_size=int(self.world_size), rank=rank,
                                timeout=timedelta(seconds=seconds))
        self._barrier()
        self.run_test(test_name, pipe)
        self._barrier()
        dist.destroy_process_group()
        sys.exit(0)
