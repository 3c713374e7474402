import os
import signal
import subprocess
import sys
import time

import pytest
from prelude import PIDFILE

FOLDER = os.environ["SERVER_DIR"]


def request(n):
    """Ask the server for worker ``n``; its pid once it holds its GPU memory."""
    open(os.path.join(FOLDER, f"request-{n}"), "w").close()
    path = os.path.join(FOLDER, f"worker-{n}.pid")
    deadline = time.monotonic() + 30
    while not os.path.exists(path):
        assert time.monotonic() < deadline, "the server started no worker"
        time.sleep(0.01)
    pid = int(open(path).read())
    with open(PIDFILE, "a") as f:
        f.write(f"{pid}\n")
    while not os.path.exists(os.path.join(os.environ["GPUCLEAN_SIMULATE"], "0", str(pid))):
        assert time.monotonic() < deadline, "the worker holds no GPU memory"
        time.sleep(0.01)
    return pid


@pytest.fixture(scope="session")
def server():
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker_server.py")
    proc = subprocess.Popen([sys.executable, script, FOLDER, os.environ["GPUCLEAN_SIMULATE"]],
                            env={"PATH": os.environ["PATH"]})
    with open(PIDFILE, "a") as f:
        f.write(f"{proc.pid}\n")
    yield request
    proc.terminate()
    proc.wait(10)
    if not os.environ.get("WORKERS_LEFT"):  # a server that stops its workers when it stops
        for name in os.listdir(FOLDER):
            if name.endswith(".pid"):
                os.kill(int(open(os.path.join(FOLDER, name)).read()), signal.SIGTERM)
