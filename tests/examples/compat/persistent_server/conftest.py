import os
import subprocess
import sys
import time

import pytest

SERVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "model_server.py")


def _alive(pid):
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


@pytest.fixture(scope="session")
def model_server():
    # A warm model server kept across runs, as people do by hand: started once (double-forked, its own
    # session), reused while it lives. Its pid file is the fixture's own record.
    pidfile = os.environ["SERVER_PIDFILE"]
    if os.path.exists(pidfile):
        pid = int(open(pidfile).read())
        if _alive(pid):
            yield pid
            return
        os.unlink(pidfile)  # stale: wait below for the new server's, not this one
    subprocess.run([sys.executable, SERVER, pidfile], check=True)
    deadline = time.monotonic() + 30
    while not os.path.exists(pidfile) and time.monotonic() < deadline:
        time.sleep(0.01)
    yield int(open(pidfile).read())
