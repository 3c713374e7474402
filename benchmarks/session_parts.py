"""Where a checked test's cost goes inside a whole pytest session: the plugin's main steps timed in place.

``session_calls.py`` counts Python calls and ``bench_session.py`` measures whole processes; this one runs a
marked suite (8 simulated devices, locks on) in-process with ``pytest.main`` and wraps a few of the plugin's
steps in a timer, so each step is timed where it really runs: between pytest's own work, with the caches
that leaves, not in a tight loop (where a clean check costs about half as much). The total per test is the
whole session's CPU time, plugin on minus plugin off, over the same suite; the garbage collector's time is
taken from ``gc.callbacks``. Each wrapper adds well under a microsecond per call.

    PYTHONPATH=<tree> python benchmarks/session_parts.py [--tests 2000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_session import make_sim, write_suite

STEPS = {
    "the two checks (Checker.check)": ("pytest_gpuclean._check.checker", "Checker", "check"),
    "taking the GPU locks (GpuLocks.acquire)": ("pytest_gpuclean._locks.gpus", "GpuLocks", "acquire"),
    "keeping them for the next test (HeldLocks.park)": ("pytest_gpuclean._locks.held", "HeldLocks",
                                                        "park"),
    "letting them go (HeldLocks.release)": ("pytest_gpuclean._locks.held", "HeldLocks", "release"),
    "the health watch (ItemChecks._health_before/_after)": ("pytest_gpuclean._session.guard", "ItemChecks",
                                                            "_health_before", "_health_after"),
    "ownership windows (Ownership.open_window/close_window)": ("pytest_gpuclean._ownership.evidence",
                                                               "Ownership", "open_window", "close_window"),
    "the test's cookie in the environment (set_owner_env)": ("pytest_gpuclean._session.checked",
                                                             "CheckedSession", "set_owner_env"),
}


def child(suite: str, on: bool, tests: int) -> None:
    import importlib

    import pytest

    spent: dict[str, int] = dict.fromkeys(STEPS, 0)

    def timed(label: str, function: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter_ns()
            try:
                return function(*args, **kwargs)
            finally:
                spent[label] += time.perf_counter_ns() - started
        return wrapper

    if on:
        for label, (module, cls, *names) in STEPS.items():
            owner = getattr(importlib.import_module(module), cls)
            for name in names:
                setattr(owner, name, timed(label, getattr(owner, name)))
    collecting = [0.0, 0]

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            collecting[0] = time.perf_counter()
        else:
            collecting[1] += int((time.perf_counter() - collecting[0]) * 1e9)

    gc.callbacks.append(on_gc)
    os.chdir(suite)
    started = time.process_time()
    with contextlib.redirect_stdout(io.StringIO()):
        pytest.main(["-q", "-p", "no:cacheprovider", *([] if on else ["-p", "no:gpuclean"])])
    total = time.process_time() - started
    print(repr({"total": total, "gc": collecting[1] / 1e9, **{k: v / 1e9 for k, v in spent.items()}}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tests", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], args.child[1] == "on", args.tests)
        return
    tmp = tempfile.mkdtemp(prefix="gpuclean-session-parts-")
    env = dict(os.environ, GPUCLEAN_SIMULATE=make_sim(os.path.join(tmp, "sim"), 8), GPUCLEAN_LOCK="on",
               GPUCLEAN_LOCK_DIR=os.path.join(tmp, "locks"), PYTHONDONTWRITEBYTECODE="1")
    suite = write_suite(os.path.join(tmp, "suite"), args.tests, marked=True)
    rounds: dict[bool, list[dict[str, float]]] = {True: [], False: []}
    for _ in range(args.rounds):
        for on in (False, True):  # (interleaved: the box's drift hits both alike)
            out = subprocess.run([sys.executable, __file__, "--tests", str(args.tests), "--child", suite,
                                  "on" if on else "off"], env=env, capture_output=True, text=True, check=True)
            rounds[on].append(eval(out.stdout.strip().splitlines()[-1]))  # (our own repr of a dict of floats)

    def per_test(on: bool, key: str) -> float:
        return statistics.median(r[key] for r in rounds[on]) / args.tests * 1e6

    added = per_test(True, "total") - per_test(False, "total")
    print(f"{args.tests} marked tests, 8 simulated devices, locks on, {args.rounds} rounds; medians, "
          "µs per test:")
    print(f"  {added:6.1f}  the plugin in all (session CPU time, on minus off)")
    for label in STEPS:
        print(f"  {per_test(True, label):6.1f}  {label}")
    print(f"  {per_test(True, 'gc') - per_test(False, 'gc'):6.1f}  the garbage collector's extra time")


if __name__ == "__main__":
    main()
