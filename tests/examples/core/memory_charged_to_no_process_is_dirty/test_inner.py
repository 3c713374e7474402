
import pytest
from prelude import SIM

from pytest_gpuclean.simulate import allocate


@pytest.mark.needs_clean_gpus(timeout=0.2)
def test_allocates_in_process():
    allocate(SIM, 0, 10)


@pytest.mark.needs_clean_gpus(timeout=0.2)
def test_after():
    pass
