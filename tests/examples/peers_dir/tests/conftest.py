"""PEER_STEP_S=S: every test of the stand-in suite takes S seconds, as on a slow box. PEER_NO_RERUN=1: a run
of some of its tests alone (run_peers.py's reruns, PEERS_KEEP_FILE) ends before any test, as one whose
collection breaks or is cut short there would. PEER_BROKEN=1: every test errors at teardown, as in a suite
whose conftest does not hold in this environment."""

import os
import time
from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def _step() -> Iterator[None]:
    time.sleep(float(os.environ.get("PEER_STEP_S", "0")))
    yield
    assert os.environ.get("PEER_BROKEN") != "1", "PEER_BROKEN=1"


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get("PEER_NO_RERUN") == "1" and os.environ.get("PEERS_KEEP_FILE"):
        raise pytest.UsageError("PEER_NO_RERUN=1: no run alone")
