"""PEER_STEP_S=S: every test of the stand-in suite takes S seconds, as on a slow box."""

import os
import time

import pytest


@pytest.fixture(autouse=True)
def _step() -> None:
    time.sleep(float(os.environ.get("PEER_STEP_S", "0")))
