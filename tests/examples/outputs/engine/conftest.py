import pytest
from prelude import hold, wait_holders


@pytest.fixture(scope="session")
def engine():
    server = hold("--children", "2", mib=8)  # a server that forks two workers, each on GPU 0
    wait_holders(3)
    with open("server.pid", "w") as f:
        f.write(str(server.pid))
    yield server
    server.terminate()  # the server stops; its two workers do not
    server.wait()
