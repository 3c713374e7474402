"""Benchmark 12: what asking "who holds this process's handle" costs (core/ownership/handles.py).

The census asks it once per direct child of the pytest process that would be judged (a leak, or a pool that
a library keeps), never on the clean path. Its cost is a walk over what is reachable from every module's
globals, so it grows with what the process imported. This imports every package it is given (and, with
``--stdlib``, every importable module of the standard library), starts real children, and times ``holders()``:

* ``nothing``: a child no object holds (a leak started by ``os.fork``): the whole walk, all three root kinds;
* ``bookkeeping``: a ``Popen`` dropped while it runs (``subprocess._active``): the first two walks whole;
* ``module``: a ``Popen`` kept in a module global imported last: found in the module walk.

It prints the module count, the objects the full walk visits and the median of ``--rounds`` timings each.

    .venv/bin/python benchmarks/bench_holders.py --stdlib --packages joblib,psutil,mypy,jsonschema
    python3 benchmarks/bench_holders.py --stdlib --packages torch,transformers,vllm    # the GPU box
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import pkgutil
import signal
import statistics
import subprocess
import sys
import time
import types
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from pytest_gpuclean._ownership import handles


def _import_all(packages: list[str], stdlib: bool) -> None:
    names = list(packages)
    if stdlib:
        skipped = ("antigravity", "this", "idlelib", "turtledemo")
        names += sorted(n for n in sys.stdlib_module_names if not n.startswith("_") and n not in skipped)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in names:
            with contextlib.suppress(Exception, SystemExit):
                module = importlib.import_module(name)
                # (a package's submodules too: what a real run has imported of it)
                for info in pkgutil.walk_packages(getattr(module, "__path__", []), name + "."):
                    if "test" in info.name or "__main__" in info.name:
                        continue
                    with contextlib.suppress(Exception, SystemExit):
                        importlib.import_module(info.name)


def _time(pid: int, rounds: int) -> tuple[float, float, str]:
    """Median wall and CPU seconds of ``holders([pid])``, and what holds ``pid``. (The CPU time is this
    process's: on a shared box it is the steadier of the two.)"""
    wall, cpu = [], []
    found = None
    for _ in range(rounds):
        started, started_cpu = time.perf_counter(), time.process_time()
        found = handles.holders([pid])
        wall.append(time.perf_counter() - started)
        cpu.append(time.process_time() - started_cpu)
    holder = found.get(pid) if found else None
    return statistics.median(wall), statistics.median(cpu), holder[0] if holder else "none"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--packages", default="", help="comma-separated packages to import (with submodules)")
    parser.add_argument("--stdlib", action="store_true", help="import every module of the standard library")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    started = time.perf_counter()
    _import_all([p for p in args.packages.split(",") if p], args.stdlib)
    print(f"imported in {time.perf_counter() - started:.1f}s: {len(sys.modules)} modules")
    forked = os.fork()
    if forked == 0:
        time.sleep(300)
        os._exit(0)
    dropped = subprocess.Popen(["sleep", "300"])
    dropped_pid = dropped.pid
    del dropped  # (joins subprocess._active)
    kept = subprocess.Popen(["sleep", "300"])
    keeper = types.ModuleType("zz_keeper")
    keeper.pool = [kept]  # type: ignore[attr-defined]
    sys.modules["zz_keeper"] = keeper
    try:
        walk = handles._Walk([forked])
        walk.walk([(v, "") for m in list(sys.modules.values()) if isinstance(m, types.ModuleType)
                   for v in list(vars(m).values())], "module")
        print(f"objects a full module walk visits: {len(walk.seen)}")
        for case, pid in (("nothing", forked), ("bookkeeping", dropped_pid), ("module", kept.pid)):
            wall, cpu, kind = _time(pid, args.rounds)
            print(f"{case:12s} found as {kind:12s} median {wall * 1000:.0f} ms wall, {cpu * 1000:.0f} ms CPU "
                  f"over {args.rounds} rounds")
    finally:
        for pid in (forked, dropped_pid, kept.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            while os.waitpid(-1, 0):
                pass


if __name__ == "__main__":
    main()
