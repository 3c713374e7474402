"""A library that caches its process pool in a module global, for the process's life, as many do."""

import concurrent.futures

_EXECUTOR = None


def executor():
    global _EXECUTOR
    if _EXECUTOR is None:
        _EXECUTOR = concurrent.futures.ProcessPoolExecutor(max_workers=2)
    return _EXECUTOR
