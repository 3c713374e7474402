import os

import pytest
from intervals import use_gpus


@pytest.mark.needs_clean_gpus(count=1)
@pytest.mark.parametrize("n", range(4))
def test_one_gpu(request, n):
    use_gpus(request, 0.15)


def test_visible_devices_restored():
    assert "CUDA_VISIBLE_DEVICES" not in os.environ
