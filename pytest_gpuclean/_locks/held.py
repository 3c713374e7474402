"""The locks a test holds: their holder records (a small JSON file per GPU and user, kept open and
overwritten in place), their release, and keeping them for the next test (``park``)."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
import time
from collections.abc import Callable, Sequence

from pytest_gpuclean._locks.directory import (
    FILE_FLAGS,
    HOST,
    MAKE_BASE,
    MARKS_LEN,
    LockDir,
    cache,
    let_go,
    marked,
    marks_of,
)
from pytest_gpuclean._reading import procfs

_RECORD_BYTES = 512
_BLANK = b" " * _RECORD_BYTES

HOLDER_FILE_MODE = 0o644
"""Only its user writes a holder record; everybody reads it, to name who holds a GPU."""

HELD_VAR = "GPUCLEAN_HELD_LOCKS"
"""Set while this process holds GPU locks (JSON: the directory, and per UUID the holder's pid and start). A
nested session a test runs takes those GPUs as its own instead of waiting for its parent until it times
out."""


class HeldLocks:
    """Locks held by this process for one test, released or kept for the next (``park``)."""

    def __init__(self, taken: list[tuple[str, int | None]], waited_s: float,
                 inherited: dict[str, tuple[int, int]], state: LockDir | None) -> None:
        self.uuids = tuple([u for u, _ in taken])
        self.locks = [fd for _, fd in taken if fd is not None]
        self._taken = taken
        """Per GPU, its locked file's descriptor (None: inherited, not locked here)."""
        self.holder_fds: list[tuple[int, bool]] = []
        """This user's holder files of the locked GPUs, blanked at release; True if padded."""
        self.waited_s = waited_s
        self.inherited = inherited
        """GPUs an ancestor holds, with its (pid, start ticks): not locked again, not released."""
        self._env: tuple[str | None, str | None] = (None, None)
        """(``HELD_VAR``'s value before us, the value we set)."""
        self._dir = state
        """The directory whose shared lock this acquire holds (None: none)."""
        self._mtime_ns = state.mtime_ns if state is not None else 0
        """The directory's mtime when the acquire began: if it changed, maybe a held lock file went."""
        self.parked = False
        """Kept after its test for this session's next one."""
        self.record_slots: list[tuple[int, list[int]]] = []
        """Where the test's part of the padded holder records starts, and their descriptors: the next test
        rewrites just that part."""

    def park(self) -> bool:
        """Keep the locks for the next test if nobody waits: True if kept (for the next acquire's
        ``parked``), False if the caller must release now.

        Letting go between tests costs much of a checked test (docs/sharing.md), and no waiter could use
        that gap: a waiter gets a GPU once it queues, at a test boundary. Not kept if another session has a
        queue or make mark up, the directory changed, in a forked child, or with inherited GPUs."""
        state = self._dir
        if (state is None or self.inherited or cache.dirs.get(state.ident) is not state
                or cache.owner_pid != os.getpid()):
            return False
        try:
            if not self._directory_unchanged(state) or marked(state, MAKE_BASE, MARKS_LEN) is not None:
                return False
        except OSError:
            return False
        self.parked = True  # HELD_VAR stays: they are held, and the next test would set it again
        return True

    def _directory_unchanged(self, state: LockDir) -> bool:
        """No directory entry changed since these locks were taken (else ``release`` checks the lock
        files)."""
        info = os.fstat(state.fd)
        return info.st_mtime_ns == self._mtime_ns and info.st_ctime_ns == state.ctime_ns

    def release(self) -> None:
        # Holder record first: once the lock is free the next holder writes its own. A blank file is no
        # record.
        for fd, padded in self.holder_fds:
            try:
                if padded:
                    os.pwrite(fd, _BLANK, 0)
                else:
                    os.ftruncate(fd, 0)
            except OSError:
                pass
        self.holder_fds = []
        state = self._dir
        self._dir = None
        if state is not None and cache.dirs.get(state.ident) is state:  # (not in a forked child)
            try:
                changed = os.fstat(state.fd).st_mtime_ns != self._mtime_ns
            except OSError:
                changed = True
            if changed:
                for lock_fd in self.locks:
                    _check_still_named(state, lock_fd)
            let_go(state, self._taken)
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


def _check_still_named(state: LockDir, fd: int) -> None:
    # A deleted lock file: nobody could take the GPU meanwhile (its hold mark), but whoever deletes lock files
    # should hear of it.
    name = state.lock_names.get(fd)
    if name is None:
        return
    try:
        same = still_named(state, name, fd)
    except OSError:
        same = False
    if not same:
        cache.notices.append(
            f"gpuclean: lock file {state.path}/{name} was deleted or replaced while this session held it (by "
            "hand or by a tmp cleaner); no other session could take the GPU meanwhile, but exclude the lock "
            "directory from tmp cleaning (docs/sharing.md)")


def still_named(state: LockDir, name: str, fd: int, ctime: int | None = None) -> bool:
    """Whether ``name`` is still the file open as ``fd``: a lock on a deleted or replaced file locks
    nothing. The directory's settled ctime says so more cheaply than a path stat per GPU and test."""
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


# ---- kept locks: the next test takes them over, its records rewritten in place -------------------

def resume(parked: HeldLocks, candidates: Sequence[str], count: int, holder_id: str, directory: str,
           current: Callable[[], LockDir | None]) -> bool:
    """Make the parked locks this test's, if they fit, ``HELD_VAR`` is unchanged, and so is the directory."""
    state = parked._dir
    if (not parked.parked or state is None or len(parked.uuids) != count
            or not set(parked.uuids).issubset(candidates)
            or os.environ.get(HELD_VAR) != parked._env[1] or current() is not state):
        return False
    try:
        if not parked._directory_unchanged(state):  # looked at again: pytest ran hooks since park
            return False
    except OSError:
        return False
    parked.parked = False
    parked.waited_s = 0.0
    write_records(state, parked, holder_id, directory)
    return True


def write_records(state: LockDir, held: HeldLocks, holder_id: str, directory: str) -> None:
    """Set ``HELD_VAR`` and write this user's holder records of ``held``, naming test ``holder_id``
    (``directory``: as the session named it)."""
    me = _me_checked()  # acquire began with GpuLocks._cached(): this process's own cache
    if me is not None and held._env[1] is None:  # (set already for locks kept from the last test)
        previous = os.environ.get(HELD_VAR)
        os.environ[HELD_VAR] = ours = _held_value(directory, held, me)
        held._env = (previous, ours)
    # Only the test and the time change, and they come last: the rest is encoded once, and a kept lock's
    # record is rewritten from where they start.
    head = cache.record_head
    if head is None:
        cache.uid = os.geteuid()
        head = cache.record_head = json.dumps({"pid": cache.owner_pid, "start": me[1] if me else None,
                                               "host": HOST, "uid": cache.uid})[:-1]
    current = f', "since": {time.time()!r}, "test": {json.dumps(holder_id)}}}'.encode()
    if held.record_slots and _rewrite_records(held.record_slots, current):
        return  # (locks kept from the last test: the files it wrote, rewritten in place)
    for holder, padded in held.holder_fds:
        if not padded:  # (the last test's record was longer than the padding: a shorter one would
            with contextlib.suppress(OSError):  # leave its end behind; rare, so no per-test cost)
                os.ftruncate(holder, 0)
    uid = cache.uid
    written = held.holder_fds = []
    slots: dict[int, list[int]] = {}
    for uuid, fd in held._taken:
        if fd is None:
            continue  # the ancestor's record stays: it is the holder
        fixed = (head + marks_of(uuid).uuid_field).encode()
        try:
            written.append(_write_holder(state, holder_name(uuid, uid), fixed + current))
        except OSError:
            continue  # best effort: the lock itself is what protects the GPU
        slots.setdefault(len(fixed), []).append(written[-1][0])
    held.record_slots = list(slots.items()) if all(padded for _fd, padded in written) else []


def _rewrite_records(slots: Sequence[tuple[int, list[int]]], current: bytes) -> bool:
    """Rewrite padded holder records in place from their ``current`` part; False at one too long for the
    padding, which the caller writes the general way."""
    for start, holders in slots:
        if start + len(current) > _RECORD_BYTES:
            return False
        data = current.ljust(_RECORD_BYTES - start)
        for holder in holders:
            try:  # noqa: SIM105 (per GPU and test)
                os.pwrite(holder, data, start)
            except OSError:
                pass
    return True


def _held_value(directory: str, held: HeldLocks, me: tuple[int, int]) -> str:
    """The same from test to test, so encoded once."""
    key = (directory, held.uuids, tuple(sorted(held.inherited.items())))
    value = cache.held_values.get(key)
    if value is None:
        holders = {u: list(held.inherited.get(u, me)) for u in held.uuids}
        value = cache.held_values[key] = json.dumps({"dir": directory, "holders": holders})
    return value


def _me_now() -> tuple[int, int] | None:
    """(pid, start ticks) of this process, read once per process."""
    me = cache.me
    if me is None or me[0] != os.getpid():
        found = procfs.read_stat(os.getpid())
        me = cache.me = None if found is None else (found.pid, found.start_ticks)
    return me


def _me_checked() -> tuple[int, int] | None:
    """``_me_now`` where the caller has just checked that ``cache.owner_pid`` is this process's pid: no
    ``getpid``."""
    me = cache.me
    if me is None or me[0] != cache.owner_pid:
        return _me_now()
    return me


# ---- this user's holder files: opened once, written in place -------------------------------------

def holder_name(uuid: str, uid: int) -> str:
    return f"{marks_of(uuid).file}.{uid}.holder"


def holder_fd(state: LockDir, name: str) -> int:
    fd = state.holder_fds.get(name)
    if fd is None:
        fd = state.holder_fds[name] = _open_own_holder(state, name)
    return fd


def _open_own_holder(state: LockDir, name: str) -> int:
    flags = os.O_WRONLY | FILE_FLAGS
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
        # Another user's file, a link or a hard link under our name: never write into it. Remove it if we may,
        # and make our own.
        os.unlink(name, dir_fd=state.fd)
    raise OSError(errno.EEXIST, f"holder record {name} keeps being replaced")


def _write_holder(state: LockDir, name: str, payload: bytes) -> tuple[int, bool]:
    """Write this user's holder record for one GPU into its open file, in place (a new file per GPU and
    test costs more than the clean check); returns the descriptor and whether it was padded. A half-written
    record reads as "unknown holder"."""
    fd = holder_fd(state, name)
    if len(payload) <= _RECORD_BYTES:
        # Padded to a fixed size (JSON allows trailing blanks): no ftruncate, which costs as much as the
        # write.
        os.pwrite(fd, payload.ljust(_RECORD_BYTES), 0)
        return fd, True
    os.pwrite(fd, payload, 0)
    os.ftruncate(fd, len(payload))
    return fd, False

