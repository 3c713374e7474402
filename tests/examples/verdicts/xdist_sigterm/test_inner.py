import os
import time
from pathlib import Path

import pytest
from prelude import hold, wait_holders


@pytest.mark.needs_clean_gpus
@pytest.mark.parametrize("n", range(3))
def test_clean(n):
    pass


@pytest.mark.needs_clean_gpus
def test_leaks_and_hangs():
    hold(mib=64)
    wait_holders(1)
    Path(os.environ["STARTED"]).touch()  # the leak is known: the test's worker is running it
    deadline = time.monotonic() + 60
    while not Path(os.environ["RELEASE"]).exists() and time.monotonic() < deadline:
        time.sleep(0.05)
