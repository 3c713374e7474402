"""Per-GPU locks alone: acquire + release of N GPUs' locks in a loop, as the plugin does per checked test.

    python benchmarks/bench_locks.py [--gpus 1,8] [--iterations 3000] [--rounds 5] [--clock cpu]
                                     [--kept] [--profile] [--json F]

For each GPU count: the median of ``--rounds`` timed runs (after a warm-up), in µs per acquire + release;
``--kept`` also times, in the same rounds (alternating), the locks kept from one test to the next: the next
test's acquire of the kept locks + keeping them again (``HeldLocks.park``), as a session whose tests follow
each other pays;
``--clock cpu`` times the process's CPU time instead of the wall clock (on a loaded shared box, time spent
waiting for a core is then left out);
``--profile`` adds a cProfile of one run of the largest count, sorted by own time. The lock directory is
a fresh temporary one. Before/after comparisons run it through ``ab_trees.py`` (one run, alternating).
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common
import _layers_compat  # noqa: F401  # (a tree from before the layers: issue 29)

from pytest_gpuclean._locks.gpus import GpuLocks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", default="1,8", help="comma-separated GPU counts")
    parser.add_argument("--iterations", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    parser.add_argument("--kept", action="store_true", help="also time locks kept between tests")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    locks = GpuLocks(os.path.join(tempfile.mkdtemp(prefix="gpuclean-bench-locks-"), "locks"))
    results = {}
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    for gpus in (int(g) for g in args.gpus.split(",")):
        uuids = [f"GPU-{i:08x}-0000-0000-0000-000000000000" for i in range(gpus)]

        def once(uuids: list[str] = uuids) -> None:
            locks.acquire(uuids, len(uuids), 600.0, "bench::test").release()

        def timed(step: Callable[[], None]) -> float:
            started = clock()
            for _ in range(args.iterations):
                step()
            return (clock() - started) / args.iterations

        for _ in range(200):
            once()
        runs, kept_runs = [], []
        for _ in range(args.rounds):
            runs.append(timed(once))
            if args.kept:
                held = locks.acquire(uuids, len(uuids), 600.0, "bench::test")
                assert held.park(), "the locks were not kept (another session waits?)"
                kept = [held]

                def next_test(uuids: list[str] = uuids, kept: list[Any] = kept) -> None:
                    kept[0] = locks.acquire(uuids, len(uuids), 600.0, "bench::test", parked=kept[0])
                    kept[0].park()

                kept_runs.append(timed(next_test))
                kept[0].release()
        results[str(gpus)] = _common.summary(runs)
        print(f"acquire + release of {gpus} GPU locks: median {results[str(gpus)]['median'] * 1e6:.1f} µs "
              f"(runs: {', '.join(f'{r * 1e6:.1f}' for r in runs)})")
        if args.kept:
            results[f"{gpus} kept"] = _common.summary(kept_runs)
            kept_median = results[f"{gpus} kept"]["median"]
            print(f"  kept from one test to the next: median {kept_median * 1e6:.1f} µs "
                  f"({kept_median / results[str(gpus)]['median']:.2f} of the above; runs: "
                  f"{', '.join(f'{r * 1e6:.1f}' for r in kept_runs)})")
    if args.profile:
        profile = cProfile.Profile()
        profile.runcall(lambda: [once() for _ in range(args.iterations)])
        pstats.Stats(profile).sort_stats("tottime").print_stats(15)
    if args.json:
        _common.write_json(args.json, {"machine": _common.machine(), "iterations": args.iterations,
                                       "clock": args.clock,
                                       "by_gpus": results})


if __name__ == "__main__":
    main()
