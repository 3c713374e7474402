import pytest
from prelude import hold, wait_holders


@pytest.mark.needs_clean_gpus
def test_marked():
    pass


def test_leaks():
    hold(mib=100)
    wait_holders(1)


def test_after():
    pass
