"""Holds GPU-a's lock in the lock directory argv[1], forks a child that lives on (its pid in argv[2]), and
is killed."""

import os
import sys
import time

from pytest_gpuclean._locks.gpus import GpuLocks

GpuLocks(sys.argv[1]).acquire(["GPU-a"], 1, 5, "forking::test")
child = os.fork()
if child == 0:
    time.sleep(60)
    os._exit(0)
with open(sys.argv[2], "w") as f:
    f.write(str(child))
os.kill(os.getpid(), 9)
