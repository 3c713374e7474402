import os
import sys
import time

import pytest
from prelude import PIDFILE, SIM


def test_1_unmarked_leaks():
    # A holder left running, started without a Popen object (whose collection would warn: ResourceWarning,
    # an error under -W error that is no part of what this suite shows).
    os.spawnv(os.P_NOWAIT, sys.executable, [sys.executable, "-m", "pytest_gpuclean.simulate", "hold", "--dir",
                                            SIM, "--mib", "100", "--pidfile", PIDFILE])
    deadline = time.monotonic() + 30
    while not (os.path.exists(PIDFILE) and os.path.getsize(PIDFILE)) and time.monotonic() < deadline:
        time.sleep(0.01)  # until it holds the memory: the next check, a marked test's, finds and reaps it


@pytest.mark.needs_clean_gpus
def test_2_marked_victim():
    pass
