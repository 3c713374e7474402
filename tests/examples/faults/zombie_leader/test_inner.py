import subprocess
import sys
import time

import pytest
from prelude import PIDFILE, SIM, script, wait_holders


@pytest.mark.needs_clean_gpus
def test_leak():
    subprocess.Popen([sys.executable, script("threaded_leader.py"), SIM, PIDFILE])
    pid = wait_holders(1)[0]
    deadline = time.monotonic() + 10
    while open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
        assert time.monotonic() < deadline
        time.sleep(0.05)


@pytest.mark.needs_clean_gpus
def test_next():
    pass
