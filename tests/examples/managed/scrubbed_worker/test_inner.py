import os

import pytest
from prelude import alive


@pytest.mark.needs_clean_gpus
def test_makes_a_request(server):
    assert alive(server(0))


@pytest.mark.needs_clean_gpus
def test_finds_its_worker(server):
    worker = int(open(os.path.join(os.environ["SERVER_DIR"], "worker-0.pid")).read())
    assert alive(worker), "the worker of the first request is gone"
    assert alive(server(1))
