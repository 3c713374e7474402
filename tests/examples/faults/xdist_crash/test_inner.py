import os
import time

import pytest
from prelude import hold, wait_holders


@pytest.mark.needs_clean_gpus
def test_crash_after_leaking():
    hold(mib=64)
    wait_holders(1)
    os._exit(1)  # the worker dies: no teardown, no report from it


@pytest.mark.needs_clean_gpus
@pytest.mark.parametrize("n", range(4))
def test_later(n):
    time.sleep(0.5)
