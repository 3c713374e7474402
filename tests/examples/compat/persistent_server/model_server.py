"""model-server: double-forks, holds 512 MiB of simulated GPU 0, writes its pid, serves until killed."""

import os
import sys
import time

from pytest_gpuclean.simulate import allocate

if os.fork() > 0:
    os._exit(0)
os.setsid()
if os.fork() > 0:
    os._exit(0)
allocate(os.environ["GPUCLEAN_SIMULATE"], 0, 512)
tmp = sys.argv[1] + ".tmp"
with open(tmp, "w") as f:
    f.write(str(os.getpid()))
os.replace(tmp, sys.argv[1])
while True:
    time.sleep(60)
