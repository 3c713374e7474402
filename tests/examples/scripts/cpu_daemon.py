"""A daemon (double fork, its own session) that holds no GPU memory; appends its pid to argv[1]."""

import os
import sys
import time

if os.fork():
    os._exit(0)
os.setsid()
with open(sys.argv[1], "a") as f:
    f.write(str(os.getpid()) + chr(10))
time.sleep(300)
