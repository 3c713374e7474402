import sys

import pytest


@pytest.mark.needs_clean_gpus
def test_x():
    assert "ray" not in sys.modules
    assert "pytest_gpuclean.ray.cluster" not in sys.modules
    assert "pytest_gpuclean.ray.agent" not in sys.modules and "pytest_gpuclean.ray.node" not in sys.modules
