import os
import subprocess
import sys
from pathlib import Path

from conftest import wait_for


def test_unmarked_leak():
    Path(os.environ["LEAKER_PID"]).write_text(str(os.getpid()))
    wait_for("VICTIM_PID")
    # A Python process on no GPU, and one holding GPU memory (it says when it runs).
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    subprocess.Popen([sys.executable, "-m", "pytest_gpuclean.simulate", "hold", "--dir", os.environ["SIM"],
                      "--device", "0", "--mib", "64", "--pidfile", os.environ["LEAK_PIDFILE"]])
    wait_for("VICTIM_CHECKED")
