"""Cross-process GPU locks: one per physical GPU (by UUID) in a directory every session on the host shares.

Each lock is a BSD ``flock`` on ``<dir>/<uuid>.lock``. The kernel drops it when the holder's last
descriptor closes, so a crashed or SIGKILLed session never leaves a GPU locked. Next to each lock a small
JSON file says who holds it, so a waiting session can tell what it waits for.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import glob
import json
import os
import random
import socket
import stat
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pytest_gpuclean import procfs

_HOST = socket.gethostname()
_RECORD_BYTES = 512
_BLANK = b" " * _RECORD_BYTES
_RETRY_S = (0.02, 0.1)
"""Back-off between all-or-nothing attempts, randomised so competing sessions don't stay in step."""
_LOCK_MODE = 0o666
"""Lock files are shared by every user of the GPUs; whoever creates one makes it usable by all."""
HELD_VAR = "GPUCLEAN_HELD_LOCKS"
"""Set while this process holds GPU locks, so its children know: JSON ``{"dir": lock directory,
"holders": {uuid: [pid, start ticks]}}``. A gpuclean session that a test runs (a nested pytest,
pytester) takes those GPUs as its own instead of waiting for its parent's locks until it times out."""

# flock (not filelock.FileLock): filelock 4 refuses, in a sticky directory like ours, a lock file that
# belongs neither to this user nor to the directory's owner, so a third user of a shared GPU box could
# never lock a GPU whose lock file a second user created. We never delete or rename lock files, so the
# inode-replacement race that check guards against only arises from someone deleting files by hand,
# and ``_try`` checks for that too.

_held_fds: set[int] = set()
# Lock and holder files stay open for the whole session (path -> descriptor): opening, renaming and
# closing them for every test cost ~50 us per GPU, more than the clean check itself.
_lock_fds: dict[str, int] = {}
_holder_fds: dict[str, int] = {}
_lock_inodes: dict[int, tuple[int, int]] = {}
"""(st_dev, st_ino) of each open lock file, taken at open: compared with the path's after each flock."""
_me: tuple[int, int] | None = None
"""(pid, start ticks) of this process, read once (again after a fork: the pid differs)."""


def _close_in_forked_child() -> None:
    # A child forked (without exec) shares our open lock files: one that is locked now, or that we lock
    # later, would stay locked through a leaked child after this session dies. Drop every copy in the
    # child (close, not unlock), and forget them so the child opens its own if it locks GPUs.
    for fd in (*_lock_fds.values(), *_holder_fds.values(), *_held_fds):
        with contextlib.suppress(OSError):
            os.close(fd)
    _lock_fds.clear()
    _holder_fds.clear()
    _held_fds.clear()
    _lock_inodes.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_in_forked_child)


class LockTimeout(Exception):
    """The locks could not be had in time; ``holders`` says who has them."""

    def __init__(self, message: str, holders: dict[str, dict[str, object]]) -> None:
        super().__init__(message)
        self.holders = holders


def ensure_lock_dir(path: str) -> str:
    """Create the shared lock directory (sticky and world-writable, like /tmp) if needed."""
    try:
        os.makedirs(path, mode=0o1777, exist_ok=True)
        info = os.lstat(path)
        if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
            raise OSError(f"{path} is not a directory")
        if info.st_uid == os.getuid() and stat.S_IMODE(info.st_mode) != 0o1777:
            os.chmod(path, 0o1777)  # makedirs' mode is filtered by the umask
        elif not os.access(path, os.W_OK | os.X_OK):
            raise OSError(f"not writable by uid {os.getuid()} (owner uid {info.st_uid}, mode "
                          f"{stat.S_IMODE(info.st_mode):o}); its owner can run 'chmod 1777 {path}'")
    except OSError as exc:
        raise OSError(f"cannot use GPU lock directory {path!r}: {exc}") from exc
    return path


@functools.lru_cache(maxsize=256)
def _file_name(uuid: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in uuid)


@dataclass
class HeldLocks:
    """Locks held by this process for one test; release them in ``release``."""

    uuids: tuple[str, ...]
    locks: list[int]
    """Open descriptors of the locked files."""
    holder_fds: list[tuple[int, bool]]
    """This user's holder files of the locked GPUs, blanked at release; True if padded (see _write_holder)."""
    waited_s: float
    inherited: dict[str, tuple[int, int]] = field(default_factory=dict)
    """GPUs an ancestor process holds, with its (pid, start ticks): not locked again, not released."""
    _env: tuple[str | None, str | None] = (None, None)
    """(value of ``HELD_VAR`` before us, the value we set)."""

    def release(self) -> None:
        # Holder record first: once the lock is free, the next holder writes its own. A blank file is
        # no record (``holder`` skips it), and stays open for the next acquire to reuse.
        for fd, padded in self.holder_fds:
            try:  # (try/except, not contextlib.suppress: this runs per GPU and test)
                if padded:
                    os.pwrite(fd, _BLANK, 0)
                else:
                    os.ftruncate(fd, 0)
            except OSError:
                pass
        self.holder_fds = []
        for fd in self.locks:
            _unlock(fd)
        self.locks = []
        previous, ours = self._env
        if ours is not None and os.environ.get(HELD_VAR) == ours:
            if previous is None:
                os.environ.pop(HELD_VAR, None)
            else:
                os.environ[HELD_VAR] = previous
        self._env = (None, None)


def _unlock(fd: int) -> None:
    # The descriptor stays open (cached in _lock_fds) for the next test.
    _held_fds.discard(fd)
    try:  # noqa: SIM105 (per GPU and test: suppress() costs ~1 us)
        fcntl.flock(fd, fcntl.LOCK_UN)
    except OSError:
        pass


def _forget(path: str) -> None:
    fd = _lock_fds.pop(path, None)
    if fd is not None:
        _held_fds.discard(fd)
        _lock_inodes.pop(fd, None)
        with contextlib.suppress(OSError):
            os.close(fd)


def _open_lock_file(path: str) -> int:
    flags = os.O_CLOEXEC | os.O_NOFOLLOW
    while True:
        # Open an existing file without O_CREAT: fs.protected_regular refuses O_CREAT on another user's
        # file in a sticky directory, even when it exists.
        try:
            return os.open(path, flags | os.O_RDWR)
        except FileNotFoundError:
            pass
        except PermissionError:
            # A file made without group/other write (by hand, or an old version): flock needs only a
            # descriptor, not write access (except on NFS, where it becomes a POSIX lock).
            with contextlib.suppress(FileNotFoundError):
                return os.open(path, flags | os.O_RDONLY)
        try:
            fd = os.open(path, flags | os.O_RDWR | os.O_CREAT | os.O_EXCL, _LOCK_MODE)
        except FileExistsError:
            continue  # another session created it just now
        with contextlib.suppress(OSError):
            os.fchmod(fd, _LOCK_MODE)  # past the umask
        return fd


class GpuLocks:
    """Acquire per-GPU locks all-or-nothing, in one global (UUID) order, so no two sessions deadlock."""

    def __init__(self, directory: str) -> None:
        self.directory = ensure_lock_dir(directory)

    def lock_path(self, uuid: str) -> str:
        return f"{self.directory}/{_file_name(uuid)}.lock"

    def holder_path(self, uuid: str) -> str:
        """This user's holder file for ``uuid``.

        One per user: in the sticky lock directory nobody can replace another user's file, and a session
        that was killed leaves its file behind.
        """
        return f"{self.directory}/{_file_name(uuid)}.{os.getuid()}.holder"

    def holder(self, uuid: str) -> dict[str, object]:
        """Who holds ``uuid``'s lock, as recorded next to it (empty if nobody recorded).

        The newest record wins: a holder writes its record after it got the lock, so any older one is
        left over from a session that ended without releasing (killed).
        """
        newest: dict[str, object] = {}
        for path in glob.glob(os.path.join(glob.escape(self.directory), _file_name(uuid) + ".*.holder")):
            try:
                with open(path) as f:
                    data = json.load(f)
            except (OSError, ValueError):
                continue
            if isinstance(data, dict) and _since(data) >= _since(newest):
                newest = data
        return newest

    def _try(self, uuid: str) -> int | None:
        path = self.lock_path(uuid)
        while True:
            fd = _lock_fds.get(path)
            if fd is None:
                fd = _lock_fds[path] = _open_lock_file(path)
                opened = os.fstat(fd)
                _lock_inodes[fd] = (opened.st_dev, opened.st_ino)
            elif fd in _held_fds:
                # Held by this process already (another acquire still open): flock on the same open file
                # would just succeed again, so refuse here as a second open of the file would.
                return None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    return None
                _forget(path)
                raise
            try:
                now = os.stat(path)
                same = (now.st_dev, now.st_ino) == _lock_inodes.get(fd)
            except FileNotFoundError:
                same = False
            if same:
                _held_fds.add(fd)
                return fd
            # The file was deleted (by hand) after we opened it: a lock on that inode locks nothing.
            _unlock(fd)
            _forget(path)

    def acquire(self, candidates: Sequence[str], count: int, timeout: float, holder_id: str,
                prefer: Sequence[str] = (),
                on_wait: Callable[[dict[str, dict[str, object]]], None] | None = None) -> HeldLocks:
        """Lock ``count`` of ``candidates`` (all of them when ``count == len(candidates)``).

        GPUs that an ancestor process holds (see ``HELD_VAR``) count as taken, and come first; then free
        devices are taken in UUID order, those listed in ``prefer`` first. If fewer than ``count`` are
        free, everything taken is released and the attempt repeats until ``timeout``. ``on_wait`` is
        called once, when the first attempt fails, with the holders of the busy devices.
        """
        inherited = {u: h for u, h in self.inherited().items() if u in candidates}
        ordered = sorted(candidates, key=lambda u: (u not in inherited, u not in prefer, u))
        started = time.monotonic()
        notified = False
        while True:
            taken: list[tuple[str, int | None]] = []
            try:
                for uuid in ordered:
                    fd = None if uuid in inherited else self._try(uuid)
                    if fd is not None or uuid in inherited:
                        taken.append((uuid, fd))
                        if len(taken) == count:
                            break
                if len(taken) == count:
                    return self._record(taken, holder_id, time.monotonic() - started, inherited)
            except BaseException:
                # Also on KeyboardInterrupt or a pytest-timeout signal: a lock kept by a stray
                # descriptor would block this very session's next test.
                _unlock_all(taken)
                raise
            _unlock_all(taken)
            busy = [u for u in ordered if u not in {t for t, _ in taken}]
            waited = time.monotonic() - started
            if waited >= timeout:
                holders = {u: self.holder(u) for u in busy}
                raise LockTimeout(
                    f"waited {waited:.1f}s for {count} of {len(ordered)} GPU lock(s); held by: "
                    + describe_holders(holders), holders)
            if on_wait is not None and not notified:
                notified = True
                on_wait({u: self.holder(u) for u in busy})
            time.sleep(random.uniform(*_RETRY_S))

    def inherited(self) -> dict[str, tuple[int, int]]:
        """GPUs of this lock directory that an ancestor of this process holds, per ``HELD_VAR``.

        Trusted only if the named holder is still our ancestor (same pid and start time) and still the
        recorded holder of the GPU: a process that outlived the test that started it inherits nothing.
        """
        try:
            data = json.loads(os.environ.get(HELD_VAR) or "{}")
            if os.path.realpath(str(data["dir"])) != os.path.realpath(self.directory):
                return {}
            holders = {str(u): (int(pid), int(start)) for u, (pid, start) in data["holders"].items()}
        except (ValueError, TypeError, KeyError, AttributeError):
            return {}
        ancestors = _ancestors()
        return {u: (pid, start) for u, (pid, start) in holders.items()
                if ancestors.get(pid) == start and self.holder(u).get("pid") == pid}

    def _record(self, taken: list[tuple[str, int | None]], holder_id: str, waited_s: float,
                inherited: dict[str, tuple[int, int]]) -> HeldLocks:
        held = HeldLocks(tuple(u for u, _ in taken), [fd for _, fd in taken if fd is not None], [], waited_s,
                         inherited={u: inherited[u] for u, fd in taken if fd is None})
        me = _me_now()
        if me is not None:
            previous = os.environ.get(HELD_VAR)
            holders = {u: list(held.inherited.get(u, me)) for u in held.uuids}
            ours = json.dumps({"dir": self.directory, "holders": holders})
            os.environ[HELD_VAR] = ours
            held._env = (previous, ours)
        # The records differ only in the UUID: encode the rest once (a json.dumps per GPU cost ~4 us).
        common = json.dumps({"pid": os.getpid(), "host": _HOST, "uid": os.getuid(), "test": holder_id,
                             "since": time.time()})
        for uuid, fd in taken:
            if fd is None:
                continue  # the ancestor's record stays: it is the holder
            record = f'{common[:-1]}, "uuid": {json.dumps(uuid)}}}'.encode()
            try:  # noqa: SIM105 (per GPU and test: suppress() costs ~1 us)
                held.holder_fds.append(_write_holder(self.holder_path(uuid), record))
            except OSError:
                pass  # best effort: the lock itself is what protects the GPU
        return held


def _unlock_all(taken: list[tuple[str, int | None]]) -> None:
    for _uuid, fd in taken:
        if fd is not None:
            _unlock(fd)


def _me_now() -> tuple[int, int] | None:
    global _me
    pid = os.getpid()
    if _me is None or _me[0] != pid:
        stat = procfs.read_stat(pid)
        _me = None if stat is None else (stat.pid, stat.start_ticks)
    return _me


def _ancestors() -> dict[int, int]:
    """pid -> start ticks of every ancestor of this process."""
    found: dict[int, int] = {}
    stat = procfs.read_stat(os.getpid())
    while stat is not None and stat.ppid > 0 and stat.ppid not in found:
        stat = procfs.read_stat(stat.ppid)
        if stat is not None:
            found[stat.pid] = stat.start_ticks
    return found


def _since(holder: dict[str, object]) -> float:
    since = holder.get("since")
    return float(since) if isinstance(since, (int, float)) else float("-inf")


def describe_holder(holder: dict[str, object]) -> str:
    """One line naming a lock holder."""
    if not holder:
        return "unknown holder"
    since = holder.get("since")
    age = f", for {time.time() - since:.0f}s" if isinstance(since, (int, float)) else ""
    pid = holder.get("pid")
    gone = ""
    if isinstance(pid, int) and holder.get("host") == socket.gethostname() and not _pid_alive(pid):
        # The lock is busy, so someone holds it; this record is left over from a killed session.
        gone = " (that process is gone: a stale record; the holder did not record itself)"
    return f"pid {pid} on {holder.get('host')} running {holder.get('test')}{age}{gone}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def describe_holders(holders: dict[str, dict[str, object]]) -> str:
    """``uuid: holder; uuid: holder`` for a message."""
    return "; ".join(f"{u}: {describe_holder(h)}" for u, h in holders.items())


def _write_holder(path: str, payload: bytes) -> tuple[int, bool]:
    """Write this user's holder record (JSON) for one GPU into its (session-long open) file.

    Returns the descriptor and whether the record was padded to ``_RECORD_BYTES``.

    Overwritten in place: creating, renaming or deleting a file per GPU and test cost 0.3-0.8 ms per GPU
    on ext4, more than the whole clean check. A reader that catches a half-written record fails to parse
    it and reads "unknown holder", as for a missing one.
    """
    fd = _holder_fds.get(path)
    if fd is None:
        # O_NOFOLLOW: never write through a link someone planted in the shared directory.
        fd = _holder_fds[path] = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    if len(payload) <= _RECORD_BYTES:
        # Padded to a fixed size (JSON allows trailing blanks): no ftruncate, which costs as much as the
        # write. Released records are blanked the same way (see HeldLocks.release).
        os.pwrite(fd, payload.ljust(_RECORD_BYTES), 0)
        return fd, True
    os.pwrite(fd, payload, 0)
    os.ftruncate(fd, len(payload))
    return fd, False
