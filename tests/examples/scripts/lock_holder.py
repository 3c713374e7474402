"""Takes GPU argv[2]'s lock in the lock directory argv[1], says READY and its pid, then (argv[3]):
wait: until its stdin ends, releases the lock and prints the notices;
die: kills itself (SIGKILL);
raw-fork: forks through libc (no os.register_at_fork hook runs in the child, which lives on), writes the
child's pid to argv[4] and kills itself (SIGKILL)."""

import os
import sys
import time

from pytest_gpuclean._locks import directory, gpus

held = gpus.GpuLocks(sys.argv[1]).acquire([sys.argv[2]], 1, 10, "holder::test")
print("READY", os.getpid(), flush=True)
if sys.argv[3] == "wait":
    sys.stdin.read()
    held.release()
    print(directory.take_notices(), flush=True)
elif sys.argv[3] == "die":
    os.kill(os.getpid(), 9)
elif sys.argv[3] == "raw-fork":
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    child = libc.fork()
    if child == 0:
        time.sleep(120)
        os._exit(0)
    with open(sys.argv[4], "w") as f:
        f.write(str(child))
    os.kill(os.getpid(), 9)
