# A library's cached executor and a library's service, first used by a test, reused by the later ones.
import os

import pool_lib
import service_lib
from prelude import PIDFILE


def pid(_):
    return os.getpid()


def note():
    """The pool's workers and the service, as this test sees them."""
    pids = sorted([*pool_lib.executor()._processes, service_lib.Service.get().pid])
    with open(PIDFILE, "a") as f:  # (so that the outer test ends whatever outlives this session)
        f.write("".join(f"{p}\n" for p in pids))
    with open(os.environ["SEEN_PIDS"], "a") as f:
        f.write(" ".join(map(str, pids)) + "\n")


def test_first_use_starts_them():
    assert pool_lib.executor().submit(pid, 0).result() in pool_lib.executor()._processes
    assert service_lib.Service.get().poll() is None
    note()


def test_second_use():
    assert pool_lib.executor().submit(pid, 0).result() in pool_lib.executor()._processes
    assert service_lib.Service.get().poll() is None


def test_third_use():
    assert sorted(pool_lib.executor().map(pid, range(8)))
    assert service_lib.Service.get().poll() is None
    note()
