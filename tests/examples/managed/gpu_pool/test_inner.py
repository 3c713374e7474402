# A library's pool whose worker holds GPU memory after the test: still judged (an excuse that covered held
# memory would be a clean verdict beside it).
import pool_lib
import pytest
from prelude import PIDFILE


@pytest.mark.needs_clean_gpus
def test_leaves_gpu_memory_in_the_pool():
    worker = pool_lib.hold(256)
    with open(PIDFILE, "a") as f:
        f.write(f"{worker}\n")


@pytest.mark.needs_clean_gpus
def test_after():
    pass
