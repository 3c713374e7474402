"""A real GPU held from outside the session (issue 27, item 2): N marked tests cost one timeout, not N.

A torch process that this test starts before the inner session, so not the inner session's (another job's,
as far as it can tell), holds CUDA memory on every GPU while the inner session runs 4 marked tests with a
5 s timeout, without xdist and with ``-n 2``. Only the first check waits; the others find the same holder
and memory and fail at once. Whether the driver lists the holder (same PID namespace: ``foreign pid``) or
not (another namespace: ``memory held by no process we can see``), the outside state is the same from one
check to the next. Figures are printed so benchmarks/GPU-RUNS.md can quote them.

Run on one GPU: ``python3 -m pytest tests/gpu/test_gpu_outside.py -v -s -p no:cacheprovider``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

TIMEOUT = 5.0
HOLD_MIB = 512

HOLDER = r'''
import os, sys, time
import torch
blocks = [torch.empty(int(sys.argv[1]) * 1024 * 1024, dtype=torch.uint8, device=f"cuda:{i}")
          for i in range(torch.cuda.device_count())]
torch.cuda.synchronize()
with open(sys.argv[2], "a") as f:
    f.write(f"{os.getpid()}\n")
time.sleep(3600)
'''

# TIMEOUT becomes the module's TIMEOUT.
INNER = '''
import pytest

@pytest.mark.needs_clean_gpus(timeout=TIMEOUT)
@pytest.mark.parametrize("n", range(4))
def test_marked(n):
    raise AssertionError("must not run on GPUs dirty from outside")
'''.replace("TIMEOUT", str(TIMEOUT))


@pytest.fixture
def outside_cuda_holder(tmp_path: Path) -> Iterator[int]:
    """A CUDA process outside the inner session (started before it, not by it, without its cookie)."""
    # Not importorskip: torch imported here would be dropped from sys.modules by the pytester fixture's
    # snapshot at this test's end, and importing it again in the next test fails inside torch (seen on the
    # H200). The holder is a subprocess: this process needs torch only to exist.
    if importlib.util.find_spec("torch") is None:
        pytest.skip("needs torch (the outside CUDA holder)")
    pidfile = tmp_path / "outside.pid"
    environ = {k: v for k, v in os.environ.items() if not k.startswith("GPUCLEAN_")}
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(HOLD_MIB), str(pidfile)], env=environ)
    deadline = time.monotonic() + 120
    while not (pidfile.exists() and pidfile.read_text().strip()):
        if proc.poll() is not None or time.monotonic() > deadline:
            pytest.fail("the outside CUDA holder did not start")
        time.sleep(0.05)
    yield proc.pid
    proc.send_signal(signal.SIGKILL)
    proc.wait()


@pytest.fixture
def gpu_inner(pytester: pytest.Pytester, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    monkeypatch.delenv("GPUCLEAN_SIMULATE", raising=False)
    monkeypatch.setenv("GPUCLEAN_LOCK_DIR", str(tmp_path / "locks"))
    for name in ("PYTEST_XDIST_TESTRUNUID", "PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT"):
        monkeypatch.delenv(name, raising=False)
    pytester.makepyfile(test_inner=INNER)
    return pytester


def _run(pytester: pytest.Pytester, *args: str) -> tuple[pytest.RunResult, float, list[dict[str, Any]]]:
    started = time.monotonic()
    result = pytester.runpytest_subprocess("-p", "gpuclean", "-p", "no:cacheprovider", "-rA",
                                           "--gpuclean-report=report.json", *args, timeout=300)
    wall = time.monotonic() - started
    print(result.stdout.str())
    tests: list[dict[str, Any]] = json.loads((pytester.path / "report.json").read_text())["tests"]
    for t in tests:
        outside = t["before"]["outside"]
        print(f"{t['nodeid']}: setup check {t['before']['waited_s']:.3f}s, outside {outside}")
    print(f"inner session {' '.join(args) or '(no xdist)'}: {len(tests)} marked tests, wall {wall:.1f}s")
    return result, wall, tests


def _only_the_first_waits(tests: list[dict[str, Any]]) -> None:
    assert len(tests) == 4
    checks = [t["before"] for t in tests]
    assert all(not c["clean"] and c["outside"] is not None and c["outside"]["only"] for c in checks)
    waited = [c for c in checks if c["outside"]["waited"]]
    assert len(waited) == 1 and waited[0]["waited_s"] >= TIMEOUT
    first = next(t["nodeid"] for t in tests if t["before"]["outside"]["waited"])
    others = [c for c in checks if c is not waited[0]]
    assert [c["outside"]["same_as"] for c in others] == [first] * 3
    assert all(c["waited_s"] < TIMEOUT for c in others)


def test_n_marked_tests_under_an_outside_cuda_holder_cost_one_timeout(gpu_inner: pytest.Pytester,
                                                                      outside_cuda_holder: int) -> None:
    result, _wall, tests = _run(gpu_inner)
    result.assert_outcomes(errors=4)
    result.stdout.fnmatch_lines(["*GPUs not clean before the test: GPU 0: still the same * MiB held from "
                                 "outside as at test_inner.py::test_marked[[]0[]]; not waiting again"])
    _only_the_first_waits(tests)
    assert os.path.exists(f"/proc/{outside_cuda_holder}")  # never signalled


def test_xdist_workers_share_the_wait(gpu_inner: pytest.Pytester, outside_cuda_holder: int) -> None:
    pytest.importorskip("xdist")
    result, _wall, tests = _run(gpu_inner, "-n", "2")
    result.assert_outcomes(errors=4)
    _only_the_first_waits(tests)


def test_skip_skips_the_rest_at_once(gpu_inner: pytest.Pytester, outside_cuda_holder: int) -> None:
    result, _wall, tests = _run(gpu_inner, "--gpuclean-outside=skip")
    result.assert_outcomes(skipped=4)
    _only_the_first_waits(tests)
    assert [t["outside_action"] for t in tests] == ["skip"] * 4
