"""The promise under faults: never kill what a fixture, a conftest or another session owns; never let a
leak outlive the check when something else breaks (signals, crashes, failing hooks); clean up after
sessions that died."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from helpers import (
    alive,
    children_sigint,
    kill_all,
    pytest_behind_older_processes,
    read_pids,
    run_inner,
    wait_dead,
    wait_for_file,
)

from pytest_gpuclean._reading import processes, procfs
from pytest_gpuclean._reading.simulated import simulated_uuid
from pytest_gpuclean.report.terminal import LEAK_PREFIX

# ---- it must not kill what a fixture, a conftest or the session set-up owns -----------------------

def test_module_fixture_server_with_scrubbed_environment_survives(
        example: Callable[..., Path], pytester: pytest.Pytester) -> None:
    # Before: the server was given to the test window its 10 ms start time fell in, and SIGTERMed at
    # test_2_marked's setup in 19 runs of 20. Five modules make one run as strong as five.
    pidfile = example("faults/scrubbed_server")
    for n in range(1, 5):
        pytester.makepyfile(**{f"test_copy{n}": (pytester.path / "test_inner.py").read_text()})
    result = run_inner(pytester)
    result.assert_outcomes(passed=15)
    out = result.stdout.str()
    assert "reaped" not in out.replace("0 process(es) reaped", "")
    assert len(read_pids(pidfile, 5)) == 5


def test_processes_of_conftest_and_configure_are_the_sessions(
        example: Callable[..., Path], pytester: pytest.Pytester) -> None:
    pidfile = example("faults/conftest_servers")
    result = run_inner(pytester)
    at_import, at_configure = read_pids(pidfile, 2)
    result.assert_outcomes(passed=2)
    out = result.stdout.str() + result.stderr.str()
    assert "leaked by unknown" not in out
    assert "was leaked" not in out
    # The one its conftest did not stop is reaped at the very end, after pytest_unconfigure.
    assert f"gpuclean: reaped 1 process(es) of the session set-up (conftest, plugins) still alive after " \
           f"pytest_unconfigure: pid {at_configure} SIGTERM" in out
    assert wait_dead([at_import, at_configure]) == []


def test_children_of_a_protected_process_are_protected(example: Callable[..., Path],
                                                        pytester: pytest.Pytester) -> None:
    pidfile = example("faults/protected_children", "scripts/forking_server.py")
    result = run_inner(pytester)
    workers = read_pids(pidfile)
    result.assert_outcomes(passed=2)
    assert "reaped" not in result.stdout.str().replace("0 process(es) reaped", "")
    assert wait_dead(workers) == []


def test_processes_that_existed_before_the_session_are_never_signalled(
        example: Callable[..., Path], pytester: pytest.Pytester, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    # `sleep 600 & exec pytest`: the shell becomes pytest, and the background job is pytest's child from
    # before pytest began. Before: SIGTERMed at the very end as "of the session set-up", together with what
    # it started during a test. The conftest's server, started without a cookie, is still the set-up's.
    pidfile = example("faults/older_process")
    with pytest_behind_older_processes(pytester, monkeypatch, tmp_path, "scripts/older.py",
                                       before="sleep 600 & echo $! >> {pids}; ") as (result, older_pids):
        older = read_pids(older_pids, 3)  # sleep, the older process, and the child it started in a test
        server = read_pids(pidfile)[0]
        out = result.stdout.str() + result.stderr.str()
        result.assert_outcomes(passed=2)
        assert "leaked" not in out.replace("0 with findings", "")
        assert [pid for pid in older if not alive(pid)] == []
        # Said once, never signalled.
        assert "gpuclean: left alone 3 process(es) under pytest that are no part of the session" in out
        assert all(f"pid {pid} (" in out for pid in older)
        assert ("gpuclean: reaped 1 process(es) of the session set-up (conftest, plugins) still alive "
                f"after pytest_unconfigure: pid {server} SIGTERM") in out
        assert wait_dead([server]) == []


def _other_user() -> str | None:
    import pwd

    for name in ("nobody", "daemon"):
        with contextlib.suppress(KeyError):
            pwd.getpwnam(name)
            return name
    return None


@pytest.mark.skipif(os.geteuid() != 0, reason="starting a process as another user through su needs root")
def test_process_of_another_user_started_through_su_is_not_killed_through_su(
        example: Callable[..., Path], pytester: pytest.Pytester, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    user = _other_user()
    if user is None or not os.path.exists("/bin/su"):
        pytest.skip("no su or no second user on this machine")
    marker = tmp_path / "other-user-sleep"
    monkeypatch.setenv("OTHER_USER", user)
    monkeypatch.setenv("SU_MARKER", str(marker))
    example("faults/su")
    result = run_inner(pytester, "--gpuclean-grace=1")
    try:
        result.assert_outcomes(passed=1, errors=1)
        # su relays signals to its child: signalling it would kill the other user's process by proxy.
        result.stdout.fnmatch_lines([
            f"{LEAK_PREFIX} * (NOT all reaped)",
            f"*leaked pid * (user {user}, *belongs to another user ({user}): never killed*",
            f"*note: left alone: pid * (user root, su {user} *): a signal to it may be relayed to pid * of "
            f"user {user} (*), its descendant*: su, sudo and runuser pass signals on",
        ])
        others = [int(p) for p in subprocess.run(["pgrep", "-f", str(marker)], capture_output=True,
                                                 text=True).stdout.split()]
        assert others and all(alive(p) for p in others)
    finally:
        subprocess.run(["pkill", "-9", "-f", str(marker)])


def _force_pid(target: int, attempts: int = 200) -> subprocess.Popen[bytes] | None:
    # ns_last_pid (root) says which pid the next fork gets: the way to reuse a pid on purpose.
    for _ in range(attempts):
        try:
            with open("/proc/sys/kernel/ns_last_pid", "w") as f:
                f.write(str(target - 1))
        except OSError:
            return None
        proc = subprocess.Popen(["/bin/sleep", "300"])
        if proc.pid == target:
            return proc
        proc.kill()
        proc.wait()
    return None


@pytest.mark.skipif(os.geteuid() != 0, reason="forcing a pid needs root (ns_last_pid)")
def test_recycled_pid_is_never_signalled_through_a_pinned_process() -> None:
    # The pidfd is taken when the process is first found; a recycled pid, even one that started in the
    # same clock tick, is another process and never receives the signal meant for the first.
    first = subprocess.Popen(["/bin/sleep", "300"])
    pinned = processes.pin(first.pid)
    assert pinned is not None
    handle, stat = pinned
    first.kill()
    first.wait()
    second = _force_pid(first.pid)
    if second is None:
        handle.close()
        pytest.skip("could not recycle the pid on this machine")
    try:
        assert handle.exited()
        assert not handle.signal(signal.SIGTERM)
        outcome = processes.terminate([processes.KillTarget(first.pid, stat.start_ticks, 0, handle)], 0.2)
        assert outcome[0].ended_by == "reaped zombie"  # gone before we came: nothing was signalled
        time.sleep(0.1)
        assert second.poll() is None
    finally:
        handle.close()
        second.kill()
        second.wait()


# ---- it must not miss what it must catch --------------------------------------------------------

def test_process_that_replaces_itself_on_sigterm_is_frozen_and_killed(
        example: Callable[..., Path], pytester: pytest.Pytester) -> None:
    pidfile = example("faults/respawner", "scripts/respawner.py")
    result = run_inner(pytester, "--gpuclean-grace=2")
    pids = read_pids(pidfile)
    try:
        result.assert_outcomes(passed=2, errors=1)
        result.stdout.fnmatch_lines([f"{LEAK_PREFIX} * (reaped)",
                                     "*new processes appeared while reaping (round 2)*stopped and killed "
                                     "with SIGKILL*"])
        assert "gave up" not in result.stdout.str()
        # It did fork a replacement (which may be stopped before it writes its pid to the file).
        note = re.search(r"new processes appeared while reaping \(round 2\): \[([\d, ]+)\]",
                         result.stdout.str())
        assert note is not None
        pids += [int(p) for p in note.group(1).split(", ") if int(p) not in pids]
        assert len(pids) >= 2
        assert wait_dead(pids, timeout=2) == []
        assert "ERROR at setup of test_next" not in result.stdout.str()
    finally:
        kill_all([p for p in pids if alive(p)])


def test_zombie_leader_with_live_threads_is_alive_and_reaped(
        example: Callable[..., Path], pytester: pytest.Pytester) -> None:
    pidfile = example("faults/zombie_leader", "scripts/threaded_leader.py")
    result = run_inner(pytester, "--gpuclean-grace=1")
    pid = read_pids(pidfile)[0]
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines([f"{LEAK_PREFIX} 1 process(es) (reaped)",
                                 f"  pid {pid} ended by SIGTERM*held GPU 0 24 MiB*"])
    assert "reaped zombie" not in result.stdout.str()
    assert not os.path.exists(f"/proc/{pid}/task")


def _start_inner(pytester: pytest.Pytester, tmp_path: Path, *args: str,
                 sigint_ignored: bool = False) -> subprocess.Popen[bytes]:
    # Not runpytest_subprocess: this test signals the inner pytest while it runs. Its output goes to a
    # file, not a pipe: a leak could hold a pipe open.
    with open(tmp_path / "inner.out", "wb") as out, children_sigint(ignored=sigint_ignored):
        return subprocess.Popen([sys.executable, "-m", "pytest", "-p", "gpuclean", "-p", "no:cacheprovider",
                                 "-rA", *args], cwd=pytester.path, stdout=out, stderr=subprocess.STDOUT)


@contextlib.contextmanager
def _in_final_sweep(example: Callable[..., Path], pytester: pytest.Pytester, tmp_path: Path,
                    monkeypatch: pytest.MonkeyPatch, interrupt: int,
                    sigint_ignored: bool = False) -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    """An inner session (``--gpuclean-all``, 60 s grace) whose leak (a child that notes each SIGTERM in
    $LEAK_TERMED and lives on: the note says that the final sweep is in its grace; the inner pytest's own
    output, buffered in a file, says nothing until the session ends) survives SIGTERM, interrupted with
    ``interrupt``: yields (pytest, the leak) while the final sweep waits out its grace. Afterwards the leak
    must be dead, and reported as reaped by SIGKILL (the sweep's SIGTERM did not end it)."""
    pidfile, termed = example("faults/term_noting", "scripts/note_term.py"), tmp_path / "termed"
    monkeypatch.setenv("LEAK_TERMED", str(termed))
    report, out = tmp_path / "report.json", tmp_path / "inner.out"
    proc = _start_inner(pytester, tmp_path, "--gpuclean-all", "--gpuclean-grace=60",
                        f"--gpuclean-report={report}", sigint_ignored=sigint_ignored)
    try:
        leaked = read_pids(pidfile, timeout=60)[0]
        time.sleep(0.3)
        proc.send_signal(interrupt)
        wait_for_file(termed, proc, timeout=30, output=out.read_text)  # the sweep is in its grace
        yield proc, leaked
    finally:
        if proc.poll() is None:
            proc.kill()
    assert wait_dead([leaked], timeout=2) == [], out.read_text()
    document = json.loads(report.read_text())
    assert [(r["process"]["pid"], r["ended_by"]) for r in document["session_reaped"]] == [
        (leaked, "SIGKILL")], out.read_text()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_to_pytest_runs_the_sweep_and_writes_the_reports(
        example: Callable[..., Path], pytester: pytest.Pytester, tmp_path: Path, signum: int) -> None:
    pidfile = example("faults/sleeper")
    report, junit = tmp_path / "report.json", tmp_path / "junit.xml"
    proc = _start_inner(pytester, tmp_path, "--gpuclean-all", f"--gpuclean-report={report}",
                        f"--junitxml={junit}", "-k", "test_leak_and_hang")
    try:
        leaked = read_pids(pidfile, timeout=60)[0]
        time.sleep(0.3)
        proc.send_signal(signum)
        code = proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = (tmp_path / "inner.out").read_text()
    assert wait_dead([leaked], timeout=2) == [], out
    # SIGTERM: the job runner sees the process die of SIGTERM, as it would without us.
    assert code == (-signal.SIGTERM if signum == signal.SIGTERM else pytest.ExitCode.INTERRUPTED), out
    document = json.loads(report.read_text())
    assert [r["process"]["pid"] for r in document["session_reaped"]] == [leaked]
    assert junit.exists()
    assert "session end: reaped 1 leftover process(es)" in out


def test_forked_children_die_of_sigterm_as_without_the_plugin(
        example: Callable[..., Path], pytester: pytest.Pytester) -> None:
    # The plugin takes SIGTERM in the pytest process (a cancelled job still gets its sweep). Before, a child
    # forked by a test inherited that handler: SIGTERM ran its finally blocks, multiprocessing's terminate()
    # gave exitcode 1 instead of -15, and each printed "KeyboardInterrupt: SIGTERM". Both a marked test and
    # an unmarked one after it (the handler stays for the session) fork.
    example("faults/forked_sigterm")
    result = run_inner(pytester)
    result.assert_outcomes(passed=2)
    out = result.stdout.str() + result.stderr.str()
    assert "KeyboardInterrupt" not in out


def test_second_interrupt_shortens_the_grace_and_keeps_the_sweep(
        example: Callable[..., Path], pytester: pytest.Pytester, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The final sweep waits out a 60 s grace for a process that survives SIGTERM...
    with _in_final_sweep(example, pytester, tmp_path, monkeypatch, signal.SIGINT) as (proc, leaked):
        time.sleep(1)
        assert proc.poll() is None and alive(leaked)
        proc.send_signal(signal.SIGINT)  # ...until a second Ctrl-C says: be quick
        proc.wait(30)  # far less than the grace


def test_ignored_sigint_stays_ignored_in_the_final_sweep(
        example: Callable[..., Path], pytester: pytest.Pytester, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    # pytest run as a background job (``cmd &`` in a script, nohup) starts with SIGINT ignored: whoever
    # started it chose that a Ctrl-C to the group must not touch it. The sweep's "hurry" handler must not
    # take SIGINT over; SIGTERM (a cancelled job) still interrupts and still hurries.
    with _in_final_sweep(example, pytester, tmp_path, monkeypatch, signal.SIGTERM,
                         sigint_ignored=True) as (proc, leaked):
        proc.send_signal(signal.SIGINT)
        time.sleep(2)
        assert proc.poll() is None and alive(leaked), "SIGINT, ignored by the session's starter, hurried it"
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(30)  # far less than the grace
    assert code == -signal.SIGTERM, (tmp_path / "inner.out").read_text()


def test_failing_sessionfinish_of_a_conftest_does_not_skip_the_sweep(
        example: Callable[..., Path], pytester: pytest.Pytester, tmp_path: Path) -> None:
    pidfile = example("faults/failing_sessionfinish")
    report = tmp_path / "report.json"
    result = run_inner(pytester, f"--gpuclean-report={report}")
    leaked = read_pids(pidfile)[0]
    assert "conftest broke at session end" in result.stdout.str() + result.stderr.str()
    assert wait_dead([leaked], timeout=2) == []
    document = json.loads(report.read_text())
    assert [r["process"]["pid"] for r in document["session_reaped"]] == [leaked]


def test_device_lost_at_session_end_does_not_skip_the_sweep(
        example: Callable[..., Path], pytester: pytest.Pytester, tmp_path: Path) -> None:
    pidfile = example("faults/device_lost")
    report = tmp_path / "report.json"
    result = run_inner(pytester, f"--gpuclean-report={report}")
    leaked = read_pids(pidfile)[0]
    assert wait_dead([leaked], timeout=2) == [], result.stdout.str()
    document = json.loads(report.read_text())
    assert leaked in [r["process"]["pid"] for r in document["session_reaped"]] + [
        p["pid"] for t in document["tests"] for p in t.get("leaked", [])]


# ---- a device that cannot be read mid-session -------------------------------------------------------

def test_a_device_read_error_is_one_line_and_the_tests_leak_is_still_reaped(
        example: Callable[..., Path], pytester: pytest.Pytester, sim: Path) -> None:
    # The test's child writes garbage into its own device file and stays: the teardown check cannot read
    # GPU 0. It says so in one line, reaps the child all the same (ownership needs no reading), and the
    # later tests, whose GPUs the reaping made readable again, pass.
    pidfile = example("faults/garbage", "scripts/garbage_writer.py")
    result = run_inner(pytester, "--gpuclean-report=report.json", "--gpuclean-dead-sessions=off")
    writer = read_pids(pidfile)[0]
    result.assert_outcomes(passed=4, errors=1)
    device = sim / "0" / str(writer)
    result.stdout.fnmatch_lines([
        "*ERROR at teardown of test_garbage*",
        f"gpuclean: could not check the GPUs after the test: GPU 0 (GPU-*): simulated device file "
        f"'{device}' holds 'garbage', not a number of bytes (a whole number >= 0)",
        f"{LEAK_PREFIX} 1 process(es) (reaped)",
        "reaped 1 process(es):",
        f"  pid {writer} ended by SIGTERM*(found as descendant, spawned by test_inner.py::test_garbage)*",
        "*= gpuclean =*",
        "4 checked test(s), 1 with findings, 1 process(es) reaped, 1 could not read a device",
    ])
    out = result.stdout.str()
    assert "Traceback" not in out and "checker.py" not in out and "SimulationError" not in out
    assert not alive(writer)
    document = json.loads((pytester.path / "report.json").read_text())
    tests = {t["nodeid"]: t for t in document["tests"]}
    garbage = tests["test_inner.py::test_garbage"]
    assert garbage["outcome"] == "leaked" and "holds 'garbage'" in garbage["after"]["error"]
    assert [(p["pid"], p["found"]) for p in garbage["leaked"]] == [(writer, "teardown")]
    assert document["session_reaped"] == []  # reaped at its test's teardown, not at the session's end
    assert {n: t["outcome"] for n, t in tests.items() if n != "test_inner.py::test_garbage"} == {
        f"test_inner.py::test_later[{n}]": "clean" for n in range(3)}
    summary = document["summary"]
    assert (summary["checked"], summary["leaked"], summary["device_errors"]) == (4, 1, 1)


@pytest.mark.parametrize("how", ["unreadable", "gone"])
def test_a_device_that_stays_unreadable_fails_each_later_check_in_one_line_or_stops_when_gone(
        example: Callable[..., Path], pytester: pytest.Pytester, sim: Path,
        monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    # What NVML's errors map to on simulated devices: a device folder that is not a folder is a read error
    # (NVMLError: each later check tries again and fails in one line); a folder removed is a lost GPU
    # (NVMLError_GpuIsLost: the session stops, in one line). Either way the leak is reaped at its test.
    monkeypatch.setenv("HOW", how)
    pidfile = example("faults/breaks_gpu_1")
    result = run_inner(pytester, "--gpuclean-report=report.json", "--gpuclean-dead-sessions=off")
    leaked = read_pids(pidfile)[0]
    where = sim / "1"
    cause = (f"simulated GPU 1 ({where}) unreadable: [Errno 20] Not a directory: '{where}'"
             if how == "unreadable"
             else f"GPU 1 ({simulated_uuid(sim, 1)}) is lost: vanished ({where} is gone)")
    lines = result.stdout.lines
    start = lines.index(next(text for text in lines if "ERROR at teardown of test_breaks_gpu_1" in text))
    assert lines[start + 1:start + 4] == [
        f"gpuclean: could not check the GPUs after the test: {cause}",
        f"{LEAK_PREFIX} 1 process(es) (reaped)",
        "reaped 1 process(es):",
    ]
    # GPU 0 could still be read: what the leak held there is known.
    assert re.match(rf"  pid {leaked} ended by SIGTERM.*: held GPU 0 8 MiB", lines[start + 4])
    assert not alive(leaked)
    document = json.loads((pytester.path / "report.json").read_text())
    summary = document["summary"]
    if how == "unreadable":
        result.assert_outcomes(passed=2, errors=3)
        for name in ("test_2", "test_4"):
            at = lines.index(next(text for text in lines if f"ERROR at setup of {name} " in text))
            # One line each, no traceback: the next line is the next section.
            assert lines[at + 1] == f"gpuclean: could not check the GPUs before the test: {cause}"
            assert lines[at + 2].startswith(("_", "="))
        result.stdout.fnmatch_lines([
            "*= gpuclean =*",
            "3 checked test(s), 3 with findings, 1 process(es) reaped, 3 could not read a device"])
        assert (summary["checked"], summary["device_errors"], summary["not_clean"]) == (3, 3, 2)
    else:
        result.assert_outcomes(passed=1, errors=1)  # nothing ran on the lost GPU
        # (Not fnmatch: the cause's "[Errno 2]" reads as a character class.)
        assert any(f"Interrupted: gpuclean: {cause}; stopping the session's tests instead of letting each "
                   "wait its timeout (every later check would fail)" in text for text in lines)
        assert (summary["checked"], summary["device_errors"], summary["leaked"]) == (1, 1, 1)
    assert "Traceback" not in result.stdout.str()


@pytest.mark.usefixtures("dead_sessions_on")
def test_crashed_xdist_worker_leak_is_reaped_and_blamed(
        example: Callable[..., Path], pytester: pytest.Pytester, tmp_path: Path) -> None:
    pidfile = example("faults/xdist_crash")
    report = tmp_path / "report.json"
    result = run_inner(pytester, "-n", "2", "-p", "xdist", f"--gpuclean-report={report}",
                       "--gpuclean-timeout=20")
    leaked = read_pids(pidfile)[0]
    out = result.stdout.str()
    assert wait_dead([leaked], timeout=2) == [], out
    result.assert_outcomes(passed=4, failed=1)
    assert "GPUs not clean" not in out
    document = json.loads(report.read_text())
    crashed = [t for t in document["tests"] if t["nodeid"].endswith("test_crash_after_leaking")]
    assert crashed and crashed[0]["outcome"] == "leaked", json.dumps(document["tests"], indent=1)
    assert [p["pid"] for p in crashed[0]["leaked"]] == [leaked]
    # Every later test found the GPUs clean: the leak never counted against them.
    later = [t for t in document["tests"] if "test_later" in t["nodeid"]]
    assert len(later) == 4 and all(t["outcome"] == "clean" for t in later), later


# ---- debris of dead sessions ------------------------------------------------------------------

@pytest.mark.usefixtures("dead_sessions_on")
def test_session_killed_with_sigkill_leaves_debris_that_the_next_session_reaps(
        example: Callable[..., Path], pytester: pytest.Pytester, tmp_path: Path) -> None:
    pidfile = example("faults/sleeper")
    proc = _start_inner(pytester, tmp_path, "--gpuclean-all", "-k", "test_leak_and_hang")
    try:
        leaked = read_pids(pidfile, timeout=60)[0]
        proc.kill()  # the OOM killer, a runner that kills only the leader: no sweep, no report
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert alive(leaked)
    try:
        result = run_inner(pytester, "-k", "test_next_session")
        result.assert_outcomes(passed=1)
        out = result.stdout.str()
        assert f"pid {leaked}: left by dead session gc.{proc.pid}." in out
        assert "test_inner.py::test_leak_and_hang: leaked 1 process(es) found by a later check" in out
        assert wait_dead([leaked], timeout=2) == []
        # It did not wait out its timeout for a process it could prove was debris.
        first_check = [line for line in out.splitlines() if "setup: reaped 1" in line]
        assert first_check and "clean after" in first_check[0]
    finally:
        kill_all([leaked])


@pytest.fixture
def cookie_holders(sim: Path, tmp_path: Path) -> Iterator[Callable[[str], int]]:
    started: list[subprocess.Popen[bytes]] = []

    def start(cookie: str) -> int:
        pidfile = tmp_path / f"cookie-{len(started)}.pid"
        env = {**os.environ, "GPUCLEAN_TEST": cookie}
        proc = subprocess.Popen([sys.executable, "-m", "pytest_gpuclean.simulate", "hold", "--dir", str(sim),
                                 "--mib", "10", "--pidfile", str(pidfile)], env=env)
        started.append(proc)
        return read_pids(pidfile)[0]

    yield start
    for proc in started:
        proc.kill()
        proc.wait()


@pytest.mark.usefixtures("dead_sessions_on")
def test_only_provably_dead_sessions_leave_debris(pytester: pytest.Pytester, inner: Callable[[str], Path],
                                                   cookie_holders: Callable[[str], int]) -> None:
    me = procfs.read_stat(os.getpid())
    assert me is not None
    namespace = procfs.pid_namespace()
    dead = subprocess.Popen(["true"])
    dead.wait()  # a pid that is certainly gone now
    live_session = cookie_holders(f"gc.{os.getpid()}.{me.start_ticks}.{namespace}.0badc0de:t3")
    other_namespace = cookie_holders(f"gc.{dead.pid}.1.{namespace + 1}.0badc0de:t3")
    not_ours = cookie_holders("buildkite-1234:job")
    # Last: until the inner session's first check, any session of this user that starts reaps it.
    debris = cookie_holders(f"gc.{dead.pid}.1.{namespace}.0badc0de:t3")
    inner("""
@pytest.mark.needs_clean_gpus(timeout=1)
def test_first():
    pass
""")
    result = run_inner(pytester)
    out = result.stdout.str()
    assert wait_dead([debris], timeout=10) == [], out
    assert f"pid {debris}: left by dead session gc.{dead.pid}." in out
    for survivor in (live_session, other_namespace, not_ours):
        assert alive(survivor), out
        assert f"foreign pid {survivor} " in out
    result.assert_outcomes(errors=1)


def test_concurrent_live_session_processes_are_never_debris(
        example: Callable[..., Path], pytester: pytest.Pytester, tmp_path: Path) -> None:
    pidfile = example("faults/sleeper")
    first = _start_inner(pytester, tmp_path, "-k", "test_leak_and_hang", "--gpuclean-lock=off")
    try:
        held = read_pids(pidfile, timeout=60)[0]
        result = run_inner(pytester, "-k", "test_other_session", "--gpuclean-lock=off")
        assert alive(held) and first.poll() is None
        result.assert_outcomes(errors=1)
        result.stdout.fnmatch_lines([f"  foreign pid {held} *not started by this session*"])
    finally:
        first.kill()
        first.wait()
        kill_all(read_pids(pidfile))


@pytest.mark.usefixtures("dead_sessions_on")
def test_cli_reaps_dead_sessions_only_when_asked(sim: Path) -> None:
    me = procfs.read_stat(os.getpid())
    assert me is not None
    namespace = procfs.pid_namespace()
    dead = subprocess.Popen(["true"])
    dead.wait()

    def sleeper(cookie: str) -> subprocess.Popen[bytes]:
        env = {"PATH": os.environ["PATH"], "GPUCLEAN_TEST": cookie, "GPUCLEAN_OWNER": "tests/x.py::test_x"}
        return subprocess.Popen(["/bin/sleep", "300"], env=env)

    debris = sleeper(f"gc.{dead.pid}.1.{namespace}.0badc0de:t3")
    live = sleeper(f"gc.{os.getpid()}.{me.start_ticks}.{namespace}.0badc0de:t3")
    gpuclean = [sys.executable, "-m", "pytest_gpuclean"]  # devices: GPUCLEAN_SIMULATE (the sim fixture)
    try:
        time.sleep(0.2)
        check = subprocess.run([*gpuclean, "check"], capture_output=True, text=True)
        assert check.returncode == 0, check.stdout + check.stderr
        assert "`gpuclean reap --dead-sessions` would end 1 process(es)" in check.stdout
        assert f"pid {debris.pid} (/bin/sleep 300): left by dead session gc.{dead.pid}." in check.stdout
        assert "spawned by tests/x.py::test_x" in check.stdout
        plain = subprocess.run([*gpuclean, "reap"], capture_output=True, text=True)
        assert "nothing to end" in plain.stdout and debris.poll() is None
        reap = subprocess.run([*gpuclean, "reap", "--dead-sessions", "--grace", "1"], capture_output=True,
                              text=True)
        assert reap.returncode == 0, reap.stdout + reap.stderr
        assert f"dead session: pid {debris.pid}: left by dead session gc.{dead.pid}." in reap.stdout
        assert debris.wait(5) == -signal.SIGTERM
        assert live.poll() is None
    finally:
        for proc in (debris, live):
            proc.kill()
            proc.wait()
