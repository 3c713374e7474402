
import pytest
from prelude import hold, wait_holders


@pytest.mark.needs_clean_gpus
def test_leaks():
    hold("--seconds", "1.5", mib=64)
    wait_holders(1)


@pytest.mark.needs_clean_gpus(timeout=30)
def test_next():
    pass
