import multiprocessing

import pytest
from prelude import PIDFILE

POOLS = []


@pytest.mark.needs_clean_gpus
def test_leak():
    pool = multiprocessing.get_context("fork").Pool(3)
    POOLS.append(pool)  # still referenced: its handler thread would respawn killed workers
    with open(PIDFILE, "w") as f:
        f.write(" ".join(str(p.pid) for p in pool._pool))


@pytest.mark.needs_clean_gpus
def test_next():
    pass
