"""The pytest process's own helpers, which its libraries keep for its life, found through what they hold.
The census leaves them out: killing them breaks later tests, and they end with the pytest process."""

from __future__ import annotations

import os
import sys

MULTIPROCESSING_PACKAGES = ("multiprocessing", "multiprocess")
"""``multiprocess`` is the dill-based fork vLLM's tests use."""
_HELPER_MODULES = tuple((f"{p}.resource_tracker", f"{p}.forkserver") for p in MULTIPROCESSING_PACKAGES)


def library_helpers() -> dict[int, str]:
    """Multiprocessing's (and ``multiprocess``'s) resource tracker and forkserver, and whatever a library
    registered to shut down at exit (torch.compile's worker pool) with its processes, each with why."""
    helpers: dict[int, str] = {}
    modules = sys.modules
    for tracker_name, forkserver_name in _HELPER_MODULES:
        # each getattr only where the module was imported
        module = modules.get(tracker_name)
        if module is not None:
            tracker = getattr(module, "_resource_tracker", None)
            if getattr(tracker, "_pid", None):
                helpers[tracker._pid] = f"{tracker_name}'s resource tracker"  # type: ignore[union-attr]
        module = modules.get(forkserver_name)
        if module is not None:
            forkserver = getattr(module, "_forkserver", None)
            if getattr(forkserver, "_forkserver_pid", None):
                helpers[forkserver._forkserver_pid] = (  # type: ignore[union-attr]
                    f"{forkserver_name}'s fork server")
    for package in MULTIPROCESSING_PACKAGES:
        helpers.update(_shut_down_at_exit(modules.get(f"{package}.util")))
    # torch.compile shuts its worker pools down at exit; some torch versions register no Finalize for them.
    compile_pools = getattr(modules.get("torch._inductor.async_compile"), "_pool_set", None)
    if compile_pools:
        for pool in list(compile_pools):
            how = (f"{type(pool).__module__}.{type(pool).__qualname__}, a torch.compile worker pool, "
                   "which torch shuts down at the pytest process's exit")
            for pid in _processes_of(pool):
                helpers.setdefault(pid, how)
    return helpers


def torch_shm_manager() -> str | None:
    """torch's shared-memory manager's executable: libshm execs it from C++ when a tensor is first shared
    under ``file_system``, and nothing in Python holds it. None without torch."""
    torch_file = getattr(sys.modules.get("torch"), "__file__", None)
    if not isinstance(torch_file, str):
        return None
    manager = _SHM_MANAGERS.get(torch_file)
    if manager is None:
        # as /proc/<pid>/exe names it: symlinks resolved
        manager = _SHM_MANAGERS[torch_file] = os.path.realpath(
            os.path.join(os.path.dirname(torch_file), "bin", "torch_shm_manager"))
    return manager


_SHM_MANAGERS: dict[str, str] = {}


def _shut_down_at_exit(util: object) -> dict[int, str]:
    """Processes owned by objects ``Finalize`` shuts down at exit, tied to no object's life (no referent)."""
    registry = getattr(util, "_finalizer_registry", None)
    if not isinstance(registry, dict) or not registry:
        return {}
    found: dict[int, str] = {}
    for finalizer in list(registry.values()):
        key = getattr(finalizer, "_key", None)
        # (``Finalize`` keeps a ``_weakref`` only when it has a referent)
        if hasattr(finalizer, "_weakref") or not isinstance(key, tuple) or key[0] is None:
            continue  # tied to an object's life (a Pool's), or run only when called: not the process's
        callback = getattr(finalizer, "_callback", None)
        owner = getattr(callback, "__self__", None)
        if owner is None:
            continue
        how = (f"{type(owner).__module__}.{type(owner).__qualname__}, which its library shuts down at the "
               "pytest process's exit")
        for pid in _processes_of(owner):
            found[pid] = how
    return found


def _processes_of(owner: object) -> set[int]:
    """The pids an object holds: a ``process`` (``Popen``, ``Process``), an executor's ``_processes``, a
    pool's ``_pool``."""
    pids: set[int] = set()
    pid = getattr(getattr(owner, "process", None), "pid", None)
    if isinstance(pid, int):
        pids.add(pid)
    workers = getattr(owner, "_processes", None)
    if isinstance(workers, dict):
        pids.update(p for p in workers if isinstance(p, int))
    pool = getattr(owner, "_pool", None)
    if isinstance(pool, list):
        pids.update(p.pid for p in pool if isinstance(getattr(p, "pid", None), int))
    return pids
