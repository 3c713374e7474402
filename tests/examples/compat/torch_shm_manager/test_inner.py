import torch
import torch.multiprocessing as mp

# (torchmetrics' conftest does this; so do suites whose tensors cross process boundaries in file form)
mp.set_sharing_strategy("file_system")


def test_first_share():
    # The first shared tensor makes torch's libshm start torch_shm_manager, for the pytest process's life.
    assert torch.zeros(10).share_memory_().is_shared()


def test_second_share():
    assert torch.ones(10).share_memory_().is_shared()
