import os
import time
from pathlib import Path

import pytest


def wait_for(name):
    deadline = time.monotonic() + 60
    while not (Path(os.environ[name]).exists() and Path(os.environ[name]).read_text()):
        assert time.monotonic() < deadline, name
        time.sleep(0.01)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_setup(item):
    if item.nodeid.startswith("test_b.py"):  # before its check: once the other worker's process runs
        Path(os.environ["VICTIM_PID"]).write_text(str(os.getpid()))
        wait_for("LEAK_PIDFILE")
    return (yield)


def pytest_runtest_logreport(report):
    worker = "PYTEST_XDIST_WORKER" in os.environ
    if worker and report.when == "setup" and report.nodeid.startswith("test_b.py"):
        Path(os.environ["VICTIM_CHECKED"]).write_text("1")
