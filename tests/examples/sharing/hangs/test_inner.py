import time

import pytest
from prelude import hold, wait_holders


@pytest.mark.needs_clean_gpus
def test_hangs():
    hold(mib=64)
    wait_holders(1)
    time.sleep(60)
