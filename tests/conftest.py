"""Fixtures of gpuclean's own tests: simulated devices, holders outside the inner session, inner test
modules; plain helpers are in helpers.py."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from helpers import INNER_PRELUDE, TEST_TIMEOUT_S, alive, kill_all, read_pids, reap_orphans, wait_dead

# The inner suites the tests copy into their pytester sessions (pytester_example_dir): not tests of this run.
collect_ignore = ["examples"]


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
    # The debris of dead sessions is any session's of this user, wherever it runs: an inner session would
    # reap what another test, running beside this one (xdist, CI's stages side by side), deliberately left
    # as a dead session's debris. The tests of that opt in (--gpuclean-dead-sessions=on), one at a time.
    monkeypatch.setenv("GPUCLEAN_DEAD_SESSIONS", "off")
    return root


@pytest.fixture
def dead_sessions_on(sim: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """For a test of what dead sessions leave: its inner sessions reap dead sessions' debris (the default,
    which ``sim`` turns off), and no other such test of this user runs meanwhile (xdist workers, another
    run of the suite on the box): it would reap this test's debris first, or this one its."""
    monkeypatch.setenv("GPUCLEAN_DEAD_SESSIONS", "on")
    lock = Path(tempfile.gettempdir()) / f"gpuclean-tests-dead-sessions-{os.getuid()}.lock"
    with lock.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


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


@pytest.fixture
def inner(pytester: pytest.Pytester, sim: Path, tmp_path: Path,
          monkeypatch: pytest.MonkeyPatch) -> Callable[[str], Path]:
    """Write an inner test module (with INNER_PRELUDE); returns the pidfile its holders append to."""
    pidfile = tmp_path / "leak.pids"
    monkeypatch.setenv("LEAK_PIDFILE", str(pidfile))

    def write(body: str) -> Path:
        pytester.copy_example("prelude.py")
        pytester.makepyfile(test_inner=INNER_PRELUDE + body)
        return pidfile

    return write


@pytest.fixture
def example(pytester: pytest.Pytester, sim: Path, tmp_path: Path,
            monkeypatch: pytest.MonkeyPatch) -> Callable[..., Path]:
    """Copy inner suites from tests/examples (a folder's files, or a file) next to its prelude.py; returns the
    pidfile their holders append to."""
    pidfile = tmp_path / "leak.pids"
    monkeypatch.setenv("LEAK_PIDFILE", str(pidfile))

    def copy(*names: str) -> Path:
        for name in ("prelude.py", *names):
            pytester.copy_example(name)
        return pidfile

    return copy


@pytest.fixture
def public_tmp() -> Iterator[Path]:
    """A directory every user can reach (``tmp_path`` is in root's own, mode 700), for a command run as user
    nobody (``helpers.unprivileged``); removed afterwards, whatever modes it left inside."""
    base = Path(tempfile.mkdtemp(prefix="gpuclean-public-"))
    base.chmod(0o755)
    try:
        yield base
    finally:
        for folder, dirs, _files in os.walk(base):
            for name in dirs:
                with contextlib.suppress(OSError):
                    os.chmod(os.path.join(folder, name), 0o755)
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(autouse=True)
def _no_leftovers(tmp_path: Path) -> Iterator[None]:
    # Whatever a test's holders were, none may outlive it (the point of this project).
    yield
    pidfile = tmp_path / "leak.pids"
    if pidfile.exists():
        pids = [int(x) for x in pidfile.read_text().split()]
        kill_all([p for p in pids if alive(p)])
        wait_dead(pids)
        reap_orphans(pids)  # orphans of inner sessions are re-parented to this (subreaper) process


def _nvml_reason() -> str | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        count = pynvml.nvmlDeviceGetCount()
        pynvml.nvmlShutdown()
    except Exception as exc:
        return f"no NVIDIA driver/NVML: {exc}"
    return None if count else "NVML sees no GPU"


def _give_each_test_a_timeout(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.pluginmanager.hasplugin("timeout"):
        return
    if config.getoption("timeout", None) is not None or os.environ.get("PYTEST_TIMEOUT"):
        return
    for item in items:
        if item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(TEST_TIMEOUT_S))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _give_each_test_a_timeout(config, items)
    # tests/gpu/ needs a real GPU (benchmarks/GPU-RUNS.md); elsewhere say why it is skipped.
    gpu_items = [item for item in items if "tests/gpu/" in item.nodeid or item.nodeid.startswith("gpu/")]
    if not gpu_items:
        return
    reason = _nvml_reason()
    if reason is None:
        return
    for item in gpu_items:
        item.add_marker(pytest.mark.skip(reason=f"real-GPU test: {reason}"))
