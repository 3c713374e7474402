import os

import pytest
from prelude import hold, wait_holders

STOP_SERVER = os.environ["STOP_SERVER"] == "yes"  # or leave it to gpuclean


@pytest.fixture(scope="module")
def server():
    proc = hold(mib=50)
    pid = wait_holders(1)[0]
    yield pid
    if STOP_SERVER:
        proc.terminate()
        proc.wait()


@pytest.mark.needs_clean_gpus
def test_one(server):
    os.kill(server, 0)


@pytest.mark.needs_clean_gpus
def test_two(server):
    os.kill(server, 0)  # the first test's checks left the fixture's server alone
