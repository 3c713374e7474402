import pytest
from prelude import hold, wait_holders


def test_a_unchecked_leaks_a_daemon():
    hold("--daemonize", mib=50)
    wait_holders(1)


@pytest.mark.needs_clean_gpus
def test_b_checked():
    pass
