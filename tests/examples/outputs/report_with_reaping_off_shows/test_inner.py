
import pytest
from prelude import hold, wait_holders


@pytest.mark.needs_clean_gpus(timeout=60)
def test_leaks_briefly():
    hold("--seconds", "1", mib=16)
    wait_holders(1)
