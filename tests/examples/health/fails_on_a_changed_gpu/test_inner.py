
import pytest
from gpu_health import SIM

from pytest_gpuclean import simulate


@pytest.mark.needs_clean_gpus
def test_fails():
    simulate.set_state(SIM, 0, "ecc_uncorrected", "5")
    simulate.set_state(SIM, 1, "compute_mode", "Prohibited")
    simulate.set_state(SIM, 1, "clocks_event_reasons", "hw_slowdown,hw_thermal")
    raise AssertionError
