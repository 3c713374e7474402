"""Benchmark (issue 28): what GPU health costs. Three figures, each a median over interleaved rounds:

* **quiet path**: what the health watch adds to a clean checked test (the Xid drain before and after,
  ``HealthWatch.before`` + ``after`` with nothing pointing at the slow reads), per checked test, next to
  the two clean checks it rides with (``Checker.check`` setup + teardown) and the two together;
* **slow reads**: one ``health()`` (row remapping, ECC, compute/MIG/persistence modes) and one
  ``clock_reasons()`` per device: what a test pays only when an Xid, a reaped GPU process or a failure
  points at them, and the session once at its start;
* **probe**: ``probe.run`` on each GPU alone, and on all of them in one subprocess (the CUDA context is
  the expensive part), per GPU: the cost of ``--gpuclean-probe`` each time it runs.

The paired before/after of a whole checked test is ``ab_trees.py`` with ``bench_clean_path.py``, which
includes the watch when the tree has it (docs/benchmarks.md 7).

    python benchmarks/bench_health.py                     # simulated devices (CPU)
    python benchmarks/bench_health.py --real --json $OUT/health_real.json
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import _common
import _layers_compat  # noqa: F401  # (a tree from before the layers: issue 29)

from pytest_gpuclean._check.checker import Checker
from pytest_gpuclean._check.health import HealthWatch
from pytest_gpuclean._model.records import DeviceInfo
from pytest_gpuclean._reading import probe
from pytest_gpuclean._reading.nvml import NvmlBackend
from pytest_gpuclean._reading.simulated import SimulatedBackend


def _per_call(fn: Callable[[], object], reps: int) -> float:
    started = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - started) / reps


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--real", action="store_true", help="real GPUs through NVML (default: simulated)")
    parser.add_argument("--devices", type=int, default=8, help="simulated devices (default 8)")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--reps", type=int, default=500, help="checked tests per round (quiet path)")
    parser.add_argument("--slow-reps", type=int, default=20, help="slow reads per device and round")
    parser.add_argument("--probe-rounds", type=int, default=5)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()

    tmp = tempfile.mkdtemp(prefix="gpuclean-bench-health-")
    sim_root = None
    if args.real:
        backend: Any = NvmlBackend()
    else:
        sim_root = os.path.join(tmp, "sim")
        for index in range(args.devices):
            os.makedirs(os.path.join(sim_root, str(index)))
        backend = SimulatedBackend(sim_root)
    found: tuple[DeviceInfo, ...] = backend.devices()
    checker = Checker(backend)
    watch = HealthWatch(backend, found)
    started = time.perf_counter()
    watch.start()
    start_s = time.perf_counter() - started
    info = _common.machine()
    info["backend"] = backend.kind
    info["driver"] = backend.driver_version()
    info["devices"] = [f"{d.label}: {d.name}" for d in found]
    print(f"GPU health benchmark, {backend.kind} devices ({len(found)}), {info['date_utc']}, {info['host']}")
    print(f"session start (Xid registration + a health read per device): {_common.fmt_time(start_s)}")

    def checks() -> None:
        checker.check("setup", found, tolerance_mib=0, timeout=60.0)
        checker.check("teardown", found, tolerance_mib=0, timeout=60.0)

    def health() -> None:
        watch.before("bench::test", found, 0)
        watch.after("bench::test", found, (), 0)

    def both() -> None:
        health()
        checks()

    quiet: dict[str, Callable[[], object]] = {"checks": checks, "health watch": health,
                                              "checks + watch": both}
    samples: dict[str, list[float]] = {name: [] for name in quiet}
    for fn in quiet.values():
        _per_call(fn, 20)
    names = list(quiet)
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            samples[name].append(_per_call(quiet[name], args.reps))
    quiet_summary = {name: _common.summary(values) for name, values in samples.items()}
    print(f"\nquiet path, per checked test on {len(found)} device(s) (median of {args.rounds} rounds of "
          f"{args.reps}):")
    for name, s in quiet_summary.items():
        print(f"  {name:<16} {_common.fmt_time(s['median'])}")

    slow: dict[str, dict[str, float]] = {}
    for name, fn in (("health()", backend.health), ("clock_reasons()", backend.clock_reasons)):
        values = [_per_call(lambda fn=fn: [fn(d) for d in found], args.slow_reps) / len(found)
                  for _ in range(args.rounds)]
        slow[name] = _common.summary(values)
        print(f"slow read {name:<16} {_common.fmt_time(slow[name]['median'])} per device")

    probes: dict[str, Any] = {}
    if args.probe_rounds:
        timeout = 120.0
        alone: list[float] = []
        together: list[float] = []
        failures: dict[str, str | None] = {}
        for _ in range(args.probe_rounds):
            for device in found[:8]:
                t0 = time.perf_counter()
                failures.update(probe.run([device], simulate=sim_root, timeout=timeout))
                alone.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            failures.update(probe.run(found, simulate=sim_root, timeout=timeout))
            together.append((time.perf_counter() - t0) / len(found))
        probes = {"one_gpu_per_run": _common.summary(alone),
                  "per_gpu_all_in_one_run": _common.summary(together),
                  "failures": {u: e for u, e in failures.items() if e is not None}}
        print(f"probe: one GPU per run {_common.fmt_time(probes['one_gpu_per_run']['median'])}; all "
              f"{len(found)} in one run {_common.fmt_time(probes['per_gpu_all_in_one_run']['median'])} "
              "per GPU" + (f"; FAILED: {probes['failures']}" if probes["failures"] else ""))

    if args.json:
        _common.write_json(args.json, {"machine": info, "session_start_s": start_s,
                                       "quiet_path": quiet_summary, "slow_reads_per_device": slow,
                                       "probe": probes, "rounds": args.rounds, "reps": args.reps})
    backend.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
