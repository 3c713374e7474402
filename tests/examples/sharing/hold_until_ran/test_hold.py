import os
import time
from pathlib import Path

import pytest


@pytest.mark.needs_clean_gpus
def test_hold():
    """Hold every GPU's lock until RELEASE exists (or a minute passes)."""
    Path(os.environ["HOLDING"]).write_text(str(os.getpid()))
    release = Path(os.environ["RELEASE"])
    deadline = time.monotonic() + 60
    while not release.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert release.exists(), "the other session's test did not run while this one held its GPU"
