"""PEER_STEP_S=S: every test of the stand-in suite takes S seconds, as on a slow box. PEER_NO_RERUN=1: a run
of some of its tests alone (run_peers.py's reruns, PEERS_KEEP_FILE) ends before any test, as one whose
collection breaks or is cut short there would."""

import os
import time

import pytest


@pytest.fixture(autouse=True)
def _step() -> None:
    time.sleep(float(os.environ.get("PEER_STEP_S", "0")))


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get("PEER_NO_RERUN") == "1" and os.environ.get("PEERS_KEEP_FILE"):
        raise pytest.UsageError("PEER_NO_RERUN=1: no run alone")
