"""Shared helpers: simulated devices, real holder processes, inner pytest sessions in subprocesses."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

HOLD = [sys.executable, "-m", "pytest_gpuclean.simulate", "hold"]
INNER_TIMEOUT = 180


def alive(pid: int) -> bool:
    """True if ``pid`` runs (a zombie does not count: it holds nothing)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_dead(pids: list[int], timeout: float = 10.0) -> list[int]:
    """Wait until every pid is gone; return those still alive at the deadline."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        living = [p for p in pids if alive(p)]
        if not living:
            return []
        time.sleep(0.02)
    return [p for p in pids if alive(p)]


def read_pids(path: Path, expected: int = 1, timeout: float = 15.0) -> list[int]:
    """Pids appended to ``path`` by holders (``--pidfile``), waiting until ``expected`` are there."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            pids = [int(x) for x in path.read_text().split()]
            if len(pids) >= expected:
                return pids
        time.sleep(0.02)
    raise AssertionError(f"{path}: fewer than {expected} pids after {timeout}s")


def kill_all(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@pytest.fixture
def sim(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Two simulated devices; the inner sessions find them through GPUCLEAN_SIMULATE."""
    root = tmp_path / "sim"
    for index in (0, 1):
        (root / str(index)).mkdir(parents=True)
    monkeypatch.setenv("GPUCLEAN_SIMULATE", str(root))
    monkeypatch.setenv("GPUCLEAN_LOCK_DIR", str(tmp_path / "locks"))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    for name in list(os.environ):
        if name.startswith("GPUCLEAN_") and name not in ("GPUCLEAN_SIMULATE", "GPUCLEAN_LOCK_DIR",
                                                          "GPUCLEAN_TEST"):
            monkeypatch.delenv(name)
    return root


@pytest.fixture
def outside_holder(sim: Path, tmp_path: Path) -> Iterator[Callable[..., int]]:
    """Start holders that are NOT descendants of the inner session (foreign / pre-existing to it)."""
    started: list[int] = []

    def start(*extra: str, device: int = 0, mib: float = 100, python: str = sys.executable) -> int:
        pidfile = tmp_path / f"outside-{len(started)}.pid"
        proc = subprocess.Popen([python, "-m", "pytest_gpuclean.simulate", "hold", "--dir", str(sim),
                                 "--device", str(device), "--mib", str(mib), "--pidfile", str(pidfile),
                                 *extra])
        started.append(proc.pid)
        return read_pids(pidfile)[0]

    yield start
    kill_all(started)
    for pid in started:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)


def run_inner(pytester: pytest.Pytester, *args: str, timeout: float = INNER_TIMEOUT) -> pytest.RunResult:
    """An inner pytest session with gpuclean, in a subprocess (signals, children and kills stay there)."""
    return pytester.runpytest_subprocess("-p", "gpuclean", "-p", "no:cacheprovider", "-rA", *args,
                                         timeout=timeout)


INNER_PRELUDE = '''
import os, subprocess, sys, time
import pytest

SIM = os.environ["GPUCLEAN_SIMULATE"]
PIDFILE = os.environ.get("LEAK_PIDFILE", "leak.pids")


def hold(*extra, device=0, mib=100, prefix=()):
    """Start a simulated holder as a child of this test process."""
    return subprocess.Popen([*prefix, sys.executable, "-m", "pytest_gpuclean.simulate", "hold", "--dir", SIM,
                             "--device", str(device), "--mib", str(mib), "--pidfile", PIDFILE, *extra])


def wait_holders(n):
    """Wait until n holders recorded their pids (so they really hold memory)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if os.path.exists(PIDFILE) and len(open(PIDFILE).read().split()) >= n:
            return [int(x) for x in open(PIDFILE).read().split()]
        time.sleep(0.01)
    raise AssertionError("holders did not start")
'''


@pytest.fixture
def inner(pytester: pytest.Pytester, sim: Path, tmp_path: Path,
          monkeypatch: pytest.MonkeyPatch) -> Callable[[str], Path]:
    """Write an inner test module (with INNER_PRELUDE); returns the pidfile its holders append to."""
    pidfile = tmp_path / "leak.pids"
    monkeypatch.setenv("LEAK_PIDFILE", str(pidfile))

    def write(body: str) -> Path:
        pytester.makepyfile(test_inner=INNER_PRELUDE + body)
        return pidfile

    return write


@pytest.fixture(autouse=True)
def _no_leftovers(tmp_path: Path) -> Iterator[None]:
    # Whatever a test's holders were, none may outlive it (the point of this project).
    yield
    pidfile = tmp_path / "leak.pids"
    if pidfile.exists():
        pids = [int(x) for x in pidfile.read_text().split()]
        kill_all([p for p in pids if alive(p)])
        wait_dead(pids)
        for pid in pids:  # orphans of inner sessions are re-parented to this (subreaper) process
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)


def _nvml_reason() -> str | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        count = pynvml.nvmlDeviceGetCount()
        pynvml.nvmlShutdown()
    except Exception as exc:
        return f"no NVIDIA driver/NVML: {exc}"
    return None if count else "NVML sees no GPU"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # tests/gpu/ needs a real GPU (run it on the H200: docs/gpu.md); elsewhere say why it is skipped.
    gpu_items = [item for item in items if "tests/gpu/" in item.nodeid or item.nodeid.startswith("gpu/")]
    if not gpu_items:
        return
    reason = _nvml_reason()
    if reason is None:
        return
    for item in gpu_items:
        item.add_marker(pytest.mark.skip(reason=f"real-GPU test: {reason}"))
