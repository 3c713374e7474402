"""The shared lock directory under attack, and locks that outlive a fork.

Other users are real: a user made with ``useradd`` for the test, and steps run as that user in a forked
child that drops to its uid (the interpreter lives where other users can't exec it). Tests that need root
skip without it, saying why.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers import EXAMPLES, alive

from pytest_gpuclean._locks import held as held_mod
from pytest_gpuclean._locks.directory import HOST, QUEUE_AFTER_S, LockDirError, take_notices
from pytest_gpuclean._locks.gpus import GpuLocks, LockTimeout
from pytest_gpuclean._locks.held import HELD_VAR
from pytest_gpuclean._locks.holders import clean_text
from pytest_gpuclean._model.records import LockHolder
from pytest_gpuclean._reading import procfs

ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not ROOT, reason="acting as another user or mounting a tmpfs needs root")


@dataclass(frozen=True)
class User:
    name: str
    uid: int
    gid: int


@pytest.fixture(scope="module")
def other_user() -> Iterator[User]:
    """A real local user for the test, removed afterwards."""
    if not ROOT:
        pytest.skip("creating a second user needs root")
    useradd = shutil.which("useradd")
    if useradd is None:
        pytest.skip("useradd is not installed")
    name = f"gpucl{os.getpid() % 100000}"
    made = subprocess.run([useradd, "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
                          capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"useradd failed: {made.stderr.strip()}")
    try:
        import pwd

        entry = pwd.getpwnam(name)
        yield User(name, entry.pw_uid, entry.pw_gid)
    finally:
        subprocess.run([shutil.which("userdel") or "userdel", name], capture_output=True)


@pytest.fixture
def shared_tmp() -> Iterator[Path]:
    """A sticky world-writable directory like /tmp, that every user can reach (tmp_path is root's own)."""
    base = Path(tempfile.mkdtemp(prefix="gpuclean-locktest-"))
    base.chmod(0o1777)
    try:
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


@contextlib.contextmanager
def as_user(user: User, action: Callable[[], str]) -> Iterator[tuple[int, str]]:
    """Run ``action`` as ``user`` in a forked child; while the block runs, the child waits (holding what
    it took); yields (child pid, what ``action`` returned or raised)."""
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - reports through the pipe
        try:
            os.close(ready_r)
            os.close(go_w)
            os.setgroups([])
            os.setgid(user.gid)
            os.setuid(user.uid)
            answer = action()
        except BaseException as exc:
            answer = f"{type(exc).__name__}: {exc}"
        os.write(ready_w, answer.encode().replace(b"\n", b"\\n") + b"\n")
        os.read(go_r, 1)
        os._exit(0)
    os.close(ready_w)
    os.close(go_r)
    try:
        with os.fdopen(ready_r) as f:
            answer = f.readline().rstrip("\n")
        yield pid, answer
    finally:
        os.close(go_w)
        os.waitpid(pid, 0)


def run_as(user: User, action: Callable[[], str]) -> str:
    with as_user(user, action) as (_pid, answer):
        return answer


LOCK_HOLDER = [sys.executable, str(EXAMPLES / "scripts" / "lock_holder.py")]
"""A process that takes a GPU's lock, says READY, then waits for the end of its stdin, dies or raw-forks."""


@contextlib.contextmanager
def holding(lock_dir: str, uuid: str = "GPU-a") -> Iterator[subprocess.Popen[str]]:
    """Another process holds ``uuid``'s lock until its stdin ends; then it releases it and prints the
    notices."""
    proc = subprocess.Popen([*LOCK_HOLDER, lock_dir, uuid, "wait"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("READY"), line
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


# ---- 1. the directory is opened once, never through a link ----------------------------------------

@needs_root
def test_directory_swapped_for_a_link_after_start_gets_nothing(other_user: User, shared_tmp: Path) -> None:
    # Another user makes the lock directory; a root session starts using it; the user then renames it
    # and puts a link to a directory of their choice in its place.
    lock_dir, moved, target = shared_tmp / "locks", shared_tmp / "locks.moved", shared_tmp / "target"
    target.mkdir(mode=0o755)  # root's: the attacker wants root to create files here

    def make_dir() -> str:
        lock_dir.mkdir()
        lock_dir.chmod(0o1777)
        return "made"

    assert run_as(other_user, make_dir) == "made"
    locks = GpuLocks(str(lock_dir))
    locks.acquire(["GPU-a"], 1, 5, "root::first").release()

    def swap() -> str:
        lock_dir.rename(moved)
        lock_dir.symlink_to(target)
        return "swapped"

    assert run_as(other_user, swap) == "swapped"
    with pytest.raises(LockDirError, match=r"lock directory .*locks': it is a symbolic link \(owner uid "
                                           f"{other_user.uid}\\)"):
        locks.acquire(["GPU-b"], 1, 5, "root::second")
    assert list(target.iterdir()) == []
    # A session started after the swap refuses the link too.
    with pytest.raises(LockDirError, match="symbolic link"):
        GpuLocks(str(lock_dir))
    assert list(target.iterdir()) == []


@needs_root
def test_planted_links_fifos_and_hard_links_are_never_used(other_user: User, shared_tmp: Path) -> None:
    lock_dir = shared_tmp / "locks"
    locks = GpuLocks(str(lock_dir))
    victim = shared_tmp / "victim"
    victim.write_text("root's data\n")
    victim.chmod(0o666)  # writable by all, so a hard link to it passes any permission check

    def plant() -> str:
        (lock_dir / "GPU-link.lock").symlink_to(victim)
        os.mkfifo(lock_dir / "GPU-fifo.lock")
        os.link(victim, lock_dir / "GPU-hard.lock")
        return "planted"

    assert run_as(other_user, plant) == "planted"
    for uuid, why in (("GPU-link", "is a symbolic link"), ("GPU-fifo", "is not a regular file"),
                      ("GPU-hard", "is not a regular file with a single link")):
        with pytest.raises(LockDirError, match=f"lock file {uuid}.lock {why}"):
            locks.acquire([uuid], 1, 5, "root::test")  # returns at once: a FIFO never blocks the open
    assert victim.read_text() == "root's data\n"


# ---- 2. a directory we did not create keeps its mode -----------------------------------------------

def test_existing_directory_keeps_its_mode(tmp_path: Path) -> None:
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    home_like = tmp_path / "home"
    home_like.mkdir(mode=0o755)
    home_like.chmod(0o755)
    for directory, mode in ((private, 0o700), (home_like, 0o755)):
        GpuLocks(str(directory)).acquire(["GPU-a"], 1, 5, "t::test").release()
        assert stat.S_IMODE(directory.stat().st_mode) == mode
    created = tmp_path / "made" / "locks"
    GpuLocks(str(created)).acquire(["GPU-a"], 1, 5, "t::test").release()
    assert stat.S_IMODE(created.stat().st_mode) == 0o1777  # made by gpuclean: shared like /tmp
    assert stat.S_IMODE((created / "GPU-a.lock").stat().st_mode) == 0o666
    assert stat.S_IMODE((created / f"GPU-a.{os.geteuid()}.holder").stat().st_mode) == 0o644


def test_world_writable_directory_without_sticky_bit_is_refused(tmp_path: Path,
                                                                pytester: pytest.Pytester) -> None:
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    with pytest.raises(LockDirError, match=r"every user can write it and it has no sticky bit \(owner uid "
                                           rf"\d+, mode 777\).*run 'chmod \+t {open_dir}'"):
        GpuLocks(str(open_dir))
    assert stat.S_IMODE(open_dir.stat().st_mode) == 0o777
    sim = tmp_path / "sim"
    (sim / "0").mkdir(parents=True)
    # The directory is opened when the session starts checking: a session with a checked test.
    pytester.copy_example("test_marked.py")
    result = pytester.runpytest_subprocess("-p", "gpuclean", f"--gpuclean-simulate={sim}",
                                           f"--gpuclean-lock-dir={open_dir}")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"ERROR: --gpuclean-lock-dir: cannot use GPU lock directory '{open_dir}': "
                                 "every user can write it and it has no sticky bit*(from the command line)*"])


@needs_root
def test_directory_another_user_cannot_write_is_refused_with_advice(other_user: User,
                                                                    shared_tmp: Path) -> None:
    closed = shared_tmp / "closed"
    closed.mkdir(mode=0o755)
    answer = run_as(other_user, lambda: str(GpuLocks(str(closed)).directory))
    assert answer == (f"LockDirError: cannot use GPU lock directory '{closed}': not writable by uid "
                      f"{other_user.uid} (owner uid 0, mode 755); gpuclean did not create it, so it leaves "
                      f"its mode alone: if it is meant to be shared its owner can run 'chmod 1777 {closed}', "
                      "else choose another with --gpuclean-lock-dir")


@needs_root
def test_three_users_share_a_directory_gpuclean_made(other_user: User, shared_tmp: Path) -> None:
    lock_dir = str(shared_tmp / "locks")

    def lock_and_release() -> str:
        locks = GpuLocks(lock_dir)
        held = locks.acquire(["GPU-a"], 1, 5, f"user {os.getuid()}")
        recorded = locks.holder("GPU-a")
        held.release()
        assert recorded is not None
        return f"ok {recorded.pid == os.getpid()} {recorded.user}"

    # The other user makes the directory and the lock file; root and a third uid use them.
    assert run_as(other_user, lock_and_release) == f"ok True {other_user.name}"
    assert lock_and_release() == "ok True root"
    third = User("nobody", 65534, 65534)
    assert run_as(third, lock_and_release) == "ok True nobody"


# ---- 3. a held lock file deleted by hand or by a cleaner -------------------------------------------

def test_deleted_held_lock_file_lets_nobody_in(tmp_path: Path) -> None:
    lock_dir = str(tmp_path / "locks")
    with holding(lock_dir) as holder:
        os.unlink(tmp_path / "locks" / "GPU-a.lock")  # while the holder runs its test
        locks = GpuLocks(lock_dir)
        with pytest.raises(LockTimeout, match=r"GPU-a: its lock file was deleted .* while a session held "
                                              r"the GPU, which it still does through the deleted file: pid "
                                              rf"{holder.pid} .* running holder::test, .*; a new lock file "
                                              r"is made as soon as it lets go"):
            locks.acquire(["GPU-a"], 1, 0.5, "second::test")
        assert not (tmp_path / "locks" / "GPU-a.lock").exists()
        assert holder.stdin is not None and holder.stdout is not None
        holder.stdin.close()  # the holder's test ends
        notices = holder.stdout.read()
    assert f"lock file {lock_dir}/GPU-a.lock was deleted or replaced while this session held it" in notices
    locks.acquire(["GPU-a"], 1, 5, "second::test").release()
    assert (tmp_path / "locks" / "GPU-a.lock").exists()


def test_missing_lock_file_of_a_free_gpu_is_made_while_other_gpus_are_held(tmp_path: Path) -> None:
    # A lock file that does not exist yet (a new GPU, a new directory, a cleaner's work) concerns only its
    # own GPU: it is made at once while other sessions hold other GPUs, even one whose file was deleted.
    lock_dir = str(tmp_path / "locks")
    with holding(lock_dir, "GPU-a") as holder:
        os.unlink(tmp_path / "locks" / "GPU-a.lock")  # deleted under its holder: stays protected
        locks = GpuLocks(lock_dir)
        told: list[dict[str, LockHolder]] = []
        held = locks.acquire(["GPU-b"], 1, 0, "second::test", on_wait=told.append)
        assert (held.uuids, told) == (("GPU-b",), [])
        held.release()
        with pytest.raises(LockTimeout, match="GPU-a: its lock file was deleted"):
            locks.acquire(["GPU-a", "GPU-b"], 2, 0.3, "third::test")
        assert not (tmp_path / "locks" / "GPU-a.lock").exists()
        assert holder.stdin is not None
        holder.stdin.close()
        assert holder.wait(timeout=60) == 0
    locks.acquire(["GPU-a", "GPU-b"], 2, 5, "fourth::test").release()


MARKING = """
import fcntl, os, sys
from pytest_gpuclean._locks import directory
fd = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECTORY)
offset = getattr(directory.marks_of("GPU-a"), sys.argv[2])
fcntl.fcntl(fd, fcntl.F_OFD_SETLK, directory._FLOCK.pack(fcntl.F_RDLCK, 0, offset, 1, 0))
print("MARKED", flush=True)
sys.stdin.read()
"""


@contextlib.contextmanager
def marking(lock_dir: str, mark: str) -> Iterator[None]:
    """Another process keeps GPU-a's ``mark`` (see directory._Marks) up on the lock directory meanwhile."""
    proc = subprocess.Popen([sys.executable, "-c", MARKING, lock_dir, mark], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdin is not None
        assert proc.stdout.readline() == "MARKED\n"
        yield
        proc.stdin.close()
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()
        proc.wait()


def test_a_gpu_whose_lock_file_is_being_made_is_not_taken(tmp_path: Path) -> None:
    # The holder's half of the handshake in directory.create: while another session is making GPU-a's lock
    # file (it saw the name missing), a descriptor of an older GPU-a file may be one that was deleted, so
    # it is not trusted; other GPUs are.
    lock_dir = str(tmp_path / "locks")
    locks = GpuLocks(lock_dir)
    locks.prepare(["GPU-a", "GPU-b"])
    with marking(lock_dir, "make"):  # as _create does between seeing the name missing and making the file
        with pytest.raises(LockTimeout, match=r"GPU-a: its lock file is being created by another session"):
            locks.acquire(["GPU-a"], 1, 0.3, "first::test")
        held = locks.acquire(["GPU-a", "GPU-b"], 1, 0, "second::test")
        held.release()
        assert held.uuids == ("GPU-b",)
    locks.acquire(["GPU-a"], 1, 5, "third::test").release()


def test_a_newcomer_leaves_a_free_gpu_to_a_session_that_has_waited_long(tmp_path: Path) -> None:
    lock_dir = str(tmp_path / "locks")
    locks = GpuLocks(lock_dir)
    with marking(lock_dir, "queue"):  # another session has waited a second for GPU-a, and still waits
        held = locks.acquire(["GPU-a", "GPU-b"], 1, 0, "first::test")  # GPU-a comes first, but is free
        held.release()
        assert held.uuids == ("GPU-b",)
        with pytest.raises(LockTimeout, match=r"GPU-a: free, but another session has waited over 1s for it "
                                              r"and goes first \(long waiters before newcomers\)"):
            locks.acquire(["GPU-a"], 1, 0.3, "second::test")
        # Once this session has waited as long, it queues too, and the queued compete as equals: a queue
        # mark left up (a waiter's raw-forked child that kept its descriptor) never keeps a GPU out of use.
        held = locks.acquire(["GPU-a"], 1, 10, "third::test")
        held.release()
        assert held.waited_s >= QUEUE_AFTER_S  # (it could not have it before it queued)


def other_session_tries(lock_dir: str, uuid: str) -> str:
    """Another session (not a child of this one's test: no ``HELD_VAR``) tries to lock ``uuid`` for 0.3 s:
    "locked", or why not (its LockTimeout)."""
    script = ("import sys; from pytest_gpuclean._locks.gpus import GpuLocks, LockTimeout\n"
              "try: GpuLocks(sys.argv[1]).acquire([sys.argv[2]], 1, 0.3, 'other::test').release()\n"
              "except LockTimeout as exc: print(exc)\n"
              "else: print('locked')")
    env = {k: v for k, v in os.environ.items() if k != HELD_VAR}
    return subprocess.run([sys.executable, "-c", script, lock_dir, uuid], capture_output=True, text=True,
                          check=True, env=env).stdout


def recorded_test(locks: GpuLocks, uuid: str) -> str | None:
    """The test that ``uuid``'s newest valid holder record names (None: no record)."""
    record = locks.holder(uuid)
    return None if record is None else record.test


def test_locks_kept_for_the_next_test_are_that_tests(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # HeldLocks.park: between two tests of one session nobody waits, so the locks stay; the next acquire
    # that needs just those GPUs takes them as they are (its own records), one that needs others lets
    # them go first.
    monkeypatch.delenv(HELD_VAR, raising=False)  # (a session whose test holds GPUs would inherit them)
    lock_dir = str(tmp_path / "locks")
    locks = GpuLocks(lock_dir)
    locks.prepare(["GPU-a", "GPU-b"])
    held = locks.acquire(["GPU-a", "GPU-b"], 1, 5, "first::test")
    assert held.uuids == ("GPU-a",) and held.park()
    assert HELD_VAR in os.environ  # (they are held: a session started now would inherit them)
    assert recorded_test(locks, "GPU-a") == "first::test"
    assert "GPU-a: pid" in other_session_tries(lock_dir, "GPU-a")  # still locked: nobody else gets it
    again = locks.acquire(["GPU-a", "GPU-b"], 1, 5, "second::test", parked=held)
    assert again is held and not held.parked and HELD_VAR in os.environ
    assert recorded_test(locks, "GPU-a") == "second::test"
    # A record too long for the padded size, then a short one again: each reads back whole.
    for name in ("long::test[" + "x" * 600 + "]", "short::test"):
        assert held.park()
        assert locks.acquire(["GPU-a", "GPU-b"], 1, 5, name, parked=held) is held
        assert str(recorded_test(locks, "GPU-a"))[:100] == name[:100]  # (texts are cut when read)
    assert held.park()
    both = locks.acquire(["GPU-a", "GPU-b"], 2, 5, "third::test", parked=held)
    assert both is not held and both.uuids == ("GPU-a", "GPU-b") and not held.locks
    both.release()
    assert locks.holder("GPU-a") is None and locks.holder("GPU-b") is None and HELD_VAR not in os.environ


def test_kept_locks_interrupted_while_the_next_test_takes_them_are_let_go(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Ctrl-C (or a pytest-timeout signal) while the next test rewrites the records: its caller no longer
    # has the kept locks to let go of, so the acquire does.
    monkeypatch.delenv(HELD_VAR, raising=False)
    lock_dir = str(tmp_path / "locks")
    locks = GpuLocks(lock_dir)
    locks.prepare(["GPU-a"])  # (as a session's start does: a record file made later changes the directory)
    held = locks.acquire(["GPU-a"], 1, 5, "first::test")
    assert held.park()

    def interrupted(*args: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(held_mod, "write_records", interrupted)
    with pytest.raises(KeyboardInterrupt):
        locks.acquire(["GPU-a"], 1, 5, "second::test", parked=held)
    monkeypatch.undo()
    assert other_session_tries(lock_dir, "GPU-a") == "locked\n" and HELD_VAR not in os.environ


def test_kept_locks_after_a_test_scrubbed_the_environment_are_taken_anew(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A test that cleared os.environ (or a hook between two tests) took HELD_VAR away: what a session the
    # next test starts would inherit no longer says these locks, so they are let go and taken afresh,
    # and HELD_VAR says them again.
    monkeypatch.delenv(HELD_VAR, raising=False)
    lock_dir = str(tmp_path / "locks")
    locks = GpuLocks(lock_dir)
    locks.prepare(["GPU-a"])
    held = locks.acquire(["GPU-a"], 1, 5, "first::test")
    assert held.park()
    del os.environ[HELD_VAR]
    again = locks.acquire(["GPU-a"], 1, 5, "second::test", parked=held)
    assert again is not held and not held.locks and HELD_VAR in os.environ
    assert recorded_test(locks, "GPU-a") == "second::test"
    assert "second::test" in other_session_tries(lock_dir, "GPU-a")
    again.release()
    assert HELD_VAR not in os.environ


@pytest.mark.parametrize("mark", ["queue", "make"])
def test_locks_are_not_kept_while_another_session_waits(tmp_path: Path, mark: str) -> None:
    # A queue mark: a session has waited a second for a GPU (for this one or not: one request looks at
    # all); a make mark: one is making a lock file. Either way the test boundary is its chance.
    lock_dir = str(tmp_path / "locks")
    locks = GpuLocks(lock_dir)
    locks.prepare(["GPU-b"])
    held = locks.acquire(["GPU-b"], 1, 5, "first::test")
    with marking(lock_dir, mark):  # (GPU-a's mark: another GPU than the one held)
        assert not held.park()
    held.release()
    held = locks.acquire(["GPU-b"], 1, 5, "second::test")
    assert held.park()
    held.release()
    assert locks.holder("GPU-b") is None


def test_lock_file_deleted_while_its_lock_is_kept_is_seen_at_the_next_test(tmp_path: Path) -> None:
    # Deleted between two tests (a tmp cleaner): the kept lock is on an inode nobody else sees, so the
    # next test lets it go (saying so), makes a new file and locks that one.
    lock_dir = str(tmp_path / "locks")
    locks = GpuLocks(lock_dir)
    locks.prepare(["GPU-a"])
    held = locks.acquire(["GPU-a"], 1, 5, "first::test")
    assert held.park()
    os.unlink(tmp_path / "locks" / "GPU-a.lock")
    again = locks.acquire(["GPU-a"], 1, 5, "second::test", parked=held)
    assert again is not held
    assert any(f"lock file {lock_dir}/GPU-a.lock was deleted or replaced" in n
               for n in take_notices())
    assert "second::test" in other_session_tries(lock_dir, "GPU-a")  # the new file is the one locked
    again.release()


STREAM = """
import os, sys, time
from pathlib import Path
from pytest_gpuclean._locks import gpus
gpu = gpus.GpuLocks(sys.argv[1])
stop = Path(sys.argv[2])
tests = 0
while not stop.exists():
    # One test after another, as fast as a session can: the lock is free for microseconds between them.
    held = gpu.acquire(["GPU-a"], 1, 60, f"stream::test_{tests}")
    if tests == 0:
        print("STREAMING", flush=True)
    time.sleep(0.05)
    held.release()
    tests += 1
"""


def test_a_waiter_is_not_kept_out_by_a_stream_of_tests(tmp_path: Path) -> None:
    lock_dir = str(tmp_path / "locks")
    stop = tmp_path / "stop"
    stream = subprocess.Popen([sys.executable, "-c", STREAM, lock_dir, str(stop)], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert stream.stdout is not None
        assert stream.stdout.readline() == "STREAMING\n"
        # Without the queue, this acquire polls every 20-100 ms for a gap of microseconds: it would have to
        # be lucky. Once it has waited a second, the stream's next test lets it go first.
        held = GpuLocks(lock_dir).acquire(["GPU-a"], 1, 20, "waiter::test")
        assert stream.poll() is None  # (the stream is still going: it did not just end)
        held.release()
        stop.write_text("")
        out = stream.communicate(timeout=60)[0]
    finally:
        stream.kill()
        stream.wait()
    assert stream.returncode == 0, out


def test_a_waiter_moves_to_a_lock_directory_made_anew(tmp_path: Path) -> None:
    # The lock directory is moved away (or removed) while a session waits for a GPU held in it: the waiter
    # notices at its next attempt, uses the new directory and says so.
    lock_dir = tmp_path / "locks"
    locks = GpuLocks(str(lock_dir))
    locks.prepare(["GPU-a"])
    with holding(str(lock_dir), "GPU-a") as holder:
        moved = threading.Timer(0.5, lambda: (lock_dir.rename(tmp_path / "old"), lock_dir.mkdir()))
        moved.start()
        try:
            held = locks.acquire(["GPU-a"], 1, 20, "waiter::test")
        finally:
            moved.join()
        held.release()
        assert holder.poll() is None  # (still holding GPU-a in the old directory)
    assert held.waited_s > 0
    assert (lock_dir / "GPU-a.lock").exists()
    assert any("was removed or replaced while this session ran" in n for n in take_notices())


def test_lock_file_replaced_between_tests_is_seen_though_names_are_not_looked_up(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Once the directory has been unchanged for a while, a test's locks skip looking their names up
    # (held.still_named): its ctime says no entry was added or removed. Replacing a lock file changes it.
    lock_dir = str(tmp_path / "locks")
    locks = GpuLocks(lock_dir)
    locks.prepare(["GPU-a"])
    locks.acquire(["GPU-a"], 1, 5, "first::test").release()  # (the holder record is created: a change)
    time.sleep(procfs.SETTLED_NS / 1e9 + 0.02)
    locks.acquire(["GPU-a"], 1, 5, "second::test").release()  # looks the name up, and trusts the ctime
    lookups: list[str] = []
    real_stat = os.stat

    def counting_stat(path: object, *args: object, **kwargs: object) -> os.stat_result:
        if kwargs.get("dir_fd") is not None:
            lookups.append(str(path))
        return real_stat(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "stat", counting_stat)
    locks.acquire(["GPU-a"], 1, 5, "third::test").release()
    assert lookups == []  # the fast path is taken
    # Another session (or a hand) replaces the lock file and holds the new one: this session must not lock
    # the old file, which nobody else would see.
    os.unlink(tmp_path / "locks" / "GPU-a.lock")
    with holding(lock_dir) as holder:
        with pytest.raises(LockTimeout, match="GPU-a"):
            locks.acquire(["GPU-a"], 1, 0.5, "fourth::test")
        assert "GPU-a.lock" in lookups
        assert holder.stdin is not None
        holder.stdin.close()
    locks.acquire(["GPU-a"], 1, 5, "fifth::test").release()


def test_tmp_cleaner_leaves_a_lock_directory_alone_while_a_lock_is_held(tmp_path: Path) -> None:
    tmpfiles = shutil.which("systemd-tmpfiles")
    if tmpfiles is None:
        pytest.skip("systemd-tmpfiles is not installed")
    parent = tmp_path / "tmp"
    lock_dir = parent / "gpuclean-locks"
    GpuLocks(str(lock_dir)).acquire(["GPU-a"], 1, 5, "first::test").release()
    lock_file = lock_dir / "GPU-a.lock"
    old = time.time() - 30 * 86400
    os.utime(lock_file, (old, old))
    config = tmp_path / "clean.conf"
    # Aging like /tmp's, by mtime only: lock files never change theirs.
    config.write_text(f"e {parent} - - - m:1s\n")

    def clean() -> None:
        subprocess.run([tmpfiles, "--clean", str(config)], check=True, capture_output=True)

    with holding(str(lock_dir)) as holder:
        clean()
        assert lock_file.exists()
        assert holder.stdin is not None
        holder.stdin.close()
        assert holder.wait(timeout=60) == 0
    # The exclusion docs/sharing.md recommends keeps it when nobody holds a lock, too.
    config.write_text(f"e {parent} - - - m:1s\nx {lock_dir}\n")
    clean()
    assert lock_file.exists()
    config.write_text(f"e {parent} - - - m:1s\n")
    clean()
    assert not lock_file.exists()  # the cleaner does clean, when nobody holds a lock there
    GpuLocks(str(lock_dir)).acquire(["GPU-a"], 1, 5, "next::test").release()


# ---- forked children never hold a lock; the real holder is named ------------------------------------

def test_child_of_a_raw_fork_does_not_keep_the_lock(tmp_path: Path) -> None:
    lock_dir = str(tmp_path / "locks")
    child_file = tmp_path / "child"
    # It forks through libc (no os.register_at_fork hook runs in the child), and is killed.
    subprocess.run([*LOCK_HOLDER, lock_dir, "GPU-a", "raw-fork", str(child_file)], stdout=subprocess.DEVNULL,
                   timeout=60)
    child = int(child_file.read_text())
    try:
        assert alive(child)
        GpuLocks(lock_dir).acquire(["GPU-a"], 1, 5, "next::test").release()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)


def test_child_of_a_raw_fork_and_its_parent_exclude_each_other(tmp_path: Path) -> None:
    # The child inherited the parent's open lock files: a lock it takes must still keep the parent out.
    lock_dir = str(tmp_path / "locks")
    script = """
import ctypes, os, sys, time
from pytest_gpuclean._locks import gpus
gpus.GpuLocks(sys.argv[1]).acquire(["GPU-a"], 1, 5, "parent::first").release()  # GPU-a's file stays open
held = gpus.GpuLocks(sys.argv[1]).acquire(["GPU-b"], 1, 5, "parent::holds")
print("READY", flush=True)
libc = ctypes.CDLL(None)
child = libc.fork()
if child == 0:
    mine = gpus.GpuLocks(sys.argv[1]).acquire(["GPU-a"], 1, 5, "child::test")
    os.write(1, b"CHILD HOLDS\\n")
    time.sleep(120)
    os._exit(0)
assert sys.stdin.readline() == "go\\n"
try:
    gpus.GpuLocks(sys.argv[1]).acquire(["GPU-a"], 1, 0.3, "parent::second")
    print("PARENT GOT IT TOO", flush=True)
except gpus.LockTimeout:
    print("PARENT KEPT OUT", flush=True)
os.kill(child, 9)
os.waitpid(child, 0)
"""
    proc = subprocess.Popen([sys.executable, "-c", script, lock_dir], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdin is not None
        assert proc.stdout.readline().startswith("READY")
        assert proc.stdout.readline() == "CHILD HOLDS\n"
        proc.stdin.write("go\n")
        proc.stdin.flush()
        assert proc.stdout.readline() == "PARENT KEPT OUT\n"
        assert proc.wait(timeout=60) == 0  # after it killed its child
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("unreaped", [False, True], ids=["reaped", "zombie"])
def test_waiting_names_the_real_holder_not_a_stale_record(tmp_path: Path, unreaped: bool) -> None:
    lock_dir = str(tmp_path / "locks")
    # A session records itself and is killed: its record stays. A zombie (its parent has not waited for
    # it yet) holds no lock either: it is as gone as a reaped one.
    dead = subprocess.Popen([*LOCK_HOLDER, lock_dir, "GPU-a", "die"], stdout=subprocess.PIPE, text=True)
    assert dead.stdout is not None
    with dead.stdout:
        dead_pid = int(dead.stdout.read().split()[1])  # (read to its end: it is a zombie now)
    if not unreaped:
        dead.wait(timeout=60)
    # Then some other process takes the lock without recording itself.
    lock_file = tmp_path / "locks" / "GPU-a.lock"
    taker = subprocess.Popen([sys.executable, "-c", "import fcntl, sys; f = open(sys.argv[1], 'r+'); "
                              "fcntl.lockf(f, fcntl.LOCK_EX); print('LOCKED', flush=True); sys.stdin.read()",
                              str(lock_file)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert taker.stdout is not None and taker.stdout.readline() == "LOCKED\n"
        told: list[dict[str, LockHolder]] = []
        expected = r"^waited .* for 1 of 1 GPU lock\(s\); held by: GPU-a: "
        with pytest.raises(LockTimeout, match=expected) as timeout:
            GpuLocks(lock_dir).acquire(["GPU-a"], 1, 0.5, "waiter::test", on_wait=told.append)
        message = str(timeout.value)
        assert f"GPU-a: pid {taker.pid} (user root: {sys.executable} -c import fcntl" in message
        assert (f"which left no record; the newest record, pid {dead_pid} (user root) on "
                f"{HOST} running holder::test, for ") in message
        assert message.endswith("is stale (that process is gone)")
        assert told[0]["GPU-a"].lock_pid == taker.pid
    finally:
        taker.kill()
        taker.wait()
        dead.wait(timeout=60)


# ---- 4. holder records are untrusted input ---------------------------------------------------------

HOSTILE_TEST = "\n::error::pwned\x1b[31m red \x1b]8;;http://x\x07\u202egnp.exe\r\n::add-mask::secret"


@needs_root
def test_hostile_holder_records_are_validated_and_cleaned(other_user: User, shared_tmp: Path) -> None:
    lock_dir = shared_tmp / "locks"
    GpuLocks(str(lock_dir))

    def hold_and_lie() -> str:
        taken = []
        for uuid, since in (("GPU-a", time.time()), ("GPU-b", -999999.0)):
            fd = os.open(lock_dir / f"{uuid}.lock", os.O_RDWR | os.O_CREAT, 0o666)
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            taken.append(fd)
            record = {"pid": os.getpid(), "host": HOST, "uid": os.getuid(), "test": HOSTILE_TEST,
                      "since": since, "uuid": uuid}
            (lock_dir / f"{uuid}.{os.getuid()}.holder").write_text(json.dumps(record))
        # A record under root's name, claiming root holds GPU-b for a test of its choosing.
        (lock_dir / "GPU-b.0.holder").write_text(json.dumps(
            {"pid": 1, "host": HOST, "uid": 0, "test": "forged::by_another_user",
             "since": time.time(), "uuid": "GPU-b"}))
        globals()["_keep"] = taken
        return "holding"

    with as_user(other_user, hold_and_lie) as (pid, answer):
        assert answer == "holding"
        locks = GpuLocks(str(lock_dir))
        with pytest.raises(LockTimeout, match=r"^waited .* for 2 of 2 GPU lock\(s\); held by: ") as timeout:
            locks.acquire(["GPU-a", "GPU-b"], 2, 0.3, "root::test")
        message = str(timeout.value)
        assert all(c.isprintable() for c in message), repr(message)
        assert "\x1b" not in message and "\u202e" not in message
        assert "?::error::pwned [31m red ]8;;http://x gnp.exe ::add-mask::secret" in message
        for line in message.splitlines():
            assert not line.lstrip().startswith(("::", "##")), line
        # GPU-a: the (cleaned) record is the holder's own. GPU-b: its record has a negative time and the
        # one under root's name was written by someone else: neither is believed; the kernel names the holder.
        assert f"GPU-a: pid {pid} (user {other_user.name}) on " in message
        assert f"GPU-b: pid {pid} (user {other_user.name}: " in message and "which left no record" in message
        assert "forged" not in message and "-999" not in message
        assert locks.holder("GPU-b") is None
    # Root's own record replaces the squatter's file.
    held = GpuLocks(str(lock_dir)).acquire(["GPU-b"], 1, 5, "root::after")
    try:
        info = (lock_dir / "GPU-b.0.holder").stat()
        assert info.st_uid == 0 and recorded_test(GpuLocks(str(lock_dir)), "GPU-b") == "root::after"
    finally:
        held.release()


def test_clean_text_neutralises_what_a_terminal_or_ci_runner_would_interpret() -> None:
    assert clean_text("::error::x") == "?::error::x"
    assert clean_text("  ##[error]x") == "?##[error]x"
    assert clean_text("a\nb\rc\x1b[2Jd\x85e\u2028f\u200bg") == "a b c [2Jd e f g"
    assert clean_text(42) == "?"
    assert len(clean_text("x" * 1000)) == 300


# ---- 5. a full file system ---------------------------------------------------------------------------

@pytest.fixture
def tiny_fs(tmp_path: Path) -> Iterator[Path]:
    """A tmpfs with 4 inodes: its root, the lock directory, one lock file, one more file."""
    if not ROOT:
        pytest.skip("mounting a tmpfs needs root")
    mount_point = tmp_path / "tiny"
    mount_point.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k,nr_inodes=4", "tmpfs",
                              str(mount_point)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], capture_output=True)


def test_full_lock_directory_is_named_in_a_clear_message(tiny_fs: Path, tmp_path: Path,
                                                         pytester: pytest.Pytester) -> None:
    # A session on three GPUs: its lock directory takes the second inode, two lock files the last two.
    lock_dir = tiny_fs / "locks"
    sim = tmp_path / "sim"
    for index in range(3):
        (sim / str(index)).mkdir(parents=True)
    pytester.copy_example("test_marked.py")
    result = pytester.runpytest_subprocess("-p", "gpuclean", f"--gpuclean-simulate={sim}",
                                           f"--gpuclean-lock-dir={lock_dir}")
    assert result.ret == pytest.ExitCode.USAGE_ERROR, result.stdout.str()
    result.stderr.fnmatch_lines([f"ERROR: --gpuclean-lock-dir: cannot use GPU lock directory '{lock_dir}': "
                                 "cannot create lock file GPU-*.lock: no space left on its file system "
                                 "(no free blocks or no free inodes): free some there, or set "
                                 "--gpuclean-lock-dir*"
                                 "(from the command line)"])
    assert "Traceback" not in result.stderr.str()
    # Later, when a test needs a lock file that does not exist yet: the same message, not an OSError.
    with pytest.raises(LockDirError, match=rf"cannot use GPU lock directory '{lock_dir}': cannot create lock "
                                           r"file GPU-new\.lock: no space left on its file system"):
        GpuLocks(str(lock_dir)).acquire(["GPU-new"], 1, 5, "t::test")
