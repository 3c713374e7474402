import os
import time
from pathlib import Path

import pytest


@pytest.mark.needs_clean_gpus
def test_waiter():
    # The session on GPU 1 ran during the stream (it did not wait for it): only now does the stream stop.
    deadline = time.monotonic() + 60
    while not Path(os.environ["RAN"]).exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    Path(os.environ["STOP"]).touch()
