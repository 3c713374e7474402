import ctypes
import os
import time
from pathlib import Path

import pytest


@pytest.mark.needs_clean_gpus
def test_forks():
    child = ctypes.CDLL(None).fork()
    if child == 0:
        time.sleep(120)
        os._exit(0)
    Path(os.environ["CHILD"]).write_text(str(child))
    time.sleep(120)
