"""System calls per checked test of a whole pytest session: the kernel side of issue 29's CPU-time slope,
counted, not timed (docs/benchmarks.md 1).

``session_calls.py`` counts the Python calls; this counts what reaches the kernel: ``strace -f -c`` over
whole ``pytest -q`` processes (and their children) of 50 and 650 marked tests on 8 simulated devices with
locks (the suites ``bench_session.py`` writes), each against the same suite with ``-p no:gpuclean``. Per
checked test: ((calls(650) - calls(50)) on - (the same) off) / 600, in total and per system call. The
counts are deterministic (a few calls of a test's 8 GPUs' worth either way, from the odd garbage
collection or a directory that changed), so one run before and one after a change are a comparison.

    PYTHONPATH=<tree> python benchmarks/session_syscalls.py [--top 20]
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_session import make_sim, write_suite

SMALL, BIG = 50, 650


def count(suite: str, env: dict[str, str], out: str, on: bool) -> collections.Counter[str]:
    """System calls of one ``pytest -q`` run, by name (strace's summary, children included)."""
    cmd = ["strace", "-f", "-c", "-U", "name,calls", "-o", out,
           sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    if not on:
        cmd += ["-p", "no:gpuclean"]
    subprocess.run(cmd, cwd=suite, env=env, stdout=subprocess.DEVNULL, check=False)
    found: collections.Counter[str] = collections.Counter()
    with open(out) as f:
        for line in f:
            parts = line.split()
            if len(parts) == 2 and parts[1].isdigit() and parts[0] != "total":
                found[parts[0]] = int(parts[1])
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--top", type=int, default=20, help="system calls listed (default 20)")
    args = parser.parse_args()
    if shutil.which("strace") is None:
        sys.exit("session_syscalls.py needs strace (apt-get install strace)")
    import pytest_gpuclean

    tree = os.path.dirname(os.path.dirname(os.path.abspath(pytest_gpuclean.__file__)))
    # Byte-compiled first: the runs write no .pyc files, and a module compiled in one run but not in the
    # other would count its compilation.
    subprocess.run([sys.executable, "-m", "compileall", "-q", os.path.join(tree, "pytest_gpuclean")],
                   stdout=subprocess.DEVNULL, check=False)
    tmp = tempfile.mkdtemp(prefix="gpuclean-session-syscalls-")
    sim = make_sim(os.path.join(tmp, "sim"), 8)
    env = dict(os.environ, PYTHONPATH=tree, GPUCLEAN_SIMULATE=sim, GPUCLEAN_LOCK="on",
               GPUCLEAN_LOCK_DIR=os.path.join(tmp, "locks"), PYTHONDONTWRITEBYTECODE="1")
    counted: dict[tuple[int, bool], collections.Counter[str]] = {}
    try:
        for n in (SMALL, BIG):
            suite = write_suite(os.path.join(tmp, f"suite{n}"), n, marked=True)
            for on in (True, False):
                counted[(n, on)] = count(suite, env, os.path.join(tmp, f"{n}-{on}.strace"), on)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    span = BIG - SMALL
    names = set().union(*counted.values())
    diff = {name: ((counted[(BIG, True)][name] - counted[(SMALL, True)][name])
                   - (counted[(BIG, False)][name] - counted[(SMALL, False)][name])) / span
            for name in names}
    on_slope = sum(counted[(BIG, True)].values()) - sum(counted[(SMALL, True)].values())
    off_slope = sum(counted[(BIG, False)].values()) - sum(counted[(SMALL, False)].values())
    print(f"system calls per test ({tree}): plugin on {on_slope / span:.1f}, off {off_slope / span:.1f}; "
          f"per checked test {(on_slope - off_slope) / span:.1f}")
    for name, per_test in sorted(diff.items(), key=lambda kv: -abs(kv[1]))[: args.top]:
        if round(per_test, 1):
            print(f"  {per_test:7.1f}  {name}")


if __name__ == "__main__":
    main()
