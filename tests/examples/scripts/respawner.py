"""Holds 16 MiB of GPU argv[1]'s device 0 and appends its pid to argv[2]; on SIGTERM it forks a replacement
that does the same, then exits: a process that "dies" and lives on."""

import os
import signal
import sys
import time

from pytest_gpuclean.simulate import allocate


def on_term(signum, frame):
    if os.fork() == 0:
        start()
    os._exit(0)


def start():
    signal.signal(signal.SIGTERM, on_term)
    allocate(sys.argv[1], 0, 16)
    with open(sys.argv[2], "a") as f:
        f.write(f"{os.getpid()}\n")
    while True:
        time.sleep(1)


start()
