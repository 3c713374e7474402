import os
import subprocess
import sys
import time

import pytest
from gpu_health import SIM

from pytest_gpuclean import simulate


@pytest.mark.needs_clean_gpus
def test_leaks():
    simulate.set_state(SIM, 0, "remap_pending", "2")
    subprocess.Popen([sys.executable, "-m", "pytest_gpuclean.simulate", "hold", "--dir", SIM,
                     "--device", "0", "--mib", "64", "--pidfile", os.environ["LEAK_PIDFILE"]])
    while not os.path.exists(os.environ["LEAK_PIDFILE"]):
        time.sleep(0.01)
