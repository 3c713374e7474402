import subprocess
import sys
import time

import pytest


@pytest.fixture(scope="module")
def worker():
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(7)"])
    with open("worker.pid", "w") as f:  # not PIDFILE: its pids are killed after the test
        f.write(str(proc.pid))
    yield proc
    assert proc.wait() == 7


@pytest.mark.needs_clean_gpus
def test_one(worker):
    time.sleep(0.3)  # the worker has exited: a zombie that belongs to the fixture


@pytest.mark.needs_clean_gpus
def test_two(worker):
    pass
