import pytest
from prelude import hold, wait_holders


@pytest.mark.needs_clean_gpus(timeout=3)
def test_1():
    pass


def test_2_unmarked_leaks():
    hold("--seconds", "1", mib=64)
    wait_holders(1)


@pytest.mark.needs_clean_gpus(timeout=3)
def test_3():
    pass
