import subprocess
import time

import pytest
from prelude import PIDFILE

KEEP = []


@pytest.mark.needs_clean_gpus
def test_leak():
    proc = subprocess.Popen(["true"])
    KEEP.append(proc)  # never waited for: a zombie once it exits
    with open(PIDFILE, "w") as f:
        f.write(str(proc.pid))
    time.sleep(0.3)
