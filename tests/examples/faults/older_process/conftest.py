import os
import subprocess

# Started by the session set-up with a scrubbed environment (no cookie): its birth says it is the session's.
SERVER = subprocess.Popen(["/bin/sleep", "300"], env={"PATH": os.environ["PATH"]})
with open(os.environ["LEAK_PIDFILE"], "a") as f:
    f.write(f"{SERVER.pid}\n")
