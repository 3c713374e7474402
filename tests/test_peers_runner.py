"""benchmarks/peers/run_peers.py judges what a peer suite's pytest left behind: that judgement, which CI
fails on, must not depend on how fast a helper that ends with pytest happens to exit."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

PEERS = Path(__file__).resolve().parent.parent / "benchmarks" / "peers"

# A stand-in for a way's pytest: it starts a helper that ends on its own 1 s after its parent is gone (as
# multiprocessing's resource tracker ends on EOF from the pytest process it served, and takes its time to
# exit on a loaded box) and a setsid daemon that never ends on its own; then it exits.
STAND_IN = r"""
import os, subprocess, sys
r, w = os.pipe()
helper = subprocess.Popen(
    [sys.executable, "-c", "import os, sys, time; os.read(int(sys.argv[1]), 1); time.sleep(1)", str(r)],
    pass_fds=(r,), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
daemon = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                          start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
print(helper.pid, daemon.pid, flush=True)
os._exit(0)
"""

# The runner's side, as run_way calls it once the way's pytest has been reaped.
RUNNER = """
import json, subprocess, sys
sys.path.insert(0, sys.argv[1])
import run_peers
assert run_peers.set_child_subreaper()
out = subprocess.run([sys.executable, "-c", sys.argv[2]], capture_output=True, text=True, check=True).stdout
helper, daemon = map(int, out.split())
print(json.dumps({"helper": helper, "daemon": daemon, "leftovers": run_peers.end_leftovers()}))
"""


def test_a_helper_ending_after_pytest_is_not_left_behind_and_a_daemon_is() -> None:
    done = subprocess.run([sys.executable, "-c", RUNNER, str(PEERS), STAND_IN],
                          capture_output=True, text=True, timeout=60, check=True)
    result = json.loads(done.stdout)
    leftovers = result["leftovers"]
    assert [line.split()[1] for line in leftovers] == [str(result["daemon"])], leftovers
    assert "time.sleep(60)" in leftovers[0]
