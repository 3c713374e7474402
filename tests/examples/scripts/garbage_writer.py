"""Writes garbage into its own file in the device folder argv[1] (no driver reports this: the simulated
backend's reading of that GPU fails), appends its pid to argv[2], and stays."""

import os
import sys
import time

with open(os.path.join(sys.argv[1], str(os.getpid())), "w") as f:
    f.write("garbage")
with open(sys.argv[2], "a") as f:
    f.write(f"{os.getpid()}\n")
time.sleep(600)
