"""A stray is what nothing manages (issue 44, items 1 and 2), and parentage and timing are not ownership
(issue 47, items 4 and 6).

Inner sessions over simulated devices, with real processes. A library's reusable pool or service, which a
module global keeps, is the pytest process's helper, whichever test's call started it; a server whose handle a
live fixture's value holds is that fixture's. What a test creates and drops is still its leak, and so is a
library's pool that holds GPU memory. A cookie-less orphan born during a test while a protected process whose
children carry no cookie was alive is left alone: either may have started it.
"""

from __future__ import annotations

import subprocess
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import ClassVar

import pytest
from helpers import alive, pytest_behind_older_processes, read_pids, summary_of, wait_dead
from test_compat import compat_run, needs

from pytest_gpuclean._ownership.handles import holders


def _lines(path: Path) -> list[list[int]]:
    return [[int(x) for x in line.split()] for line in path.read_text().splitlines()]


# ---- a library's pool or service: kept in a module global (44.1) ----------------------------------------

@needs("joblib", "joblib")
def test_joblibs_reusable_pool_is_a_helper_of_the_pytest_process(
        example: Callable[..., Path], pytester: pytest.Pytester, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: under --gpuclean-all loky's workers and resource tracker were SIGTERMed after the first test
    # that used joblib.Parallel (its error: "leaked 3 process(es)"), 5 s of grace for the tracker, which
    # ignores SIGTERM; the later tests started a new pool each. The evidence: the reusable executor, a
    # module global of loky, holds the workers' handles.
    seen = tmp_path / "workers"
    monkeypatch.setenv("WORKER_PIDS", str(seen))
    example("managed/joblib_pool")
    result = compat_run(pytester, "--gpuclean-all")
    result.assert_outcomes(passed=3)
    summary = summary_of(result)
    assert summary[-1] == "3 checked test(s), 0 with findings, 0 process(es) reaped"
    first, again, _last = _lines(seen)
    assert first == again and len(first) == 2  # the very same workers, never signalled
    loky_worker = ("is a helper of the pytest process (its handle, a joblib.externals.loky.backend."
                   "popen_loky_posix.Popen, is kept in joblib.externals.loky.reusable_executor._executor, "
                   "started during test_inner.py::test_parallel_starts_the_pool)")
    assert sum(loky_worker in line for line in summary) == 2, summary
    assert any("kept in joblib.externals.loky.backend.resource_tracker._resource_tracker" in line
               for line in summary), summary
    assert "SIG" not in result.stdout.str()


def test_a_librarys_cached_executor_and_service_are_helpers(
        example: Callable[..., Path], pytester: pytest.Pytester, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    # A concurrent.futures executor that a library caches in a module global, and a service process that a
    # library keeps in a class attribute of a module singleton (named nowhere in the plugin): started by the
    # first test, used by the next ones. Before: both reaped as the first test's leak.
    seen = tmp_path / "seen"
    monkeypatch.setenv("SEEN_PIDS", str(seen))
    example("managed/library_pools")
    result = compat_run(pytester, "--gpuclean-all")
    result.assert_outcomes(passed=3)
    summary = summary_of(result)
    assert summary[-1] == "3 checked test(s), 0 with findings, 0 process(es) reaped"
    first, last = _lines(seen)
    assert first == last
    assert sum("is kept in pool_lib._EXECUTOR, started during test_inner.py::test_first_use_starts_them)"
               in line for line in summary) == 2, summary
    assert sum("its handle, a subprocess.Popen, is kept in service_lib.Service, started during "
               "test_inner.py::test_first_use_starts_them)" in line for line in summary) == 1, summary
    assert wait_dead(first, timeout=10) == []  # their libraries ended them at exit


def test_what_a_test_drops_is_its_own(example: Callable[..., Path], pytester: pytest.Pytester,
                                      tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The twins of the pools above: nothing but the standard library's bookkeeping (subprocess._active,
    # multiprocessing.process._children) holds these, so they are the test's. An executor dropped unshut is
    # stopped by CPython itself once it is freed (its manager thread sends the workers home): they exit by
    # themselves, no finding.
    dropped = tmp_path / "dropped"
    monkeypatch.setenv("DROPPED_PIDS", str(dropped))
    pidfile = example("managed/unmanaged")
    result = compat_run(pytester)
    result.assert_outcomes(passed=5, errors=2)
    result.stdout.fnmatch_lines(["*ERROR at teardown of test_drops_a_running_popen*",
                                 "*ERROR at teardown of test_drops_a_started_process*"])
    assert "ERROR at teardown of test_drops_an_executor " not in result.stdout.str()
    assert wait_dead(read_pids(pidfile, 5), timeout=10) == []
    out = result.stdout.str()
    assert not any(f"pid {pid} ended by" in out for pid in [int(x) for x in dropped.read_text().split()])


def test_a_librarys_pool_that_holds_gpu_memory_is_judged(example: Callable[..., Path],
                                                         pytester: pytest.Pytester) -> None:
    pidfile = example("managed/gpu_pool")
    result = compat_run(pytester)
    result.assert_outcomes(passed=2, errors=1)
    worker = read_pids(pidfile)[0]
    assert wait_dead([worker], timeout=10) == []
    assert "is a helper of the pytest process" not in result.stdout.str()
    result.stdout.fnmatch_lines(["*ERROR at teardown of test_leaves_gpu_memory_in_the_pool*"])


# ---- a live fixture's server, started lazily in a test (44.2) ---------------------------------------------

@pytest.mark.parametrize("env", ["inherited", "scrubbed"])
def test_a_server_a_live_fixture_holds_is_the_fixtures(
        example: Callable[..., Path], pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch,
        env: str) -> None:
    # A module-scoped fixture's factory starts the server in the first test that calls it. Before: reaped as
    # that test's leak ("teardown: reaped 1 (pid ... SIGTERM)"), and the next two tests failed. The evidence:
    # the fixture's value (the factory's closure) holds the server's handle.
    monkeypatch.setenv("SERVER_ENV", env)
    pidfile = example("managed/lazy_server")
    result = compat_run(pytester)
    result.assert_outcomes(passed=3)
    server = read_pids(pidfile)[0]
    summary = summary_of(result)
    assert summary[-1] == "3 checked test(s), 0 with findings, 0 process(es) reaped"
    assert any(line.startswith(f"gpuclean: pid {server} is fixture server (module-scoped)'s, not "
                               "test_inner.py::test_first_use_starts_it's: the fixture's value holds its "
                               "handle (subprocess.Popen); protected while the fixture is set up")
               for line in summary), summary
    assert wait_dead([server]) == []  # its fixture stopped it
    # A fixture that forgets to stop it: the fixture's leak, when it ends.
    pidfile.unlink()
    monkeypatch.setenv("SERVER_LEFT", "1")
    left = compat_run(pytester)
    left.assert_outcomes(passed=3, errors=1)
    left.stdout.fnmatch_lines(["*gpuclean: fixture server (module-scoped, test_inner.py:12) leaked 1 "
                               "process(es) (reaped), found at the teardown of *::test_third_use*"])
    assert wait_dead(read_pids(pidfile)) == []


# ---- cookie-less orphans: parentage and timing are not ownership (47.4, 47.6) ------------------------------

def test_a_session_fixtures_scrubbed_server_keeps_its_orphaned_worker(
        example: Callable[..., Path], pytester: pytest.Pytester, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The server (scrubbed environment) runs `sh -c 'WORKER & ...'` on a request; the shell exits at once and
    # the worker, adopted by pytest, carries no cookie and was born in the test's window. Before: the test
    # errored ("leaked 1 process(es) (reaped)", SIGTERM to the worker) and the next found its worker gone. The
    # worker holds GPU memory: the next test's setup check excuses it (no wait for "foreign" memory).
    folder = tmp_path / "server"
    folder.mkdir()
    monkeypatch.setenv("SERVER_DIR", str(folder))
    pidfile = example("managed/scrubbed_worker")
    result = compat_run(pytester)
    result.assert_outcomes(passed=2)
    server, worker = read_pids(pidfile, 2)[:2]
    summary = summary_of(result)
    assert summary[-1] == "2 checked test(s), 0 with findings, 0 process(es) reaped"
    assert any(line.startswith(
        f"gpuclean: pid {worker} left alone (no cookie of the session, born during "
        f"test_inner.py::test_makes_a_request while pid {server} (fixture server (session-scoped)), whose "
        "children carry no cookie of the session, was alive: either may have started it); judged again when "
        "fixture server (session-scoped) ends") for line in summary), summary
    # A server that leaves its workers when it stops: they are judged when its fixture ends, as its leak.
    for name in ("request-0", "request-1", "worker-0.pid", "worker-1.pid"):
        (folder / name).unlink()
    monkeypatch.setenv("WORKERS_LEFT", "1")
    left = compat_run(pytester)
    left.assert_outcomes(passed=2, errors=1)
    left.stdout.fnmatch_lines(["*gpuclean: fixture server (session-scoped, conftest.py:*) leaked 2 "
                               "process(es) (reaped), found at the teardown of *::test_finds_its_worker*"])
    workers = [int((folder / f"worker-{n}.pid").read_text()) for n in (0, 1)]
    assert wait_dead(workers) == []


def test_an_older_processs_daemon_born_during_a_test_is_left_alone(
        example: Callable[..., Path], pytester: pytest.Pytester, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    # `<older process> & exec pytest`: the older process double-forks during a test, its middle process exits
    # before any walk, and pytest (the subreaper) adopts a daemon with no cookie, born in the test's window.
    # Before: reaped as that test's leak. It may descend from a process older than the session: never ours.
    example("managed/older_double_fork")
    with pytest_behind_older_processes(pytester, monkeypatch, tmp_path,
                                       "scripts/older_double_fork.py") as (result, older_pids):
        older, daemon = read_pids(older_pids, 2)
        out = result.stdout.str() + result.stderr.str()
        result.assert_outcomes(passed=2)
        assert alive(older) and alive(daemon)
        assert (f"gpuclean: pid {daemon} left alone (no cookie of the session, born during "
                f"test_inner.py::test_asks_the_older_process_to_double_fork while pid {older} (older than "
                "the session), whose children carry no cookie of the session, was alive: either may have "
                "started it); never signalled: it may descend from a process older than the session") in out
        assert "SIGTERM" not in out and "reaped 1" not in out


# ---- the walk itself (_ownership/handles.py) --------------------------------------------------------------

class _Trap:
    """An object whose every hook that the walk could run records the call."""

    calls: ClassVar[list[str]] = []

    def __getattribute__(self, name: str) -> object:
        if name not in ("__dict__",):
            _Trap.calls.append(f"getattribute {name}")
        return object.__getattribute__(self, name)

    def __getattr__(self, name: str) -> object:
        _Trap.calls.append(f"getattr {name}")
        raise AttributeError(name)

    @property
    def __class__(self) -> type:  # type: ignore[override]
        _Trap.calls.append("__class__")
        return _Trap

    def __eq__(self, other: object) -> bool:
        _Trap.calls.append("__eq__")
        return False

    __hash__ = object.__hash__


def test_the_walk_runs_no_user_code(monkeypatch: pytest.MonkeyPatch) -> None:
    # A guest runs no user code: a handle that a booby-trapped object holds is found without one call.
    proc = subprocess.Popen(["sleep", "30"])
    try:
        trap = _Trap()
        object.__setattr__(trap, "pid", proc.pid)
        object.__setattr__(trap, "other", _Trap())
        module = types.ModuleType("trapped_library")
        module.keeper = [trap]  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, "trapped_library", module)
        _Trap.calls.clear()
        assert holders([proc.pid]) == {proc.pid: ("module", "trapped_library.keeper", f"{__name__}._Trap")}
        assert _Trap.calls == []
    finally:
        proc.kill()
        proc.wait()


def test_the_walk_tells_keepers_from_bookkeeping(monkeypatch: pytest.MonkeyPatch) -> None:
    # Module global, class attribute, a fixture value's closure, a waited-for handle (its pid may be another
    # process's now), and a Popen dropped while it runs (held by subprocess._active alone).
    procs = [subprocess.Popen(["sleep", "30"]) for _ in range(4)]
    waited = subprocess.Popen(["true"])
    waited.wait()
    try:
        class Service:
            instance = procs[1]

        Service.__module__ = "keeping_library"
        module = types.ModuleType("keeping_library")
        module.pools = {"default": [procs[0]]}  # type: ignore[attr-defined]
        module.Service = Service  # type: ignore[attr-defined]
        module.done = waited  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, "keeping_library", module)
        started = [procs[2]]

        def factory() -> subprocess.Popen[bytes]:
            return started[0]

        dropped = procs[3].pid
        monkeypatch.setattr(subprocess, "_active", [procs[3]])
        found = holders([p.pid for p in procs] + [waited.pid], [("f7", factory)])
        assert found == {procs[0].pid: ("module", "keeping_library.pools", "subprocess.Popen"),
                         procs[1].pid: ("module", "keeping_library.Service", "subprocess.Popen"),
                         procs[2].pid: ("fixture", "f7", "subprocess.Popen"),
                         dropped: ("bookkeeping", "subprocess._active", "subprocess.Popen")}
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def test_a_thread_that_waits_for_a_process_is_no_keeper(monkeypatch: pytest.MonkeyPatch) -> None:
    # asyncio's child watcher (in the event loop policy, a session fixture's value under pytest-asyncio)
    # keeps one thread per child, whose target holds the child: found through the fixture, a child the test
    # forgot was excused as the fixture's. A running thread of the standard library's is bookkeeping wherever
    # found; one that runs the suite's own code (a fixture's server thread) is walked like any object.
    import threading

    proc = subprocess.Popen(["sleep", "30"])
    served = subprocess.Popen(["sleep", "30"])
    release = threading.Event()
    waiter = threading.Thread(target=proc.wait, daemon=True)  # the standard library's code
    server = threading.Thread(target=lambda handle: release.wait(), args=(served,), daemon=True)
    waiter.start()
    server.start()
    try:
        watcher = types.SimpleNamespace(threads={proc.pid: waiter}, server=server)
        module = types.ModuleType("watching_library")
        module.watcher = watcher  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, "watching_library", module)
        assert holders([proc.pid, served.pid], [("event_loop_policy", watcher)], modules=False) == {
            served.pid: ("fixture", "event_loop_policy", "subprocess.Popen")}
        assert holders([proc.pid], [("event_loop_policy", watcher)]) == {
            proc.pid: ("bookkeeping", "threading._active", "subprocess.Popen")}
        watcher.kept = proc  # what the watcher keeps itself is the fixture's
        assert holders([proc.pid], [("event_loop_policy", watcher)], modules=False) == {
            proc.pid: ("fixture", "event_loop_policy", "subprocess.Popen")}
    finally:
        release.set()
        for p in (proc, served):
            p.kill()
            p.wait()
