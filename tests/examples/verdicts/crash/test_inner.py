import os
import time

import pytest
from prelude import hold, wait_holders


@pytest.mark.needs_clean_gpus
def test_holds_then_exits():
    hold(mib=512)
    wait_holders(1)
    os._exit(3)  # the worker dies in the middle of a marked test: no teardown, no report from it


@pytest.mark.needs_clean_gpus
@pytest.mark.parametrize("n", range(4))
def test_later(n):
    time.sleep(0.3)
