import os
import subprocess
import sys


def _start(tag):
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)", tag],
                            env={"PATH": os.environ["PATH"]})
    with open(os.environ["LEAK_PIDFILE"], "a") as f:
        f.write(f"{proc.pid}\n")
    return proc


AT_IMPORT = _start("conftest-import")  # before any plugin's pytest_configure


def pytest_configure(config):
    config._servers = [AT_IMPORT, _start("conftest-configure")]


def pytest_unconfigure(config):
    # The conftest stops one of its servers itself; it must still be alive to be stopped.
    server = config._servers[0]
    assert server.poll() is None, "the conftest's server was killed before pytest_unconfigure"
    server.terminate()
    server.wait(10)
