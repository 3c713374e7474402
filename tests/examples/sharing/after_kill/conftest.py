import os
import time


def pytest_runtest_logstart(nodeid, location):
    os.environ["LOGSTART_NS"] = str(time.monotonic_ns())  # before setup, so before the lock wait
