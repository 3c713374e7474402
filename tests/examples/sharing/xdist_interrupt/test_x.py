import os
import subprocess
import sys
import time
from pathlib import Path

import pytest


@pytest.mark.needs_clean_gpus(count=1)
def test_leaks(clean_gpus):
    pidfile = Path(os.environ["LEAK_PIDFILE"])
    subprocess.Popen([sys.executable, "-m", "pytest_gpuclean.simulate", "hold", "--dir", os.environ["SIM"],
                      "--device", str(clean_gpus.devices[0].index), "--mib", "64", "--pidfile", str(pidfile)])
    while not pidfile.exists() or not pidfile.read_text():
        time.sleep(0.01)


def test_runs_until_interrupted():
    Path(os.environ["STARTED"]).touch()
    deadline = time.monotonic() + 60
    while not Path(os.environ["RELEASE"]).exists() and time.monotonic() < deadline:
        time.sleep(0.05)
