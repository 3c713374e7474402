import os
import subprocess
import sys

import pytest
from prelude import PIDFILE, SIM, script, wait_holders


@pytest.mark.needs_clean_gpus
def test_garbage():
    subprocess.Popen([sys.executable, script("garbage_writer.py"), os.path.join(SIM, "0"), PIDFILE])
    wait_holders(1)


@pytest.mark.needs_clean_gpus
@pytest.mark.parametrize("n", range(3))
def test_later(n):
    pass
