"""Faults on a real GPU: a pytest killed with SIGKILL while its test's CUDA child holds memory, and an
xdist worker that segfaults after leaking a CUDA child.

Figures are printed so benchmarks/GPU-RUNS.md can quote them.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from gpu_helpers import alive, used_mib

# A CUDA holder: allocates MIB of device memory, then records its pid (so the test knows it holds).
HOLDER = r'''
import os, sys, time
import torch
block = torch.empty(int(sys.argv[1]) * 1024 * 1024, dtype=torch.uint8, device="cuda")
torch.cuda.synchronize()
with open(sys.argv[2], "a") as f:
    f.write(f"{os.getpid()}\n")
time.sleep(3600)
'''

# What the inner tests start with; HOLDER_SOURCE becomes HOLDER as a Python string literal.
PRELUDE = '''
import ctypes, os, subprocess, sys, time
import pytest
HOLDER = HOLDER_SOURCE
PIDFILE = os.environ["LEAK_PIDFILE"]

def hold(mib):
    subprocess.Popen([sys.executable, "-c", HOLDER, str(mib), PIDFILE])
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if os.path.exists(PIDFILE) and open(PIDFILE).read().strip():
            return int(open(PIDFILE).read().split()[0])
        time.sleep(0.05)
    raise AssertionError("CUDA holder did not start")
'''.replace("HOLDER_SOURCE", repr(HOLDER))


def _read_pid(path: Path, timeout: float = 180) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().strip():
            return int(path.read_text().split()[0])
        time.sleep(0.05)
    raise AssertionError(f"no pid in {path}")


@pytest.fixture
def gpu_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.delenv("GPUCLEAN_SIMULATE", raising=False)
    monkeypatch.setenv("GPUCLEAN_LOCK_DIR", str(tmp_path / "locks"))
    pidfile = tmp_path / "holder.pids"
    monkeypatch.setenv("LEAK_PIDFILE", str(pidfile))
    return pidfile


def test_sigkilled_pytest_leaves_debris_the_next_session_reaps(
        pytester: pytest.Pytester, gpu_env: Path, tmp_path: Path) -> None:
    pytester.makepyfile(test_inner=PRELUDE + """
@pytest.mark.needs_clean_gpus
def test_leak_and_hang():
    hold(4096)
    time.sleep(600)

@pytest.mark.needs_clean_gpus(timeout=120)
def test_next_session():
    pass
""")
    with open(tmp_path / "first.out", "wb") as out:
        first = subprocess.Popen([sys.executable, "-m", "pytest", "-p", "gpuclean", "-p", "no:cacheprovider",
                                  "-k", "test_leak_and_hang"], cwd=pytester.path, stdout=out,
                                 stderr=subprocess.STDOUT)
    holder = _read_pid(gpu_env)
    first.send_signal(signal.SIGKILL)
    first.wait()
    time.sleep(1)
    held = used_mib()
    print(f"pytest pid {first.pid} SIGKILLed; its test's CUDA child pid {holder} alive, "
          f"GPU used {held:.0f} MiB")
    assert held > 4000
    started = time.monotonic()
    result = pytester.runpytest_subprocess("-p", "gpuclean", "-p", "no:cacheprovider", "-rA", "-k",
                                           "test_next_session", timeout=300)
    took = time.monotonic() - started
    out = result.stdout.str()
    print(out)
    print(f"next session took {took:.1f}s; GPU used after: {used_mib():.0f} MiB")
    result.assert_outcomes(passed=1)
    assert f"pid {holder}: left by dead session gc.{first.pid}." in out
    assert "test_inner.py::test_leak_and_hang: leaked 1 process(es) found by a later check" in out
    assert not alive(holder)  # a zombie at most: its parent (this process, the subreaper) collects it
    assert took < 100  # far from its 120 s timeout: debris is reaped, not waited for
    assert used_mib() < 100


def test_xdist_worker_segfault_after_leaking_a_cuda_child(
        pytester: pytest.Pytester, gpu_env: Path, tmp_path: Path) -> None:
    pytest.importorskip("xdist")
    pytester.makepyfile(test_inner=PRELUDE + """
@pytest.mark.needs_clean_gpus
def test_segfault_after_leaking():
    hold(2048)
    ctypes.string_at(0)  # SIGSEGV: the worker dies, its CUDA child lives on

@pytest.mark.needs_clean_gpus(timeout=120)
@pytest.mark.parametrize("n", range(3))
def test_later(n):
    time.sleep(2)
""")
    report = tmp_path / "report.json"
    result = pytester.runpytest_subprocess("-p", "gpuclean", "-p", "no:cacheprovider", "-rA", "-n", "2",
                                           f"--gpuclean-report={report}", timeout=600)
    out = result.stdout.str()
    print(out)
    holder = _read_pid(gpu_env, timeout=5)
    assert not alive(holder)
    document = json.loads(report.read_text())
    tests = {t["nodeid"].split("::")[-1]: t for t in document["tests"]}
    print(json.dumps(tests.get("test_segfault_after_leaking"), indent=1))
    crashed = tests["test_segfault_after_leaking"]
    assert crashed["outcome"] == "leaked"
    assert [p["pid"] for p in crashed["leaked"]] == [holder]
    assert all(tests[f"test_later[{n}]"]["outcome"] == "clean" for n in range(3))
    assert used_mib() < 100
