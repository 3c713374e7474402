"""Notes each SIGTERM in $LEAK_TERMED and lives on; appends its pid to $LEAK_PIDFILE."""

import os
import signal
import time

signal.signal(signal.SIGTERM, lambda *_: open(os.environ["LEAK_TERMED"], "a").write("SIGTERM "))
open(os.environ["LEAK_PIDFILE"], "a").write(f"{os.getpid()} ")
while True:
    time.sleep(3600)
