# A test starts another user's process through runuser (in a session of its own), then its pytest is
# SIGKILLed: runuser is the dead session's debris, and relays a signal to the other user's process.
import os
import signal
import subprocess
import time

import pytest

VICTIM, PYTHON, LOGSIG, LOG = (os.environ[name]
                               for name in ("VICTIM", "VICTIM_PYTHON", "LOGSIG", "VICTIM_LOG"))


@pytest.mark.needs_clean_gpus
def test_relay_then_die():
    subprocess.Popen(["runuser", "-u", VICTIM, "--", PYTHON, "-I", LOGSIG, LOG], start_new_session=True,
                     cwd="/")
    deadline = time.monotonic() + 30
    while not (os.path.exists(LOG) and open(LOG).read().startswith("ready")):
        assert time.monotonic() < deadline, "the other user's process did not start"
        time.sleep(0.01)
    os.kill(os.getpid(), signal.SIGKILL)  # the OOM killer: no sweep, no report


@pytest.mark.needs_clean_gpus(timeout=2)
def test_next_session():
    pass
