import os
import subprocess

# Started by the session set-up, stopped by nobody: reaped by the very last sweep, after pytest_unconfigure.
SLEEPER = subprocess.Popen(["sleep", "600"])
with open(os.environ["LEAK_PIDFILE"], "a") as f:
    f.write(f"{SLEEPER.pid}\n")
