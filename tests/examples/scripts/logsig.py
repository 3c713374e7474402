"""A bystander that says exactly what reached it: writes 'ready <pid> <uid>' to argv[1], then the name of each
signal it receives (SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2, SIGCONT), one a line, and lives on.
A SIGCONT in its log means it had been stopped (SIGSTOP itself cannot be caught). Standard library only: it
runs as another user, under an interpreter without the test's virtual environment."""

import os
import signal
import sys
import time

LOG = sys.argv[1]


def note(text):
    with open(LOG, "a") as f:
        f.write(text + "\n")


def on_signal(signum, frame):
    note(signal.Signals(signum).name)


for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2,
            signal.SIGCONT):
    signal.signal(sig, on_signal)
note(f"ready {os.getpid()} {os.getuid()}")
while True:
    time.sleep(1)
