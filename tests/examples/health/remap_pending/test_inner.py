
import pytest
from gpu_health import SIM

from pytest_gpuclean import simulate


@pytest.mark.needs_clean_gpus
def test_breaks_a_row():
    # The driver records a row remapping (Xid 63); the remapping waits for a reset.
    simulate.set_state(SIM, 1, "remap_pending", "1")
    simulate.xid(SIM, 1, 63)


@pytest.mark.needs_clean_gpus
def test_later():
    pass
