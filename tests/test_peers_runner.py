"""benchmarks/peers/run_peers.py judges what a peer suite's pytest left behind: that judgement, which CI
fails on, must not depend on how fast a helper that ends with pytest happens to exit."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

PEERS = Path(__file__).resolve().parent.parent / "benchmarks" / "peers"
EXAMPLES = Path(__file__).resolve().parent / "examples"

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


# ---- a recorded plugin-off run standing in for the off way (CI's peer stages) --------------------------


def _run_peers(tmp_path: Path, *args: str, probe: bool = False) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, GPUCLEAN_DEAD_SESSIONS="off", PEER_PROBE="1" if probe else "0")
    return subprocess.run([sys.executable, str(PEERS / "run_peers.py"), "vllm", "tests/test_peer.py",
                           "--vllm-dir", str(tmp_path / "suite"), "--no-iomp", *args],
                          capture_output=True, text=True, timeout=300, env=env)


def test_a_recorded_off_run_stands_in_and_a_difference_is_still_rerun_both_ways(tmp_path: Path) -> None:
    shutil.copytree(EXAMPLES / "peers", tmp_path / "suite")
    reference = tmp_path / "reference"
    recorded = _run_peers(tmp_path, "--ways", "off", "--record-reference", str(reference))
    assert recorded.returncode == 0, recorded.stdout + recorded.stderr
    (path,) = reference.iterdir()
    record = json.loads(path.read_text())
    assert record["targets"] == ["tests/test_peer.py"]
    assert sorted(record["off"]["outcomes"].values()) == ["passed", "passed", "skipped"]

    # The two ways under gpuclean run; the off way does not (no log, no JUnit of it in the work dir).
    work = tmp_path / "work"
    used = _run_peers(tmp_path, "--simulate", "--reference-dir", str(reference), "--keep-work", str(work))
    assert used.returncode == 0, used.stdout + used.stderr
    assert f"plugin-off outcomes: the reference {path}" in used.stdout
    assert "vllm: 2 passed, 0 failed" in used.stdout
    assert sorted(p.name for p in work.glob("*.xml")) == ["all.xml", "marked.xml"]

    # An outcome gpuclean changes is caught against the record: the test runs again alone, plugin off here
    # (it passes) and under gpuclean (it fails again), and the run fails naming it.
    changed = _run_peers(tmp_path, "--simulate", "--reference-dir", str(reference), probe=True)
    assert changed.returncode == 1, changed.stdout + changed.stderr
    for way in ("marked", "all"):
        assert (f"FAIL {way}: tests.test_peer::test_fails_only_under_gpuclean: failed with gpuclean, passed "
                "without (reproduced alone)") in changed.stdout

    # Another key (here another slice) has no record: the off way runs.
    other = _run_peers(tmp_path, "--simulate", "--shard", "2", "--reference-dir", str(reference),
                       "--ways", "off")
    assert other.returncode == 0, other.stdout + other.stderr
    assert f"plugin-off outcomes: no reference in {reference}" in other.stdout
