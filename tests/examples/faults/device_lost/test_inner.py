import os
import shutil

import pytest
from prelude import SIM, hold, wait_holders


@pytest.fixture(scope="session", autouse=True)
def lose_a_device():
    yield
    # The device disappears after the last test (a GPU that fell off the bus).
    shutil.rmtree(os.path.join(SIM, "1"))


def test_unmarked_leak():
    hold(mib=8)
    wait_holders(1)


@pytest.mark.needs_clean_gpus
def test_checked():
    pass
