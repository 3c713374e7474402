import pytest
from prelude import hold, wait_holders


@pytest.mark.needs_clean_gpus
def test_checked_first():
    pass


def test_unmarked_last():
    hold(mib=3)
    wait_holders(1)
