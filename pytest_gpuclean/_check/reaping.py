"""The reap ladder: SIGTERM, grace, SIGKILL, timing how long the driver takes to free the memory; and the
pytest process's pools that own a leak's workers, shut down (a live ``Pool`` replaces killed workers). It
signals only what it is handed: the gate decided before."""

from __future__ import annotations

import gc
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from pytest_gpuclean._model.records import DeviceInfo, DeviceSnapshot, FoundBy, Owner, ProcessInfo, Reaped
from pytest_gpuclean._reading import processes
from pytest_gpuclean._reading.devices import DeviceError

_RELEASE_POLL_S = 0.005

Read = Callable[[Sequence[DeviceInfo]], Sequence[DeviceSnapshot]]


def kill_and_confirm(targets: Sequence[processes.KillTarget], devices: Sequence[DeviceInfo],
                     holders: set[int], *, read: Read, grace: float, hurry: Callable[[], bool] | None = None,
                     kill_first: bool = False
                     ) -> tuple[dict[int, tuple[processes.KillOutcome, float | None]], float | None]:
    """The kill ladder, then wait until the driver lists none of ``holders``. Per pid its outcome and
    release time, and the seconds until every holder was gone (None if none held a GPU or one stayed)."""
    watch = _ReleaseWatch(read, devices, holders)
    killed_at = time.monotonic()
    outcomes = processes.terminate(targets, grace, watch=watch.poll, hurry=hurry, kill_first=kill_first)
    watch.finish(deadline=time.monotonic() + max(grace, 10.0))
    ended: dict[int, tuple[processes.KillOutcome, float | None]] = {}
    for outcome in outcomes:
        release = None
        if outcome.pid in watch.gone_at and outcome.signal_s is not None:
            # The driver frees memory while the process exits: time from the signal that ended it.
            release = max(0.0, watch.gone_at[outcome.pid] - (killed_at + outcome.signal_s))
        ended[outcome.pid] = (outcome, release)
    all_released = None
    if holders and holders <= watch.gone_at.keys():
        all_released = max(watch.gone_at[p] for p in holders) - killed_at
    return ended, all_released


class _ReleaseWatch:
    """Notes when each killed GPU holder leaves the driver's process list."""

    def __init__(self, read: Read, devices: Sequence[DeviceInfo], holders: set[int]) -> None:
        self.read = read
        self.devices = devices
        self.holders = holders
        self.gone_at: dict[int, float] = {}

    def poll(self) -> None:
        if len(self.gone_at) == len(self.holders):
            return
        try:
            listed = {p.pid for s in self.read(self.devices) for p in s.processes}
        except DeviceError:
            # The killing goes on untimed; the check's next reading meets the error.
            self.holders = set(self.gone_at)
            return
        now = time.monotonic()
        for pid in self.holders - listed - self.gone_at.keys():
            self.gone_at[pid] = now

    def finish(self, deadline: float) -> None:
        self.poll()
        while len(self.gone_at) < len(self.holders) and time.monotonic() < deadline:
            time.sleep(_RELEASE_POLL_S)
            self.poll()


def vanished(pid: int) -> ProcessInfo:
    """A stand-in for a process that ended before it could be described."""
    return ProcessInfo(pid, 0, 0, -1, "?", "(exited)", "gone")


def reaped_record(info: ProcessInfo | None, pid: int, owner: Owner | None, found_by: FoundBy,
                  ended: tuple[processes.KillOutcome, float | None],
                  held: tuple[tuple[str, float], ...]) -> Reaped:
    """What the kill ladder did to one process, as reported."""
    outcome, release = ended
    return Reaped.after_kill(info or vanished(pid), owner, found_by, held, outcome, release)


def _worker_pids(obj: Any, pool_type: type | None, executor_type: type | None) -> set[int]:
    if pool_type is not None and isinstance(obj, pool_type):
        return {p.pid for p in list(getattr(obj, "_pool", None) or []) if p.pid}
    if executor_type is not None and isinstance(obj, executor_type):
        return set((getattr(obj, "_processes", None) or {}).keys())
    return set()


def _registered_pools(pool_type: type | None, executor_type: type | None) -> list[Any] | None:
    """Live pools and executors, from the standard library's registries: walking the heap instead is slow
    after importing torch, all before the first signal. None where the internals are missing: walk the heap
    then."""
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
    """Terminate pools owning any of ``leaked_pids``, in a thread bounded by ``wait``: ``Pool.terminate``
    joins its workers and would hang on one that ignores SIGTERM."""
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
