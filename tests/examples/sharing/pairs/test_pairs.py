import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from intervals import use_gpus


@pytest.mark.needs_clean_gpus(count=2)
@pytest.mark.parametrize("n", range(6))
def test_pair(request, n):
    use_gpus(request, 0.1)


@pytest.mark.needs_clean_gpus(count=2)
def test_leaks_a_holder(request, clean_gpus):
    pidfile = Path(os.environ["LEAK_PIDFILE"])
    subprocess.Popen([sys.executable, "-m", "pytest_gpuclean.simulate", "hold", "--dir",
                      os.environ["SIM"], "--device", str(clean_gpus.devices[1].index), "--mib", "64",
                      "--pidfile", str(pidfile)])
    while not pidfile.exists() or not pidfile.read_text():
        time.sleep(0.01)
    use_gpus(request, 0.0)
