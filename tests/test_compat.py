"""The plugin inside suites written elsewhere: process-per-test runners and helpers.

Each case runs an inner session under ``-p gpuclean --gpuclean-all`` over simulated devices, with the
helper as its users have it: pytest-forked, pytest-xdist, PyTorch's ``MultiProcessTestCase``, vLLM's
fork/spawn-per-test decorators and a server started in a fixture, and the common pytest plugins. A
clean suite must pass exactly as without gpuclean (no finding, no killed runner); a leak must be
reaped, blamed on its test and reported once.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest
from helpers import INNER_TIMEOUT, alive, kill_all, read_pids, reap_orphans, run_inner, summary_of, wait_dead

from pytest_gpuclean._check.checker import Checker
from pytest_gpuclean._ownership.census import Census, KeptAlive
from pytest_gpuclean.report.terminal import LEAK_PREFIX

PYTEST_VERSION = tuple(int(part) for part in pytest.__version__.split(".")[:2])


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


# pytest 9.2 puts a ``_id`` (a NodeId object) on every test report; pytest-forked (1.6.0 and 1.7.5)
# marshals the report's attributes and fails on it, so on 9.2 every forked test fails, gpuclean or not.
needs_forked = pytest.mark.skipif(
    not _installed("pytest_forked") or PYTEST_VERSION >= (9, 2),
    reason="needs pytest-forked on pytest < 9.2 (pytest-forked 1.7.5 cannot serialise pytest 9.2's "
           "reports: every forked test fails with or without gpuclean); CI runs these in .venv-pytest8")


needs_xdist = pytest.mark.skipif(not _installed("xdist"), reason="needs pytest-xdist")


def needs(module: str, package: str) -> pytest.MarkDecorator:
    """Skip unless ``package`` is installed (CI installs the plugins in .venv-pytest8 / .venv-pytest9)."""
    return pytest.mark.skipif(not _installed(module), reason=f"needs {package} (.ci/peers installs it "
                                                           "in .venv-pytest8 and .venv-pytest9)")


def compat_run(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    """An inner gpuclean session in test order (pytest-randomly, where installed, only when asked)."""
    before = {child.pid for child in psutil.Process().children()}
    try:
        return run_inner(pytester, *(args if "randomly" in " ".join(args) else ("-p", "no:randomly", *args)))
    finally:
        collect_inner_helpers(before)


MULTIPROCESSING_CHILD = re.compile(r"multiprocess(ing)?\.(spawn|resource_tracker|forkserver) import")


def collect_inner_helpers(before: set[int]) -> None:
    # The inner session's multiprocessing helpers (resource tracker, forkserver) exit once the inner
    # pytest has closed their pipe, and ranks that MultiProcessTestCase terminated without joining exit
    # a moment later: re-parented to this subreaper, wait for them and collect them.
    helpers = []
    for child in psutil.Process().children():
        with contextlib.suppress(psutil.Error):
            if child.pid not in before and (child.status() == psutil.STATUS_ZOMBIE
                                            or MULTIPROCESSING_CHILD.search(" ".join(child.cmdline()))):
                helpers.append(child.pid)
    wait_dead(helpers)
    reap_orphans(helpers)


def report_of(pytester: pytest.Pytester) -> dict[str, Any]:
    """The inner session's --gpuclean-report=report.json."""
    document: dict[str, Any] = json.loads((pytester.path / "report.json").read_text())
    return document


def records_by_nodeid(report: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    found: dict[str, list[dict[str, Any]]] = {}
    for test in report["tests"]:
        found.setdefault(test["nodeid"], []).append(test)
    return found


# ---- pytest-forked ---------------------------------------------------------------------------------

@needs_forked
@pytest.mark.parametrize("reap", ["on", "off"])
def test_forked_child_is_never_a_suspect(example: Callable[..., Path], pytester: pytest.Pytester,
                                         reap: str) -> None:
    # The forked child runs gpuclean's hooks with the checker the session built before forking: the
    # running process and the parent pytest must be "us", not a leak (it was SIGTERMed, or with
    # reaping off reported as leaked after the timeout).
    example("compat/forked_marked")
    result = compat_run(pytester, "--forked", "--gpuclean-all", f"--gpuclean-reap={reap}",
                       "--gpuclean-timeout=3")
    result.assert_outcomes(passed=2)
    assert "CRASHED" not in result.stdout.str()
    assert LEAK_PREFIX not in result.stdout.str()
    assert summary_of(result)[-1].startswith("2 checked test(s), 0 with findings")


@needs_forked
def test_forked_leak_is_reaped_in_the_child_and_reported_once(example: Callable[..., Path],
                                                              pytester: pytest.Pytester) -> None:
    pidfile = example("compat/forked_leaks", "scripts/cpu_daemon.py")
    result = compat_run(pytester, "--forked", "--gpuclean-all", "--gpuclean-report=report.json",
                        "--junitxml=junit.xml")
    result.assert_outcomes(passed=4, errors=3)
    leaked = read_pids(pidfile, expected=3)
    assert wait_dead(leaked, timeout=5) == []
    out = result.stdout.str()
    assert out.count(LEAK_PREFIX) == 3
    summary = summary_of(result)
    assert summary[-1] == "4 checked test(s), 3 with findings, 3 process(es) reaped"
    for name in ("test_leaks", "test_leaks_a_daemon", "test_leaks_a_cpu_daemon"):
        assert sum(1 for line in summary if line.startswith(f"test_inner.py::{name}:")) == 1
    report = json.loads((pytester.path / "report.json").read_text())
    records = {t["nodeid"]: t for t in report["tests"]}
    assert len(report["tests"]) == 4 == len(records)
    assert [p["pid"] for p in records["test_inner.py::test_leaks_a_cpu_daemon"]["leaked"]] == leaked[2:]
    assert [p["pid"] for p in records["test_inner.py::test_leaks"]["leaked"]] == leaked[:1]
    daemon = records["test_inner.py::test_leaks_a_daemon"]["leaked"]
    assert leaked[1] in [p["pid"] for p in daemon]
    assert all(p["owner"]["name"] == "test_inner.py::test_leaks_a_daemon" for p in daemon)
    assert records["test_inner.py::test_after"]["outcome"] == "clean"
    assert report["session_reaped"] == []
    junit = (pytester.path / "junit.xml").read_text()
    assert 'name="gpuclean_outcome" value="leaked"' in junit


@needs_forked
def test_forked_unchecked_leak_is_blamed_on_its_own_test(example: Callable[..., Path],
                                                         pytester: pytest.Pytester) -> None:
    # Each forked child starts from the session's state as it was before the fork: an unchecked
    # test's escapee, found by the next checked test's cookie scan in another child, still names the
    # test that spawned it, not the test that found it.
    pidfile = example("compat/forked_unchecked")
    result = compat_run(pytester, "--forked", "--gpuclean-report=report.json")
    leaked = read_pids(pidfile)
    assert wait_dead(leaked, timeout=5) == []
    result.assert_outcomes(passed=2)
    report = json.loads((pytester.path / "report.json").read_text())
    records = {t["nodeid"]: t for t in report["tests"]}
    later = records["test_inner.py::test_a_unchecked_leaks_a_daemon"]["found_later"]
    assert [r["process"]["pid"] for r in later] == leaked
    assert records["test_inner.py::test_b_checked"]["leaked"] == []
    assert alive(leaked[0]) is False


@needs_forked
@needs_xdist
def test_forked_under_xdist_reports_each_leak_once(example: Callable[..., Path],
                                                    pytester: pytest.Pytester) -> None:
    # The record travels child -> worker (on the report) -> controller (in the worker's output); the
    # controller also sees the report itself and must not count it again.
    pidfile = example("compat/forked_xdist")
    result = compat_run(pytester, "-n", "2", "--forked", "--gpuclean-all", "--gpuclean-report=report.json")
    result.assert_outcomes(passed=5, errors=1)
    leaked = read_pids(pidfile)
    assert wait_dead(leaked, timeout=5) == []
    assert summary_of(result)[-1] == "5 checked test(s), 1 with findings, 1 process(es) reaped"
    report = json.loads((pytester.path / "report.json").read_text())
    assert sorted(t["nodeid"] for t in report["tests"]) == sorted(
        [f"test_inner.py::test_clean[{n}]" for n in range(4)] + ["test_inner.py::test_leaks"])
    assert [t["outcome"] for t in report["tests"] if t["nodeid"] == "test_inner.py::test_leaks"] == ["leaked"]


# ---- pytest-xdist ----------------------------------------------------------------------------------

@needs_xdist
@pytest.mark.parametrize("dist", ["load", "loadgroup"])
def test_xdist_suite_reports_only_the_leak(example: Callable[..., Path], pytester: pytest.Pytester,
                                          dist: str) -> None:
    pidfile = example("compat/xdist_groups")
    result = compat_run(pytester, "-n", "2", f"--dist={dist}", "--gpuclean-all",
                        "--gpuclean-report=report.json")
    result.assert_outcomes(passed=7, errors=1)
    leaked = read_pids(pidfile)
    assert wait_dead(leaked, timeout=5) == []
    assert summary_of(result)[-1] == "7 checked test(s), 1 with findings, 1 process(es) reaped"
    records = records_by_nodeid(report_of(pytester))
    # xdist 3.8's loadgroup renames grouped tests "...@engine" on pytest 8, and on pytest 9.2 does not
    # (nor keeps the group on one worker: its rename no longer reaches the report), gpuclean or not.
    renamed = dist == "loadgroup" and PYTEST_VERSION < (9, 2)
    grouped = "test_inner.py::test_grouped_leaks" + ("@engine" if renamed else "")
    leaker = records.pop(grouped)
    assert [r["outcome"] for r in leaker] == ["leaked"]
    assert [p["pid"] for p in leaker[0]["leaked"]] == leaked
    assert len(records) == 6
    assert all(r["outcome"] == "clean" for rs in records.values() for r in rs)


# ---- pytest-isolate --------------------------------------------------------------------------------

# pytest-isolate 0.0.17 calls _pytest.warnings.apply_warning_filters, which pytest 9.2 no longer has: every
# isolated test fails there, gpuclean or not.
@pytest.mark.skipif(not _installed("pytest_isolate") or PYTEST_VERSION >= (9, 2),
                    reason="needs pytest-isolate on pytest < 9.2 (pytest-isolate 0.0.17 fails every test on "
                           "pytest 9.2, with or without gpuclean); CI runs it in .venv-pytest8")
def test_isolate_checks_each_child_and_reports_once(example: Callable[..., Path],
                                                    pytester: pytest.Pytester) -> None:
    pidfile = example("compat/isolate")
    # pytest-isolate does nothing while pytest-timeout or pytest-forked is loaded.
    result = compat_run(pytester, "-p", "no:timeout", "-p", "no:forked", "--isolate", "--gpuclean-all",
                        "--gpuclean-report=report.json",
                        "-W", "ignore::UserWarning")
    result.assert_outcomes(passed=3, errors=1)
    leaked = read_pids(pidfile)
    assert wait_dead(leaked, timeout=5) == []
    assert "CRASHED" not in result.stdout.str()
    assert summary_of(result)[-1] == "3 checked test(s), 1 with findings, 1 process(es) reaped"
    records = records_by_nodeid(report_of(pytester))
    assert [p["pid"] for p in records["test_inner.py::test_leaks"][0]["leaked"]] == leaked
    assert len(records) == 3 and all(len(rs) == 1 for rs in records.values())


# ---- pytest-rerunfailures, pytest-repeat, pytest-randomly -----------------------------------------

@needs("pytest_rerunfailures", "pytest-rerunfailures")
def test_rerunfailures_each_attempt_is_checked(example: Callable[..., Path], pytester: pytest.Pytester,
                                               tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A flaky test leaks on its failing first attempt and passes on the rerun: the leak of the first
    # attempt is reaped and reported, the rerun starts on clean GPUs.
    monkeypatch.setenv("ATTEMPTS", str(tmp_path / "attempts"))
    pidfile = example("compat/rerun")
    result = compat_run(pytester, "--reruns=1", "--gpuclean-all",
                        "--gpuclean-report=report.json")
    # rerunfailures shows the first attempt's failure and its teardown error (the leak) as two reruns.
    assert result.parseoutcomes() == {"passed": 2, "rerun": 2}
    leaked = read_pids(pidfile)
    assert wait_dead(leaked, timeout=5) == []
    records = records_by_nodeid(report_of(pytester))
    assert [r["outcome"] for r in records["test_inner.py::test_flaky"]] == ["leaked", "clean"]
    assert [p["pid"] for p in records["test_inner.py::test_flaky"][0]["leaked"]] == leaked
    assert summary_of(result)[-1] == "3 checked test(s), 1 with findings, 1 process(es) reaped"


@needs("pytest_repeat", "pytest-repeat")
def test_repeat_blames_each_repetition(example: Callable[..., Path], pytester: pytest.Pytester) -> None:
    pidfile = example("compat/repeat")
    result = compat_run(pytester, "--count=3", "--gpuclean-all",
                        "--gpuclean-report=report.json")
    result.assert_outcomes(passed=3, errors=3)
    leaked = read_pids(pidfile, expected=3)
    assert wait_dead(leaked, timeout=5) == []
    records = records_by_nodeid(report_of(pytester))
    assert sorted(records) == [f"test_inner.py::test_leaks[{i}-3]" for i in (1, 2, 3)]
    assert sorted(p["pid"] for rs in records.values() for p in rs[0]["leaked"]) == sorted(leaked)


@needs("pytest_randomly", "pytest-randomly")
def test_randomly_any_order_blames_the_spawner(example: Callable[..., Path],
                                               pytester: pytest.Pytester) -> None:
    # Whatever the order, an unchecked test's escapee is blamed on it, found by the next checked test.
    pidfile = example("compat/randomly")
    for seed in ("1", "2", "3"):
        result = compat_run(pytester, f"--randomly-seed={seed}",
                            "--gpuclean-report=report.json")
        result.assert_outcomes(passed=4)
        leaked = read_pids(pidfile)
        assert wait_dead(leaked, timeout=5) == []
        records = records_by_nodeid(report_of(pytester))
        # Found by a later test's check, or by the final sweep if it ran last (with the zombies of its
        # double fork, which only the sweep reports).
        later = records["test_inner.py::test_unchecked_leaks"][0]["found_later"]
        assert leaked[0] in [r["process"]["pid"] for r in later]
        assert {r["owner"]["name"] for r in later} == {"test_inner.py::test_unchecked_leaks"}
        assert all(r["leaked"] == [] for name, rs in records.items() if name.startswith(
            "test_inner.py::test_checked") for r in rs)
        pidfile.unlink()


# ---- pytest-asyncio --------------------------------------------------------------------------------

@needs("pytest_asyncio", "pytest-asyncio")
def test_asyncio_subprocesses(example: Callable[..., Path], pytester: pytest.Pytester) -> None:
    # asyncio waits for its children in a watcher thread: the one it awaited is no leak, the one it
    # forgot is reaped (and the watcher does not break when gpuclean collects it).
    pidfile = example("compat/asyncio")
    result = compat_run(pytester, "--gpuclean-all", "--gpuclean-report=report.json")
    result.assert_outcomes(passed=3, errors=1)
    leaked = read_pids(pidfile)
    assert wait_dead(leaked, timeout=5) == []
    records = records_by_nodeid(report_of(pytester))
    assert [p["pid"] for p in records["test_inner.py::test_forgets_its_child"][0]["leaked"]] == leaked
    assert records["test_inner.py::test_awaits_its_child"][0]["outcome"] == "clean"
    assert records["test_inner.py::test_after"][0]["outcome"] == "clean"


# ---- pytest-timeout, junitxml ------------------------------------------------------------------------

@pytest.mark.parametrize("method", ["signal", "thread"])
def test_timeout_that_does_not_fire_changes_nothing(example: Callable[..., Path], pytester: pytest.Pytester,
                                                    method: str) -> None:
    # (Timeouts that fire: tests/test_sharing.py, test_pytest_timeout_*.)
    example("compat/timeout")
    result = compat_run(pytester, "-p", "timeout", "--timeout=60", f"--timeout-method={method}",
                        "--gpuclean-all", "--junitxml=junit.xml")
    result.assert_outcomes(passed=2)
    assert summary_of(result)[-1] == "2 checked test(s), 0 with findings, 0 process(es) reaped"
    junit = (pytester.path / "junit.xml").read_text()
    assert junit.count('name="gpuclean_outcome" value="clean"') == 2


# ---- PyTorch's MultiProcessTestCase --------------------------------------------------------------------

def _torch_distributed_reason() -> str | None:
    if not _installed("torch"):
        return "needs torch"
    if not _installed("expecttest"):
        return "needs expecttest (torch.testing._internal imports it; .ci/setup installs it)"
    return None


needs_torch_distributed = pytest.mark.skipif(_torch_distributed_reason() is not None,
                                             reason=_torch_distributed_reason() or "")


@needs_torch_distributed
def test_multi_process_test_case(example: Callable[..., Path], pytester: pytest.Pytester) -> None:
    # Ranks are spawned (multiprocessing's resource tracker with them) and joined inside the test; a
    # rank's child outlives the rank, is adopted by the session and is blamed on the test.
    pidfile = example("compat/multi_process")
    result = compat_run(pytester, "--gpuclean-all", "--gpuclean-report=report.json")
    result.assert_outcomes(passed=2, errors=1)
    leaked = read_pids(pidfile)
    assert wait_dead(leaked, timeout=5) == []
    records = records_by_nodeid(report_of(pytester))
    assert records["test_inner.py::TestGloo::test_all_reduce"][0]["outcome"] == "clean"
    leak = records["test_inner.py::TestGloo::test_rank_leaks"][0]
    assert [(p["pid"], p["owner"]["name"]) for p in leak["leaked"]] == [
        (leaked[0], "test_inner.py::TestGloo::test_rank_leaks")]
    assert summary_of(result)[-1] == "2 checked test(s), 1 with findings, 1 process(es) reaped"


# ---- multiprocessing's helpers, from the standard library and from the ``multiprocess`` package --------

@pytest.mark.parametrize("module", ["multiprocessing", "multiprocess"])
def test_resource_tracker_is_the_sessions_helper(example: Callable[..., Path], pytester: pytest.Pytester,
                                                 monkeypatch: pytest.MonkeyPatch, module: str) -> None:
    # The first test that spawns a process starts the resource tracker (and here the forkserver) of the
    # pytest process; they live until pytest exits and serve every later test. vLLM's shm tests use the
    # ``multiprocess`` package (dill-based), whose helpers are the same code under another name: gpuclean
    # SIGKILLed its tracker (which ignores SIGTERM) as the first test's leak, 5 s later.
    if not _installed(module):
        pytest.skip(f"needs {module}")
    monkeypatch.setenv("MP_MODULE", module)
    example("compat/mp_helpers")
    result = compat_run(pytester, "--gpuclean-all", "--gpuclean-report=report.json")
    result.assert_outcomes(passed=3)
    assert summary_of(result)[-1] == "3 checked test(s), 0 with findings, 0 process(es) reaped"
    assert report_of(pytester)["session_reaped"] == []


def test_torch_compile_worker_pool_is_the_sessions_helper(example: Callable[..., Path],
                                                          pytester: pytest.Pytester, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    # Issue 37: torch.compile's worker pool (``SubprocPool``: a sidecar process and its workers) serves the
    # pytest process for the rest of its life. Before, gpuclean SIGTERMed it as the first test's leak
    # ("reaped 3") and the next test's compile timed out on the dead pool. The evidence it is the session's:
    # torch registered the pool's shutdown for the process's exit (multiprocessing's Finalize, no referent).
    if not _installed("torch"):
        pytest.skip("needs torch")
    pool_pidfile = tmp_path / "pool.pid"
    monkeypatch.setenv("POOL_PIDFILE", str(pool_pidfile))
    example("compat/torch_compile_pool")
    result = compat_run(pytester, "--gpuclean-report=report.json")
    result.assert_outcomes(passed=2)
    pool = read_pids(pool_pidfile)[0]
    summary = summary_of(result)
    assert summary[-1] == "2 checked test(s), 0 with findings, 0 process(es) reaped"
    assert any(line.startswith(f"gpuclean: pid {pool} is a helper of the pytest process "
                               "(torch._inductor.compile_worker.subproc_pool.SubprocPool, which its library "
                               "shuts down at the pytest process's exit, started during "
                               "test_inner.py::test_first_compile_starts_the_pool)") for line in summary
               ), summary
    # torch's own shutdown at exit ended it, with pytest.
    assert wait_dead([pool], timeout=30) == []


def test_torch_shared_memory_manager_is_the_sessions_helper(example: Callable[..., Path],
                                                           pytester: pytest.Pytester) -> None:
    # Found running torchmetrics' own tests unchanged (docs/compat.md): under the file_system sharing strategy
    # the first shared tensor starts torch_shm_manager from C++; gpuclean reaped it as that test's leak, and
    # every later share failed with "Broken pipe". The evidence: it runs the manager of the torch imported
    # here (the file /proc names as its executable).
    if not _installed("torch"):
        pytest.skip("needs torch")
    example("compat/torch_shm_manager")
    result = compat_run(pytester, "--gpuclean-all")
    result.assert_outcomes(passed=2)
    summary = summary_of(result)
    assert summary[-1] == "2 checked test(s), 0 with findings, 0 process(es) reaped"
    assert any("is a helper of the pytest process (torch's shared-memory manager (libshm)" in line
               for line in summary), summary


def test_open_mpi_singleton_daemon_is_the_sessions_helper(example: Callable[..., Path],
                                                          pytester: pytest.Pytester,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    # Found running Lightning Fabric's tests unchanged on the H200 (docs/compat.md): mpi4py's MPI_Init in the
    # pytest process forked Open MPI's singleton daemon, gpuclean SIGKILLed it as the test's leak, and the
    # next test hung. The evidence it serves the pytest process: the pipe whose closing ends it
    # (``--singleton-died-pipe FD``) is one the pytest process holds. The daemon here follows libmpi's
    # protocol.
    pidfile = example("compat/mpi_singleton")
    result = compat_run(pytester, "--gpuclean-all")
    result.assert_outcomes(passed=2, skipped=1)
    daemon = read_pids(pidfile)[0]
    summary = summary_of(result)
    # (the skipped test is checked too)
    assert summary[-1] == "3 checked test(s), 0 with findings, 0 process(es) reaped"
    notes = [line for line in summary if "Open MPI's daemon" in line]
    assert len(notes) == 1
    assert notes[0].startswith(f"gpuclean: pid {daemon} is a helper of the pytest process")
    # It ends with the pytest process (the pipe closes), as with real Open MPI.
    assert wait_dead([daemon], timeout=10) == []
    # The same command line without the evidence (the pipe's other end in another child) is the test's leak.
    pidfile.unlink()
    monkeypatch.setenv("MPI_NEGATIVE", "1")
    negative = compat_run(pytester, "--gpuclean-all", "-k", "another_child")
    negative.assert_outcomes(passed=1, errors=1)
    assert summary_of(negative)[-1] == "1 checked test(s), 1 with findings, 2 process(es) reaped"
    assert wait_dead(read_pids(pidfile), timeout=10) == []


def test_torch_211_compile_pools_are_found_in_torchs_own_set(monkeypatch: pytest.MonkeyPatch) -> None:
    # torch 2.11 (the H200's) registers no Finalize for its SubprocPool: the pool is found in the set where
    # torch keeps every compile pool it started (and shuts down at exit). Before, it was reaped on the H200.
    class SubprocPool:
        def __init__(self, process: subprocess.Popen[bytes]) -> None:
            self.process = process

    sidecar = subprocess.Popen(["sleep", "60"])
    try:
        module = types.ModuleType("torch._inductor.async_compile")
        module._pool_set = {SubprocPool(sidecar)}  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, "torch._inductor.async_compile", module)
        helpers = Checker(None).census.helper_pids()
        assert "a torch.compile worker pool" in helpers[sidecar.pid]
    finally:
        sidecar.kill()
        sidecar.wait()


def test_helpers_declared_by_their_command_line(example: Callable[..., Path],
                                                pytester: pytest.Pytester) -> None:
    # A helper that no library registry vouches for: named by its command line, it is no leak of the test
    # that started it, said once, and ended at the session's end. Without the option, it is that test's leak.
    pidfile = example("compat/declared_helpers")
    result = compat_run(pytester, "--gpuclean-helpers=*compile-server*")
    result.assert_outcomes(passed=2)
    server = read_pids(pidfile)[0]
    out = result.stdout.str()
    assert f"gpuclean: pid {server} is a helper of the pytest process (its command line matches " \
           "--gpuclean-helpers, started during test_inner.py::test_first_use_starts_it)" in out
    assert "2 checked test(s), 0 with findings, 0 process(es) reaped" in out
    assert f"gpuclean: ended 1 helper process(es) of the pytest process at the session's end " \
           f"(--gpuclean-helpers; not leaks): pid {server} SIGTERM" in out
    assert wait_dead([server], timeout=5) == []
    pidfile.unlink()
    # Undeclared: reaped as the first test's leak, and the next test has lost it.
    undeclared = compat_run(pytester)
    undeclared.assert_outcomes(passed=1, failed=1, errors=1)
    undeclared.stdout.fnmatch_lines(["*ERROR at teardown of test_first_use_starts_it*"])


def test_a_declared_helper_that_holds_gpu_memory_is_judged(inner: Callable[[str], Path],
                                                            pytester: pytest.Pytester) -> None:
    # A helper holds no GPU memory; an excuse that covered held memory would be a clean verdict beside it.
    pidfile = inner("""
@pytest.mark.needs_clean_gpus
def test_starts_a_holding_helper():
    hold()
    wait_holders(1)
""")
    result = compat_run(pytester, "--gpuclean-helpers=*simulate hold*")
    result.assert_outcomes(passed=1, errors=1)
    holder = read_pids(pidfile)[0]
    assert wait_dead([holder], timeout=5) == []
    assert "is a helper of the pytest process" not in result.stdout.str()


# ---- processes meant to outlive the session (issue 37 item 6) -------------------------------------------

def test_a_persistent_server_outlives_each_session_and_is_reused(
        example: Callable[..., Path], pytester: pytest.Pytester, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, dead_sessions_on: None) -> None:
    # A warm model server kept across runs (512 MiB on GPU 0): named by --gpuclean-persistent, it is no leak
    # of the session fixture that started it, no dead session's debris in the next run, and its memory is
    # excused in every check, said once per session. Before: reaped at the end of every run.
    server_pidfile, seen = tmp_path / "server.pid", tmp_path / "seen.pids"
    monkeypatch.setenv("SERVER_PIDFILE", str(server_pidfile))
    monkeypatch.setenv("SEEN_PIDS", str(seen))
    example("compat/persistent_server")
    try:
        for _ in range(3):
            result = compat_run(pytester, "--gpuclean-persistent=*model_server.py*")
            result.assert_outcomes(passed=1)
            assert summary_of(result)[-1] == "1 checked test(s), 0 with findings, 0 process(es) reaped"
            server = int(server_pidfile.read_text())
            result.stdout.fnmatch_lines([f"gpuclean: pid {server} is persistent (its command line matches "
                                         "--gpuclean-persistent*): left running past the session, never "
                                         "signalled, its GPU memory excused in every check: *"])
        pids = read_pids(seen, expected=3)
        assert pids == [pids[0]] * 3 and alive(pids[0])
        # Undeclared, it is the debris of the session that started it (reaped by the first check), and the
        # server the fixture starts again is the fixture's leak.
        report = tmp_path / "report.json"
        result = compat_run(pytester, f"--gpuclean-report={report}")
        result.assert_outcomes(passed=1, errors=1)
        assert wait_dead([pids[0]], timeout=5) == []
        out = result.stdout.str()
        assert f"gpuclean: pid {pids[0]}: left by dead session" in out
        assert "spawned by fixture model_server (session-scoped): reaped (SIGTERM) before " \
               "test_inner.py::test_asks_the_server" in out
        assert "gpuclean: fixture model_server (session-scoped, conftest.py:20) leaked 1 process(es)" in out
        # The dead session's fixture is no test of this session: not counted as an unchecked test that
        # leaked, nor a test in the report (it was, before: the name it left was taken for a test's).
        assert summary_of(result)[-1] == \
            "1 checked test(s), 0 with findings, 1 fixture(s) that leaked processes, 2 process(es) reaped"
        document = json.loads(report.read_text())
        assert [t["nodeid"] for t in document["tests"]] == ["test_inner.py::test_asks_the_server"]
    finally:
        if server_pidfile.exists():
            kill_all([int(server_pidfile.read_text())])


def test_pytest_xprocess_servers_are_persistent(example: Callable[..., Path], pytester: pytest.Pytester,
                                                 tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 dead_sessions_on: None) -> None:
    # Issue 37 item 6 as reported: a session fixture using pytest-xprocess (whose point is a server kept
    # across runs) got "fixture model_server (session-scoped, conftest.py:6) leaked 1 process(es) (reaped)"
    # at the end of every run, and the next run started the server again. xprocess's own records are the
    # evidence: no option needed.
    if not _installed("xprocess"):
        pytest.skip("needs pytest-xprocess (CI: the compat venvs)")
    seen = tmp_path / "seen.pids"
    monkeypatch.setenv("SEEN_PIDS", str(seen))
    example("compat/xprocess_server")
    try:
        for _ in range(3):
            # (xprocess keeps its records in pytest's cache directory: the cache provider stays on)
            result = pytester.runpytest_subprocess("-p", "gpuclean", "-p", "no:randomly", "-rA",
                                                   timeout=INNER_TIMEOUT)
            result.assert_outcomes(passed=1)
            assert summary_of(result)[-1] == "1 checked test(s), 0 with findings, 0 process(es) reaped"
            server = read_pids(seen)[-1]
            result.stdout.fnmatch_lines([f"gpuclean: pid {server} is persistent (pytest-xprocess keeps "
                                         "'model_server'*): left running past the session, never signalled, "
                                         "its GPU memory excused in every check: *"])
        pids = read_pids(seen, expected=3)
        assert pids == [pids[0]] * 3 and alive(pids[0])
    finally:
        # What xprocess's users do to stop it: pytest --xkill.
        pytester.runpytest_subprocess("--xkill", "-p", "no:gpuclean", timeout=INNER_TIMEOUT)
        if seen.exists():
            assert wait_dead(read_pids(seen), timeout=10) == []


def test_an_xprocess_record_of_another_user_vouches_for_nothing(example: Callable[..., Path],
                                                                 pytester: pytest.Pytester) -> None:
    # A cache directory others can write to (a shared checkout): a pid file another user planted there must
    # not make our leak persistent (its memory excused, never reaped). One of ours, beside it, does.
    if not _installed("xprocess"):
        pytest.skip("needs pytest-xprocess (CI: the compat venvs)")
    if os.getuid() != 0:
        pytest.skip("needs root, to give a file to another user")
    pidfile = example("compat/xprocess_planted")
    result = pytester.runpytest_subprocess("-p", "gpuclean", "-p", "no:randomly", "-rA",
                                           timeout=INNER_TIMEOUT)
    planted_for, ours = read_pids(pidfile, expected=2)
    try:
        result.assert_outcomes(passed=2, errors=1)
        result.stdout.fnmatch_lines(["*ERROR at teardown of test_record_planted_by_another_user*"])
        assert wait_dead([planted_for], timeout=10) == []
        assert alive(ours)
    finally:
        kill_all([ours])


def test_persistence_needs_the_very_process_a_record_names() -> None:
    # pytest-xprocess's pid file names a pid: a process that has it now but started after the record was
    # written reuses the pid, and is not what the record vouches for (never excused, never spared for it).
    proc = subprocess.Popen(["sleep", "60"])
    try:
        now = time.time()
        census = Census.of_its_own(kept=KeptAlive(registry=lambda: {proc.pid: ("xprocess 'old'", now - 600)}))
        assert census.persistent_of([proc.pid]) == {}
        census = Census.of_its_own(kept=KeptAlive(registry=lambda: {proc.pid: ("xprocess 'new'", now + 1)}))
        assert census.persistent_of([proc.pid]) == {proc.pid: "xprocess 'new'"}
    finally:
        proc.kill()
        proc.wait()


# ---- vLLM's process helpers (the shape of vLLM's tests/utils.py, in tests/examples/compat/vllm_like) ------

def test_vllm_like_helpers(example: Callable[..., Path], pytester: pytest.Pytester) -> None:
    # tests/examples/compat/vllm_like: vllm_like.py (the helpers), fake_server.py, and the tests using them.
    pidfile = example("compat/vllm_like")
    result = compat_run(pytester, "--gpuclean-all", "--gpuclean-report=report.json")
    result.assert_outcomes(passed=6, errors=1)
    grouped, escapee = read_pids(pidfile, expected=2)
    assert wait_dead([grouped, escapee], timeout=5) == []
    records = records_by_nodeid(report_of(pytester))
    leak = records.pop("test_inner.py::test_forked_escapee")[0]
    assert escapee in [p["pid"] for p in leak["leaked"]]
    assert {p["owner"]["name"] for p in leak["leaked"]} == {"test_inner.py::test_forked_escapee"}
    # The server and its engine were the module fixture's while it lived, and its teardown ended them.
    assert [r["outcome"] for rs in records.values() for r in rs] == ["clean"] * 5
    # Processes that ended by themselves (the helper's killpg, the server's teardown) are listed in the
    # summary as collected, noticed: no leak, and no finding of the test whose check collected them.
    assert summary_of(result)[-1] == "6 checked test(s), 1 with findings, 1 process(es) reaped"
    assert result.stdout.str().count("ERROR at teardown of") == 1
