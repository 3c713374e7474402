"""Before/after: run one benchmark script against several source trees, alternating, in one run.

Each tree is a git revision exported with ``git archive`` (or ``WORKTREE``, the checkout as it is, or a
directory holding a ``pytest_gpuclean`` package, e.g. HEAD with some commits reverse-applied) into
a temporary directory; the benchmark script of the *current* checkout is copied into each tree, so only
``pytest_gpuclean`` differs. Runs alternate A, B, ..., A, B, ... and the medians of the chosen JSON
values are printed with their ratios to the first tree.

    python benchmarks/ab_trees.py --trees 7db02a2,WORKTREE --runs 5 -- bench_clean_path.py --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common

KEYS = {
    "bench_clean_path.py": [
        ("1 device: gpuclean", ("by_devices", "1", "per_test_s", "gpuclean", "median")),
        ("1 device: gpuclean+locks", ("by_devices", "1", "per_test_s", "gpuclean+locks", "median")),
        ("8 devices: gpuclean", ("by_devices", "8", "per_test_s", "gpuclean", "median")),
        ("8 devices: gpuclean+locks", ("by_devices", "8", "per_test_s", "gpuclean+locks", "median")),
        ("1 device, own context: gpuclean", ("own_context", "1", "per_test_s", "median")),
        ("8 devices, own context: gpuclean", ("own_context", "8", "per_test_s", "median")),
    ],
    "bench_locks.py": [
        ("1 GPU: acquire + release", ("by_gpus", "1", "median")),
        ("8 GPUs: acquire + release", ("by_gpus", "8", "median")),
    ],
}


def export(rev: str, dest: str) -> None:
    os.makedirs(dest)
    if rev == "WORKTREE" or os.path.isdir(rev):
        source = _common.REPO if rev == "WORKTREE" else rev
        shutil.copytree(os.path.join(source, "pytest_gpuclean"), os.path.join(dest, "pytest_gpuclean"),
                        ignore=shutil.ignore_patterns("__pycache__"))
    else:
        archive = subprocess.run(["git", "-C", _common.REPO, "archive", rev, "pytest_gpuclean"],
                                 check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", dest], input=archive, check=True)
    shutil.copytree(os.path.join(_common.REPO, "benchmarks"), os.path.join(dest, "benchmarks"),
                    ignore=shutil.ignore_patterns("results", "__pycache__"))


def dig(data: Any, path: tuple[str, ...]) -> float | None:
    for key in path:
        if not isinstance(data, dict) or key not in data:
            return None
        data = data[key]
    return float(data) if isinstance(data, (int, float)) else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trees", required=True, help="comma-separated git revisions or WORKTREE")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--json", help="write the medians here")
    parser.add_argument("script", help="benchmark script name in benchmarks/")
    parser.add_argument("script_args", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    trees = args.trees.split(",")
    tmp = tempfile.mkdtemp(prefix="gpuclean-ab-")
    dirs = {}
    for i, rev in enumerate(trees):
        dirs[rev] = os.path.join(tmp, f"tree{i}")
        export(rev, dirs[rev])
    values: dict[str, dict[str, list[float]]] = {rev: {} for rev in trees}
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    extra = [a for a in args.script_args if a != "--"]
    for r in range(args.runs):
        for rev in trees[r % len(trees):] + trees[: r % len(trees)]:
            out = os.path.join(tmp, f"{r}-{trees.index(rev)}.json")
            cmd = [sys.executable, os.path.join(dirs[rev], "benchmarks", args.script), *extra, "--json", out]
            # cwd is the tree: its pytest_gpuclean shadows the editable install of the checkout.
            subprocess.run(cmd, cwd=dirs[rev], env={**env, "PYTHONPATH": dirs[rev]}, check=True,
                           stdout=subprocess.DEVNULL)
            with open(out) as f:
                data = json.load(f)
            for label, path in KEYS.get(args.script, []):
                v = dig(data, path)
                if v is not None:
                    values[rev].setdefault(label, []).append(v)
            print(f"run {r + 1}: {rev} done", flush=True)
    medians = {rev: {k: statistics.median(v) for k, v in vals.items()} for rev, vals in values.items()}
    rows = []
    for label, _path in KEYS.get(args.script, []):
        base = medians[trees[0]].get(label)
        row = [label]
        for rev in trees:
            v = medians[rev].get(label)
            row.append("-" if v is None else _common.fmt_time(v)
                       + ("" if rev == trees[0] or not base else f" ({v / base:.2f}x)"))
        rows.append(row)
    print(_common.table(rows, ["per checked test", *trees]))
    if args.json:
        _common.write_json(args.json, {"machine": _common.machine(), "trees": trees, "runs": args.runs,
                                       "script": args.script, "script_args": extra, "medians": medians,
                                       "values": values})
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
