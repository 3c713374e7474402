"""Issue 27's three slow verdicts as whole pytest runs: victims and wall time, for one source tree.

Each scenario writes a small suite into a temporary directory and runs it in a fresh pytest process with
``PYTHONPATH=<tree>``, so the same script measures the code before and after a change (``--tree``: a directory
holding a ``pytest_gpuclean`` package, e.g. ``git archive <rev> pytest_gpuclean | tar -x -C before``):

- ``xdist``: two xdist workers; an unmarked test leaves a GPU holder behind (a CUDA process on a real GPU,
  ``simulate hold`` on simulated devices) while six marked ``count=1`` tests run. Victims: marked tests that
  failed or errored.
- ``outside``: a process that the session did not start holds GPU memory; four marked no-op tests. Victims:
  all four fail either way (the memory is there); the figure is the wall time, one timeout or four.
- ``locks``: two simulated devices, one lock directory; session A (device 0) runs a 10 s marked test,
  session B (device 1) starts 2 s later with a marked no-op. The figure is B's wall time.

    python benchmarks/verdict_scenarios.py --tree WORKTREE [--real] [--timeout 20] [--only xdist,outside]

Prints one JSON document (machine, tree, per scenario: wall_s, outcome counts, victims, lines of interest).
A benchmark, not a test: nothing here asserts.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import textwrap
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common

CUDA_HOLDER = ("import sys, time, torch; x = torch.ones(int(sys.argv[1]) << 18, device='cuda'); "
               "torch.cuda.synchronize(); print('holding', flush=True); time.sleep(600)")
"""A real GPU holder: argv[1] MiB of float32 on cuda:0, then sleeps."""


def _holder_cmd(real: bool, sim: str, mib: int) -> list[str]:
    if real:
        return [sys.executable, "-c", CUDA_HOLDER, str(mib)]
    return [sys.executable, "-m", "pytest_gpuclean.simulate", "hold", "--dir", sim, "--device", "0",
            "--mib", str(mib)]


def _make_sim(root: str, devices: int) -> str:
    sim = os.path.join(root, "sim")
    for i in range(devices):
        os.makedirs(os.path.join(sim, str(i)), exist_ok=True)
    return sim


def _counts(output: str) -> dict[str, int]:
    counts: dict[str, int] = {}
    for number, word in re.findall(r"(\d+) (passed|failed|errors?|skipped)", output.splitlines()[-1]
                                   if output.strip() else ""):
        counts[word.rstrip("s") if word.startswith("error") else word] = int(number)
    return counts


def _pytest(tree: str, cwd: str, args: list[str], env_extra: dict[str, str] | None = None,
            timeout: float = 1800) -> tuple[float, str, int]:
    env = dict(os.environ)
    env["PYTHONPATH"] = tree + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.pop("GPUCLEAN_TEST", None)  # a fresh session, not a nested one of whatever runs this script
    env.pop("GPUCLEAN_OWNER", None)
    env.update(env_extra or {})
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "gpuclean", "-p", "no:cacheprovider", *args],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    return time.monotonic() - started, done.stdout + done.stderr, done.returncode


def _interesting(output: str) -> list[str]:
    keep = ("foreign", "waits for GPU lock", "not waiting again", "leaked by", "in use by", "held by",
            "gpuclean: test leaked", "passed", "failed", "error")
    return [line[:240] for line in output.splitlines() if any(k in line for k in keep)][:30]


def scenario_xdist(tree: str, real: bool, timeout: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as root:
        sim = "" if real else _make_sim(root, 1)
        holder = _holder_cmd(real, sim, 64)
        with open(os.path.join(root, "test_x.py"), "w") as f:
            f.write(textwrap.dedent(f"""\
                import subprocess, time
                import pytest

                def test_unmarked_leak():
                    subprocess.Popen({holder!r}, stdout=subprocess.DEVNULL)
                    time.sleep(0.5)

                @pytest.mark.needs_clean_gpus(count=1)
                @pytest.mark.parametrize("i", range(6))
                def test_marked(i):
                    time.sleep(0.2)
                """))
        args = ["-q", "-n", "2", "-p", "xdist", f"--gpuclean-timeout={timeout}",
                f"--gpuclean-lock-dir={os.path.join(root, 'locks')}", "-rfE"]
        if not real:
            args.append(f"--gpuclean-simulate={sim}")
        wall, output, rc = _pytest(tree, root, args)
    counts = _counts(output)
    victims = len(set(re.findall(r"(?:ERROR|FAILED) test_x\.py::test_marked\[\d\]", output)))
    return {"wall_s": round(wall, 2), "rc": rc, "counts": counts, "victims": victims,
            "lines": _interesting(output)}


def scenario_outside(tree: str, real: bool, timeout: float, tests: int = 4) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as root:
        sim = "" if real else _make_sim(root, 1)
        holder = subprocess.Popen(_holder_cmd(real, sim, 512), stdout=subprocess.PIPE, text=True,
                                  start_new_session=True)
        try:
            if real:
                assert holder.stdout is not None
                holder.stdout.readline()  # "holding": its memory is on the GPU
            else:
                time.sleep(1.0)
            with open(os.path.join(root, "test_o.py"), "w") as f:
                f.write(textwrap.dedent(f"""\
                    import pytest

                    @pytest.mark.needs_clean_gpus
                    @pytest.mark.parametrize("i", range({tests}))
                    def test_marked(i):
                        pass
                    """))
            args = ["-q", f"--gpuclean-timeout={timeout}",
                    f"--gpuclean-lock-dir={os.path.join(root, 'locks')}", "-rfE"]
            if not real:
                args.append(f"--gpuclean-simulate={sim}")
            wall, output, rc = _pytest(tree, root, args)
        finally:
            holder.kill()
            holder.wait()
    return {"wall_s": round(wall, 2), "rc": rc, "counts": _counts(output), "tests": tests,
            "timeout_s": timeout, "lines": _interesting(output)}


def scenario_locks(tree: str, hold_s: float = 10.0, delay_s: float = 2.0) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as root:
        sim = _make_sim(root, 2)
        locks = os.path.join(root, "locks")
        with open(os.path.join(root, "test_a.py"), "w") as f:
            f.write(f"import time, pytest\n\n@pytest.mark.needs_clean_gpus\ndef test_busy():\n"
                    f"    time.sleep({hold_s})\n")
        with open(os.path.join(root, "test_b.py"), "w") as f:
            f.write("import pytest\n\n@pytest.mark.needs_clean_gpus\ndef test_free():\n    pass\n")
        env = dict(os.environ, PYTHONPATH=tree)
        env.pop("GPUCLEAN_TEST", None)
        env.pop("GPUCLEAN_OWNER", None)
        base = [sys.executable, "-m", "pytest", "-p", "gpuclean", "-p", "no:cacheprovider", "-q", "-s",
                f"--gpuclean-simulate={sim}", f"--gpuclean-lock-dir={locks}"]
        a = subprocess.Popen([*base, "--gpuclean-devices=0", "test_a.py"], cwd=root, env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            time.sleep(delay_s)
            wall, output, rc = _pytest(tree, root, ["-q", "-s", f"--gpuclean-simulate={sim}",
                                                    f"--gpuclean-lock-dir={locks}", "--gpuclean-devices=1",
                                                    "test_b.py"])
        finally:
            a.wait(timeout=120)
    return {"wall_s_of_b": round(wall, 2), "rc": rc, "a_holds_s": hold_s, "b_starts_after_s": delay_s,
            "b_waited_for_lock": "waits for GPU lock" in output, "lines": _interesting(output)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", default="WORKTREE",
                        help="directory holding pytest_gpuclean (WORKTREE: this checkout)")
    parser.add_argument("--real", action="store_true",
                        help="real NVML and a CUDA holder (needs torch and a GPU)")
    parser.add_argument("--timeout", type=float, default=20.0, help="--gpuclean-timeout for the sessions")
    parser.add_argument("--only", default="xdist,outside,locks")
    opts = parser.parse_args()
    tree = _common.REPO if opts.tree == "WORKTREE" else os.path.abspath(opts.tree)
    chosen = opts.only.split(",")
    result: dict[str, Any] = {"machine": _common.machine(), "tree": tree, "real": opts.real,
                              "timeout": opts.timeout}
    if "xdist" in chosen:
        result["xdist"] = scenario_xdist(tree, opts.real, opts.timeout)
    if "outside" in chosen:
        result["outside"] = scenario_outside(tree, opts.real, opts.timeout)
    if "locks" in chosen:
        result["locks"] = scenario_locks(tree)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
