"""Find process pools inside the pytest process whose workers a test leaked, and shut them down.

A live ``multiprocessing.Pool`` replaces every worker we kill from a handler thread in our own
process, so killing its workers from outside never converges; terminating the pool object does.
"""

from __future__ import annotations

import gc
import sys
import threading
from typing import Any

__all__ = [
    "shutdown_pools",
]


def _worker_pids(obj: Any, pool_type: type | None, executor_type: type | None) -> set[int]:
    if pool_type is not None and isinstance(obj, pool_type):
        return {p.pid for p in list(getattr(obj, "_pool", None) or []) if p.pid}
    if executor_type is not None and isinstance(obj, executor_type):
        return set((getattr(obj, "_processes", None) or {}).keys())
    return set()


def _registered_pools(pool_type: type | None, executor_type: type | None) -> list[Any] | None:
    """Live pools and executors, found through the standard library's own registries.

    A ``Pool`` registers a ``multiprocessing.util.Finalize`` holding a weak reference to itself; a
    ``ProcessPoolExecutor`` with workers runs a manager thread holding one. Walking the heap instead
    takes time proportional to it, and in a process that imported torch, transformers and vllm all of
    that lies between the teardown's start and the first signal (docs/benchmarks.md). None where these
    internals are missing (another Python version): the caller walks the heap then.
    """
    found: list[Any] = []
    if pool_type is not None:
        registry = getattr(sys.modules.get("multiprocessing.util"), "_finalizer_registry", None)
        if not isinstance(registry, dict):
            return None
        for finalizer in list(registry.values()):
            ref = getattr(finalizer, "_weakref", None)
            obj = ref() if callable(ref) else None
            if isinstance(obj, pool_type):
                found.append(obj)
    if executor_type is not None:
        manager_type = getattr(sys.modules.get("concurrent.futures.process"), "_ExecutorManagerThread", None)
        if not isinstance(manager_type, type):
            return None
        for thread in threading.enumerate():
            if isinstance(thread, manager_type):
                ref = getattr(thread, "executor_reference", None)
                obj = ref() if callable(ref) else None
                if isinstance(obj, executor_type):
                    found.append(obj)
    return found


def shutdown_pools(leaked_pids: set[int], wait: float) -> list[str]:
    """Terminate pools in this process owning any of ``leaked_pids``; return a note per pool.

    Finds them through the standard library's registries (``_registered_pools``), else by walking the
    garbage collector's objects. Termination runs in a thread bounded by ``wait``: ``Pool.terminate``
    joins its workers and would hang on one that ignores SIGTERM until the kill ladder escalates to
    SIGKILL.
    """
    mp_pool = sys.modules.get("multiprocessing.pool")
    cf_process = sys.modules.get("concurrent.futures.process")
    pool_type = getattr(mp_pool, "Pool", None)
    executor_type = getattr(cf_process, "ProcessPoolExecutor", None)
    if pool_type is None and executor_type is None:
        return []
    notes: list[str] = []
    registered = _registered_pools(pool_type, executor_type)
    for obj in registered if registered is not None else gc.get_objects():
        try:
            owned = _worker_pids(obj, pool_type, executor_type) & leaked_pids
        except Exception:  # a half-constructed or foreign object: not ours to judge
            continue
        if not owned:
            continue
        kind = type(obj).__name__
        if pool_type is not None and isinstance(obj, pool_type):
            stopper = threading.Thread(target=obj.terminate, name="gpuclean-pool-terminate", daemon=True)
        else:
            stopper = threading.Thread(target=obj.shutdown, kwargs={"wait": False, "cancel_futures": True},
                                       name="gpuclean-executor-shutdown", daemon=True)
        stopper.start()
        stopper.join(wait)
        notes.append(f"{kind} with workers {sorted(owned)} was still referenced in the pytest process: "
                     f"shut it down{'' if not stopper.is_alive() else ' (still stopping)'}")
    return notes
