"""Never touch what is not ours, never leave a leak alive: the signal gate, run as root with a second unix
user (``gpuclean-victim``, created by the ``victim_user`` fixture where missing), as CI can.

Every signal gpuclean sends (SIGSTOP included) passes one gate first: another user's process, a process that
would relay the signal to another user's (``su``, ``runuser``: its descendants run as someone else), this
process and its ancestors, what is protected now, are left alone and named. The other user's process here is
``scripts/logsig.py``, which writes down every signal that reaches it (a SIGCONT: it had been stopped), so
each test asserts exactly what reached it: nothing.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import pwd
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from helpers import EXAMPLES, alive, exec_done, run_inner

from pytest_gpuclean import simulate
from pytest_gpuclean._check import reaping
from pytest_gpuclean._check.checker import Checker, CheckSettings
from pytest_gpuclean._model.records import Owner
from pytest_gpuclean._reading import processes, procfs
from pytest_gpuclean._reading.simulated import SimulatedBackend
from pytest_gpuclean.report.terminal import LEAK_PREFIX

VICTIM = "gpuclean-victim"


def gpuclean(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """The ``gpuclean`` command as a runner hook runs it (devices: ``GPUCLEAN_SIMULATE``, the ``sim``
    fixture's)."""
    return subprocess.run([sys.executable, "-m", "pytest_gpuclean", *args], capture_output=True, text=True,
                          timeout=timeout)


def state(pid: int) -> str:
    """The kernel's state letter of ``pid`` ('' if it is gone): ``T`` is stopped."""
    stat = procfs.read_stat(pid)
    return "" if stat is None else stat.state


def with_marker(marker: str) -> list[int]:
    """The live processes whose command line holds ``marker``."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit() and marker in processes.command_line(int(name)) and alive(int(name)):
            found.append(int(name))
    return found


def kill_marked(marker: str) -> None:
    """SIGKILL every process whose command line holds ``marker``, until none has been seen for a while (a
    chain forks a new one every few milliseconds)."""
    quiet_since = time.monotonic()
    deadline = quiet_since + 30
    while time.monotonic() - quiet_since < 0.3 and time.monotonic() < deadline:
        found = with_marker(marker)
        if found:
            quiet_since = time.monotonic()
        for pid in found:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for pid in found:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
        time.sleep(0.002)


@pytest.fixture(scope="session")
def victim_user() -> pwd.struct_passwd:
    """A second unix user, ``gpuclean-victim`` (created where missing, and kept: other tests of the run may be
    using it). Skipped with the reason where that cannot be: not root, no useradd, setpriv or runuser."""
    if os.geteuid() != 0:
        pytest.skip("needs root: processes of a second unix user are started through setpriv and runuser")
    for tool in ("useradd", "setpriv", "runuser"):
        if shutil.which(tool) is None:
            pytest.skip(f"no {tool} on this machine")
    lock = Path(tempfile.gettempdir()) / "gpuclean-tests-victim-user.lock"
    with lock.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # (xdist workers, another run on the box)
        with contextlib.suppress(KeyError):
            return pwd.getpwnam(VICTIM)
        made = subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin",
                               VICTIM], capture_output=True, text=True)
        if made.returncode != 0:
            pytest.skip(f"useradd {VICTIM} failed: {made.stderr.strip()}")
        return pwd.getpwnam(VICTIM)


class Victim:
    """The second user's bystander: ``logsig.py`` run as that user, and what its log says reached it."""

    def __init__(self, user: pwd.struct_passwd, python: str, folder: Path) -> None:
        self.name, self.uid, self.gid = user.pw_name, user.pw_uid, user.pw_gid
        self.python = python
        self.logsig = str(shutil.copy(EXAMPLES / "scripts" / "logsig.py", folder / "logsig.py"))
        self.log = folder / f"victim-{uuid.uuid4().hex[:8]}.log"
        self.log.touch()
        os.chown(self.log, self.uid, self.gid)

    @property
    def argv(self) -> list[str]:
        """The bystander's command, for whatever runs it as the other user."""
        return [self.python, "-I", self.logsig, str(self.log)]

    def env(self) -> dict[str, str]:
        """What an inner suite reads (tests/examples/safety)."""
        return {"VICTIM": self.name, "VICTIM_PYTHON": self.python, "LOGSIG": self.logsig,
                "VICTIM_LOG": str(self.log)}

    def pid(self, timeout: float = 30) -> int:
        """The bystander's pid, once it is ready."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            lines = self.log.read_text().splitlines()
            if lines and lines[0].startswith("ready "):
                pid, uid = (int(word) for word in lines[0].split()[1:])
                assert uid == self.uid, lines[0]
                return pid
            time.sleep(0.01)
        raise AssertionError(f"{self.log}: the other user's process never got ready")

    def signals(self) -> list[str]:
        """The signals that reached it, in order."""
        return self.log.read_text().splitlines()[1:]

    def kill_all(self) -> None:
        """End every process of this bystander (its runuser or su included: their command line names the
        log)."""
        kill_marked(str(self.log))


@pytest.fixture
def victim(victim_user: pwd.struct_passwd, public_tmp: Path) -> Iterator[Victim]:
    """The second user's bystander, ready to start (an interpreter that user may run: root's home is
    private); every process of it ends with the test."""
    python = ""
    for candidate in (os.path.realpath(sys.executable), "/usr/bin/python3", shutil.which("python3") or ""):
        ways = (["setpriv", f"--reuid={victim_user.pw_uid}", f"--regid={victim_user.pw_gid}",
                 "--clear-groups"], ["runuser", "-u", victim_user.pw_name, "--"])
        if candidate and all(subprocess.run([*way, candidate, "-I", "-c", "pass"], cwd="/",
                                            capture_output=True).returncode == 0 for way in ways):
            python = candidate
            break
    if not python:
        pytest.skip(f"no Python interpreter that user {victim_user.pw_name} may run")
    bystander = Victim(victim_user, python, public_tmp)
    try:
        yield bystander
    finally:
        bystander.kill_all()


# ---- 1. a process gpuclean may not kill is never stopped, and nothing is left stopped --------------------


def test_another_users_process_is_never_stopped_by_the_freeze(
        victim: Victim, example: Callable[..., Path], pytester: pytest.Pytester,
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The test leaks the other user's process (setpriv, a session of its own) beside one whose SIGTERM
    # handler forks a replacement: from the second round on, the replacement is frozen and SIGKILLed. The
    # other user's process has the same owner; it must be neither stopped nor signalled in any way.
    for name, value in victim.env().items():
        monkeypatch.setenv(name, value)
    example("safety/another_user", "scripts/respawner.py")
    result = run_inner(pytester, "--gpuclean-grace=1")
    theirs = victim.pid()
    out = result.stdout.str()
    result.assert_outcomes(passed=1, errors=1)
    assert "new processes appeared while reaping (round 2)" in out  # the freeze ran
    assert f"left alone: pid {theirs} (user {victim.name}, " in out
    result.stdout.fnmatch_lines([f"*leaked pid {theirs} (user {victim.name}, sleeping,*belongs to another "
                                 f"user ({victim.name}): never killed*"])
    assert state(theirs) not in ("", "T", "t"), out  # alive, and not stopped after pytest ended
    assert victim.signals() == [], out


def test_a_freeze_interrupted_by_an_error_continues_what_it_stopped(monkeypatch: pytest.MonkeyPatch) -> None:
    # Whatever was stopped and then is not killed gets SIGCONT, exceptions included.
    checker = Checker(None, CheckSettings(dead_sessions=False))
    token = checker.ownership.new_token(Owner("test", "t.py::test_x"))
    child = exec_done(subprocess.Popen(["sleep", "600"],
                                       env={**os.environ, "GPUCLEAN_TEST": checker.ownership.cookie(token)}))
    try:
        found = [f for f in checker.take_census() if f.pid == child.pid]
        assert [f.token for f in found] == [token]

        def broken(*args: object, **kwargs: object) -> None:
            raise RuntimeError("the ladder broke")

        monkeypatch.setattr(reaping, "kill_and_confirm", broken)
        with pytest.raises(RuntimeError, match="the ladder broke"):
            checker.reap_round(found, (), (), [], freeze={token})
        assert state(child.pid) not in ("", "T", "t")
    finally:
        child.kill()
        child.wait()
        checker.close()


# ---- 2. `gpuclean reap --cookie` as root never reaches another user's process through runuser -------------


def test_reap_by_cookie_never_reaches_another_user_through_runuser(victim: Victim, sim: Path) -> None:
    relay = subprocess.Popen(["runuser", "-u", victim.name, "--", *victim.argv], cwd="/",
                             env={**os.environ, "GPUCLEAN_TEST": "job42:job"}, start_new_session=True)
    theirs = victim.pid()
    assert procfs.read_stat(theirs) is not None and procfs.read_stat(theirs).ppid == relay.pid  # type: ignore[union-attr]
    dry = gpuclean("reap", "--cookie", "job42:", "--dry-run")
    assert dry.returncode == 0, dry.stdout + dry.stderr
    assert "nothing to end" in dry.stdout, dry.stdout
    result = gpuclean("reap", "--cookie", "job42:", "--grace", "1")
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert "gpuclean reap: nothing to end" in lines, result.stdout
    # The relay, named with the other user's process it would pass the signal to; and that process itself.
    [left_relay] = [line for line in lines if line.startswith(f"  left alone: pid {relay.pid} ")]
    assert f"pid {theirs} of user {victim.name}" in left_relay and "runuser" in left_relay, left_relay
    [left_theirs] = [line for line in lines if line.startswith(f"  left alone: pid {theirs} ")]
    assert f"of user {victim.name}" in left_theirs and "another user's process" in left_theirs, left_theirs
    assert relay.poll() is None and alive(theirs)
    assert victim.signals() == []

    # Root may opt in, explicitly: --all-users keeps its documented meaning, and ends both.
    result = gpuclean("reap", "--cookie", "job42:", "--all-users", "--grace", "1")
    assert result.returncode == 0, result.stdout + result.stderr
    assert relay.wait(timeout=10) is not None and not alive(theirs)
    assert victim.signals()[:1] == ["SIGTERM"]


# ---- 3. a dead session's debris that relays to another user is left alone, by the next session and the CLI


@pytest.mark.usefixtures("dead_sessions_on")
def test_a_dead_sessions_relay_to_another_user_is_left_alone(
        victim: Victim, example: Callable[..., Path], pytester: pytest.Pytester,
        monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in victim.env().items():
        monkeypatch.setenv(name, value)
    # Sessions of their own, as a job's: not nested in this run's session, which is alive and would be the
    # one to reap what a session nested in it left (docs/ownership.md).
    monkeypatch.delenv("GPUCLEAN_TEST", raising=False)
    example("safety/dead_relay")
    died = run_inner(pytester, "-k", "test_relay_then_die")
    assert died.ret == -signal.SIGKILL, died.stdout.str()
    theirs = victim.pid()
    stat = procfs.read_stat(theirs)
    assert stat is not None
    relay = stat.ppid
    assert "runuser" in processes.command_line(relay)
    # The command finds the relay as the dead session's debris, and leaves it alone.
    dry = gpuclean("reap", "--dead-sessions", "--dry-run")
    assert dry.returncode == 0, dry.stdout + dry.stderr
    assert f"  left alone: pid {relay} of user root (runuser" in dry.stdout, dry.stdout
    assert f"pid {theirs} of user {victim.name}" in dry.stdout
    assert "would end" not in dry.stdout or f"pid {relay} " not in dry.stdout.split("would end", 1)[1]
    # The next session's first check does too.
    result = run_inner(pytester, "-k", "test_next_session")
    out = result.stdout.str()
    assert f"left alone: pid {relay} (user root, runuser" in out, out
    assert f"pid {theirs} of user {victim.name}" in out
    assert alive(relay) and alive(theirs), out
    assert victim.signals() == [], out
# ---- 5. a self-replacing chain is frozen and killed, and does not outlive pytest ---------------------------


def test_a_self_replacing_chain_is_frozen_and_killed(example: Callable[..., Path], pytester: pytest.Pytester,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    marker = f"chain-{uuid.uuid4().hex[:12]}"
    monkeypatch.setenv("CHAIN_MARKER", marker)
    example("safety/chain", "scripts/self_replacing.py")
    try:
        result = run_inner(pytester, "--gpuclean-grace=1")
        out = result.stdout.str()
        result.assert_outcomes(passed=2, errors=1)
        # Which pass catches a member alive is the scheduler's to decide: the chain rule freezes the owner's
        # set, or a member alive at the first pass is reaped and its replacement frozen; either way stopped
        # and killed with SIGKILL, and a leak.
        result.stdout.fnmatch_lines([f"{LEAK_PREFIX} * (reaped)", "*ended by SIGKILL*"])
        result.stdout.re_match_lines([
            r"note: (a self-replacing chain \(each process forks the next and exits at once; \d+ born while "
            r"the check waited: .*\): |new processes appeared while reaping \(round \d+\): .*; )stopped and "
            r"killed with SIGKILL"])
        assert "exited by themselves" not in out
        assert "ERROR at setup of test_next" not in out
        # Nothing of it outlived pytest: looked for over half a second, which is hundreds of its forks.
        deadline = time.monotonic() + 0.5
        while time.monotonic() < deadline:
            assert with_marker(marker) == [], out
            time.sleep(0.01)
    finally:
        kill_marked(marker)


def test_what_replaces_itself_at_the_sessions_end_does_not_outlive_it(
        example: Callable[..., Path], pytester: pytest.Pytester, tmp_path: Path) -> None:
    # No check ever sees this leak (its test is not checked; the report makes the session watch): the sweep
    # at the session's end SIGTERMs it, its handler forks a replacement, and the sweep looks again.
    example("safety/respawner_at_end", "scripts/respawner.py")
    marker = str(pytester.path / "respawner.py")
    try:
        result = run_inner(pytester, f"--gpuclean-report={tmp_path / 'report.json'}", "--gpuclean-grace=1")
        result.assert_outcomes(passed=1)
        deadline = time.monotonic() + 0.3
        while time.monotonic() < deadline:
            assert with_marker(marker) == [], result.stdout.str()
            time.sleep(0.01)
    finally:
        kill_marked(marker)


# ---- 7. a simulated holder file speaks for its process only if its owner may ----------------------------


def test_a_holder_file_planted_by_another_user_names_no_process(victim: Victim, public_tmp: Path) -> None:
    sim = public_tmp / "sim"
    simulate.init(str(sim), 1, 80 * 1024)
    bystander = subprocess.Popen(["sleep", "600"])  # root's, unrelated to anything simulated
    try:
        planted = sim / "0" / str(bystander.pid)
        planted.write_text(str(1 << 30))
        for path in (sim, sim / "0", planted):
            os.chown(path, victim.uid, victim.gid)
        status = gpuclean("status", "--simulate", str(sim))
        assert status.returncode == 0, status.stderr
        assert not re.search(rf"^\s+{bystander.pid}\s", status.stdout, re.MULTILINE), status.stdout
        assert "1024 / 81920 MiB used  no processes" in status.stdout, status.stdout  # charged to no process
        result = gpuclean("reap", "--simulate", str(sim), "--grace", "1")
        assert result.returncode == 0, result.stdout + result.stderr
        assert "nothing to end" in result.stdout, result.stdout
        assert bystander.poll() is None
        # Said once, naming the file, its owner and the process's.
        assert result.stderr.count(str(planted)) == 1, result.stderr
        assert f"user {victim.name}" in result.stderr and "root" in result.stderr, result.stderr
        # In a session: no process is listed (nothing to own or reap), the memory is no process's, and the
        # file is named once in the session's notes however often it is read.
        backend = SimulatedBackend(sim)
        checker = Checker(backend, CheckSettings(dead_sessions=False))
        for _ in range(2):
            found = checker.check("check", backend.devices(), tolerance_mib=0, timeout=0)
            assert [(o.reason, o.process) for o in found.offenders] == [("memory", None)], found.offenders
        assert [line for line in checker.notices if str(planted) in line] == [
            f"simulated device file {str(planted)!r} belongs to user {victim.name}, but pid {bystander.pid} "
            "runs as root: it cannot speak for that process (ignored: its bytes count as memory of no "
            "process)"]
        assert bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait()
