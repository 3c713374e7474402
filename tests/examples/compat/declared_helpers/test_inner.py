import os
import subprocess
import sys

import pytest

_server = None


def compile_server():
    # A library's helper started once, for the pytest process's life, by whichever test first needs it.
    global _server
    if _server is None:
        _server = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", "compile-server"])
        with open(os.environ["LEAK_PIDFILE"], "a") as f:
            f.write(f"{_server.pid}\n")
    return _server


@pytest.mark.needs_clean_gpus
def test_first_use_starts_it():
    assert compile_server().poll() is None


@pytest.mark.needs_clean_gpus
def test_later_use_finds_it():
    assert compile_server().poll() is None
