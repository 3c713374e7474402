
import pytest
from gpu_health import SIM, child_xid

from pytest_gpuclean import simulate


@pytest.mark.needs_clean_gpus
def test_kernel_faults():
    simulate.xid(SIM, 0, 31)


@pytest.mark.needs_clean_gpus
def test_child_faults():
    child_xid(13, device=1)


@pytest.mark.needs_clean_gpus
def test_next():
    pass
