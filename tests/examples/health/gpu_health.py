"""What the inner suites of the health tests share: the simulated devices, a child that hits a fault."""

import os
import subprocess
import sys

SIM = os.environ["GPUCLEAN_SIMULATE"]


def child_xid(code, device=0):
    """A child process of the test hits the fault (the driver logs the Xid, the test sees nothing)."""
    subprocess.run([sys.executable, "-m", "pytest_gpuclean.simulate", "xid", "--dir", SIM, "--device",
                    str(device), "--code", str(code)], check=True)
