
import pytest
from prelude import SIM

from pytest_gpuclean.simulate import allocate


@pytest.mark.needs_clean_gpus
def test_allocates_in_process():
    allocate(SIM, 0, 300)  # like torch's primary context: lives as long as the pytest process


@pytest.mark.needs_clean_gpus
def test_after():
    pass
