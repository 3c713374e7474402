import os
import signal

import pytest


@pytest.mark.needs_clean_gpus
def test_gcs_dies():
    os.kill(int(os.environ["GCS_PID"]), signal.SIGKILL)
