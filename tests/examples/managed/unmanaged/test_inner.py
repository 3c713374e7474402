# What a test creates in its own body and drops is its own, whatever the standard library still keeps of it.
import concurrent.futures
import multiprocessing
import os
import subprocess
import sys
import time

import pytest
from prelude import PIDFILE


def note(pids):
    with open(PIDFILE, "a") as f:
        f.write("".join(f"{p}\n" for p in pids))


def pid(_):
    return os.getpid()


@pytest.mark.needs_clean_gpus
def test_drops_a_running_popen():
    # Dropped while it runs: Popen.__del__ puts it in subprocess._active, which holds it for no one.
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    note([proc.pid])


@pytest.mark.needs_clean_gpus
def test_drops_a_started_process():
    # Dropped while it runs: multiprocessing.process._children holds its popen, for no one.
    process = multiprocessing.get_context("fork").Process(target=time.sleep, args=(300,))
    process.start()
    note([process.pid])


@pytest.mark.needs_clean_gpus
def test_drops_an_executor():
    # Unshut and freed at once: CPython's manager thread then stops the workers by itself.
    executor = concurrent.futures.ProcessPoolExecutor(max_workers=2)
    executor.submit(pid, 0).result()
    note(list(executor._processes))
    with open(os.environ["DROPPED_PIDS"], "w") as f:
        f.write(" ".join(map(str, executor._processes)))


@pytest.mark.needs_clean_gpus
def test_drops_a_manager_in_a_cycle():
    # Unshut, kept alive only by a reference cycle until the next garbage collection: the collection gpuclean
    # runs before it judges ends it through multiprocessing's own finalizer.
    manager = multiprocessing.get_context("fork").Manager()
    note([manager._process.pid])
    with open(os.environ["DROPPED_PIDS"], "a") as f:
        f.write(f" {manager._process.pid}")
    cycle = [manager]
    cycle.append(cycle)


@pytest.mark.needs_clean_gpus
def test_after():
    pass
