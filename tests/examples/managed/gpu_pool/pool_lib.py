"""A library that caches its process pool in a module global; its workers hold (simulated) GPU memory."""

import concurrent.futures
import os

from pytest_gpuclean import simulate

_EXECUTOR = None


def _hold(mib):
    simulate.allocate(os.environ["GPUCLEAN_SIMULATE"], 0, mib)
    return os.getpid()


def executor():
    global _EXECUTOR
    if _EXECUTOR is None:
        _EXECUTOR = concurrent.futures.ProcessPoolExecutor(max_workers=1)
    return _EXECUTOR


def hold(mib):
    return executor().submit(_hold, mib).result()
