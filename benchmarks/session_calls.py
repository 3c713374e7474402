"""Python calls per checked test of a whole pytest session: the deterministic figure beside issue 29's
CPU-time slope (docs/benchmarks.md 1).

``call_counts.py`` counts the locks and the two checks alone; this counts everything the plugin adds to a
test, its hook wrappers and the per-test check's bookkeeping included: ``python -m cProfile`` over whole
``pytest -q`` processes of 50 and 650 marked tests on 8 simulated devices with locks (the suites
``bench_session.py`` writes), each against the same suite with ``-p no:gpuclean``. Per checked test:
((calls(650) - calls(50)) on - (the same) off) / 600, with the functions that make the difference.

    PYTHONPATH=<tree> python benchmarks/session_calls.py [--top 40]
"""

from __future__ import annotations

import argparse
import collections
import os
import pstats
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_session import make_sim, write_suite

SMALL, BIG = 50, 650
Key = tuple[str, int, str]


def profile(suite: str, env: dict[str, str], out: str, on: bool) -> pstats.Stats:
    cmd = [sys.executable, "-m", "cProfile", "-o", out, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    if not on:
        cmd += ["-p", "no:gpuclean"]
    subprocess.run(cmd, cwd=suite, env=env, stdout=subprocess.DEVNULL, check=False)
    return pstats.Stats(out)


def calls(stats: pstats.Stats) -> collections.Counter[Key]:
    return collections.Counter({key: row[1] for key, row in stats.stats.items()})  # type: ignore[attr-defined]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--top", type=int, default=30, help="functions listed (default 30)")
    args = parser.parse_args()
    import pytest_gpuclean

    tree = os.path.dirname(os.path.dirname(os.path.abspath(pytest_gpuclean.__file__)))
    tmp = tempfile.mkdtemp(prefix="gpuclean-session-calls-")
    sim = make_sim(os.path.join(tmp, "sim"), 8)
    env = dict(os.environ, PYTHONPATH=tree, GPUCLEAN_SIMULATE=sim, GPUCLEAN_LOCK="on",
               GPUCLEAN_LOCK_DIR=os.path.join(tmp, "locks"), PYTHONDONTWRITEBYTECODE="1")
    counted: dict[tuple[int, bool], pstats.Stats] = {}
    for n in (SMALL, BIG):
        suite = write_suite(os.path.join(tmp, f"suite{n}"), n, marked=True)
        for on in (True, False):
            counted[(n, on)] = profile(suite, env, os.path.join(tmp, f"{n}-{on}.prof"), on)
    total = {k: s.total_calls for k, s in counted.items()}  # type: ignore[attr-defined]
    span = BIG - SMALL
    on_slope = (total[(BIG, True)] - total[(SMALL, True)]) / span
    off_slope = (total[(BIG, False)] - total[(SMALL, False)]) / span
    print(f"Python calls per test ({tree}): plugin on {on_slope:.0f}, off {off_slope:.0f}; "
          f"per checked test {on_slope - off_slope:.0f}")
    big_on, small_on = calls(counted[(BIG, True)]), calls(counted[(SMALL, True)])
    big_off, small_off = calls(counted[(BIG, False)]), calls(counted[(SMALL, False)])
    diff = collections.Counter({k: ((big_on[k] - small_on[k]) - (big_off[k] - small_off[k])) / span
                                for k in set(big_on) | set(small_on) | set(big_off) | set(small_off)})
    for (filename, line, name), count in diff.most_common(args.top):
        print(f"  {count:7.1f}  {filename.replace(tree + '/', '')}:{line} {name}")


if __name__ == "__main__":
    main()
