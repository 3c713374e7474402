import subprocess
import sys

import pytest
from prelude import PIDFILE, SIM, script, wait_holders


@pytest.mark.needs_clean_gpus(timeout=10)
def test_leak():
    subprocess.Popen([sys.executable, script("respawner.py"), SIM, PIDFILE])
    wait_holders(1)


@pytest.mark.needs_clean_gpus
def test_next():
    pass
