"""Cross-process GPU locks: one per physical GPU (by UUID) in a directory every session on the host shares.

Each lock is a POSIX record lock (``fcntl`` ``F_SETLK``, a write lock on the whole file) on
``<dir>/<uuid>.lock``. A POSIX lock belongs to the process that took it: the kernel drops it when that
process ends (SIGKILL, the OOM killer, ``os._exit``), and no child ever holds it, whether made by
``os.fork``, ``multiprocessing`` or a raw ``fork()`` from C that skips Python's at-fork hooks. (A BSD
``flock`` belongs to the open file instead: a child that inherited the descriptor kept the GPU locked after
its pytest died.) Next to each lock, each user has a small JSON holder record saying who holds it; records
are untrusted input (another user writes them). docs/sharing.md has the threat model.

The directory is opened once, without following a symbolic link, and every file is opened relative to that
descriptor, so swapping the directory's path for a link later changes nothing. While a session holds a GPU's
lock it also marks that GPU on the directory itself (an open file description lock on one byte of it), so
that nobody makes a new lock file for a GPU whose file was deleted under its holder; see ``_create``.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import hashlib
import json
import math
import os
import pwd
import random
import socket
import stat
import struct
import time
from collections.abc import Callable, Sequence

from pytest_gpuclean.core.reading import procfs

_HOST = socket.gethostname()
_RECORD_BYTES = 512
_BLANK = b" " * _RECORD_BYTES
_READ_LIMIT = 4096
"""A holder record is well under 1 KiB: a bigger file is not one, and is not read further."""
_RETRY_S = (0.02, 0.1)
"""Back-off between all-or-nothing attempts, randomised so competing sessions don't stay in step."""
_QUEUE_AFTER_S = 1.0
"""A session that has waited this long for a GPU marks itself as waiting for it: from then on, an attempt of
a session that has not waited as long leaves that GPU to it (see ``GpuLocks.acquire``)."""
_CLOCK_SKEW_S = 300.0
"""A record may say it was written this much in the future (clocks of containers, NTP steps), no more."""
_TEXT_LIMIT = 300

DIR_MODE = 0o1777
"""Mode of a lock directory gpuclean creates: every user's sessions create lock files and their own
holder records in it, and the sticky bit stops them from deleting or replacing each other's files."""
LOCK_FILE_MODE = 0o666
"""A POSIX write lock needs a descriptor open for writing, so every user who shares the GPUs must be able
to open a lock file for writing. Nothing is ever written to it: its content means nothing."""
HOLDER_FILE_MODE = 0o644
"""Only its user writes a holder record; everybody reads it, to name who holds a GPU."""

HELD_VAR = "GPUCLEAN_HELD_LOCKS"
"""Set while this process holds GPU locks, so its children know: JSON ``{"dir": lock directory,
"holders": {uuid: [pid, start ticks]}}``. A gpuclean session that a test runs (a nested pytest,
pytester) takes those GPUs as its own instead of waiting for its parent's locks until it times out."""

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NOFOLLOW: never through a link planted in the shared directory; O_NONBLOCK: a FIFO planted under a
# lock file's name must not hang the open.
_FILE_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class LockDirError(OSError):
    """The lock directory, or a file in it, cannot be used; the message names it and says what to do."""


class LockTimeout(Exception):
    """The locks could not be had in time; ``holders`` says who has them, ``waited_s`` how long we waited."""

    def __init__(self, message: str, holders: dict[str, dict[str, object]], waited_s: float = 0.0) -> None:
        super().__init__(message)
        self.holders = holders
        self.waited_s = waited_s


class _Dir:
    """One lock directory as this process has it open: the directory and the files in it, by name. (A
    plain class: see ``ownership.Window``.)"""

    def __init__(self, path: str, fd: int, ident: tuple[int, int]) -> None:
        self.path = path
        self.fd = fd
        self.ident = ident
        self.shared = 0
        """Acquires of this process that hold the directory's shared lock (one BSD lock, counted here)."""
        self.lock_fds: dict[str, int] = {}
        self.lock_idents: dict[int, tuple[int, int]] = {}
        """(st_dev, st_ino) of each open lock file, taken at open: compared with the name's after each
        lock."""
        self.lock_names: dict[int, str] = {}
        self.verified: dict[int, int] = {}
        """Per open lock file, the directory's ctime when its name was last seen to be that file, if that
        ctime was settled then (see ``_still_named``)."""
        self.held: set[int] = set()
        self.holder_fds: dict[str, int] = {}
        self.parked: list[int] = []
        """Descriptors kept open only because closing them would drop a POSIX lock this process holds."""
        self.ctime_ns = 0
        self.mtime_ns = 0
        """The directory's times when an acquire last looked (see ``GpuLocks._state``)."""

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
    """What this process keeps of the lock directories: a forked child starts with none of it."""

    __slots__ = ("dirs", "held_values", "me", "notices", "owner_pid", "record_head", "uid")

    def __init__(self) -> None:
        self.dirs: dict[tuple[int, int], _Dir] = {}
        """Files stay open for the whole session: opening and closing them for every test cost more than
        the clean check itself. Keyed by the directory's inode, so that two spellings of one directory
        share one descriptor per file: closing a second descriptor of a file would drop this process's
        POSIX lock on it."""
        self.notices: list[str] = []
        """What was noticed about the lock directories, until ``take_notices``."""
        self.owner_pid = os.getpid()
        self.me: tuple[int, int] | None = None
        """(pid, start ticks) of this process, read once."""
        self.record_head: str | None = None
        """This process's part of its holder records as JSON (up to the GPU's ``_Marks.uuid_field``), encoded
        once; the test and the time come last (``GpuLocks._write_records``)."""
        self.uid = -1
        """The effective uid that ``record_head`` names, read with it: the records are written into that
        uid's holder files (a ``geteuid`` per test spared)."""
        self.held_values: dict[tuple[str, tuple[str, ...], tuple[tuple[str, tuple[int, int]], ...]], str] = {}
        """``HELD_VAR``'s value per directory, set of GPUs held and GPUs inherited."""

    def forget_inherited(self) -> None:
        # In a child of a fork, every descriptor here is a copy of the parent's. The child holds none of
        # the parent's POSIX locks, and closing its copies drops none of them (they are the parent's); the
        # directory's BSD lock stays with the parent's open file. Forgotten, so the child opens its own.
        for state in self.dirs.values():
            state.close_all()
        self.dirs.clear()
        self.notices.clear()
        self.owner_pid = os.getpid()
        self.me = None
        self.record_head = None  # (it names the parent's pid)
        self.uid = -1
        self.held_values.clear()

    def me_now(self) -> tuple[int, int] | None:
        me = self.me
        if me is None or me[0] != os.getpid():
            found = procfs.read_stat(os.getpid())
            me = self.me = None if found is None else (found.pid, found.start_ticks)
        return me

    def me_checked(self) -> tuple[int, int] | None:
        """``me_now`` where the caller has just made sure that ``owner_pid`` is this process's pid
        (``GpuLocks._cached``, earlier in the same acquire: nothing between forks): no ``getpid``."""
        me = self.me
        if me is None or me[0] != self.owner_pid:
            return self.me_now()
        return me


_cache = _ProcessCache()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_cache.forget_inherited)


def take_notices() -> list[str]:
    """Things noticed about the lock directory since the last call (a lock file deleted while held, the
    directory replaced), for the session's notes."""
    found = list(_cache.notices)
    _cache.notices.clear()
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


def _dir_error(path: str, what: str, exc: OSError | None = None) -> LockDirError:
    reason = f": {_os_reason(exc)}" if exc is not None else ""
    return LockDirError(f"cannot use GPU lock directory {path!r}: {what}{reason}")


def _open_dir(path: str) -> _Dir:
    """Open (and if needed create) the lock directory; check that it is one we may use."""
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
                raise _dir_error(path, f"it is a symbolic link (owner uid {found.st_uid}): gpuclean opens "
                                       "the lock directory itself, never through a link; give the real "
                                       "directory") from None
            raise _dir_error(path, "it is not a directory") from None
        raise _dir_error(path, "cannot open or create it", exc) from None
    try:
        info = os.fstat(fd)
        if created and info.st_uid == os.geteuid():
            # Made by us just now (and still ours: nobody swapped it in between): shared like /tmp.
            os.fchmod(fd, DIR_MODE)
        else:
            _check_existing(path, fd, info)
    except BaseException:
        os.close(fd)
        raise
    return _Dir(path, fd, (info.st_dev, info.st_ino))


def _check_existing(path: str, fd: int, info: os.stat_result) -> None:
    # A directory we did not create is used as it is, never chmod'ed: it may be a private directory of
    # the user, $HOME or "." given by mistake, and its mode is its owner's decision.
    mode = stat.S_IMODE(info.st_mode)
    described = f"owner uid {info.st_uid}, mode {mode:o}"
    if os.statvfs(fd).f_flag & os.ST_RDONLY:
        raise _dir_error(path, f"it is on a read-only file system ({described})")
    if not os.access(".", os.W_OK | os.X_OK, dir_fd=fd, effective_ids=os.access in os.supports_effective_ids):
        raise _dir_error(path, f"not writable by uid {os.geteuid()} ({described}); gpuclean did not create "
                               "it, so it leaves its mode alone: if it is meant to be shared its owner can "
                               f"run 'chmod 1777 {path}', else choose another with --gpuclean-lock-dir")
    # World-writable without the sticky bit: anyone could delete or replace anyone's files. (A group-writable
    # one is left to its owner, who chose the group: with umask 002 a user's own directories are 0775.)
    if mode & 0o002 and not mode & stat.S_ISVTX:
        raise _dir_error(path, f"every user can write it and it has no sticky bit ({described}): anyone "
                               "could delete or replace the lock files of GPUs in use; its owner can run "
                               f"'chmod +t {path}'")


@functools.lru_cache(maxsize=256)
def _file_name(uuid: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in uuid)


# ---- marks on the directory: who holds, makes or waits for which GPU -------------------------------------
#
# A lock file deleted while it is held (by hand, by a tmp cleaner) takes the only trace of its holder with it:
# a session that found the name missing and made a new file would lock that one and run next to the holder.
# The directory is the one thing whose identity every session keeps (the descriptor it opened it with), so
# each GPU has a few bytes *of the directory*, on which sessions take open file description (OFD) read locks:
#
#   hold(X)   from just after a session locks X's file until it releases it;
#   make(X)   while a session creates X's missing lock file (_create);
#   queue(X)  while a session that has waited _QUEUE_AFTER_S for X goes on waiting (GpuLocks.acquire).
#
# A directory can only be opened for reading, so these are read locks, which never conflict with each other;
# F_OFD_GETLK (does a write lock conflict, and with what?) tells whether another open file description has
# one. OFD locks, not POSIX ones: a POSIX lock is dropped when its process closes *any* descriptor of the
# file, and plenty opens and closes the lock directory (os.listdir, a second GpuLocks, a test, a dup); an OFD
# lock lasts until every descriptor of its own open file description is closed. Like the directory's BSD lock
# (kept for tmp cleaners: see ``_share``), a mark of a raw-forked child that kept the parent's descriptor
# lasts as long as that child; it only matters for a GPU whose lock file has gone missing.
#
# One byte per mark, at an offset hashed from the UUID: two GPUs whose offsets collide (a chance of one in
# 2**56 per pair) would only make one wait for the other now and then, never let two sessions in.

_FLOCK = struct.Struct("hhqqi4x")
"""Linux's struct flock (64-bit off_t)."""
_SLOT_BITS = 56
_MAKE_BASE = 1 << 60
"""make(X) is at ``_MAKE_BASE + 2 * slot``, queue(X) just after it; hold(X) is at ``slot``."""
_MARKS_LEN = 2 << _SLOT_BITS
_PROBE = _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, _MAKE_BASE, _MARKS_LEN, 0)
"""Is any make or queue mark of another open file description up, for any GPU? One syscall per acquire."""
_UNHOLD_ALL = _FLOCK.pack(fcntl.F_UNLCK, os.SEEK_SET, 0, 1 << _SLOT_BITS, 0)


class _Marks:
    """The offsets of one GPU's marks, its hold mark's requests packed once, and its files' names. (A plain
    class: see ``ownership.Window``.)"""

    __slots__ = ("file", "hold", "lock", "make", "queue", "set_hold", "unset_hold", "uuid_field")

    def __init__(self, uuid: str) -> None:
        self.file = _file_name(uuid)
        self.lock = f"{self.file}.lock"
        """The lock file's name."""
        self.uuid_field = f', "uuid": {json.dumps(uuid)}'
        """Its holder record's field that names it (see ``GpuLocks._write_records``)."""
        digest = hashlib.blake2b(uuid.encode(), digest_size=8).digest()
        slot = int.from_bytes(digest, "big") >> (64 - _SLOT_BITS)
        self.hold = slot
        self.make = _MAKE_BASE + 2 * slot
        self.queue = self.make + 1
        self.set_hold = _FLOCK.pack(fcntl.F_RDLCK, os.SEEK_SET, slot, 1, 0)
        self.unset_hold = _FLOCK.pack(fcntl.F_UNLCK, os.SEEK_SET, slot, 1, 0)


@functools.lru_cache(maxsize=256)
def _marks(uuid: str) -> _Marks:
    return _Marks(uuid)


_MARK_ERROR = "cannot mark it (open file description locks: Linux 3.15 or later)"


def _mark(state: _Dir, request: bytes, fd: int | None = None) -> None:
    """Set (or clear) a mark of ours on the directory, through ``state.fd`` unless ``fd`` is given."""
    try:
        fcntl.fcntl(state.fd if fd is None else fd, fcntl.F_OFD_SETLK, request)
    except OSError as exc:
        raise _dir_error(state.path, _MARK_ERROR, exc) from None


def _mark_at(state: _Dir, kind: int, offset: int, fd: int | None = None) -> None:
    _mark(state, _FLOCK.pack(kind, os.SEEK_SET, offset, 1, 0), fd)


def _marked(state: _Dir, offset: int, length: int = 1, fd: int | None = None) -> int | None:
    """Where another open file description than ``fd``'s (default ``state.fd``) has a mark in
    ``[offset, offset + length)``; None if none has."""
    request = _PROBE if length == _MARKS_LEN else _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, offset, length, 0)
    try:
        answer = fcntl.fcntl(state.fd if fd is None else fd, fcntl.F_OFD_GETLK, request)
    except OSError as exc:
        raise _dir_error(state.path, "cannot look at its marks", exc) from None
    kind, _whence, start, _length, _pid = _FLOCK.unpack(answer)
    return None if kind == fcntl.F_UNLCK else int(start)


def _clear(state: _Dir, request: bytes) -> None:
    try:  # noqa: SIM105 (per test: cheaper than contextlib.suppress)
        fcntl.fcntl(state.fd, fcntl.F_OFD_SETLK, request)
    except OSError:
        pass  # (a mark left up only delays making that GPU's lock file if it goes missing, until we exit)


def _let_go(state: _Dir, taken: Sequence[tuple[str, int | None]]) -> None:
    """Unlock and unmark the GPUs of an attempt (or of a test), and drop the directory's shared lock."""
    last = state.shared <= 1  # no other acquire of this process holds marks: one request clears them all
    marked = False
    for uuid, fd in taken:
        if fd is not None:
            _unlock(state, fd)
            marked = True
            if not last:
                _clear(state, _marks(uuid).unset_hold)
    if marked and last:
        _clear(state, _UNHOLD_ALL)
    _unshare(state)


def _unqueue(state: _Dir, uuids: set[str]) -> None:
    for uuid in uuids:
        _clear(state, _FLOCK.pack(fcntl.F_UNLCK, os.SEEK_SET, _marks(uuid).queue, 1, 0))


class HeldLocks:
    """Locks held by this process for one test; release them in ``release``. (A plain class: see
    ``ownership.Window``.)"""

    def __init__(self, taken: list[tuple[str, int | None]], waited_s: float,
                 inherited: dict[str, tuple[int, int]], state: _Dir | None) -> None:
        self.uuids = tuple([u for u, _ in taken])
        self.locks = [fd for _, fd in taken if fd is not None]
        """Open descriptors of the locked files."""
        self._taken = taken
        """Per GPU, the descriptor of its locked file (None: inherited, not locked here)."""
        self.holder_fds: list[tuple[int, bool]] = []
        """This user's holder files of the locked GPUs, blanked at release; True if padded (see
        _write_holder)."""
        self.waited_s = waited_s
        self.inherited = inherited
        """GPUs an ancestor process holds, with its (pid, start ticks): not locked again, not released."""
        self._env: tuple[str | None, str | None] = (None, None)
        """(value of ``HELD_VAR`` before us, the value we set)."""
        self._dir = state
        """The directory whose shared lock this acquire holds (None: it holds none)."""
        self._mtime_ns = state.mtime_ns if state is not None else 0
        """The directory's mtime when the acquire began: if it changed by release, an entry was removed or
        added, maybe a held lock file."""
        self.parked = False
        """Kept after its test for this session's next one (see ``park``)."""
        self.record_slots: list[tuple[int, list[int]]] = []
        """Where the test's part of the holder records last written starts, and their descriptors (one entry
        per start: GPU UUIDs are of one length), if all were padded: the next test of a kept lock rewrites
        just that part of these."""

    def park(self) -> bool:
        """Keep the locks for this process's next test instead of releasing them, if nobody else is waiting:
        True if kept (hand them to the next ``GpuLocks.acquire`` as ``parked``, or ``release`` them), False
        if the caller must release them now.

        Why: letting go of a GPU between two tests of one session and taking it again was half of what a
        checked test cost (five system calls per GPU), and nobody could use that gap: a waiter that looks
        every 20 to 100 ms almost never looks in the few hundred microseconds it lasts, so it gets a GPU only
        once it queues (``_QUEUE_AFTER_S``). So the locks are kept unless another session has a queue or a
        make mark up (one request covers every GPU), and a waiter gets them at the next test boundary as it
        did before. Not kept either if the directory had an entry added, removed or renamed since the
        acquire (``release`` then checks that the lock files are still ours), in a forked child, or with
        GPUs inherited from an ancestor.
        """
        state = self._dir
        if (state is None or self.inherited or _cache.dirs.get(state.ident) is not state
                or _cache.owner_pid != os.getpid()):
            return False
        try:
            if not self._directory_unchanged(state) or _marked(state, _MAKE_BASE, _MARKS_LEN) is not None:
                return False
        except OSError:
            return False
        self.parked = True  # (``HELD_VAR`` stays: they are held, and the next test would set it again)
        return True

    def _directory_unchanged(self, state: _Dir) -> bool:
        """No entry of the directory was added, removed or renamed since these locks were taken (else
        ``release`` checks that the lock files are still the ones locked)."""
        info = os.fstat(state.fd)
        return info.st_mtime_ns == self._mtime_ns and info.st_ctime_ns == state.ctime_ns

    def release(self) -> None:
        # Holder record first: once the lock is free, the next holder writes its own. A blank file is
        # no record (``holders`` skips it), and stays open for the next acquire to reuse.
        for fd, padded in self.holder_fds:
            try:  # (try/except, not contextlib.suppress: this runs per GPU and test)
                if padded:
                    os.pwrite(fd, _BLANK, 0)
                else:
                    os.ftruncate(fd, 0)
            except OSError:
                pass
        self.holder_fds = []
        state = self._dir
        self._dir = None
        if state is not None and _cache.dirs.get(state.ident) is state:  # (not in a forked child)
            try:
                changed = os.fstat(state.fd).st_mtime_ns != self._mtime_ns
            except OSError:
                changed = True
            if changed:
                for lock_fd in self.locks:
                    _check_still_named(state, lock_fd)
            _let_go(state, self._taken)
        self.locks = []
        self._taken = []
        self.parked = False
        self._restore_env()

    def _restore_env(self) -> None:
        previous, ours = self._env
        if ours is not None and os.environ.get(HELD_VAR) == ours:
            if previous is None:
                os.environ.pop(HELD_VAR, None)
            else:
                os.environ[HELD_VAR] = previous
        self._env = (None, None)


def _check_still_named(state: _Dir, fd: int) -> None:
    # The holder's side of a deleted lock file: nobody else could take the GPU meanwhile (its hold mark kept
    # a new lock file from being made: see _create), but whoever deletes lock files should hear of it.
    name = state.lock_names.get(fd)
    if name is None:
        return
    try:
        same = _still_named(state, name, fd)
    except OSError:
        same = False
    if not same:
        _cache.notices.append(
            f"gpuclean: lock file {state.path}/{name} was deleted or replaced while this session held it (by "
            "hand or by a tmp cleaner); no other session could take the GPU meanwhile, but exclude the lock "
            "directory from tmp cleaning (docs/sharing.md)")


def _unlock(state: _Dir, fd: int) -> None:
    # The descriptor stays open (cached in lock_fds) for the next test.
    state.held.discard(fd)
    try:  # noqa: SIM105 (per GPU and test: cheaper than contextlib.suppress)
        fcntl.lockf(fd, fcntl.LOCK_UN)
    except OSError:
        pass


def _share(state: _Dir) -> bool:
    """Take the directory's shared BSD lock (once per process, counted); False while someone holds it
    exclusively (a tmp cleaner at work, or a gpuclean older than the marks).

    Not what keeps lock files from being replaced (the marks do), but systemd-tmpfiles leaves alone a
    directory that is BSD-locked, so it does not clean this one while a session holds GPU locks.
    """
    if state.shared == 0:
        try:
            fcntl.flock(state.fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        except OSError as exc:
            raise _dir_error(state.path, "cannot lock it", exc) from None
    state.shared += 1
    return True


def _unshare(state: _Dir) -> None:
    state.shared -= 1
    if state.shared <= 0:
        state.shared = 0
        try:  # noqa: SIM105 (per test)
            fcntl.flock(state.fd, fcntl.LOCK_UN)
        except OSError:
            pass


def _create(state: _Dir, uuids: Sequence[str]) -> list[str]:
    """Create the missing lock files of ``uuids``; returns those it must not make now: a session holds that
    GPU through a lock file that was deleted under it.

    Why: the deleted file's inode was the only trace of its holder, so a new file made now would let a
    second session lock the GPU next to it. Each holder keeps its GPU's hold mark on the directory from
    just after it locks the file, before it checks that the name still names that file, until it releases
    it. A creator sets the GPU's make mark, then looks for a hold mark; a holder sets its hold mark, then
    looks for make marks (``GpuLocks._attempt``). Of two sessions that overlap, at least one sees the
    other's mark and backs off (Dekker's handshake; the kernel orders requests on one inode's locks), so a
    file is never made while someone holds that GPU through a deleted one: it stays missing until its
    holder is done. Only holders of *that* GPU matter: a missing file of one GPU never waits for the
    holders of others.
    """
    try:
        # An open file description of its own: the hold marks of this very process (on state.fd) count too,
        # and closing it drops its make marks.
        fd = os.open(".", _DIR_FLAGS, dir_fd=state.fd)
    except OSError as exc:
        raise _dir_error(state.path, "cannot open it", exc) from None
    blocked = []
    try:
        for uuid in uuids:
            marks = _marks(uuid)
            _mark_at(state, fcntl.F_RDLCK, marks.make, fd)
            if _marked(state, marks.hold, fd=fd) is not None:
                blocked.append(uuid)
                continue
            name = f"{_file_name(uuid)}.lock"
            try:
                new = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL | _FILE_FLAGS, LOCK_FILE_MODE,
                              dir_fd=state.fd)
            except FileExistsError:
                continue
            except OSError as exc:
                raise _dir_error(state.path, f"cannot create lock file {name}", exc) from None
            with contextlib.suppress(OSError):
                os.fchmod(new, LOCK_FILE_MODE)  # past the umask
            # Closing is safe: nobody (this process included) can hold a lock on a file this new.
            os.close(new)
    finally:
        os.close(fd)  # drops the make marks
    return blocked


_MISSING = -1


def _open_lock(state: _Dir, name: str) -> int:
    """A lock file's descriptor, or ``_MISSING`` if there is no file of that name."""
    try:
        fd = os.open(name, os.O_RDWR | _FILE_FLAGS, dir_fd=state.fd)
    except FileNotFoundError:
        return _MISSING
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


def _file_error(state: _Dir, name: str, exc: OSError | None) -> LockDirError:
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
        return _dir_error(state.path, f"cannot open lock file {name}", exc)
    return _dir_error(state.path, what)


def _unchanged(state: _Dir, info: os.stat_result) -> bool:
    """Whether the directory (``info``: its fstat) had no entry added, removed or renamed, and was not
    itself renamed or removed, since the last look; notes its times."""
    state.mtime_ns = info.st_mtime_ns
    # Renaming or removing the directory changes its ctime (or its link count), and so does any entry added
    # or removed: only then is the path looked up again (a path stat per test costs as much as locking a GPU).
    if info.st_ctime_ns == state.ctime_ns and info.st_nlink > 0:
        return True
    state.ctime_ns = info.st_ctime_ns
    return False


class GpuLocks:
    """Acquire per-GPU locks all-or-nothing, in one global (UUID) order, so no two sessions deadlock."""

    def __init__(self, directory: str) -> None:
        self.directory = os.path.abspath(directory)
        self._ident = _open_dir_once(self.directory).ident

    def _cached(self) -> _Dir | None:
        if os.getpid() != _cache.owner_pid:
            _cache.forget_inherited()  # a raw fork() skipped the at-fork hook: nothing here is ours
        return _cache.dirs.get(self._ident)

    def _state(self) -> _Dir:
        state = self._cached()
        if state is not None and _unchanged(state, os.fstat(state.fd)):
            return state
        return self._looked_up(state)

    def _looked_up(self, state: _Dir | None) -> _Dir:
        """The directory the path names now (``state`` if it is still that one)."""
        try:
            now = os.stat(self.directory, follow_symlinks=False)
            same = (now.st_dev, now.st_ino) == self._ident and stat.S_ISDIR(now.st_mode)
        except OSError:
            same = False
        if state is not None and same:
            return state
        if state is not None:
            _cache.notices.append(
                f"gpuclean: the GPU lock directory {self.directory} was removed or replaced while this "
                "session ran; the new one is used from now on (sessions still in the old one don't see its "
                "locks until their next test)")
        state = _open_dir_once(self.directory)
        self._ident = state.ident
        return state

    def lock_path(self, uuid: str) -> str:
        return f"{self.directory}/{_file_name(uuid)}.lock"

    def prepare(self, uuids: Sequence[str]) -> None:
        """Open (and create, where nobody holds the GPU through a deleted one) the lock and holder files of
        ``uuids``.

        At session start, so that an unusable or full directory stops the session with a clear message
        rather than failing a test later.
        """
        state = self._state()
        missing = [u for u in uuids if (name := f"{_file_name(u)}.lock") not in state.lock_fds
                   and _cache_lock(state, name) is None]
        if missing:
            _create(state, missing)
            for uuid in missing:
                _cache_lock(state, f"{_file_name(uuid)}.lock")
        for uuid in uuids:
            try:
                _holder_fd(state, _holder_name(uuid, os.geteuid()))
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS):
                    raise _dir_error(self.directory, "cannot create a holder record", exc) from None

    def holder(self, uuid: str) -> dict[str, object]:
        """Who holds ``uuid``'s lock, as recorded next to it (empty if nobody recorded), validated.

        The newest record wins: a holder writes its record after it got the lock, so any older one is
        left over from a session that ended without releasing (killed).
        """
        return _read_records(self._state(), [uuid]).get(uuid, {})

    def holders(self, uuids: Sequence[str],
                seen: dict[str, str] | None = None) -> dict[str, dict[str, object]]:
        """For each of ``uuids``: its newest valid record, plus what the kernel says about the lock.

        ``lock_pid``: the process holding the POSIX lock per /proc/locks (0: one in another PID namespace),
        with ``lock_user`` and ``lock_cmd``; ``missing``: the lock file is missing, and then ``held`` if a
        session holds the GPU through a deleted file; ``making``: a session is creating the file;
        ``queued``: another session has waited long for it (it goes first). ``seen``: what an attempt saw
        (see ``_attempt``), which may have changed since: a waiter let in first may be done already.
        """
        state = self._state()
        records = _read_records(state, uuids)
        idents: dict[tuple[int, int], str] = {}
        found: dict[str, dict[str, object]] = {}
        for uuid in uuids:
            found[uuid] = dict(records.get(uuid, {}))
            fd = state.lock_fds.get(f"{_file_name(uuid)}.lock")
            if fd is None:
                with contextlib.suppress(OSError):
                    fd = _cache_lock(state, f"{_file_name(uuid)}.lock")
            why = seen.get(uuid) if seen else None
            marks = _marks(uuid)
            if why == "making" or _marked(state, marks.make) is not None:
                found[uuid]["making"] = True
            if fd is None:
                found[uuid]["missing"] = True
                if _marked(state, marks.hold) is not None:
                    found[uuid]["held"] = True
            else:
                idents[state.lock_idents[fd]] = uuid
                if why == "queued" or _marked(state, marks.queue) is not None:
                    found[uuid]["queued"] = True
        lockers = _posix_lockers(set(idents))
        for ident, uuid in idents.items():
            pid = lockers.get(ident)
            if pid is not None:
                found[uuid]["lock_pid"] = pid
                if pid > 0:
                    found[uuid]["lock_user"], found[uuid]["lock_cmd"] = _describe_process(pid)
        return found

    def _try(self, state: _Dir, name: str) -> int | None:
        """Lock the GPU's file ``name``: its descriptor, None if it is busy, ``_MISSING`` if there is no such
        file. (Not yet trusted: see ``_attempt``.)"""
        fd = state.lock_fds.get(name)
        if fd is None:
            fd = _cache_lock(state, name)
            if fd is None:
                return _MISSING
        elif fd in state.held:
            # Held by this process already (another acquire still open): a second POSIX lock of the same
            # process would just succeed, so refuse here as another process would be refused.
            return None
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            _busy_or_raise(state, name, exc)
            return None
        state.held.add(fd)
        return fd

    def _attempt(self, state: _Dir, ordered: Sequence[str], count: int,
                 inherited: dict[str, tuple[int, int]], queued: set[str], careful: bool,
                 seen: dict[str, str]) -> list[tuple[str, int | None]] | str:
        """One all-or-nothing attempt: ``count`` of ``ordered`` taken (locked, marked, their names checked),
        or why not: ``"busy"`` (fewer are free; ``seen`` says, per GPU that was not simply locked by someone
        else, ``"free"`` (taken, and given back), ``"missing"`` (no lock file), ``"queued"`` (left to a
        session that queues for it) or ``"making"`` (its lock file is being made)),
        ``"closed"`` (the directory is locked exclusively: nothing was tried), ``"careful"`` (another
        session is making a lock file or queues for a GPU: try again at once, looking at each GPU's marks),
        ``"again"`` (a lock file was replaced: try again at once).

        ``careful``: look at each GPU's marks before trusting it, and leave a GPU that another session
        queues for to it unless this acquire queues for it too (``queued``).
        """
        if not _share(state):
            return "closed"
        taken: list[tuple[str, int | None]] = []
        # One loop per GPU (the lock, the hold mark; the names' check after it, one look for all GPUs): a
        # helper call per step and GPU was most of the locks' Python cost per test.
        try:
            for uuid in ordered:
                if uuid in inherited:
                    taken.append((uuid, None))
                else:
                    marks = _marks(uuid)
                    if careful and uuid not in queued and _marked(state, marks.queue) is not None:
                        seen[uuid] = "queued"  # a session that has waited long for it goes first
                        continue
                    fd = self._try(state, marks.lock)
                    if fd is None:
                        continue
                    if fd == _MISSING:
                        seen[uuid] = "missing"
                        continue
                    taken.append((uuid, fd))
                    _mark(state, marks.set_hold)
                    if careful and _marked(state, marks.make) is not None:
                        # Somebody saw the name missing and is making a file: ours may be a deleted one.
                        taken.pop()
                        _unlock(state, fd)
                        _clear(state, marks.unset_hold)
                        seen[uuid] = "making"
                        continue
                if len(taken) == count:
                    break
            if len(taken) < count:
                seen.update((u, "free") for u, fd in taken if fd is not None)
                _let_go(state, taken)
                return "busy"
            # Our hold marks are up: from now on nobody makes a new file for these GPUs (see _create). Only
            # now can the names be trusted to stay ours: a make mark seen now may be one begun before ours.
            if not careful and _marked(state, _MAKE_BASE, _MARKS_LEN) is not None:
                _let_go(state, taken)
                return "careful"
            # One look at the directory serves it and every GPU's name (see _unchanged, _still_named).
            info = os.fstat(state.fd)
            if not _unchanged(state, info) and self._looked_up(state) is not state:
                _let_go(state, taken)  # it was replaced: lock in the new one
                return "again"
            ctime = info.st_ctime_ns
            for _uuid, fd in taken:
                if fd is not None and not _still_named(state, name := state.lock_names[fd], fd, ctime):
                    # The file was deleted (by hand, a cleaner) since we opened it: a lock on that inode locks
                    # nothing. Look at what the name holds now.
                    _let_go(state, taken)
                    _forget(state, name)
                    return "again"
        except BaseException:
            # Also on KeyboardInterrupt or a pytest-timeout signal: a lock kept by a stray descriptor would
            # block this very session's next test.
            _let_go(state, taken)
            raise
        return taken

    def acquire(self, candidates: Sequence[str], count: int, timeout: float, holder_id: str,
                prefer: Sequence[str] = (),
                on_wait: Callable[[dict[str, dict[str, object]]], None] | None = None,
                parked: HeldLocks | None = None) -> HeldLocks:
        """Lock ``count`` of ``candidates`` (all of them when ``count == len(candidates)``).

        ``parked``: the previous test's locks, kept by ``HeldLocks.park``. If they are what this acquire
        needs, they are this test's (its holder records rewritten); else they are released first.

        GPUs that an ancestor process holds (see ``HELD_VAR``) count as taken, and come first; then free
        devices are taken in UUID order, those listed in ``prefer`` first. If fewer than ``count`` are
        free, everything taken is released and the attempt repeats until ``timeout``. ``on_wait`` is
        called once, when the first attempt fails, with the holders of the busy devices (see ``holders``).

        Once it has waited ``_QUEUE_AFTER_S``, the acquire queues for the GPUs it could not get (their queue
        marks), and attempts that do not queue for them leave them alone: a newcomer, or the holder's own
        next test, waits its turn instead of taking a GPU the instant it is freed, so a stream of them can't
        keep a waiter out for ever; the queued compete among themselves as everyone did before.
        """
        if parked is not None:
            try:
                if self._resume(parked, candidates, count, holder_id):
                    return parked
            except BaseException:
                parked.release()  # (an interrupt: the caller no longer has them to let go)
                raise
            parked.release()
        inherited = {u: h for u, h in self.inherited().items() if u in candidates}
        ordered = (sorted(candidates, key=lambda u: (u not in inherited, u not in prefer, u))
                   if inherited or prefer else sorted(candidates))  # (the same order: no key call per GPU)
        started = time.monotonic()
        notified = False
        careful = False
        queued: set[str] = set()
        queued_in: _Dir | None = None
        state = self._cached()  # (looked at once the locks are taken: see _attempt)
        try:
            while True:
                if state is None:
                    state = self._state()
                seen: dict[str, str] = {}
                outcome = self._attempt(state, ordered, count, inherited, queued, careful, seen)
                if not isinstance(outcome, str):
                    return self._record(state, outcome, holder_id, time.monotonic() - started, inherited)
                if outcome == "careful":
                    careful = True
                    continue
                if outcome == "again":
                    state = None
                    continue  # a name or the directory changed: try again at once
                missing = [u for u, why in seen.items() if why == "missing"]
                if missing:
                    fresh = self._state()  # (never make files in a directory that was replaced)
                    if fresh is not state or len(_create(state, missing)) < len(missing):
                        state = fresh
                        continue  # we made lock files: try again at once
                waited = time.monotonic() - started
                if outcome == "closed" and waited < timeout:
                    # Someone holds the directory exclusively for a moment (a tmp cleaner looking at it):
                    # nothing was tried, so there is nobody to name yet.
                    time.sleep(random.uniform(*_RETRY_S))
                    state = None
                    continue
                busy = [u for u in ordered if u not in inherited and seen.get(u) != "free"]
                if waited >= timeout:
                    holders = self.holders(busy, seen)
                    raise LockTimeout(
                        f"waited {waited:.1f}s for {count} of {len(ordered)} GPU lock(s); held by: "
                        + describe_holders(holders), holders, waited)
                if waited >= _QUEUE_AFTER_S:
                    if queued_in is not state:  # (the directory was replaced: queue in the new one)
                        if queued_in is not None:
                            _unqueue(queued_in, queued)
                        queued_in, queued = state, set()
                    for uuid in busy:
                        if uuid not in queued:
                            _mark_at(state, fcntl.F_RDLCK, _marks(uuid).queue)
                            queued.add(uuid)
                    careful = True
                if on_wait is not None and not notified:
                    notified = True
                    on_wait(self.holders(busy, seen))
                time.sleep(random.uniform(*_RETRY_S))
                state = None  # (a wait is long enough for the directory to be replaced: look again)
        finally:
            if queued_in is not None:
                _unqueue(queued_in, queued)

    def inherited(self) -> dict[str, tuple[int, int]]:
        """GPUs of this lock directory that an ancestor of this process holds, per ``HELD_VAR``.

        Trusted only if the named holder is still our ancestor (same pid and start time) and still the
        recorded holder of the GPU: a process that outlived the test that started it inherits nothing.
        """
        value = os.environ.get(HELD_VAR)
        if not value:
            return {}  # (the usual case: no json.loads per test)
        try:
            data = json.loads(value)
            if os.path.realpath(str(data["dir"])) != os.path.realpath(self.directory):
                return {}
            holders = {str(u): (int(pid), int(start)) for u, (pid, start) in data["holders"].items()}
        except (ValueError, TypeError, KeyError, AttributeError):
            return {}
        if not holders:
            return {}
        ancestors = procfs.ancestry(os.getpid())
        records = _read_records(self._state(), list(holders))
        return {u: (pid, start) for u, (pid, start) in holders.items()
                if ancestors.get(pid) == start and records.get(u, {}).get("pid") == pid}

    def _held_value(self, held: HeldLocks, me: tuple[int, int]) -> str:
        """``HELD_VAR``'s value while ``held`` is held: the same from test to test, so encoded once."""
        key = (self.directory, held.uuids, tuple(sorted(held.inherited.items())))
        value = _cache.held_values.get(key)
        if value is None:
            holders = {u: list(held.inherited.get(u, me)) for u in held.uuids}
            value = _cache.held_values[key] = json.dumps({"dir": self.directory, "holders": holders})
        return value

    def _resume(self, parked: HeldLocks, candidates: Sequence[str], count: int, holder_id: str) -> bool:
        """Make the parked locks this test's, if they are ``count`` of ``candidates``, ``HELD_VAR`` still
        says what they set (else something changed the environment between the tests), and the directory
        is unchanged."""
        state = parked._dir
        if (not parked.parked or state is None or len(parked.uuids) != count
                or not set(parked.uuids).issubset(candidates)
                or os.environ.get(HELD_VAR) != parked._env[1] or self._cached() is not state):
            return False
        try:
            if not parked._directory_unchanged(state):  # (looked at again: pytest ran hooks since ``park``)
                return False
        except OSError:
            return False
        parked.parked = False
        parked.waited_s = 0.0
        self._write_records(state, parked, holder_id)
        return True

    def _record(self, state: _Dir, taken: list[tuple[str, int | None]], holder_id: str, waited_s: float,
                inherited: dict[str, tuple[int, int]]) -> HeldLocks:
        held = HeldLocks(taken, waited_s, {u: inherited[u] for u, fd in taken if fd is None}, state)
        self._write_records(state, held, holder_id)
        return held

    def _write_records(self, state: _Dir, held: HeldLocks, holder_id: str) -> None:
        """Set ``HELD_VAR`` and write this user's holder records of the GPUs ``held`` locked, naming the test
        ``holder_id``."""
        me = _cache.me_checked()  # (acquire began with _cached(): this process's own cache)
        if me is not None and held._env[1] is None:  # (set already for locks kept from the last test)
            previous = os.environ.get(HELD_VAR)
            os.environ[HELD_VAR] = ours = self._held_value(held, me)
            held._env = (previous, ours)
        # Only the test and the time change from one record to the next, and they come last: the rest is
        # encoded once per process and GPU, and a kept lock's record is rewritten from where they start,
        # with the same bytes for every GPU (the encoding and padding of a record per GPU and test cost as
        # much as writing it).
        head = _cache.record_head
        if head is None:
            _cache.uid = os.geteuid()
            head = _cache.record_head = json.dumps({"pid": _cache.owner_pid, "start": me[1] if me else None,
                                                    "host": _HOST, "uid": _cache.uid})[:-1]
        current = f', "since": {time.time()!r}, "test": {json.dumps(holder_id)}}}'.encode()
        if held.record_slots and _rewrite_records(held.record_slots, current):
            return  # (locks kept from the last test: the files it wrote, rewritten in place)
        for holder, padded in held.holder_fds:
            if not padded:  # (the last test's record was longer than the padding: a shorter one would
                with contextlib.suppress(OSError):  # leave its end behind; rare, so no per-test cost)
                    os.ftruncate(holder, 0)
        uid = _cache.uid
        written = held.holder_fds = []
        slots: dict[int, list[int]] = {}
        for uuid, fd in held._taken:
            if fd is None:
                continue  # the ancestor's record stays: it is the holder
            fixed = (head + _marks(uuid).uuid_field).encode()
            try:
                written.append(_write_holder(state, _holder_name(uuid, uid), fixed + current))
            except OSError:
                continue  # best effort: the lock itself is what protects the GPU
            slots.setdefault(len(fixed), []).append(written[-1][0])
        held.record_slots = list(slots.items()) if all(padded for _fd, padded in written) else []


def _rewrite_records(slots: Sequence[tuple[int, list[int]]], current: bytes) -> bool:
    """Rewrite padded holder records in place from where their ``current`` part (the test and the time)
    starts, one padded copy per start; False (having stopped) at one too long for the padding (a long
    test id), which the caller writes the general way."""
    for start, holders in slots:
        if start + len(current) > _RECORD_BYTES:
            return False
        data = current.ljust(_RECORD_BYTES - start)
        for holder in holders:
            try:  # noqa: SIM105 (per GPU and test: cheaper than contextlib.suppress)
                os.pwrite(holder, data, start)
            except OSError:
                pass
    return True


def _busy_or_raise(state: _Dir, name: str, exc: OSError) -> None:
    """A refused ``lockf`` of lock file ``name``: returns if another process holds it; raises otherwise."""
    if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
        return
    raise _dir_error(state.path, f"cannot lock {name}", exc) from None


def _open_dir_once(path: str) -> _Dir:
    opened = _open_dir(path)
    known = _cache.dirs.get(opened.ident)
    if known is not None:
        os.close(opened.fd)  # (a directory: no POSIX lock of ours to lose)
        return known
    _cache.dirs[opened.ident] = opened
    return opened


def _cache_lock(state: _Dir, name: str) -> int | None:
    fd = state.lock_fds.get(name)
    if fd is None:
        fd = _open_lock(state, name)
        if fd == _MISSING:
            return None
        state.lock_fds[name] = fd
    return fd


def _still_named(state: _Dir, name: str, fd: int, ctime: int | None = None) -> bool:
    """Whether ``name`` in the directory is still the file open as ``fd`` (just locked).

    A lock on a file that was deleted (or replaced) since it was opened locks nothing. Looking the name
    up costs a path stat per GPU and test; the directory's ctime says more cheaply that no entry was
    added or removed since the name was last looked up, provided that ctime was settled then
    (``procfs.SETTLED_NS``). ``ctime``: the directory's, read after the lock was taken (one read serves
    every GPU of an acquire); read here if not given.
    """
    if ctime is None:
        try:
            ctime = os.fstat(state.fd).st_ctime_ns
        except OSError:
            ctime = None
    if ctime is not None and state.verified.get(fd) == ctime:
        return True
    try:
        now = os.stat(name, dir_fd=state.fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    if (now.st_dev, now.st_ino) != state.lock_idents.get(fd):
        return False
    if ctime is not None and time.time_ns() - ctime > procfs.SETTLED_NS:
        state.verified[fd] = ctime
    return True


def _forget(state: _Dir, name: str) -> None:
    fd = state.lock_fds.pop(name, None)
    if fd is not None:
        state.held.discard(fd)
        state.lock_idents.pop(fd, None)
        state.lock_names.pop(fd, None)
        state.verified.pop(fd, None)
        with contextlib.suppress(OSError):
            os.close(fd)


# ---- holder records: written by us, read as untrusted input ------------------------------------------

def _holder_name(uuid: str, uid: int) -> str:
    return f"{_marks(uuid).file}.{uid}.holder"


def _holder_fd(state: _Dir, name: str) -> int:
    fd = state.holder_fds.get(name)
    if fd is None:
        fd = state.holder_fds[name] = _open_own_holder(state, name)
    return fd


def _open_own_holder(state: _Dir, name: str) -> int:
    flags = os.O_WRONLY | _FILE_FLAGS
    for _attempt in range(2):
        try:
            fd = os.open(name, flags | os.O_CREAT | os.O_EXCL, HOLDER_FILE_MODE, dir_fd=state.fd)
        except FileExistsError:
            pass
        else:
            with contextlib.suppress(OSError):
                os.fchmod(fd, HOLDER_FILE_MODE)
            return fd
        try:
            fd = os.open(name, flags, dir_fd=state.fd)
        except OSError as exc:
            if exc.errno not in (errno.ELOOP, errno.ENXIO, errno.EACCES):  # a link, a FIFO, another's file
                raise
        else:
            info = os.fstat(fd)
            if stat.S_ISREG(info.st_mode) and info.st_uid == os.geteuid() and info.st_nlink == 1:
                return fd
            os.close(fd)
        # Another user's file under our name, a link, or a hard link to some other file: never write into
        # it. Remove it if we may (root, or the directory's owner), and make our own.
        os.unlink(name, dir_fd=state.fd)
    raise OSError(errno.EEXIST, f"holder record {name} keeps being replaced")


def _write_holder(state: _Dir, name: str, payload: bytes) -> tuple[int, bool]:
    """Write this user's holder record (JSON) for one GPU into its (session-long open) file.

    Returns the descriptor and whether the record was padded to ``_RECORD_BYTES``.

    Overwritten in place: a file created, renamed or deleted per GPU and test costs more than the whole
    clean check (docs/benchmarks.md 9). A reader that catches a half-written record fails to parse
    it and reads "unknown holder", as for a missing one.
    """
    fd = _holder_fd(state, name)
    if len(payload) <= _RECORD_BYTES:
        # Padded to a fixed size (JSON allows trailing blanks): no ftruncate, which costs as much as the
        # write. Released records are blanked the same way (see HeldLocks.release).
        os.pwrite(fd, payload.ljust(_RECORD_BYTES), 0)
        return fd, True
    os.pwrite(fd, payload, 0)
    os.ftruncate(fd, len(payload))
    return fd, False


def _read_records(state: _Dir, uuids: Sequence[str]) -> dict[str, dict[str, object]]:
    """The newest valid holder record of each of ``uuids`` (absent: none)."""
    wanted = {_file_name(u): u for u in uuids}
    try:
        names = os.listdir(state.fd)
    except OSError:
        return {}
    now = time.time()
    newest: dict[str, dict[str, object]] = {}
    for name in names:
        if not name.endswith(".holder"):
            continue
        base, _, uid_text = name[: -len(".holder")].rpartition(".")
        uuid = wanted.get(base)
        if uuid is None or not (uid_text.isascii() and uid_text.isdigit()):
            continue
        record = _read_record(state, name, int(uid_text), uuid, now)
        if record is not None and _since(record) >= _since(newest.get(uuid, {})):
            newest[uuid] = record
    return newest


def _read_record(state: _Dir, name: str, uid: int, uuid: str, now: float) -> dict[str, object] | None:
    try:
        fd = os.open(name, os.O_RDONLY | _FILE_FLAGS, dir_fd=state.fd)
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        # Only the user a record file is named after may have written it: the kernel says who made it.
        if not stat.S_ISREG(info.st_mode) or info.st_uid != uid:
            return None
        raw = os.read(fd, _READ_LIMIT + 1)
    except OSError:
        return None
    finally:
        os.close(fd)
    if len(raw) > _READ_LIMIT or not raw.strip():
        return None
    try:
        data = json.loads(raw)
    except ValueError:
        return None  # blank (released), half-written, or not ours
    return _valid_record(data, uid, uuid, now)


def _valid_record(data: object, uid: int, uuid: str, now: float) -> dict[str, object] | None:
    """The fields of a holder record we can use, checked and cleaned; None if it is not a valid record."""
    if not isinstance(data, dict) or data.get("uuid") != uuid:
        return None
    pid, since, start = data.get("pid"), data.get("since"), data.get("start")
    if type(pid) is not int or not 0 < pid < 1 << 22:  # (bool is an int: type(), not isinstance)
        return None
    if data.get("uid") != uid or type(data.get("uid")) is not int:
        return None
    if not isinstance(since, (int, float)) or isinstance(since, bool) or not math.isfinite(since):
        return None
    if not 0 < since <= now + _CLOCK_SKEW_S:
        return None
    record: dict[str, object] = {"pid": pid, "uid": uid, "user": _user_name(uid),
                                 "host": _clean_host(data.get("host")), "test": clean_text(data.get("test")),
                                 "since": float(since), "uuid": uuid}
    if type(start) is int and start >= 0:
        record["start"] = start
    return record


def clean_text(value: object, limit: int = _TEXT_LIMIT) -> str:
    """Untrusted text made safe to print: one line, no control or format characters (ANSI escapes,
    bidi overrides), at most ``limit`` characters, and never starting like a CI workflow command."""
    if not isinstance(value, str):
        return "?"
    text = " ".join("".join(c if c.isprintable() else " " for c in value).split())
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    # GitHub's runner reads "::command::" (and the older "##[command]") at the start of a line.
    if text.startswith(("::", "##")):
        text = "?" + text
    return text or "?"


def _clean_host(value: object) -> str:
    if isinstance(value, str) and 0 < len(value) <= 253 and all(c.isascii() and (c.isalnum() or c in ".-_")
                                                                 for c in value):
        return value
    return "?"


@functools.lru_cache(maxsize=64)
def _user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def _since(holder: dict[str, object]) -> float:
    since = holder.get("since")
    return float(since) if isinstance(since, (int, float)) else float("-inf")


# ---- who really holds a lock: /proc/locks ------------------------------------------------------------

def _proc_locks() -> list[tuple[str, int, int, int, int]]:
    """(kind, pid, major, minor, inode) of every lock on the host (not waiters)."""
    try:
        with open("/proc/locks") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        parts = line.split()
        # "1: POSIX  ADVISORY  WRITE 4242 fd:01:131090 0 EOF"; waiters have "->" as second field.
        if len(parts) < 6 or parts[1] == "->":
            continue
        try:
            major, minor, inode = parts[5].split(":")
            found.append((parts[1], int(parts[4]), int(major, 16), int(minor, 16), int(inode)))
        except ValueError:
            continue
    return found


def _posix_lockers(idents: set[tuple[int, int]]) -> dict[tuple[int, int], int]:
    """For each (st_dev, st_ino): the pid holding a POSIX lock on it (0: in another PID namespace)."""
    if not idents:
        return {}
    wanted = {(os.major(dev), os.minor(dev), ino): (dev, ino) for dev, ino in idents}
    by_inode: dict[int, list[tuple[tuple[int, int], int]]] = {}
    found: dict[tuple[int, int], int] = {}
    for kind, pid, major, minor, inode in _proc_locks():
        if kind != "POSIX":
            continue
        ident = wanted.get((major, minor, inode))
        if ident is not None:
            found[ident] = pid
        else:
            by_inode.setdefault(inode, []).append(((major, minor), pid))
    # Some file systems (btrfs subvolumes, overlayfs) report another device number in stat() than in
    # /proc/locks: fall back to the inode number when only one lock has it.
    for dev, ino in idents - set(found):
        candidates = by_inode.get(ino, [])
        if len(candidates) == 1:
            found[(dev, ino)] = candidates[0][1]
    return found


def _describe_process(pid: int) -> tuple[str, str]:
    """(user, command line) of a local process, cleaned for printing."""
    try:
        uid = os.stat(f"/proc/{pid}").st_uid
        user = _user_name(uid)
    except OSError:
        user = "?"
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read(1024).replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        cmd = ""
    return user, clean_text(cmd, 120)


def _record_alive(holder: dict[str, object]) -> bool | None:
    """Whether the recorded process still runs (None: it runs on another host, or we can't tell)."""
    pid = holder.get("pid")
    if not isinstance(pid, int) or holder.get("host") != _HOST:
        return None
    start = holder.get("start")
    return procfs.is_live(pid, start if isinstance(start, int) else None)


def _recorded(holder: dict[str, object]) -> str:
    age = f", for {max(0.0, time.time() - _since(holder)):.0f}s" if "since" in holder else ""
    return (f"pid {holder.get('pid')} (user {holder.get('user')}) on {holder.get('host')} running "
            f"{holder.get('test')}{age}")


def describe_holder(holder: dict[str, object]) -> str:
    """One line naming a lock's holder: its record, checked against the kernel's /proc/locks."""
    lock_pid = holder.get("lock_pid")
    if holder.get("making") and not isinstance(lock_pid, int) and not holder.get("held"):
        return ("its lock file is being created by another session (a moment; if it lasts, a process keeps "
                "its mark on the lock directory up: lslocks shows OFDLCK locks)")
    if holder.get("missing"):
        if not holder.get("held"):
            return "its lock file is missing; the next attempt creates it"
        who = "a session that left no record"
        if "pid" in holder:
            who = _recorded(holder)
            if _record_alive(holder) is False:
                who += " (gone: a process that inherited its descriptors, a raw fork's child, keeps its mark)"
        return ("its lock file was deleted (by hand or by a tmp cleaner?) while a session held the GPU, "
                f"which it still does through the deleted file: {who}; a new lock file is made as soon as it "
                "lets go")
    recorded = _recorded(holder) if "pid" in holder else None
    if not isinstance(lock_pid, int) and holder.get("queued"):
        return (f"free, but another session has waited over {_QUEUE_AFTER_S:.0f}s for it and goes first "
                "(long waiters before newcomers)")
    if not isinstance(lock_pid, int):
        if recorded is None:
            return "unknown holder (no valid holder record, and /proc/locks does not name the process)"
        if _record_alive(holder) is False:
            return recorded + " (that process is gone: a stale record; the holder did not record itself)"
        return recorded
    if lock_pid == 0:
        return (recorded or "unknown holder") + " (the lock is held from another PID namespace)"
    if recorded is not None and holder.get("host") != _HOST:
        return f"{recorded} (pid {lock_pid} here)"  # another container: its own pid numbers
    if recorded is not None and holder.get("pid") == lock_pid and _record_alive(holder) is not False:
        return recorded
    real = (f"pid {lock_pid} (user {holder.get('lock_user')}: {holder.get('lock_cmd') or '?'}), which left "
            "no record")
    if recorded is None:
        return real
    state = "that process is gone" if _record_alive(holder) is False else "that process does not hold it"
    return f"{real}; the newest record, {recorded}, is stale ({state})"


def describe_holders(holders: dict[str, dict[str, object]]) -> str:
    """``uuid: holder; uuid: holder`` for a message."""
    return "; ".join(f"{u}: {describe_holder(h)}" for u, h in holders.items())
