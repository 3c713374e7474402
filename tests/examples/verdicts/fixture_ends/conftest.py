import pytest
from prelude import hold, wait_holders


@pytest.fixture(scope="session")
def server():
    """A server holding 1 GiB of GPU 0 that nothing ever stops: its leak."""
    proc = hold(mib=1024)
    wait_holders(1)
    yield proc


@pytest.fixture(scope="module")
def engine():
    """A module's engine holding 64 MiB of GPU 1, never stopped either."""
    proc = hold(device=1, mib=64)
    wait_holders(2)
    yield proc
