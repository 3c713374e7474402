import os
import time

import pytest

marked = pytest.mark.needs_clean_gpus(timeout=float(os.environ["MARK_TIMEOUT"]))


@marked
def test_1_gpu_taken_from_outside_while_it_runs():
    open(os.environ["GO"], "w").close()
    while not (os.path.exists(os.environ["LATER_PIDFILE"]) and open(os.environ["LATER_PIDFILE"]).read()):
        time.sleep(0.01)


@marked
@pytest.mark.parametrize("n", range(2))
def test_2_not_run(n):
    raise AssertionError("must not run on dirty GPUs")
