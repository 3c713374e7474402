import os
import sys

import pytest
from xprocess import ProcessStarter

SERVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "model_server.py")


@pytest.fixture(scope="session")
def model_server(xprocess):
    # pytest-xprocess's documented use: a server started once and reused by later runs while it lives
    # (xprocess.ensure), stopped only with `pytest --xkill`.
    class Starter(ProcessStarter):
        pattern = "serving"
        args = (sys.executable, SERVER)
        timeout = 60

    pid, _log = xprocess.ensure("model_server", Starter)
    return pid
