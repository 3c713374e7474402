
import pytest
from prelude import hold, wait_holders


@pytest.mark.needs_clean_gpus
def test_leaks():
    hold(mib=5)
    wait_holders(1)
