import os
import shutil

import pytest
from prelude import SIM, hold, wait_holders


@pytest.mark.needs_clean_gpus
def test_breaks_gpu_1():
    hold(mib=8)  # on GPU 0, which stays readable
    wait_holders(1)
    shutil.rmtree(os.path.join(SIM, "1"))
    if os.environ["HOW"] == "unreadable":
        with open(os.path.join(SIM, "1"), "w") as f:
            f.write("a file where the device's folder was")


@pytest.mark.needs_clean_gpus
def test_2():
    pass


def test_3_unchecked():
    pass


@pytest.mark.needs_clean_gpus
def test_4():
    pass
