import pytest
from prelude import hold, wait_holders


@pytest.mark.needs_clean_gpus
def test_leaks():
    hold(mib=64)
    wait_holders(1)


@pytest.mark.needs_clean_gpus
def test_clean():
    pass


def test_unchecked():
    pass
