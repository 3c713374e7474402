import os

import pytest
from prelude import hold, wait_holders

TIMEOUT = float(os.environ["MARK_TIMEOUT"])


@pytest.mark.needs_clean_gpus(timeout=TIMEOUT)
def test_1():
    pass


def test_2_unmarked_leaks():
    hold(mib=64)
    wait_holders(1)


@pytest.mark.needs_clean_gpus(timeout=TIMEOUT)
def test_3():
    pass
