
import pytest
from gpu_health import SIM

from pytest_gpuclean import simulate


@pytest.mark.needs_clean_gpus
def test_info():
    simulate.xid(SIM, 0, 45)


@pytest.mark.needs_clean_gpus
def test_unknown():
    simulate.xid(SIM, 0, 1234)
