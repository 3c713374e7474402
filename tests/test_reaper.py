"""The reaper: every way a test can leak a process, attribution, and the safety rules."""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from helpers import alive, kill_all, owner_uid, read_pids, reap_orphans, run_inner, wait_dead

from pytest_gpuclean._reading import processes, procfs
from pytest_gpuclean.report.terminal import LEAK_PREFIX

# name (a function of tests/examples/reaper/scenarios) -> (pids expected in the pidfile, text expected in
# the report)
SCENARIOS: dict[str, tuple[int, list[str]]] = {
    "plain_child": (1, ["*ended by SIGTERM*found as descendant*held GPU 0 64 MiB*"]),
    "grandchild_of_exited_parent": (1, ["*ended by SIGTERM*held GPU 0 8 MiB*"]),
    "setsid_double_fork_daemon": (1, ["*ended by SIGTERM*found as adopted*held GPU 0 16 MiB*"]),
    "scrubbed_environment": (1, ["*ended by SIGTERM*spawned by test_inner.py::test_leak*held GPU 0 4 MiB*"]),
    "ignores_sigterm": (1, ["*ended by SIGKILL*held GPU 0 32 MiB*"]),
    "deep_tree_20": (21, ["reaped 21 process(es):"]),
    "wide_tree_100": (100, ["reaped 100 process(es):"]),
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_leak_is_found_attributed_reaped_and_next_test_passes(
        scenario: str, example: Callable[..., Path], pytester: pytest.Pytester,
        monkeypatch: pytest.MonkeyPatch) -> None:
    count, expected = SCENARIOS[scenario]
    monkeypatch.setenv("LEAK", scenario)
    monkeypatch.setenv("HOLDERS", str(count))
    pidfile = example("reaper/scenarios", "scripts/chain.py")
    result = run_inner(pytester, "--gpuclean-grace=0.5")
    pids = read_pids(pidfile, count)
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines(["*ERROR at teardown of test_leak*", f"{LEAK_PREFIX} *", *expected])
    assert f"pid {pids[-1]} " in result.stdout.str()
    assert wait_dead(pids, timeout=2) == []
    assert "ERROR at setup of test_next" not in result.stdout.str()


def test_zombie_child_is_reaped_by_its_pid(example: Callable[..., Path], pytester: pytest.Pytester) -> None:
    example("reaper/zombie_child")
    result = run_inner(pytester)
    zombie = read_pids(Path(os.environ["LEAK_PIDFILE"]))[0]
    # An exited process holds no GPU memory: collected and reported, not a test error (most such
    # zombies are orphans our subreaper adopted, which init would have collected).
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines([f"test_inner.py::test_leak: noticed, not a finding: collected 1 process(es) "
                                 f"that exited by themselves (pid {zombie} spawned by "
                                 "test_inner.py::test_leak)"])
    assert procfs.read_stat(zombie) is None  # collected, not left as a zombie


def test_multiprocessing_pool_left_open_is_shut_down(example: Callable[..., Path],
                                                      pytester: pytest.Pytester) -> None:
    pidfile = example("reaper/pool")
    result = run_inner(pytester, "--gpuclean-grace=1")
    workers = read_pids(pidfile, 3)
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines(["*note: Pool with workers * was still referenced in the pytest process: "
                                 "shut it down*"])
    assert wait_dead(workers, timeout=2) == []
    assert "gave up" not in result.stdout.str()


def test_leak_of_unmarked_test_is_blamed_on_it_and_finder_proceeds(
        example: Callable[..., Path], pytester: pytest.Pytester) -> None:
    pidfile = example("reaper/unmarked_leaker")
    result = run_inner(pytester)
    leaked = read_pids(pidfile)[0]
    # Said in the leaker's line, not as a warning filed under the finder (tests/test_messages.py).
    result.assert_outcomes(passed=3, warnings=0)
    result.stdout.fnmatch_lines([
        "*= gpuclean =*",
        f"test_inner.py::test_finder: noticed, not a finding: setup: reaped 1 (pid {leaked} SIGTERM)*",
        f"test_inner.py::test_unmarked_leaker: leaked 1 process(es) found by a later check "
        f"(pid {leaked} SIGTERM)",
    ])
    assert "test_inner.py::test_unmarked_innocent:" not in result.stdout.str()
    assert not alive(leaked)


def test_module_fixture_process_survives_its_tests(example: Callable[..., Path], pytester: pytest.Pytester,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STOP_SERVER", "yes")
    pidfile = example("reaper/server_fixture")
    result = run_inner(pytester)
    result.assert_outcomes(passed=2)
    assert "leaked" not in result.stdout.str()
    assert not alive(read_pids(pidfile)[0])


def test_module_fixture_that_leaks_is_blamed_at_its_teardown(example: Callable[..., Path],
                                                             pytester: pytest.Pytester,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STOP_SERVER", "no")
    pidfile = example("reaper/server_fixture")
    result = run_inner(pytester)
    server = read_pids(pidfile)[0]
    result.assert_outcomes(passed=2, errors=1)
    # pytest ends the fixture at test_two's teardown: the finding is the fixture's, named with where it is.
    line = next(n for n, text in enumerate((pytester.path / "test_inner.py").read_text().splitlines(), 1)
                if text == '@pytest.fixture(scope="module")')
    result.stdout.fnmatch_lines([
        "*ERROR at teardown of test_two*",
        f"gpuclean: fixture server (module-scoped, test_inner.py:{line}) leaked 1 process(es) (reaped), "
        "found at the teardown of test_inner.py::test_two",
        f"  pid {server} ended by SIGTERM*(found as descendant, spawned by fixture server (module-scoped)): "
        "held GPU 0 50 MiB*",
    ])
    assert "ERROR at teardown of test_one" not in result.stdout.str()
    assert LEAK_PREFIX not in result.stdout.str()
    assert not alive(server)


def test_session_end_sweeps_what_nothing_else_checked(example: Callable[..., Path],
                                                      pytester: pytest.Pytester) -> None:
    pidfile = example("reaper/session_end")
    result = run_inner(pytester)
    leaked = read_pids(pidfile)[0]
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines([
        f"session end: reaped 1 leftover process(es): pid {leaked} (test_inner.py::test_unmarked_last) "
        "SIGTERM",
    ])
    assert not alive(leaked)


def test_escapee_through_a_daemon_is_found_by_its_cookie(
        example: Callable[..., Path], pytester: pytest.Pytester, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    # A launcher outside the inner session's tree starts processes with the requester's environment,
    # like a daemon that inherits env: only the cookie ties the process to the test that asked.
    fifo = tmp_path / "launch.fifo"
    os.mkfifo(fifo)
    monkeypatch.setenv("LAUNCH_FIFO", str(fifo))
    launcher = subprocess.Popen([sys.executable, pytester.copy_example("scripts/launcher.py"), str(fifo)])
    try:
        pidfile = example("reaper/escapee")
        result = run_inner(pytester)
        escapee = read_pids(pidfile)[0]
        result.assert_outcomes(passed=2, errors=1)
        result.stdout.fnmatch_lines([
            f"  pid {escapee} ended by SIGTERM*(found as cookie, spawned by "
            "test_inner.py::test_leak_via_daemon): held GPU 0 12 MiB*",
        ])
        assert not alive(escapee)
        assert launcher.poll() is None  # the launcher itself was never ours
    finally:
        launcher.kill()
        launcher.wait()


@pytest.fixture
def other_user() -> Iterator[pwd.struct_passwd]:
    if os.geteuid() != 0:
        pytest.skip("needs root to run a process as another user")
    name = "gpuclean-other"
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        if shutil.which("useradd") is None:
            pytest.skip("no useradd to create a second user")
        subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", name], check=True)
        entry = pwd.getpwnam(name)
    yield entry


def test_another_users_process_is_never_signalled(other_user: pwd.struct_passwd, pytester: pytest.Pytester,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    # Even as root, and even when it is our own descendant, another user's process is not ours to kill.
    shared = Path(tempfile.mkdtemp(prefix="gpuclean-uid-"))
    holders: list[int] = []
    try:
        shared.chmod(0o1777)
        (shared / "0").mkdir(mode=0o777)
        (shared / "0").chmod(0o777)
        pidfile = shared / "pids"
        monkeypatch.setenv("GPUCLEAN_SIMULATE", str(shared))
        monkeypatch.setenv("GPUCLEAN_LOCK_DIR", str(shared / "locks"))
        monkeypatch.setenv("LEAK_PIDFILE", str(pidfile))
        monkeypatch.setenv("OTHER_UID", str(other_user.pw_uid))
        monkeypatch.setenv("OTHER_GID", str(other_user.pw_gid))
        pytester.copy_example("reaper/other_user")
        result = run_inner(pytester)
        holders[:] = read_pids(pidfile)
        holder = holders[0]
        assert alive(holder), result.stdout.str()
        assert owner_uid(holder) == other_user.pw_uid
        result.stdout.fnmatch_lines([
            f"  leaked pid {holder} (user {other_user.pw_name}*): GPU 0 7 MiB; belongs to another user "
            f"({other_user.pw_name}): never killed",
            f"note: left alone: pid {holder} (user {other_user.pw_name}, sleep 3600): another user's "
            "process"])
        assert "SIGTERM" not in result.stdout.str()
    finally:
        # The holder outlived the inner session and was re-parented to this (subreaper) process: end
        # it and collect it, or this session's own final check finds it.
        kill_all(holders)
        assert wait_dead(holders) == []
        reap_orphans(holders)
        shutil.rmtree(shared, ignore_errors=True)
    # (Re-parented to init instead when this session is no subreaper: it checks no test of its own.)
    stat = procfs.read_stat(holder)
    assert stat is None or stat.ppid != os.getpid(), "the holder is still a zombie of this process"


def test_pid_reuse_is_never_signalled() -> None:
    # A recorded identity whose start time no longer matches is a different process: leave it alone.
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        stat = procfs.read_stat(proc.pid)
        assert stat is not None
        stale = processes.KillTarget(proc.pid, stat.start_ticks - 1)
        outcome = processes.terminate([stale], grace=0.2)
        assert [(o.pid, o.ended_by) for o in outcome] == [(proc.pid, "pid reused")]
        time.sleep(0.1)
        assert proc.poll() is None
        # The true identity is killed, and collected by its specific pid.
        outcome = processes.terminate([processes.KillTarget(proc.pid, stat.start_ticks)], grace=2)
        assert outcome[0].ended_by == "SIGTERM"
        assert procfs.read_stat(proc.pid) is None
    finally:
        proc.kill()
        proc.wait()


def test_reaper_never_steals_popen_exit_statuses(example: Callable[..., Path],
                                                  pytester: pytest.Pytester) -> None:
    # A Popen held by a module fixture keeps its own exit status: gpuclean waits on specific pids only.
    example("reaper/fixture_worker")
    result = run_inner(pytester)
    result.assert_outcomes(passed=2)
    # The fixture's exited worker was left to the fixture: neither collected nor reported.
    worker = read_pids(pytester.path / "worker.pid")[0]
    assert f"pid {worker} " not in result.stdout.str()
    result.stdout.fnmatch_lines(["*= gpuclean =*", "2 checked test(s), * process(es) reaped",
                                 "PASSED test_inner.py::test_one", "PASSED test_inner.py::test_two"])


def test_fixture_protection_ends_with_the_fixture(tmp_path: Path) -> None:
    # Ownership bookkeeping: a process spawned under a fixture's cookie is protected only while it lives.
    from pytest_gpuclean._model.records import Owner
    from pytest_gpuclean._ownership.evidence import Ownership
    ownership = Ownership("s1")
    token = ownership.new_token(Owner("fixture", "server (module-scoped)"))
    ownership.active_fixtures.add(token)
    assert ownership.is_protected(ownership.token_of_cookie(ownership.cookie(token)))
    ownership.active_fixtures.discard(token)
    assert not ownership.is_protected(token)
    assert ownership.token_of_cookie("other-session:" + token) is None


def test_what_existed_before_the_session_is_decided_by_evidence() -> None:
    # The session began (its cookie exported) in tick 1000, when the last pid allocated was 500. A start
    # time outside that tick decides; inside it only the pids can, and without them nothing is proven
    # (None: left alone, never taken for the session set-up's).
    from pytest_gpuclean._ownership.evidence import PREEXISTING, Ownership
    ownership = Ownership("s1", began_tick=1000, began_pid=500)
    assert ownership.existed_before(600, 999, last_pid=700) is True
    assert ownership.existed_before(400, 1001, last_pid=700) is False
    assert ownership.existed_before(500, 1000, last_pid=700) is True  # the export's own reading
    assert ownership.existed_before(501, 1000, last_pid=700) is False
    assert ownership.existed_before(800, 1000, last_pid=700) is True  # not allocated since: older
    assert Ownership("s1", began_tick=1000, began_pid=None).existed_before(501, 1000, last_pid=700) is None
    wrapped = ownership.existed_before(501, 1000, last_pid=500 + procfs.pid_max() // 2 + 1)
    assert wrapped is None  # the pids may have gone all the way round
    assert Ownership("s1").existed_before(1, 0) is False  # no beginning given: nothing is older
    assert ownership.is_protected(PREEXISTING)
    ownership.session_over = True
    assert ownership.is_protected(PREEXISTING)  # the very last sweep too


# (settle time, how long the helper outlives its test, whether it works or sleeps meanwhile): wide margins
# both ways, for a loaded CI box. A helper that works on its way out gets the settle time; one that sleeps
# waits for nothing the test will do, and is reaped at once, however long the settle time (600 s here:
# waited out, the inner session would not end within its own timeout).
@pytest.mark.parametrize(("settle", "lifetime", "busy", "leaked"), [
    ("3", "0.3", True, False), ("0", "3", True, True), ("600", "600", False, True),
    ("600", "1", False, True)])
def test_a_leftover_that_exits_within_the_settle_time_is_no_leak(
        example: Callable[..., Path], pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, settle: str,
        lifetime: str, busy: bool, leaked: bool) -> None:
    # Like a subprocess's resource tracker, which outlives its client by a moment to clean up after it.
    monkeypatch.setenv("LIFETIME", lifetime)
    if busy:
        monkeypatch.setenv("BUSY", "1")
    pidfile = example("reaper/settle")
    result = run_inner(pytester, f"--gpuclean-settle={settle}", timeout=120)
    helper = read_pids(pidfile)[0]
    if leaked:
        result.assert_outcomes(passed=1, errors=1)
        result.stdout.fnmatch_lines([f"  pid {helper} ended by SIGTERM*"])
    else:
        result.assert_outcomes(passed=1)
        result.stdout.fnmatch_lines([
            "test_inner.py::test_leaves_a_short_lived_helper: noticed, not a finding: collected 1 "
            f"process(es) that exited by themselves (pid {helper} spawned by "
            "test_inner.py::test_leaves_a_short_lived_helper)"])
    assert not alive(helper)


@pytest.fixture
def stopped_child() -> Iterator[int]:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        os.kill(child.pid, signal.SIGSTOP)
        for _ in range(500):  # SIGSTOP takes effect asynchronously
            stat = procfs.read_stat(child.pid)
            if stat is not None and stat.state == "T":
                break
            time.sleep(0.01)
        yield child.pid
    finally:
        child.kill()
        child.wait()


@pytest.mark.parametrize("psutil_denied", [False, True], ids=["psutil", "psutil-denied"])
def test_a_described_process_state_is_named_the_same_whatever_could_be_read(
        stopped_child: int, monkeypatch: pytest.MonkeyPatch, psutil_denied: bool) -> None:
    # The report's ``state`` is psutil's word (``stopped``), also when psutil could not read the process
    # and only /proc/<pid>/stat was left: never the kernel's bare letter ``T``.
    import psutil

    if psutil_denied:
        def denied(self: object) -> None:
            raise psutil.AccessDenied(stopped_child)

        # Below psutil's caches: its Linux implementation, as if /proc/<pid>/status were unreadable.
        monkeypatch.setattr(psutil._psplatform.Process, "uids", denied)
    info = processes.describe(stopped_child)
    assert info is not None
    assert info.state == "stopped"
    assert (info.user, info.uid) == (("?", -1) if psutil_denied else (pwd.getpwuid(os.getuid()).pw_name,
                                                                      os.getuid()))


def test_last_pid_reads_anew_through_its_kept_descriptor_and_survives_its_number_being_reused(
        tmp_path: Path) -> None:
    # ns_last_pid is read through a descriptor kept open (procfs._last_pid_file): each reading must be the
    # kernel's answer now, and a descriptor closed behind its back (its number reused by another file)
    # must not be read as if it were ns_last_pid.
    if procfs.last_pid() is None:
        pytest.skip("the kernel does not say ns_last_pid here")
    space = procfs.pid_max()
    before = procfs.last_pid()
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    after = procfs.last_pid()
    assert before is not None and after is not None
    assert 0 < (child.pid - before) % space <= (after - before) % space  # read anew: the child's pid is in
    assert procfs._last_pid_file is not None
    kept = procfs._last_pid_file[0]
    planted = tmp_path / "digits"
    planted.write_text(str((after - 1000) % space))  # what a reader of the wrong file would answer
    os.close(kept)
    fd = os.open(planted, os.O_RDONLY)  # the lowest free number: the one just closed
    try:
        assert fd == kept
        reading = procfs.last_pid()
        assert reading is not None and (reading - after) % space < space // 2, (reading, after)
        assert procfs._last_pid_file[0] != kept  # a descriptor of its own again; the other file untouched
        assert os.pread(fd, 32, 0) == planted.read_bytes()
    finally:
        os.close(fd)
