import os
import time

import pytest
from prelude import SIM, hold


@pytest.mark.needs_clean_gpus
@pytest.mark.parametrize("n", range(4))
def test_leaks(n):
    holder = hold(mib=16)
    with open("spawned.pids", "a") as f:
        f.write(f"{holder.pid}\n")
    while not os.path.exists(os.path.join(SIM, "0", str(holder.pid))):
        time.sleep(0.01)


@pytest.mark.needs_clean_gpus
@pytest.mark.parametrize("n", range(4))
def test_clean(n):
    pass
