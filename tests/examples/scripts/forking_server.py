"""A server that starts a worker with a scrubbed environment whenever asked (a line on stdin); it appends
the workers' pids to argv[1]."""

import subprocess
import sys

for _line in sys.stdin:
    worker = subprocess.Popen(["/bin/sleep", "300"], env={})
    with open(sys.argv[1], "a") as f:
        f.write(f"{worker.pid}\n")
