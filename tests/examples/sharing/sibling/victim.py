# Copied as test_b.py, test_c.py and test_d.py.

import os
import time
from pathlib import Path

import pytest


@pytest.mark.needs_clean_gpus
@pytest.mark.parametrize("i", range(2))
def test_victim(i):
    # Holding every GPU's lock: the first one here waits until the other worker's test has put its memory
    # on GPU 0, so that this test's teardown check meets it.
    Path(os.environ["VICTIM_STARTED"]).write_text(os.environ["PYTEST_XDIST_WORKER"])
    pidfile, deadline = Path(os.environ["LEAK_PIDFILE"]), time.monotonic() + 60
    while not (pidfile.exists() and pidfile.read_text()) and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)
