"""What every inner test module of gpuclean's tests shares: the simulated devices, the pidfile its holders
append to (LEAK_PIDFILE), a holder started as a child of the test process, and a wait for holders."""

import os
import subprocess
import sys
import time

SIM = os.environ["GPUCLEAN_SIMULATE"]
PIDFILE = os.environ.get("LEAK_PIDFILE", "leak.pids")


def hold(*extra, device=0, mib=100, prefix=()):
    """Start a simulated holder as a child of this test process."""
    return subprocess.Popen([*prefix, sys.executable, "-m", "pytest_gpuclean.simulate", "hold", "--dir", SIM,
                             "--device", str(device), "--mib", str(mib), "--pidfile", PIDFILE, *extra])


def wait_holders(n):
    """Wait until n holders recorded their pids (so they really hold memory)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if os.path.exists(PIDFILE) and len(open(PIDFILE).read().split()) >= n:
            return [int(x) for x in open(PIDFILE).read().split()]
        time.sleep(0.01)
    raise AssertionError("holders did not start")


def script(name):
    """The path of a script copied next to this module (from tests/examples/scripts)."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), name)


def alive(pid):
    """Whether ``pid`` runs (a zombie does not: it holds nothing)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
