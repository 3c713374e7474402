import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pytest_gpuclean._reading import procfs


def wait_for(name):
    deadline = time.monotonic() + 60
    while not Path(os.environ[name]).exists():
        assert time.monotonic() < deadline, name
        time.sleep(0.01)


def test_nested_session_died():
    # What a nested gpuclean session of this test left when it died (SIGKILL): its cookie names that dead
    # session inside this live worker's test.
    dead = subprocess.Popen(["true"])
    dead.wait()
    cookie = f"{os.environ['GPUCLEAN_TEST']}/gc.{dead.pid}.1.{procfs.pid_namespace()}.0badc0de:t1"
    subprocess.Popen([sys.executable, "-m", "pytest_gpuclean.simulate", "hold", "--dir", os.environ["SIM"],
                      "--device", "0", "--mib", "64", "--pidfile", os.environ["LEAK_PIDFILE"]],
                     env={**os.environ, "GPUCLEAN_TEST": cookie})
    while not (Path(os.environ["LEAK_PIDFILE"]).exists() and Path(os.environ["LEAK_PIDFILE"]).read_text()):
        time.sleep(0.01)
    Path(os.environ["NESTED_DEAD"]).touch()
    wait_for("VICTIM_CHECKED")


@pytest.mark.needs_clean_gpus
def test_after():
    pass
