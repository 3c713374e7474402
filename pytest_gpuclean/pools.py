"""Find process pools inside the pytest process whose workers a test leaked, and shut them down.

A live ``multiprocessing.Pool`` replaces every worker we kill from a handler thread in our own
process, so killing its workers from outside never converges; terminating the pool object does.
"""

from __future__ import annotations

import gc
import sys
import threading
from typing import Any


def _worker_pids(obj: Any, pool_type: type | None, executor_type: type | None) -> set[int]:
    if pool_type is not None and isinstance(obj, pool_type):
        return {p.pid for p in list(getattr(obj, "_pool", None) or []) if p.pid}
    if executor_type is not None and isinstance(obj, executor_type):
        return set((getattr(obj, "_processes", None) or {}).keys())
    return set()


def shutdown_pools(leaked_pids: set[int], wait: float) -> list[str]:
    """Terminate pools in this process owning any of ``leaked_pids``; return a note per pool.

    Walks the garbage collector's objects (milliseconds), so it runs only when a leak was found.
    Termination runs in a thread bounded by ``wait``: ``Pool.terminate`` joins its workers and would
    hang on one that ignores SIGTERM until the kill ladder escalates to SIGKILL.
    """
    mp_pool = sys.modules.get("multiprocessing.pool")
    cf_process = sys.modules.get("concurrent.futures.process")
    pool_type = getattr(mp_pool, "Pool", None)
    executor_type = getattr(cf_process, "ProcessPoolExecutor", None)
    if pool_type is None and executor_type is None:
        return []
    notes: list[str] = []
    for obj in gc.get_objects():
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
