import os
import subprocess
import sys
import time
from pathlib import Path

import pytest


def wait_for(name):
    deadline = time.monotonic() + 60
    while not (Path(os.environ[name]).exists() and Path(os.environ[name]).read_text()):
        assert time.monotonic() < deadline, name
        time.sleep(0.01)


def test_unmarked_leak():
    # Not checked, so it takes no lock: it puts memory on GPU 0 while another worker's test holds it.
    wait_for("VICTIM_STARTED")
    if os.environ["HOW"] == "child":
        subprocess.Popen([sys.executable, "-m", "pytest_gpuclean.simulate", "hold", "--dir",
                          os.environ["SIM"], "--device", "0", "--mib", "64", "--pidfile",
                          os.environ["LEAK_PIDFILE"]])
    else:  # in this (worker) process, as torch in the test itself would
        from pytest_gpuclean.simulate import allocate

        allocate(os.environ["SIM"], 0, 64)
        Path(os.environ["LEAK_PIDFILE"]).write_text(f"{os.getpid()}\n")
    wait_for("LEAK_PIDFILE")
    time.sleep(0.5)


@pytest.mark.needs_clean_gpus
@pytest.mark.parametrize("i", range(2))
def test_after(i):
    time.sleep(0.2)
