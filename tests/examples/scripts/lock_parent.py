"""Holds GPU-a's lock in the lock directory argv[1] and starts a child that takes it too (it inherits it:
printed as CHILD ...); prints HELD and the inherited variable, releases on end of stdin, prints AFTER."""

import os
import subprocess
import sys

from pytest_gpuclean._locks.gpus import GpuLocks
from pytest_gpuclean._locks.held import HELD_VAR

CHILD = ("import sys; from pytest_gpuclean._locks.gpus import GpuLocks; "
         "held = GpuLocks(sys.argv[1]).acquire(['GPU-a'], 1, 0, 'child::test'); "
         "print('CHILD', held.uuids, held.locks, sorted(held.inherited))")

held = GpuLocks(sys.argv[1]).acquire(["GPU-a"], 1, 5, "parent::test")
child = subprocess.run([sys.executable, "-c", CHILD, sys.argv[1]], capture_output=True, text=True)
print(child.stdout.strip() or child.stderr, flush=True)
print("HELD", os.environ[HELD_VAR], flush=True)
sys.stdin.read()
held.release()
print("AFTER", os.environ.get(HELD_VAR), flush=True)
