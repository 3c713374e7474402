import json
import os
from pathlib import Path

import pytest

LOCK_DIR = Path(os.environ["LOCK_DIR"])
EVENTS = Path(os.environ["EVENTS"])


def held_by_us():
    """The GPU lock files this process holds a POSIX lock on, as the kernel lists them (/proc/locks)."""
    by_inode = {p.stat().st_ino: p.name for p in LOCK_DIR.glob("*.lock")}
    held = set()
    for line in Path("/proc/locks").read_text().splitlines():
        fields = line.split()
        # "1: POSIX  ADVISORY  WRITE 4242 00:2f:123456 0 EOF" (a blocked waiter's line has "->" first)
        if len(fields) >= 6 and fields[1] == "POSIX" and fields[4] == str(os.getpid()):
            inode = int(fields[5].rsplit(":", 1)[1])
            if inode in by_inode:
                held.add(by_inode[inode])
    return sorted(held)


def recorded_tests():
    """The tests this user's holder records name (a blank record is a released one)."""
    texts = [p.read_text().strip() for p in LOCK_DIR.glob("*.holder")]
    return sorted(json.loads(text)["test"] for text in texts if text)


def log(**event):
    with EVENTS.open("a") as f:
        f.write(json.dumps(event) + "\n")


def pytest_runtest_logfinish(nodeid, location):
    # After the test's teardown (and gpuclean's), before the next test's setup.
    log(between=nodeid, held=held_by_us())
    if nodeid == os.environ.get("EXIT_AFTER"):
        pytest.exit("stopped between two tests (as by Ctrl-C there)")


def pytest_unconfigure(config):
    # After gpuclean's session end: what this process still holds, and what its records still say.
    log(end=True, held=held_by_us(), records=recorded_tests())
