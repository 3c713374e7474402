import torch
import torch.distributed as dist
from prelude import hold, wait_holders
from torch.testing._internal.common_distributed import MultiProcessTestCase


class TestGloo(MultiProcessTestCase):
    @property
    def world_size(self):
        return 2

    def setUp(self):
        super().setUp()
        self._spawn_processes()

    def _init(self):
        dist.init_process_group("gloo", init_method=f"file://{self.file_name}", world_size=self.world_size,
                                rank=self.rank)

    def test_all_reduce(self):
        self._init()
        t = torch.tensor([float(self.rank + 1)])
        dist.all_reduce(t)
        self.assertEqual(t.item(), 3.0)
        dist.destroy_process_group()

    def test_rank_leaks(self):
        self._init()
        if self.rank == 1:
            hold(mib=100)
            wait_holders(1)
        dist.barrier()
        dist.destroy_process_group()
