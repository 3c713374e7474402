# A module-scoped fixture hands out a factory that starts its server on first use, inside the first test that
# calls it. SERVER_ENV=scrubbed starts it with an explicit environment (no cookie); SERVER_LEFT=1 makes the
# fixture forget to stop it.
import os
import subprocess
import sys

import pytest
from prelude import PIDFILE


@pytest.fixture(scope="module")
def server():
    started = []

    def get():
        if not started:
            env = {"PATH": os.environ["PATH"]} if os.environ.get("SERVER_ENV") == "scrubbed" else None
            proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], env=env)
            with open(PIDFILE, "a") as f:
                f.write(f"{proc.pid}\n")
            started.append(proc)
        return started[0]

    yield get
    if not os.environ.get("SERVER_LEFT"):
        for proc in started:
            proc.terminate()
            proc.wait(10)


@pytest.mark.needs_clean_gpus
def test_first_use_starts_it(server):
    assert server().poll() is None


@pytest.mark.needs_clean_gpus
def test_second_use(server):
    assert server().poll() is None


@pytest.mark.needs_clean_gpus
def test_third_use(server):
    assert server().poll() is None
