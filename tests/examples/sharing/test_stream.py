import os
import time
from pathlib import Path

import pytest


@pytest.mark.needs_clean_gpus
@pytest.mark.parametrize("n", range(100))
def test_stream(n):
    """One test after another on GPU 0, until told to stop (then quick ones)."""
    Path(os.environ["STREAMING"]).touch()
    if not Path(os.environ["STOP"]).exists():
        time.sleep(0.3)
