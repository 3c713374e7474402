
import pytest
from gpu_health import SIM

from pytest_gpuclean import simulate


@pytest.mark.needs_clean_gpus
def test_incident():
    simulate.xid(SIM, 0, 31)
    simulate.set_state(SIM, 0, "probe_fails", "cuCtxCreate returned 999 (CUDA_ERROR_UNKNOWN)")


@pytest.mark.needs_clean_gpus
def test_next():
    pass
