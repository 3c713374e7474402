import os
import subprocess
import time

import pytest

USER, MARKER = os.environ["OTHER_USER"], os.environ["SU_MARKER"]


@pytest.mark.needs_clean_gpus(timeout=2)
def test_su():
    subprocess.Popen(["su", USER, "-s", "/bin/sh", "-c", f"sleep 300; : {MARKER}"])
    time.sleep(1)
