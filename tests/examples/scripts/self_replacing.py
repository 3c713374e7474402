"""A chain that never waits for a signal: each process forks the next and exits at once, the child sleeps 2 ms
and does the same. Its pid never stays, and no process of it lives longer than a few milliseconds.
argv[1] is a marker that names the chain's processes in /proc (their command line is this one)."""

import os
import time

while True:
    if os.fork() == 0:
        time.sleep(0.002)
        continue
    os._exit(0)
