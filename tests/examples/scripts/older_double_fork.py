"""Started before pytest (a container entrypoint's `server & exec pytest`): when asked (argv[2] exists),
while a test runs, it double-forks a daemon (the middle process exits at once, and the daemon is adopted
by pytest, the nearest subreaper). It appends its pid and its daemon's to argv[1]."""

import os
import sys
import time

with open(sys.argv[1], "a") as f:
    f.write(f"{os.getpid()}\n")
while not os.path.exists(sys.argv[2]):
    time.sleep(0.01)
read, write = os.pipe()
if os.fork() == 0:
    if os.fork() == 0:
        os.write(write, f"{os.getpid()}\n".encode())
        os.execv("/bin/sleep", ["sleep", "600"])
    os._exit(0)
os.close(write)
os.wait()
daemon = os.read(read, 32).decode()
with open(sys.argv[1], "a") as f:
    f.write(daemon)
time.sleep(600)
