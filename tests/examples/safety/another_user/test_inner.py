# A test that leaks another user's process (setpriv, in a session of its own) beside one whose SIGTERM
# handler forks a replacement: the second reaping round freezes the replacement, never the other user's.
import os
import subprocess
import sys
import time

import pytest
from prelude import PIDFILE, SIM, script, wait_holders

VICTIM, PYTHON, LOGSIG, LOG = (os.environ[name]
                               for name in ("VICTIM", "VICTIM_PYTHON", "LOGSIG", "VICTIM_LOG"))


def wait_ready():
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if os.path.exists(LOG) and open(LOG).read().startswith("ready"):
            return
        time.sleep(0.01)
    raise AssertionError("the other user's process did not start")


@pytest.mark.needs_clean_gpus(timeout=3)
def test_leaks():
    subprocess.Popen(["setpriv", f"--reuid={VICTIM}", f"--regid={VICTIM}", "--clear-groups", PYTHON, "-I",
                      LOGSIG, LOG], start_new_session=True, cwd="/")
    wait_ready()
    subprocess.Popen([sys.executable, script("respawner.py"), SIM, PIDFILE])
    wait_holders(1)
