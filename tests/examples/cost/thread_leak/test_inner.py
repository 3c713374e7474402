import subprocess
import sys
import threading

import pytest
from prelude import PIDFILE, wait_holders

STOP = threading.Event()
# No GPU memory: nothing but the walk of our descendants can find these two.
SLEEPER = (
    "import os, sys, time\n"
    "os.fork()\n"
    "with open(sys.argv[1], 'a') as f:\n"
    "    f.write(f'{os.getpid()}\\n')\n"
    "time.sleep(300)\n")

# Threads as torch or OpenMP start them, from the start of the session.
for _ in range(64):
    threading.Thread(target=STOP.wait, daemon=True).start()


@pytest.mark.needs_clean_gpus
def test_before():
    pass


@pytest.mark.needs_clean_gpus
def test_thread_leaks():
    # A thread that starts a process (which forks a second) and lives on: the kernel lists a child under
    # the thread that forked it, not under the main thread.
    started = threading.Event()

    def spawn():
        subprocess.Popen([sys.executable, "-c", SLEEPER, PIDFILE])
        started.set()
        STOP.wait()

    threading.Thread(target=spawn, daemon=True).start()
    assert started.wait(30)
    wait_holders(2)


@pytest.mark.needs_clean_gpus
def test_after():
    STOP.set()
