import os
import time

import pytest
from prelude import PIDFILE, hold, wait_holders

TIMEOUT = float(os.environ["MARK_TIMEOUT"])


@pytest.mark.needs_clean_gpus(timeout=TIMEOUT)
def test_1():
    pass


def test_2_unmarked_leaks():
    hold("--seconds", str(2 * TIMEOUT + 1), mib=64)
    wait_holders(1)


@pytest.mark.needs_clean_gpus(timeout=TIMEOUT)
def test_3_meets_our_leak():
    pass


def test_4_until_our_leak_is_gone():
    stat = f"/proc/{open(PIDFILE).read().split()[0]}/stat"
    while os.path.exists(stat) and open(stat).read().rsplit(")")[1].split()[0] != "Z":
        time.sleep(0.01)


@pytest.mark.needs_clean_gpus(timeout=TIMEOUT)
def test_5():
    pass
