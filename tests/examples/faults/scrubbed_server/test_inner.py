import os
import subprocess

import pytest
from prelude import PIDFILE


@pytest.fixture(scope="module")
def server():
    # A server with an explicit environment: no cookie says whose it is.
    proc = subprocess.Popen(["/bin/sleep", "300"], env={"PATH": os.environ["PATH"]})
    with open(PIDFILE, "a") as f:
        f.write(f"{proc.pid}\n")
    yield proc
    assert proc.poll() is None, f"the fixture's server died under it (returncode {proc.returncode})"
    proc.terminate()
    assert proc.wait(10) == -15  # our own exit status, not one gpuclean took from us


def test_1_unmarked(server):
    pass


@pytest.mark.needs_clean_gpus
def test_2_marked(server):
    assert server.poll() is None


@pytest.mark.needs_clean_gpus
def test_3_marked(server):
    assert server.poll() is None
