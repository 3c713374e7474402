import pytest
from prelude import hold, wait_holders


def test_unmarked_leaker():
    hold(mib=20)
    wait_holders(1)


def test_unmarked_innocent():
    pass


@pytest.mark.needs_clean_gpus
def test_finder():
    pass
