import os
import subprocess
import sys

import pytest
from prelude import PIDFILE, script, wait_holders


@pytest.fixture(scope="module")
def server():
    proc = subprocess.Popen([sys.executable, script("forking_server.py"), PIDFILE], stdin=subprocess.PIPE,
                            text=True)
    yield proc
    workers = [int(x) for x in open(PIDFILE).read().split()]
    assert all(os.path.exists(f"/proc/{w}") for w in workers), "a worker of the server was killed"
    proc.stdin.close()
    proc.wait(10)
    for w in workers:
        os.kill(w, 9)


@pytest.mark.needs_clean_gpus
def test_requests_a_worker(server):
    server.stdin.write("spawn\n")
    server.stdin.flush()
    wait_holders(1)


@pytest.mark.needs_clean_gpus
def test_uses_the_worker(server):
    worker = int(open(PIDFILE).read().split()[0])
    assert os.path.exists(f"/proc/{worker}")
