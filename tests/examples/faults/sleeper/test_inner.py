# A leak that hangs (its session is signalled or killed meanwhile), and the tests a later or concurrent
# session runs (-k picks one).
import time

import pytest
from prelude import hold, wait_holders


def test_leak_and_hang():
    hold(mib=32)
    wait_holders(1)
    time.sleep(120)


@pytest.mark.needs_clean_gpus(timeout=30)
def test_next_session():
    pass


@pytest.mark.needs_clean_gpus(timeout=1)
def test_other_session():
    pass
