# joblib.Parallel's default backend, loky's reusable executor (scikit-learn's n_jobs), used by three tests:
# the first starts the pool, the later ones reuse it. None of them leaks it.
import os

import pytest
from joblib import Parallel, delayed
from joblib.externals.loky import get_reusable_executor, reusable_executor
from prelude import PIDFILE

WORKERS = os.environ["WORKER_PIDS"]


def square(x):
    return x * x


def workers():
    pids = sorted(reusable_executor._executor._processes)
    with open(WORKERS, "a") as f:
        f.write(" ".join(map(str, pids)) + "\n")
    with open(PIDFILE, "a") as f:  # (so that the outer test ends whatever outlives this session)
        f.write("".join(f"{pid}\n" for pid in pids))
    return pids


def test_parallel_starts_the_pool():
    assert Parallel(n_jobs=2)(delayed(square)(i) for i in range(8)) == [i * i for i in range(8)]
    workers()


@pytest.mark.needs_clean_gpus
def test_parallel_again():
    assert Parallel(n_jobs=2)(delayed(square)(i) for i in range(4)) == [0, 1, 4, 9]
    workers()


def test_reusable_executor_directly():
    # (with other arguments than joblib's: loky may replace the pool, and stops the old one itself)
    executor = get_reusable_executor(max_workers=2)
    assert executor.submit(square, 3).result() == 9
    workers()
