"""A chain of argv[2] forks, each appending its pid to argv[1]; the deepest one holds 10 MiB of GPU 0."""

import os
import sys
import time

from pytest_gpuclean.simulate import allocate

pidfile, depth = sys.argv[1], int(sys.argv[2])
for _level in range(depth):
    if os.fork() != 0:
        break
else:
    allocate(os.environ["GPUCLEAN_SIMULATE"], 0, 10)  # the deepest one holds memory
with open(pidfile, "a") as f:
    f.write(f"{os.getpid()}\n")
time.sleep(3600)
