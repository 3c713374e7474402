"""The lock directory: opened once without following a link, its lock files, and the marks sessions set on
it. Files are opened relative to the directory's descriptor, and are untrusted: another user may plant a
link, a FIFO or a hard link under a lock file's name."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import hashlib
import json
import os
import socket
import stat
import struct
from collections.abc import Sequence

HOST = socket.gethostname()
"""This host, as holder records name it: another host's record is a container's (its pids are its own)."""
QUEUE_AFTER_S = 1.0
"""After waiting this long for a GPU a session queues for it: attempts of sessions that waited less leave
it."""

DIR_MODE = 0o1777
"""Every user's sessions create lock files and holder records here; the sticky bit stops them deleting or
replacing each other's."""
LOCK_FILE_MODE = 0o666
"""A POSIX write lock needs a descriptor open for writing, so every sharing user must be able to open one.
Nothing is written."""

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NOFOLLOW: never through a planted link; O_NONBLOCK: a planted FIFO must not hang the open.
FILE_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class LockDirError(OSError):
    """The lock directory, or a file in it, cannot be used; the message says what to do."""


class LockDir:
    """One lock directory as this process has it open, and its files by name."""

    def __init__(self, path: str, fd: int, ident: tuple[int, int]) -> None:
        self.path = path
        self.fd = fd
        self.ident = ident
        self.shared = 0
        """Acquires of this process holding the directory's shared lock (one BSD lock, counted here)."""
        self.lock_fds: dict[str, int] = {}
        self.lock_idents: dict[int, tuple[int, int]] = {}
        """(st_dev, st_ino) of each open lock file, taken at open: compared with the name's after each
        lock."""
        self.lock_names: dict[int, str] = {}
        self.verified: dict[int, int] = {}
        """Per open lock file, the directory's ctime when its name was last seen to be that file, if
        settled then."""
        self.held: set[int] = set()
        self.holder_fds: dict[str, int] = {}
        self.parked: list[int] = []
        """Kept open only because closing them would drop a POSIX lock this process holds."""
        self.ctime_ns = 0
        self.mtime_ns = 0
        """The directory's times when an acquire last looked (``GpuLocks._state``)."""

    def close_all(self) -> None:
        for fd in (*self.lock_fds.values(), *self.holder_fds.values(), *self.parked, self.fd):
            with contextlib.suppress(OSError):
                os.close(fd)
        self.lock_fds.clear()
        self.lock_idents.clear()
        self.lock_names.clear()
        self.verified.clear()
        self.held.clear()
        self.holder_fds.clear()
        self.parked.clear()


class _ProcessCache:
    """What this process keeps of the lock directories and its holder records: a forked child starts
    afresh."""

    def __init__(self) -> None:
        self.dirs: dict[tuple[int, int], LockDir] = {}
        """Files stay open for the session (opening them per test costs more than the clean check). Keyed
        by inode: closing a second descriptor of a file would drop this process's POSIX lock on it."""
        self.notices: list[str] = []
        """Noticed about the lock directories, until ``take_notices``."""
        self.owner_pid = os.getpid()
        self.me: tuple[int, int] | None = None
        """(pid, start ticks) of this process, read once."""
        self.record_head: str | None = None
        """This process's part of its holder records as JSON, encoded once; the test and the time come
        last."""
        self.uid = -1
        """The effective uid ``record_head`` names, read with it: the records go into that uid's holder
        files."""
        self.held_values: dict[tuple[str, tuple[str, ...], tuple[tuple[str, tuple[int, int]], ...]], str] = {}
        """``held.HELD_VAR``'s value per directory, set of GPUs held and GPUs inherited."""

    def forget_inherited(self) -> None:
        # A forked child holds none of the parent's POSIX locks, and closing its copies drops none of them:
        # forgotten, so the child opens its own.
        for state in self.dirs.values():
            state.close_all()
        self.dirs.clear()
        self.notices.clear()
        self.owner_pid = os.getpid()
        self.me = None
        self.record_head = None  # (it names the parent's pid)
        self.uid = -1
        self.held_values.clear()


cache = _ProcessCache()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=cache.forget_inherited)


def take_notices() -> list[str]:
    """What was noticed about the lock directory since the last call, for the session's notes."""
    found = list(cache.notices)
    cache.notices.clear()
    return found


def _os_reason(exc: OSError) -> str:
    if exc.errno == errno.ENOSPC:
        return ("no space left on its file system (no free blocks or no free inodes): free some there, or "
                "set --gpuclean-lock-dir / GPUCLEAN_LOCK_DIR to a directory on another file system (the same "
                "one for every session that shares these GPUs)")
    if exc.errno == errno.EDQUOT:
        return (f"the disk quota of uid {os.geteuid()} is used up there: free some, or set "
                "--gpuclean-lock-dir / GPUCLEAN_LOCK_DIR to a directory on another file system (the same one "
                "for every session that shares these GPUs)")
    if exc.errno == errno.EROFS:
        return "its file system is mounted read-only"
    return exc.strerror or str(exc)


def dir_error(path: str, what: str, exc: OSError | None = None) -> LockDirError:
    reason = f": {_os_reason(exc)}" if exc is not None else ""
    return LockDirError(f"cannot use GPU lock directory {path!r}: {what}{reason}")


def _open_dir(path: str) -> LockDir:
    """Open (and if needed create) the lock directory; check that we may use it."""
    created = False
    try:
        try:
            fd = os.open(path, _DIR_FLAGS)
        except FileNotFoundError:
            parent, name = os.path.split(path)
            os.makedirs(parent, exist_ok=True)  # intermediate directories: the user's own, as umask says
            parent_fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                try:
                    os.mkdir(name, 0o700, dir_fd=parent_fd)
                    created = True
                except FileExistsError:
                    pass  # another session made it just now
                fd = os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
            finally:
                os.close(parent_fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            try:
                found = os.lstat(path)
            except OSError:
                found = None
            if found is not None and stat.S_ISLNK(found.st_mode):
                raise dir_error(path, f"it is a symbolic link (owner uid {found.st_uid}): gpuclean opens "
                                      "the lock directory itself, never through a link; give the real "
                                      "directory") from None
            raise dir_error(path, "it is not a directory") from None
        raise dir_error(path, "cannot open or create it", exc) from None
    try:
        info = os.fstat(fd)
        if created and info.st_uid == os.geteuid():
            # Made by us just now (and nobody swapped it in since): shared like /tmp.
            os.fchmod(fd, DIR_MODE)
        else:
            _check_existing(path, fd, info)
    except BaseException:
        os.close(fd)
        raise
    return LockDir(path, fd, (info.st_dev, info.st_ino))


def _check_existing(path: str, fd: int, info: os.stat_result) -> None:
    # A directory we did not create is never chmod'ed: it may be the user's own ($HOME, "." by mistake).
    mode = stat.S_IMODE(info.st_mode)
    described = f"owner uid {info.st_uid}, mode {mode:o}"
    if os.statvfs(fd).f_flag & os.ST_RDONLY:
        raise dir_error(path, f"it is on a read-only file system ({described})")
    if not os.access(".", os.W_OK | os.X_OK, dir_fd=fd, effective_ids=os.access in os.supports_effective_ids):
        raise dir_error(path, f"not writable by uid {os.geteuid()} ({described}); gpuclean did not create "
                              "it, so it leaves its mode alone: if it is meant to be shared its owner can "
                              f"run 'chmod 1777 {path}', else choose another with --gpuclean-lock-dir")
    # World-writable without the sticky bit: anyone could replace anyone's files. Group-writable is the
    # owner's choice (umask 002).
    if mode & 0o002 and not mode & stat.S_ISVTX:
        raise dir_error(path, f"every user can write it and it has no sticky bit ({described}): anyone "
                              "could delete or replace the lock files of GPUs in use; its owner can run "
                              f"'chmod +t {path}'")


@functools.lru_cache(maxsize=256)
def _file_name(uuid: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in uuid)


# ---- marks on the directory: who holds, makes or waits for which GPU -------------------------------------
#
# A lock file deleted while held takes the only trace of its holder with it, and a new file would let a
# second session in. So each GPU has bytes of the directory carrying OFD read locks (docs/sharing.md):
#
#   hold(X)   from just after a session locks X's file until it releases it;
#   make(X)   while a session creates X's missing lock file (create);
#   queue(X)  while a session that has waited QUEUE_AFTER_S for X goes on waiting (GpuLocks.acquire).
#
# OFD, not POSIX: a POSIX lock drops when its process closes any descriptor of the file (os.listdir does).
# A mark's offset is hashed from the UUID: a collision only makes one GPU wait for another now and then.

_FLOCK = struct.Struct("hhqqi4x")
"""Linux's struct flock (64-bit off_t)."""
_SLOT_BITS = 56
MAKE_BASE = 1 << 60
"""make(X) is at ``MAKE_BASE + 2 * slot``, queue(X) just after it; hold(X) is at ``slot``."""
MARKS_LEN = 2 << _SLOT_BITS
_PROBE = _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, MAKE_BASE, MARKS_LEN, 0)
"""Any make or queue mark of another open file description up, for any GPU? One syscall per acquire."""
_UNHOLD_ALL = _FLOCK.pack(fcntl.F_UNLCK, os.SEEK_SET, 0, 1 << _SLOT_BITS, 0)


class _Marks:
    """One GPU's mark offsets, its hold mark's requests packed once, and its files' names."""

    def __init__(self, uuid: str) -> None:
        self.file = _file_name(uuid)
        self.lock = f"{self.file}.lock"
        self.uuid_field = f', "uuid": {json.dumps(uuid)}'
        """Its holder record's field that names it (``held.write_records``)."""
        digest = hashlib.blake2b(uuid.encode(), digest_size=8).digest()
        slot = int.from_bytes(digest, "big") >> (64 - _SLOT_BITS)
        self.hold = slot
        self.make = MAKE_BASE + 2 * slot
        self.queue = self.make + 1
        self.set_hold = _FLOCK.pack(fcntl.F_RDLCK, os.SEEK_SET, slot, 1, 0)
        self.unset_hold = _FLOCK.pack(fcntl.F_UNLCK, os.SEEK_SET, slot, 1, 0)


@functools.lru_cache(maxsize=256)
def marks_of(uuid: str) -> _Marks:
    return _Marks(uuid)


_MARK_ERROR = "cannot mark it (open file description locks: Linux 3.15 or later)"


def mark(state: LockDir, request: bytes, fd: int | None = None) -> None:
    """Set (or clear) a mark of ours, through ``state.fd`` unless ``fd`` is given."""
    try:
        fcntl.fcntl(state.fd if fd is None else fd, fcntl.F_OFD_SETLK, request)
    except OSError as exc:
        raise dir_error(state.path, _MARK_ERROR, exc) from None


def mark_at(state: LockDir, kind: int, offset: int, fd: int | None = None) -> None:
    mark(state, _FLOCK.pack(kind, os.SEEK_SET, offset, 1, 0), fd)


def marked(state: LockDir, offset: int, length: int = 1, fd: int | None = None) -> int | None:
    """Where another open file description than ``fd``'s has a mark in ``[offset, offset + length)``; None
    if none has."""
    request = _PROBE if length == MARKS_LEN else _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, offset, length, 0)
    try:
        answer = fcntl.fcntl(state.fd if fd is None else fd, fcntl.F_OFD_GETLK, request)
    except OSError as exc:
        raise dir_error(state.path, "cannot look at its marks", exc) from None
    kind, _whence, start, _length, _pid = _FLOCK.unpack(answer)
    return None if kind == fcntl.F_UNLCK else int(start)


def clear(state: LockDir, request: bytes) -> None:
    try:  # noqa: SIM105 (per test)
        fcntl.fcntl(state.fd, fcntl.F_OFD_SETLK, request)
    except OSError:
        pass  # a mark left up only delays making that GPU's missing lock file until we exit


def let_go(state: LockDir, taken: Sequence[tuple[str, int | None]]) -> None:
    """Unlock and unmark the GPUs of an attempt (or a test), and drop the directory's shared lock."""
    last = state.shared <= 1  # no other acquire of this process holds marks: one request clears them all
    held_any = False
    for uuid, fd in taken:
        if fd is not None:
            unlock(state, fd)
            held_any = True
            if not last:
                clear(state, marks_of(uuid).unset_hold)
    if held_any and last:
        clear(state, _UNHOLD_ALL)
    _unshare(state)


def unqueue(state: LockDir, uuids: set[str]) -> None:
    for uuid in uuids:
        clear(state, _FLOCK.pack(fcntl.F_UNLCK, os.SEEK_SET, marks_of(uuid).queue, 1, 0))


# ---- the lock files in it, and its shared lock ---------------------------------------------------------

def unlock(state: LockDir, fd: int) -> None:
    # The descriptor stays open (cached in lock_fds) for the next test.
    state.held.discard(fd)
    try:  # noqa: SIM105 (per GPU and test)
        fcntl.lockf(fd, fcntl.LOCK_UN)
    except OSError:
        pass


def share(state: LockDir) -> bool:
    """Take the directory's shared BSD lock (once per process); False while someone holds it exclusively (a
    tmp cleaner). systemd-tmpfiles leaves a BSD-locked directory alone."""
    if state.shared == 0:
        try:
            fcntl.flock(state.fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        except OSError as exc:
            raise dir_error(state.path, "cannot lock it", exc) from None
    state.shared += 1
    return True


def _unshare(state: LockDir) -> None:
    state.shared -= 1
    if state.shared <= 0:
        state.shared = 0
        try:  # noqa: SIM105 (per test)
            fcntl.flock(state.fd, fcntl.LOCK_UN)
        except OSError:
            pass


def create(state: LockDir, uuids: Sequence[str]) -> list[str]:
    """Create the missing lock files of ``uuids``; returns those it must not make now, because a session
    holds that GPU through a deleted file: a new one would let a second session in beside it.

    A creator sets the make mark, then looks for a hold mark; a holder sets its hold mark right after
    locking, then looks for make marks (``GpuLocks._attempt``). Of two overlapping sessions at least one
    sees the other's mark and backs off (Dekker's handshake; the kernel orders requests on one inode's
    locks)."""
    try:
        # An open file description of its own: our own hold marks count too, and closing it drops the make
        # marks.
        fd = os.open(".", _DIR_FLAGS, dir_fd=state.fd)
    except OSError as exc:
        raise dir_error(state.path, "cannot open it", exc) from None
    blocked = []
    try:
        for uuid in uuids:
            marks = marks_of(uuid)
            mark_at(state, fcntl.F_RDLCK, marks.make, fd)
            if marked(state, marks.hold, fd=fd) is not None:
                blocked.append(uuid)
                continue
            name = f"{_file_name(uuid)}.lock"
            try:
                new = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL | FILE_FLAGS, LOCK_FILE_MODE,
                              dir_fd=state.fd)
            except FileExistsError:
                continue
            except OSError as exc:
                raise dir_error(state.path, f"cannot create lock file {name}", exc) from None
            with contextlib.suppress(OSError):
                os.fchmod(new, LOCK_FILE_MODE)  # past the umask
            # Closing is safe: nobody (this process included) can hold a lock on a file this new.
            os.close(new)
    finally:
        os.close(fd)  # drops the make marks
    return blocked


MISSING = -1


def _open_lock(state: LockDir, name: str) -> int:
    """A lock file's descriptor, or ``MISSING`` if there is no file of that name."""
    try:
        fd = os.open(name, os.O_RDWR | FILE_FLAGS, dir_fd=state.fd)
    except FileNotFoundError:
        return MISSING
    except OSError as exc:
        raise _file_error(state, name, exc) from None
    info = os.fstat(fd)
    ident = (info.st_dev, info.st_ino)
    if stat.S_ISREG(info.st_mode) and info.st_nlink == 1:
        state.lock_idents[fd] = ident
        state.lock_names[fd] = name
        return fd
    if ident in state.lock_idents.values():
        state.parked.append(fd)  # a link to a file we have open: closing this would drop our lock on it
    else:
        os.close(fd)
    raise _file_error(state, name, None)


def _file_error(state: LockDir, name: str, exc: OSError | None) -> LockDirError:
    try:
        info = os.stat(name, dir_fd=state.fd, follow_symlinks=False)
        who = f"owner uid {info.st_uid}, mode {stat.S_IMODE(info.st_mode):o}"
    except OSError:
        info, who = None, "gone now"
    if info is not None and stat.S_ISLNK(info.st_mode):
        what = f"lock file {name} is a symbolic link ({who}), planted there: its owner or root must remove it"
    elif exc is None:
        what = (f"lock file {name} is not a regular file with a single link ({who}): gpuclean never makes "
                "such a thing; its owner or root must remove it")
    elif exc.errno in (errno.EACCES, errno.EPERM):
        what = (f"lock file {name} cannot be opened for writing by uid {os.geteuid()} ({who}); a POSIX lock "
                f"needs that: its owner can run 'chmod {LOCK_FILE_MODE:o}' on it")
    else:
        return dir_error(state.path, f"cannot open lock file {name}", exc)
    return dir_error(state.path, what)


def unchanged(state: LockDir, info: os.stat_result) -> bool:
    """Whether the directory had no entry added, removed or renamed, and was not itself moved, since the
    last look; notes its times."""
    state.mtime_ns = info.st_mtime_ns
    # Any such change moves the directory's ctime (or link count): only then is the path looked up again (a
    # path stat per test costs as much as locking a GPU).
    if info.st_ctime_ns == state.ctime_ns and info.st_nlink > 0:
        return True
    state.ctime_ns = info.st_ctime_ns
    return False


def open_dir_once(path: str) -> LockDir:
    """Opened once per process (per inode: ``_ProcessCache.dirs``)."""
    opened = _open_dir(path)
    known = cache.dirs.get(opened.ident)
    if known is not None:
        os.close(opened.fd)  # (a directory: no POSIX lock of ours to lose)
        return known
    cache.dirs[opened.ident] = opened
    return opened


def cache_lock(state: LockDir, name: str) -> int | None:
    """Opened once and kept (None: there is no such file)."""
    fd = state.lock_fds.get(name)
    if fd is None:
        fd = _open_lock(state, name)
        if fd == MISSING:
            return None
        state.lock_fds[name] = fd
    return fd


def forget(state: LockDir, name: str) -> None:
    fd = state.lock_fds.pop(name, None)
    if fd is not None:
        state.held.discard(fd)
        state.lock_idents.pop(fd, None)
        state.lock_names.pop(fd, None)
        state.verified.pop(fd, None)
        with contextlib.suppress(OSError):
            os.close(fd)

