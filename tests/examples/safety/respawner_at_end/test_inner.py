# A test nobody checks leaks a process whose SIGTERM handler forks a replacement: the session's end reaps it
# (--gpuclean-report watches a session that checks no test), and no replacement may outlive pytest.
import subprocess
import sys

from prelude import PIDFILE, SIM, script, wait_holders


def test_unchecked_leak():
    subprocess.Popen([sys.executable, script("respawner.py"), SIM, PIDFILE])
    wait_holders(1)
