# A leak that replaces itself without waiting for any signal: each process forks the next and exits.
import os
import subprocess
import sys
import time

import pytest
from prelude import script


@pytest.mark.needs_clean_gpus
def test_chain():
    subprocess.Popen([sys.executable, script("self_replacing.py"), os.environ["CHAIN_MARKER"]])
    time.sleep(0.3)


@pytest.mark.needs_clean_gpus
def test_next():
    pass
