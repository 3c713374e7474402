"""Started before pytest (a container entrypoint's `server & exec pytest`): it forks a child of its own
when asked (argv[2] exists), while a test runs; it appends its pid and its child's to argv[1]."""

import os
import subprocess
import sys
import time

with open(sys.argv[1], "a") as f:
    f.write(f"{os.getpid()}\n")
while not os.path.exists(sys.argv[2]):
    time.sleep(0.01)
child = subprocess.Popen(["/bin/sleep", "600"])
with open(sys.argv[1], "a") as f:
    f.write(f"{child.pid}\n")
child.wait()
