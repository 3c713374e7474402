"""A model server: holds 512 MiB of simulated GPU 0 and serves until stopped."""

import os
import time

from pytest_gpuclean.simulate import allocate

allocate(os.environ["GPUCLEAN_SIMULATE"], 0, 512)
print("serving", flush=True)
while True:
    time.sleep(60)
