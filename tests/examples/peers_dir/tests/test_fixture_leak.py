"""A module-scoped fixture that leaves its process behind (with PEER_LEAK=1): gpuclean names the fixture."""

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest


@pytest.fixture(scope="module")
def server() -> Iterator[None]:
    if os.environ.get("PEER_LEAK") == "1":
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(61)"])
    yield


def test_uses_the_server(server: None) -> None:
    pass
