import pytest
from prelude import hold, wait_holders


@pytest.mark.parametrize("n", range(4))
def test_clean(n):
    pass


def test_leaks():
    hold(mib=100)
    wait_holders(1)
