import json
import os
import sys

import pytest
from prelude import PIDFILE, SIM, wait_holders


@pytest.mark.needs_clean_gpus
def test_leak_via_daemon():
    argv = [sys.executable, "-m", "pytest_gpuclean.simulate", "hold", "--dir", SIM, "--mib", "12",
            "--pidfile", PIDFILE]
    with open(os.environ["LAUNCH_FIFO"], "w") as f:
        f.write(json.dumps({"argv": argv, "env": dict(os.environ)}) + "\n")
    wait_holders(1)


@pytest.mark.needs_clean_gpus
def test_next():
    pass
