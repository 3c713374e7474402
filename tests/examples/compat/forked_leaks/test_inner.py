import subprocess
import sys

from prelude import PIDFILE, hold, script, wait_holders


def test_leaks():
    hold(mib=100)
    wait_holders(1)


def test_leaks_a_daemon():
    hold("--daemonize", mib=50)
    wait_holders(2)


def test_leaks_a_cpu_daemon():
    # No GPU memory, so no cookie scan: found only because the child adopts it (its own subreaper).
    subprocess.run([sys.executable, script("cpu_daemon.py"), PIDFILE], check=True)
    wait_holders(3)


def test_after():
    pass
