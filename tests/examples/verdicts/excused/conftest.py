import pytest
from prelude import hold, wait_holders


@pytest.fixture(scope="session", autouse=True)
def server():
    """A model server on GPU 1 for the whole session, stopped at its end."""
    proc = hold(device=1, mib=2048)
    wait_holders(1)
    yield proc
    proc.terminate()
    proc.wait()
