"""Python calls per checked test on the clean path: a deterministic cost figure for a noisy box.

Wall-clock ratios on a loaded 2-core VM (or a bimodal GPU machine) move by tens of percent between runs;
the number of Python calls a checked test makes does not. This counts them with cProfile for the loop
``bench_clean_path.py`` times (the health watch's Xid drains around the two checks, with and without the GPU
locks) on simulated devices, and for the two checks alone while this process "holds" a CUDA context on
every device. Compare trees with ``PYTHONPATH=<tree> python benchmarks/call_counts.py``.
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import sys
import tempfile
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _layers_compat  # noqa: F401  # (a tree from before the layers: issue 29)
from _checked import checked_test, health_watch

from pytest_gpuclean._check.checker import Checker
from pytest_gpuclean._locks.gpus import GpuLocks
from pytest_gpuclean._model.records import DeviceInfo
from pytest_gpuclean._reading.simulated import SimulatedBackend

WARM, COUNTED = 50, 300


def calls_per_test(fn: Callable[[], None]) -> float:
    for _ in range(WARM):
        fn()
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(COUNTED):
        fn()
    profile.disable()
    return pstats.Stats(profile, stream=io.StringIO()).total_calls / COUNTED  # type: ignore[attr-defined,no-any-return]


def main() -> None:
    root = tempfile.mkdtemp(prefix="gpuclean-calls-")
    for i in range(8):
        os.makedirs(os.path.join(root, str(i)))
    backend = SimulatedBackend(root)
    physical = list(backend.devices())
    checker = Checker(backend)
    watch = health_watch(backend, physical)
    locks = GpuLocks(root + "-locks")
    rows: list[tuple[str, float]] = []
    for n in (1, 8):
        devs = tuple(physical[:n])
        uuids = [d.uuid for d in devs]
        for with_locks in (False, True):
            def test(devs: tuple[DeviceInfo, ...] = devs, uuids: list[str] = uuids,
                     with_locks: bool = with_locks) -> None:
                checked_test(checker, watch, devs, locks if with_locks else None, uuids)

            rows.append((f"{n} device(s){', with locks' if with_locks else ''}", calls_per_test(test)))
    from pytest_gpuclean.simulate import allocate

    for d in physical:  # this process "holds" a context everywhere (612 MiB + 9 MiB charged to no process)
        allocate(root, d.index, 612)
        with open(os.path.join(root, str(d.index), "context_overhead"), "w") as f:
            f.write(str(9 * 2**20))
    devs = tuple(physical)
    assert checker.check("setup", devs, tolerance_mib=0, timeout=1.0).clean

    def own_context() -> None:
        checker.check("setup", devs, tolerance_mib=0, timeout=60.0)
        checker.check("teardown", devs, tolerance_mib=0, timeout=60.0)

    rows.append(("8 device(s), own context (checks only)", calls_per_test(own_context)))
    import pytest_gpuclean

    print(f"Python calls per checked test ({os.path.dirname(pytest_gpuclean.__file__)}):")
    for name, count in rows:
        print(f"  {name:42s} {count:8.0f}")


if __name__ == "__main__":
    main()
