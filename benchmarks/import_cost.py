"""What importing a checked session's code costs, tree against tree: CPU time of the imports alone.

The whole-process benchmark (bench_gpu_cost.py) measures what users pay, but on a shared box its fixed cost
moves by tens of milliseconds from one run to the next. This isolates the part a restructuring changes:
each run is a fresh interpreter that has imported pytest already (as a pytest process has), then imports
the given modules of one tree; the trees alternate, and each reports the median and the minimum of its
rounds. Bytecode is compiled beforehand, as an installed package has it.

    python benchmarks/import_cost.py --rounds 40 \\
        /tmp/before=pytest_gpuclean._session.checked+pytest_gpuclean._session.outputs \\
        WORKTREE=pytest_gpuclean._session.checked+pytest_gpuclean._session.outputs
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common

SCRIPT = """
import sys, time
import pytest, dataclasses, typing, json  # what a pytest process has imported before the plugin starts
start = time.process_time()
for name in sys.argv[1:]:
    __import__(name)
print(time.process_time() - start)
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("specs", nargs="+", help="TREE=MODULE+MODULE (TREE: a directory, or WORKTREE)")
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    specs = []
    for spec in args.specs:
        tree, _, modules = spec.partition("=")
        path = _common.REPO if tree == "WORKTREE" else os.path.abspath(tree)
        subprocess.run([sys.executable, "-m", "compileall", "-q", os.path.join(path, "pytest_gpuclean")],
                       check=True)
        specs.append((tree, path, modules.split("+")))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    times: dict[str, list[float]] = {tree: [] for tree, _, _ in specs}
    for round_index in range(args.rounds):
        order = specs if round_index % 2 == 0 else list(reversed(specs))
        for tree, path, modules in order:
            out = subprocess.run([sys.executable, "-c", SCRIPT, *modules], env={**env, "PYTHONPATH": path},
                                 capture_output=True, text=True, check=True, cwd=tempfile.gettempdir())
            times[tree].append(float(out.stdout) * 1e3)
    rows = [[tree, f"{statistics.median(v):.1f}", f"{min(v):.1f}", str(len(v))] for tree, v in times.items()]
    print(_common.table(rows, ["tree", "median ms (CPU)", "min ms", "rounds"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
