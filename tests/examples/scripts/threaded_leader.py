"""Holds 24 MiB of the simulated devices argv[1]'s GPU 0 from a thread, appends its pid to argv[2], and ends
its main thread: the process shows state Z and runs on."""

import ctypes
import os
import sys
import threading
import time

from pytest_gpuclean.simulate import allocate


def keep_running():
    allocate(sys.argv[1], 0, 24)
    with open(sys.argv[2], "a") as f:
        f.write(f"{os.getpid()}\n")
    while True:
        time.sleep(1)


threading.Thread(target=keep_running).start()
time.sleep(0.5)
ctypes.CDLL(None).pthread_exit(None)
