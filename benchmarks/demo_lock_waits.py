"""On a real GPU: how long sessions wait for GPU locks they need not wait for, for one tree or several.

    python benchmarks/demo_lock_waits.py --trees f6c231e,WORKTREE [--devices real|simulated]
                                         [--hold 25] [--lag 4] [--stream 30] [--json F]

Each tree (a git revision or WORKTREE, exported as ab_trees.py does) runs two scenarios, each in a lock
directory of its own that no session has used before:

1. **a free GPU behind a busy one**: session A holds the GPU (``--gpuclean-devices=0``) in a marked test
   that sleeps ``--hold`` s; ``--lag`` s later session B runs one marked no-op on a device of its own, a
   simulated one (the one-GPU H200 has no second GPU; a CPU job with simulated devices on a GPU host is
   the issue's other case). B's GPU never had a lock file. Reported: B's ``lock_wait_s`` (its JSON
   report), B's wall time, and B's wait line.
2. **a waiter behind a stream**: A runs ``--stream`` marked tests of 1 s back to back on the GPU; W,
   started once A's first test runs, runs one marked no-op on the same GPU. Reported: W's
   ``lock_wait_s``, and how many of A's tests said they let W go first.

``--devices simulated`` puts A and W on a simulated device too: a dry run on a box without a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common
from ab_trees import export

SUITE = {
    "test_hold.py": """
import os, time
import pytest

@pytest.mark.needs_clean_gpus
def test_hold():
    time.sleep(float(os.environ["HOLD_S"]))
""",
    "test_noop.py": """
import pytest

@pytest.mark.needs_clean_gpus
def test_noop():
    pass
""",
    "test_stream.py": """
import os, time
from pathlib import Path
import pytest

@pytest.mark.needs_clean_gpus
@pytest.mark.parametrize("n", range(int(os.environ["STREAM_N"])))
def test_stream(n):
    Path(os.environ["STREAMING"]).touch()
    time.sleep(1)
""",
}


def session(tree: str, suite: str, lock_dir: str, devices: list[str], test: str, report: str,
            **env: str) -> subprocess.Popen[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("GPUCLEAN_", "PYTEST_"))
               and k not in ("CUDA_VISIBLE_DEVICES", "PYTHONPATH")}
    environ.update(env, PYTHONPATH=tree, PYTHONDONTWRITEBYTECODE="1")
    command = [sys.executable, "-m", "pytest", "-p", "gpuclean", "-p", "no:cacheprovider", "-q",
               f"--gpuclean-lock-dir={lock_dir}", f"--gpuclean-report={report}", *devices, test]
    return subprocess.Popen(command, cwd=suite, env=environ, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def finish(proc: subprocess.Popen[str], report: str) -> tuple[str, float]:
    out, _ = proc.communicate(timeout=900)
    if proc.returncode != 0:
        raise SystemExit(f"session {proc.args!r} failed ({proc.returncode}):\n{out}")
    with open(report) as f:
        (test,) = json.load(f)["tests"]
    return out, float(test["timings"]["lock_wait_s"])


def wait_for(path: str, proc: subprocess.Popen[str]) -> None:
    while not os.path.exists(path):
        if proc.poll() is not None:
            raise SystemExit(f"session {proc.args!r} ended early:\n{proc.communicate()[0]}")
        time.sleep(0.05)


def scenarios(tree: str, work: str, gpu: list[str], args: argparse.Namespace) -> dict[str, Any]:
    suite = os.path.join(work, "suite")
    sim = os.path.join(work, "sim")
    os.makedirs(os.path.join(sim, "0"))
    for name, text in SUITE.items():
        with open(os.path.join(suite, name), "w") as f:
            f.write(text)
    found: dict[str, Any] = {}
    # 1. A holds the GPU; B, on a device whose lock file never existed, runs a no-op.
    locks = os.path.join(work, "locks-free")
    a = session(tree, suite, locks, gpu, "test_hold.py", os.path.join(work, "a1.json"), HOLD_S=str(args.hold))
    time.sleep(args.lag)
    started = time.monotonic()
    b_out, b_wait = finish(session(tree, suite, locks, [f"--gpuclean-simulate={sim}"], "test_noop.py",
                                   os.path.join(work, "b.json")), os.path.join(work, "b.json"))
    found["free_gpu_wait_s"] = b_wait
    found["free_gpu_wall_s"] = time.monotonic() - started
    found["free_gpu_wait_line"] = next((line for line in b_out.splitlines() if "waits for GPU lock" in line),
                                       None)
    finish(a, os.path.join(work, "a1.json"))
    # 2. A runs a stream of 1 s tests on the GPU; W waits for the same GPU.
    locks, streaming = os.path.join(work, "locks-stream"), os.path.join(work, "streaming")
    a = session(tree, suite, locks, gpu, "test_stream.py", os.path.join(work, "a2.json"),
                STREAM_N=str(args.stream), STREAMING=streaming)
    wait_for(streaming, a)
    _out, found["waiter_wait_s"] = finish(session(tree, suite, locks, gpu, "test_noop.py",
                                                  os.path.join(work, "w.json")), os.path.join(work, "w.json"))
    a_out, _ = a.communicate(timeout=900)
    found["stream_lines_letting_waiter_first"] = sum("goes first" in line for line in a_out.splitlines())
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trees", default="WORKTREE", help="comma-separated git revisions or WORKTREE")
    parser.add_argument("--devices", choices=("real", "simulated"), default="real")
    parser.add_argument("--hold", type=float, default=25.0, help="seconds A holds the GPU in scenario 1")
    parser.add_argument("--lag", type=float, default=4.0, help="seconds between A's and B's start")
    parser.add_argument("--stream", type=int, default=30, help="A's tests (1 s each) in scenario 2")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    base = tempfile.mkdtemp(prefix="gpuclean-demo-locks-")
    results: dict[str, Any] = {}
    try:
        for i, rev in enumerate(args.trees.split(",")):
            tree = os.path.join(base, f"tree{i}")
            export(rev, tree)
            work = os.path.join(base, f"work{i}")
            os.makedirs(os.path.join(work, "suite"))
            gpu = ["--gpuclean-devices=0"]
            if args.devices == "simulated":
                os.makedirs(os.path.join(work, "gpu", "0"))
                gpu.append(f"--gpuclean-simulate={os.path.join(work, 'gpu')}")
            results[rev] = scenarios(tree, work, gpu, args)
            print(f"{rev}: {json.dumps(results[rev])}", flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    rows = [[rev, f"{r['free_gpu_wait_s']:.1f} s", f"{r['free_gpu_wall_s']:.1f} s",
             f"{r['waiter_wait_s']:.1f} s", str(r["stream_lines_letting_waiter_first"])]
            for rev, r in results.items()]
    print(_common.table(rows, ["tree", "B's lock wait", "B's wall time", "W's lock wait",
                               "A's tests that let W go first"]))
    if args.json:
        _common.write_json(args.json, {"machine": _common.machine(), "devices": args.devices,
                                       "hold_s": args.hold, "lag_s": args.lag, "stream": args.stream,
                                       "results": results})


if __name__ == "__main__":
    main()
