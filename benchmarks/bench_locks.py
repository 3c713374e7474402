"""Per-GPU locks alone: acquire + release of N GPUs' locks in a loop, as the plugin does per checked test.

    python benchmarks/bench_locks.py [--gpus 8] [--iterations 3000] [--profile]

Prints the median of 5 timed runs (after a warm-up) in µs per acquire + release; ``--profile`` adds a
cProfile of one run, sorted by own time. The lock directory is a fresh temporary one.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from pytest_gpuclean.locks import GpuLocks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--iterations", type=int, default=3000)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    locks = GpuLocks(os.path.join(tempfile.mkdtemp(prefix="gpuclean-bench-locks-"), "locks"))
    uuids = [f"GPU-{i:08x}-0000-0000-0000-000000000000" for i in range(args.gpus)]

    def once() -> None:
        locks.acquire(uuids, len(uuids), 600.0, "bench::test").release()

    for _ in range(200):
        once()
    runs = []
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(args.iterations):
            once()
        runs.append((time.perf_counter() - started) / args.iterations * 1e6)
    print(f"acquire + release of {args.gpus} GPU locks: median {statistics.median(runs):.1f} µs "
          f"(runs: {', '.join(f'{r:.1f}' for r in runs)})")
    if args.profile:
        profile = cProfile.Profile()
        profile.runcall(lambda: [once() for _ in range(args.iterations)])
        pstats.Stats(profile).sort_stats("tottime").print_stats(15)


if __name__ == "__main__":
    main()
