# multiprocessing's helpers, of the module $MP_MODULE names (multiprocessing or multiprocess).
import importlib
import os

import pytest

mp = importlib.import_module(os.environ["MP_MODULE"])


def work(q):
    q.put(os.getpid())


@pytest.mark.parametrize("method", ["spawn", "forkserver", "spawn"])
def test_spawns(method):
    ctx = mp.get_context(method)
    q = ctx.Queue()
    p = ctx.Process(target=work, args=(q,))
    p.start()
    assert q.get(timeout=60) == p.pid
    p.join()
