import os

import pytest


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.needs_clean_gpus
def test_makes_a_request(server):
    assert alive(server(0))


@pytest.mark.needs_clean_gpus
def test_finds_its_worker(server):
    worker = int(open(os.path.join(os.environ["SERVER_DIR"], "worker-0.pid")).read())
    assert alive(worker), "the worker of the first request is gone"
    assert alive(server(1))
