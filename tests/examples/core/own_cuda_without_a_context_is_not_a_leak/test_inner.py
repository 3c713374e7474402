
import pytest
from prelude import SIM

from pytest_gpuclean.simulate import init_cuda


@pytest.mark.needs_clean_gpus
def test_initialises_cuda():
    init_cuda(SIM, 0)


@pytest.mark.needs_clean_gpus
def test_after():
    pass
