import os
import subprocess
import sys
import time

SIM = os.environ["GPUCLEAN_SIMULATE"]
PIDFILE = os.environ["LEAK_PIDFILE"]


def _wait(n):
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if os.path.exists(PIDFILE) and len(open(PIDFILE).read().split()) >= n:
            return
        time.sleep(0.01)
    raise AssertionError("holder did not start")


def pytest_configure(config):
    # A daemon (double fork, setsid) started before gpuclean is a subreaper: it leaves the tree at once,
    # and only its cookie says that the session set-up started it. It holds GPU memory.
    subprocess.run([sys.executable, "-m", "pytest_gpuclean.simulate", "hold", "--dir", SIM, "--mib", "32",
                    "--daemonize", "--pidfile", PIDFILE], check=True)
    _wait(1)
