"""What gpuclean costs a whole pytest process on a real GPU, as users pay it (wall time).

Generated suites of trivially passing tests, each run as ``python -m pytest -q -p no:cacheprovider`` in a
subprocess, configurations interleaved in rounds so that drift hits them all alike:

* **checked**: N and M marked tests (``--tests``, ``--big-tests``), with the plugin (``-p gpuclean``, real
  NVML, every GPU) and without it (``-p no:gpuclean``); each twice: with no CUDA context in the pytest
  process, and with one (a conftest that puts a tensor on every GPU before the first test, as a torch
  suite's process holds one). With d(n) the paired per-round difference on - off at n tests:
  slope per checked test = (d(M) - d(N)) / (M - N), fixed cost = d(N) - N * slope.
* **idle**: U unmarked tests, the plugin loaded vs ``-p no:gpuclean``: the cost of a session that checks
  nothing.

``--trees DIR,...`` runs every configuration once per tree in each round: directories that hold a
``pytest_gpuclean`` package (put first on ``PYTHONPATH``; each run checks that it is the one imported), or
``WORKTREE`` for this checkout; where the environment has the plugin installed editable, its finder answers
first and the run stops (run it before installing). ``--simulate`` runs the same on 2 simulated devices (a
dry run on a CPU box; no CUDA context configurations).

    python3 benchmarks/bench_gpu_cost.py --trees bench-before,WORKTREE --rounds 9 --json $OUT/gpu_cost.json
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common
from bench_session import base_env, timed_run, write_suite

ON = ["-p", "pytest_gpuclean.plugin"]
"""The plugin of the tree on ``PYTHONPATH``, by module name (no installed entry point needed)."""
CUDA_CONFTEST = """
import torch

# Every GPU gets a context and a small tensor before the first test: the pytest process of a torch suite.
_KEEP = [torch.ones(1, device=f"cuda:{i}") for i in range(torch.cuda.device_count())]
"""


def _tree_env(env: dict[str, str], tree: str) -> dict[str, str]:
    if tree == "WORKTREE":
        tree = _common.REPO
    return {**env, "PYTHONPATH": os.path.abspath(tree)}


def _check_tree(env: dict[str, str], tree: str) -> str:
    """The package the runs of ``tree`` import (it must be the tree's own)."""
    where = subprocess.run([sys.executable, "-c", "import pytest_gpuclean; print(pytest_gpuclean.__file__)"],
                           env=env, capture_output=True, text=True, check=True,
                           cwd=tempfile.gettempdir()).stdout.strip()
    root = os.path.abspath(_common.REPO if tree == "WORKTREE" else tree)
    if not where.startswith(root + os.sep):
        raise SystemExit(f"tree {tree}: imports {where}, not its own package")
    return where


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tests", type=int, default=20)
    parser.add_argument("--big-tests", type=int, default=320)
    parser.add_argument("--idle-tests", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--trees", default="WORKTREE")
    parser.add_argument("--simulate", action="store_true", help="2 simulated devices instead of NVML")
    parser.add_argument("--no-context", action="store_true", help="skip the CUDA-context configurations")
    parser.add_argument("--json")
    args = parser.parse_args()

    root = tempfile.mkdtemp(prefix="gpuclean-gpu-cost-")
    env = base_env()
    # Bytecode as the machine has it (base_env turns writing off): the GPU image sets
    # PYTHONDONTWRITEBYTECODE=1 itself and ships some packages without bytecode, and users pay that.
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    if "PYTHONDONTWRITEBYTECODE" in os.environ:
        env["PYTHONDONTWRITEBYTECODE"] = os.environ["PYTHONDONTWRITEBYTECODE"]
    env["GPUCLEAN_LOCK_DIR"] = os.path.join(root, "locks")
    if args.simulate:
        sim = os.path.join(root, "sim")
        for index in range(2):
            os.makedirs(os.path.join(sim, str(index)))
        env["GPUCLEAN_SIMULATE"] = sim
    contexts = ["none"] if (args.simulate or args.no_context) else ["none", "cuda"]
    suites: dict[tuple[str, int], str] = {}
    for context in contexts:
        for n in (args.tests, args.big_tests):
            path = write_suite(os.path.join(root, f"checked-{context}-{n}"), n, marked=True)
            if context == "cuda":
                with open(os.path.join(path, "conftest.py"), "w") as f:
                    f.write(CUDA_CONFTEST)
            suites[(context, n)] = path
    idle = write_suite(os.path.join(root, "idle"), args.idle_tests, marked=False)

    trees = args.trees.split(",")
    tree_envs = {tree: _tree_env(env, tree) for tree in trees}
    imported = {tree: _check_tree(tree_envs[tree], tree) for tree in trees}
    for where in imported.values():
        # Bytecode for each tree's package, as an installed one has it (pip compiles at install); what the
        # environment ships without (pynvml on the GPU image) stays as it is: users pay that.
        subprocess.run([sys.executable, "-m", "compileall", "-q", os.path.dirname(where)], check=True)
    # (one untimed run of each first: bytecode the environment writes, the drivers' and caches' warm-up)
    runs: list[tuple[str, list[str], str, dict[str, str]]] = []
    for tree in trees:
        tenv = tree_envs[tree]
        for (context, n), path in suites.items():
            for plugin in ("on", "off"):
                runs.append((f"{tree}|checked|{context}|{n}|{plugin}", ON if plugin == "on" else [], path,
                             tenv))
        for plugin in ("on", "off"):
            runs.append((f"{tree}|idle|none|{args.idle_tests}|{plugin}", ON if plugin == "on" else [], idle,
                         tenv))
    base = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    # Each tree's plugin by module name, the environment's plugins not auto-loaded: the same plugins in every
    # run, whichever tree's.
    for tree in trees:
        tree_envs[tree]["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    for _name, extra, path, tenv in runs:
        timed_run([*base, *extra], path, tenv)
    wall: dict[str, list[float]] = {name: [] for name, *_ in runs}
    cpu: dict[str, list[float]] = {name: [] for name, *_ in runs}
    for round_index in range(args.rounds):
        order = runs if round_index % 2 == 0 else list(reversed(runs))
        for name, extra, path, tenv in order:
            w, c = timed_run([*base, *extra], path, tenv)
            wall[name].append(w)
            cpu[name].append(c)
        print(f"round {round_index + 1}/{args.rounds} done", flush=True)

    def paired(samples: dict[str, list[float]], key: str) -> list[float]:
        on, off = samples[key + "|on"], samples[key + "|off"]
        return [a - b for a, b in zip(on, off, strict=True)]

    results: dict[str, Any] = {"machine": _common.machine(), "commit": _common.git_commit(),
                               "args": vars(args), "imported": imported, "trees": {}}
    rows = []
    for tree in trees:
        per_tree: dict[str, Any] = {}
        for context in contexts:
            for label, samples in (("wall", wall), ("cpu", cpu)):
                d_n = paired(samples, f"{tree}|checked|{context}|{args.tests}")
                d_m = paired(samples, f"{tree}|checked|{context}|{args.big_tests}")
                slopes = [(m - n) / (args.big_tests - args.tests) for n, m in zip(d_n, d_m, strict=True)]
                fixed = [n - args.tests * s for n, s in zip(d_n, slopes, strict=True)]
                per_tree[f"{context}/{label}"] = {
                    "slope_ms_per_test": _common.summary([1e3 * s for s in slopes]),
                    "fixed_ms": _common.summary([1e3 * f for f in fixed]),
                    "off_small_s": statistics.median(samples[f"{tree}|checked|{context}|{args.tests}|off"]),
                    "off_big_s": statistics.median(samples[f"{tree}|checked|{context}|{args.big_tests}|off"]),
                }
                rows.append([tree, f"context {context}", label, f"{statistics.median(slopes) * 1e3:.3f}",
                             f"{statistics.median(fixed) * 1e3:.1f}"])
        for label, samples in (("wall", wall), ("cpu", cpu)):
            d_idle = paired(samples, f"{tree}|idle|none|{args.idle_tests}")
            per_tree[f"idle/{label}"] = {"added_ms": _common.summary([1e3 * d for d in d_idle])}
            rows.append([tree, "idle session", label, "-", f"{statistics.median(d_idle) * 1e3:.1f}"])
        results["trees"][tree] = per_tree
    print(_common.table(rows, ["tree", "configuration", "time", "slope ms/test (median)",
                               "fixed / added ms (median)"]))
    results["raw"] = {"wall": wall, "cpu": cpu}
    if args.json:
        _common.write_json(args.json, results)
    shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
