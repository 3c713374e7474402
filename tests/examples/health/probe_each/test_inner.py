
import pytest
from gpu_health import SIM

from pytest_gpuclean import simulate


@pytest.mark.needs_clean_gpus
def test_a():
    simulate.set_state(SIM, 1, "probe_fails", "read back other bytes than it wrote")


@pytest.mark.needs_clean_gpus
def test_b():
    pass
