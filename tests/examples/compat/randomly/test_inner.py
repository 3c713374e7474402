import pytest
from prelude import hold, wait_holders


def test_unchecked_leaks():
    hold("--daemonize", mib=50)
    wait_holders(1)


@pytest.mark.needs_clean_gpus
@pytest.mark.parametrize("n", range(3))
def test_checked(n):
    pass
