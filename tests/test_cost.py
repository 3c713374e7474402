"""What gpuclean costs, as facts a session can observe; the timings are in benchmarks/.

A session that checks no test must get nothing from gpuclean but its options' validation and the cookie:
no subreaper, no lock directory, no psutil, no NVML. The cheaper descendant walk must still find a child
started from any thread, and starting lazily must not turn what the session set-up started into leaks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import read_pids, run_inner, wait_dead


@pytest.mark.parametrize("args", [(), ("--co",)], ids=["run", "collect-only"])
def test_a_session_that_checks_nothing_does_nothing(sim: Path, pytester: pytest.Pytester,
                                                    monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                    args: tuple[str, ...]) -> None:
    pytester.copy_example("cost/unchecked_cookie")  # two unchecked tests, and one of the cookie
    pytester.copy_example("cost/record_state")  # a conftest that writes the session's state to $STATE_FILE
    state_file = tmp_path / "state.json"
    monkeypatch.setenv("STATE_FILE", str(state_file))
    monkeypatch.delenv("GPUCLEAN_SIMULATE")  # were it to start, it would try NVML
    lock_dir = tmp_path / "locks"
    result = run_inner(pytester, *args)
    assert result.ret == pytest.ExitCode.OK
    if not args:
        result.assert_outcomes(passed=3)
    state = json.loads(state_file.read_text())
    assert state["subreaper"] == 0
    # No psutil, no NVML bindings, none of the checking code: only what validates the options and
    # exports the cookie, and gpuclean's own hook specs (pytest_addhooks adds them in every run).
    assert state["modules"] == ["pytest_gpuclean._imports", "pytest_gpuclean._ownership",
                                "pytest_gpuclean._ownership.cookie", "pytest_gpuclean._reading",
                                "pytest_gpuclean._reading.procfs", "pytest_gpuclean._session",
                                "pytest_gpuclean._session.names", "pytest_gpuclean._settings",
                                "pytest_gpuclean._version", "pytest_gpuclean.hookspecs",
                                "pytest_gpuclean.plugin"]
    assert state["cookie"].endswith(":session")
    if not args:
        # Of the plugin's hooks, only one per test is left: the one that notices a test checked after all.
        assert "gpuclean-checker" not in state["plugins"]
        assert "gpuclean-checker-idle" in state["plugins"]
    assert not lock_dir.exists()
    assert "gpuclean" not in result.stdout.str().replace("plugins: gpuclean", "")


def test_a_session_that_checks_nothing_but_names_its_devices_only_reads_them(
        sim: Path, pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # The explicit list is held against the devices (README): the backend is opened for that and closed;
    # nothing else of a started session comes with it. (The list's syntax, ``device_list``, is checked
    # with the option, before any device is read.)
    pytester.copy_example("cost/unchecked")
    pytester.copy_example("cost/record_state")
    state_file = tmp_path / "state.json"
    monkeypatch.setenv("STATE_FILE", str(state_file))
    result = run_inner(pytester, "--gpuclean-devices=1,0")
    result.assert_outcomes(passed=2)
    state = json.loads(state_file.read_text())
    assert state["subreaper"] == 0
    # The device modules are those of the one backend opened (here the simulated devices: their reader and
    # its layout; no NVML module), what it shares with NVML's (``devices``), and the protocols, the device
    # choice and the opener (``backends``).
    assert state["modules"] == ["pytest_gpuclean._imports", "pytest_gpuclean._model",
                                "pytest_gpuclean._model.records", "pytest_gpuclean._ownership",
                                "pytest_gpuclean._ownership.cookie", "pytest_gpuclean._reading",
                                "pytest_gpuclean._reading.backends", "pytest_gpuclean._reading.devices",
                                "pytest_gpuclean._reading.procfs", "pytest_gpuclean._reading.simulated",
                                "pytest_gpuclean._reading.simulated_layout", "pytest_gpuclean._session",
                                "pytest_gpuclean._session.names", "pytest_gpuclean._session.opening",
                                "pytest_gpuclean._settings", "pytest_gpuclean._version",
                                "pytest_gpuclean.hookspecs", "pytest_gpuclean.plugin"]
    assert "gpuclean-checker-idle" in state["plugins"]
    assert not (tmp_path / "locks").exists()


def test_a_session_that_checks_nothing_needs_no_temporary_directory(pytester: pytest.Pytester) -> None:
    # Finding the temporary directory writes a probe file there; only the default lock directory needs it.
    pytester.copy_example("cost/unchecked")
    # pytest with every candidate of the temporary directory unusable (a full or read-only /tmp)
    script = pytester.copy_example("scripts/run_without_tmp.py")
    result = pytester.run(sys.executable, str(script), "-p", "gpuclean", "-p", "no:cacheprovider",
                          "--capture=sys", "-q", "test_inner.py", timeout=120)
    assert result.ret == pytest.ExitCode.OK, result.stdout.str() + result.stderr.str()
    result.stdout.fnmatch_lines(["2 passed*"])


def test_the_default_lock_directory_is_found_when_first_read() -> None:
    script = """
import os, tempfile
import pytest_gpuclean.plugin
from pytest_gpuclean import _settings as settings
resolved = settings.Settings()
assert tempfile.tempdir is None, "the temporary directory was looked up on import"
assert resolved.lock_dir == os.path.join(tempfile.gettempdir(), "gpuclean-locks")
assert settings.Settings(lock_dir="/x").lock_dir == "/x"
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={k: v for k, v in os.environ.items() if k not in ("TMPDIR", "TEMP", "TMP")})
    assert done.returncode == 0, done.stderr


def test_a_collected_checked_test_starts_the_session(example: Callable[..., Path], pytester: pytest.Pytester,
                                                     monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # The counterpart: one marked test among unmarked ones starts everything, before the first test.
    example("cost/unchecked_and_checked", "cost/record_state")
    state_file = tmp_path / "state.json"
    monkeypatch.setenv("STATE_FILE", str(state_file))
    result = run_inner(pytester)
    result.assert_outcomes(passed=3)
    state = json.loads(state_file.read_text())
    assert state["subreaper"] == 1
    assert "pytest_gpuclean._check.checker" in state["modules"]
    # The subreaper is set through _ctypes (processes._prctl says why): ctypes itself stays unloaded.
    assert not state["ctypes_loaded"]
    # pytest rewrote this conftest's asserts, but none of the package's modules (at most its __init__,
    # which is imported before it can say so; not even that where an editable install's finder, not a
    # path entry, finds the package): under PYTHONDONTWRITEBYTECODE a rewritten module is parsed and
    # compiled anew in every run (pytest_gpuclean/__init__.py, _PlainImports).
    assert state["conftest_rewritten"] == "AssertionRewritingHook"
    assert set(state["rewritten"]) <= {"pytest_gpuclean"}, state["rewritten"]
    # The model is its records and the decisions over them, loaded whole; nothing of Ray loads without
    # --gpuclean-ray, and no plugin of its hooks.
    assert {m for m in state["modules"] if m.startswith("pytest_gpuclean._model")} == {
        "pytest_gpuclean._model", "pytest_gpuclean._model.outcomes", "pytest_gpuclean._model.records"}
    assert not [m for m in state["modules"] if m.startswith("pytest_gpuclean.ray")]
    assert "gpuclean-ray" not in state["plugins"]
    # A session on simulated devices loads their reader only: neither NVML's module nor pynvml.
    assert "pytest_gpuclean._reading.simulated" in state["modules"]
    assert not {"pytest_gpuclean._reading.nvml", "pynvml"} & set(state["modules"])
    # Nor the report's and shipping code, without a report, JUnit XML or xdist; and the hooks that run
    # for every test report are those of the outputs asked for (none here) and of pytest-forked (absent).
    assert not ({"pytest_gpuclean.report.jsonreport", "pytest_gpuclean.report.serialize"}
                & set(state["modules"]))
    assert "gpuclean-checker-outputs" in state["plugins"]
    assert "gpuclean-checker-outputs-tests" not in state["plugins"]
    assert ("gpuclean-checker-forked" in state["plugins"]) == state["forked"]
    assert (tmp_path / "locks").is_dir()
    # The device lines come right after the collection, before any test.
    result.stdout.fnmatch_lines(["collected 3 items", "gpuclean: simulated devices*checking 2*",
                                 "gpuclean: GPU 0 *", "gpuclean: GPU 1 *", "test_inner.py ...*"])


def test_a_report_asked_for_starts_the_session(example: Callable[..., Path], pytester: pytest.Pytester,
                                              tmp_path: Path) -> None:
    # No checked test, but a report: the session is watched, and the report names what was left behind
    # (how the project's own CI checks that its tests leave nothing: .ci/test).
    pidfile = example("cost/a_report_asked_for_starts_the_session")
    report = tmp_path / "report.json"
    result = run_inner(pytester, f"--gpuclean-report={report}")
    result.assert_outcomes(passed=1)
    leaked = read_pids(pidfile)[0]
    document = json.loads(report.read_text())
    assert document["session"]["backend"] == "simulated"
    assert [r["process"]["pid"] for r in document["session_reaped"]] == [leaked]
    assert wait_dead([leaked], timeout=2) == []


def test_a_test_checked_after_the_collection_starts_the_session(example: Callable[..., Path],
                                                                pytester: pytest.Pytester) -> None:
    # The collection found nothing to check; a conftest marks one test while it is set up.
    pidfile = example("cost/a_test_checked_after_the")  # test_inner.py, conftest.py
    result = run_inner(pytester, "--gpuclean-grace=2", "--gpuclean-settle=0")
    leaked = read_pids(pidfile)[0]
    result.assert_outcomes(passed=3, errors=1)
    result.stdout.fnmatch_lines(["*_ ERROR at teardown of test_late _*",
                                 "gpuclean: test leaked 1 process(es) (reaped)"])
    assert f"pid {leaked} " in result.stdout.str()
    assert wait_dead([leaked], timeout=2) == []


def test_bad_lock_directory_fails_before_the_first_checked_test(
        example: Callable[..., Path], pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch,
        tmp_path: Path) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    monkeypatch.setenv("GPUCLEAN_LOCK_DIR", str(not_a_dir / "locks"))
    pidfile = example("cost/bad_lock_directory_fails_before")
    result = run_inner(pytester)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        ["ERROR: --gpuclean-lock-dir: * (from environment variable GPUCLEAN_LOCK_DIR)"])
    assert not pidfile.exists()  # no test ran


def test_a_child_started_from_another_thread_is_found_and_reaped(example: Callable[..., Path],
                                                                pytester: pytest.Pytester) -> None:
    pidfile = example("cost/thread_leak")
    result = run_inner(pytester, "--gpuclean-grace=2", "--gpuclean-settle=0")
    leaked = read_pids(pidfile, 2)
    result.assert_outcomes(passed=3, errors=1)
    result.stdout.fnmatch_lines(["*_ ERROR at teardown of test_thread_leaks _*",
                                 "gpuclean: test leaked 2 process(es) (reaped)"])
    out = result.stdout.str()
    for pid in leaked:
        assert f"pid {pid} " in out
    assert wait_dead(leaked, timeout=2) == []


def test_what_the_session_set_up_started_before_the_start_is_the_sessions(
        example: Callable[..., Path], pytester: pytest.Pytester) -> None:
    pidfile = example("cost/set_up")  # test_inner.py, conftest.py
    result = run_inner(pytester)
    daemon, server, service = read_pids(pidfile, 3)
    out = result.stdout.str() + result.stderr.str()
    result.assert_outcomes(passed=3)
    assert "leaked" not in out.replace("0 with findings", "")
    # Nobody stopped the daemon or the collection's server: reaped at the very end, as the session's.
    assert "gpuclean: reaped 2 process(es) of the session set-up (conftest, plugins) still alive after " \
           "pytest_unconfigure" in out
    assert f"pid {daemon} SIGTERM" in out and f"pid {server} SIGTERM" in out
    assert wait_dead([daemon, server, service]) == []


def test_clean_tests_share_their_device_readings(example: Callable[..., Path], pytester: pytest.Pytester,
                                                 monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # The session keeps every test's record to the end (for its report), and every full garbage collection
    # walks what it keeps, pytest's last ones included: readings equal to the device's previous one are
    # shared, and the clean_gpus fixture's value is built only for a test that asks for it.
    example("cost/count_readings")  # 40 clean tests, one that asks for clean_gpus, a conftest that counts
    state_file = tmp_path / "state.json"
    monkeypatch.setenv("STATE_FILE", str(state_file))
    run_inner(pytester).assert_outcomes(passed=41)
    alive = json.loads(state_file.read_text())
    # Two simulated devices: their readings (two before they were first shared, at most), not 41 x 2 x 2.
    assert alive["DeviceSnapshot"] <= 4, alive
    assert alive["DeviceState"] == 0, alive


# A process that forks children on command: "main" from its main thread; "thread" from a second thread that
# lives on until "end" (the kernel lists a child under the thread that forked it; once that thread ends, the
# child is re-parented to a live thread of the same process). It answers each command with the child's pid.
_FORKER = """
import subprocess, sys, threading
SLEEP = [sys.executable, "-c", "import time; time.sleep(60)"]
done = threading.Event()
children = []
def from_thread():
    children.append(subprocess.Popen(SLEEP))
    print(children[-1].pid, flush=True)
    done.wait()
for line in sys.stdin:
    if line.strip() == "main":
        children.append(subprocess.Popen(SLEEP))
        print(children[-1].pid, flush=True)
    elif line.strip() == "thread":
        thread = threading.Thread(target=from_thread)
        thread.start()
    elif line.strip() == "end":
        done.set()
        thread.join()
        print(0, flush=True)
for child in children:
    child.kill()
"""


def test_a_walk_of_an_empty_lone_process_reads_only_the_last_pid_until_one_is_allocated(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The clean path's usual walk: one thread, nothing under it. After a full look, the next walk reads
    # ns_last_pid alone while no pid was allocated; the first pid allocated after it (here: the process
    # forks) makes it look again, and the child is found, from whichever thread it was forked.
    from pytest_gpuclean._reading import procfs
    if procfs.last_pid() is None:
        pytest.skip("the kernel does not say the last pid here")
    forker = subprocess.Popen([sys.executable, "-c", _FORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    reads: list[int] = []
    real_children = procfs._children
    monkeypatch.setattr(procfs, "_children", lambda pid: reads.append(pid) or real_children(pid))

    def ask(command: str) -> int:
        assert forker.stdin is not None and forker.stdout is not None
        forker.stdin.write(command + "\n")
        forker.stdin.flush()
        return int(forker.stdout.readline())

    try:
        walk = procfs.DescendantWalk()
        deadline = time.monotonic() + 10
        while len(os.listdir(f"/proc/{forker.pid}/task")) != 1 and time.monotonic() < deadline:
            time.sleep(0.01)  # (the interpreter's start-up may still have a thread)
        assert walk.walk(forker.pid) == [] and reads == [forker.pid]
        unchanged = 0
        for _ in range(20):  # (another process of the host may allocate a pid between two walks)
            before = procfs.last_pid()
            found = walk.walk(forker.pid)
            assert found == []
            unchanged += procfs.last_pid() == before
        assert unchanged and len(reads) <= 1 + 20 - unchanged  # no children file read while nothing changed
        first = ask("main")
        assert [pid for pid, _depth, _parent in walk.walk(forker.pid)] == [first]
        second = ask("thread")  # forked by a second thread: listed under that thread only
        assert sorted(pid for pid, _depth, _parent in walk.walk(forker.pid)) == sorted([first, second])
        ask("end")
    finally:
        if forker.stdin is not None:
            forker.stdin.close()
        forker.wait(timeout=30)


def test_the_walk_finds_children_of_a_lone_thread_and_of_each_thread() -> None:
    # One thread: its children file is read without listing the task folder (its link count says one thread,
    # and that thread is the process's own pid); several: each thread's file.
    from pytest_gpuclean._reading import procfs
    forker = subprocess.Popen([sys.executable, "-c", _FORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)

    def ask(command: str) -> int:
        assert forker.stdin is not None and forker.stdout is not None
        forker.stdin.write(command + "\n")
        forker.stdin.flush()
        return int(forker.stdout.readline())

    def threads() -> int:
        return len(os.listdir(f"/proc/{forker.pid}/task"))

    try:
        first = ask("main")
        assert threads() == 1
        assert procfs.children(forker.pid) == [first]
        second = ask("thread")
        assert threads() == 2
        assert sorted(procfs.children(forker.pid)) == sorted([first, second])
        ask("end")  # the thread that forked the second child has ended: the child is the main thread's now
        deadline = time.monotonic() + 10
        while threads() != 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert threads() == 1
        assert sorted(procfs.children(forker.pid)) == sorted([first, second])
    finally:
        if forker.stdin is not None:
            forker.stdin.close()
        forker.wait(timeout=30)
