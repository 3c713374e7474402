"""One clean checked test as the plugin pays for it, shared by the clean-path benchmarks.

``bench_clean_path.py`` times it, ``call_counts.py`` counts its Python calls: the same loop, so the two
figures describe the same work. No ``sys.path`` changes here: each script chooses which tree it measures.
"""

from __future__ import annotations

from typing import Any

from pytest_gpuclean._check.checker import Checker
from pytest_gpuclean._locks.gpus import GpuLocks
from pytest_gpuclean._model.records import DeviceInfo


def checked_test(checker: Checker, watch: Any, devs: tuple[DeviceInfo, ...], locks: GpuLocks | None = None,
                 uuids: list[str] | None = None) -> None:
    """What a clean checked test costs the plugin: its GPU locks (with ``locks``), the health watch's Xid
    drain before and after (``watch``, None in a tree from before it), and the two checks."""
    held = locks.acquire(uuids or [], len(uuids or []), 600.0, "bench::test") if locks is not None else None
    if watch is not None:
        watch.before("bench::test", devs, 0)
    checker.check("setup", devs, tolerance_mib=0, timeout=60.0)
    checker.check("teardown", devs, tolerance_mib=0, timeout=60.0)
    if watch is not None:
        watch.after("bench::test", devs, (), 0)
    if held is not None:
        held.release()


def health_watch(backend: Any, physical: list[DeviceInfo]) -> Any:
    """The GPU health watch a checked test pays for around its checks (issue 28: the Xid drain before and
    after, nothing else on a clean test), started as a session starts it; None in a tree from before it."""
    try:
        from pytest_gpuclean._check.health import HealthWatch
    except ImportError:
        return None
    watch = HealthWatch(backend, physical)
    watch.start()
    return watch
