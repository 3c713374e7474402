"""A holder that rewrites its allocation in place without end, as a shell's ``echo N > file`` in a loop
would: truncated, then written. ``rewriting_holder.py DIR DEVICE MIB PIDFILE``."""

import os
import sys

folder, device, mib, pidfile = sys.argv[1:5]
path = os.path.join(folder, device, str(os.getpid()))
size = str(int(float(mib) * 1024 * 1024))
with open(path, "w") as f:
    f.write(size)
with open(pidfile, "a") as f:
    f.write(f"{os.getpid()}\n")
while True:
    with open(path, "w") as f:
        f.write(size)
