"""A daemon that starts what it is asked to (a JSON line on the fifo argv[1]: argv and environment), in a
session of its own."""

import json
import subprocess
import sys

while True:
    with open(sys.argv[1]) as f:
        for line in f:
            request = json.loads(line)
            subprocess.Popen(request["argv"], env=request["env"], start_new_session=True)
