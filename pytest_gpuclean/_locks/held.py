"""The locks a test holds (``HeldLocks``): the holder records that name it, their release, and the locks kept
for the session's next test (``park``, ``resume``). A holder record is a small JSON file next to the lock,
one per GPU and user, overwritten in place in a file kept open for the session."""

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
"""Set while this process holds GPU locks, so its children know: JSON ``{"dir": lock directory,
"holders": {uuid: [pid, start ticks]}}``. A gpuclean session that a test runs (a nested pytest,
pytester) takes those GPUs as its own instead of waiting for its parent's locks until it times out."""


class HeldLocks:
    """Locks held by this process for one test; release them in ``release``, or keep them for the next test
    (``park``). (A plain class: state that changes as the test goes, not a record.)"""

    def __init__(self, taken: list[tuple[str, int | None]], waited_s: float,
                 inherited: dict[str, tuple[int, int]], state: LockDir | None) -> None:
        self.uuids = tuple([u for u, _ in taken])
        self.locks = [fd for _, fd in taken if fd is not None]
        """Open descriptors of the locked files."""
        self._taken = taken
        """Per GPU, the descriptor of its locked file (None: inherited, not locked here)."""
        self.holder_fds: list[tuple[int, bool]] = []
        """This user's holder files of the locked GPUs, blanked at release; True if padded (see
        ``_write_holder``)."""
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

        Why: letting go of a GPU between two tests of one session and taking it again was a large part of
        what a checked test cost (docs/sharing.md, "Kept from one test to the next", has the figures), and
        nobody could use that gap: it is far shorter than a waiter's pause between two looks
        (``gpus._RETRY_S``), so a waiter gets a GPU only once it queues (``QUEUE_AFTER_S``) anyway. So
        the locks are kept unless another session has a queue or a make mark up (one request covers every
        GPU), and a waiter gets them at the next test boundary as it did before. Not kept either if the
        directory had an entry added, removed or renamed since the acquire (``release`` then checks that the
        lock files are still ours), in a forked child, or with GPUs inherited from an ancestor.
        """
        state = self._dir
        if (state is None or self.inherited or cache.dirs.get(state.ident) is not state
                or cache.owner_pid != os.getpid()):
            return False
        try:
            if not self._directory_unchanged(state) or marked(state, MAKE_BASE, MARKS_LEN) is not None:
                return False
        except OSError:
            return False
        self.parked = True  # (``HELD_VAR`` stays: they are held, and the next test would set it again)
        return True

    def _directory_unchanged(self, state: LockDir) -> bool:
        """No entry of the directory was added, removed or renamed since these locks were taken (else
        ``release`` checks that the lock files are still the ones locked)."""
        info = os.fstat(state.fd)
        return info.st_mtime_ns == self._mtime_ns and info.st_ctime_ns == state.ctime_ns

    def release(self) -> None:
        # Holder record first: once the lock is free, the next holder writes its own. A blank file is
        # no record (``holders.read_records`` skips it), and stays open for the next acquire to reuse.
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
    # The holder's side of a deleted lock file: nobody else could take the GPU meanwhile (its hold mark kept
    # a new lock file from being made: see directory.create), but whoever deletes lock files should hear
    # of it.
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


# ---- the kept-lock speed-up: the next test takes the locks over, its records rewritten in place -------

def resume(parked: HeldLocks, candidates: Sequence[str], count: int, holder_id: str, directory: str,
           current: Callable[[], LockDir | None]) -> bool:
    """Make the parked locks this test's, if they are ``count`` of ``candidates``, ``HELD_VAR`` still
    says what they set (else something changed the environment between the tests), and the directory
    is unchanged: still the one this process has open at ``directory`` (``current``: ``GpuLocks._cached``)."""
    state = parked._dir
    if (not parked.parked or state is None or len(parked.uuids) != count
            or not set(parked.uuids).issubset(candidates)
            or os.environ.get(HELD_VAR) != parked._env[1] or current() is not state):
        return False
    try:
        if not parked._directory_unchanged(state):  # (looked at again: pytest ran hooks since ``park``)
            return False
    except OSError:
        return False
    parked.parked = False
    parked.waited_s = 0.0
    write_records(state, parked, holder_id, directory)
    return True


def write_records(state: LockDir, held: HeldLocks, holder_id: str, directory: str) -> None:
    """Set ``HELD_VAR`` and write this user's holder records of the GPUs ``held`` locked, naming the test
    ``holder_id`` (``directory``: the lock directory as the session named it)."""
    me = _me_checked()  # (acquire began with GpuLocks._cached(): this process's own cache)
    if me is not None and held._env[1] is None:  # (set already for locks kept from the last test)
        previous = os.environ.get(HELD_VAR)
        os.environ[HELD_VAR] = ours = _held_value(directory, held, me)
        held._env = (previous, ours)
    # Only the test and the time change from one record to the next, and they come last: the rest is
    # encoded once per process and GPU, and a kept lock's record is rewritten from where they start,
    # with the same bytes for every GPU (the encoding and padding of a record per GPU and test cost as
    # much as writing it).
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
    """Rewrite padded holder records in place from where their ``current`` part (the test and the time)
    starts, one padded copy per start; False (having stopped) at one too long for the padding (a long
    test id), which the caller writes the general way."""
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
    """``HELD_VAR``'s value while ``held`` is held: the same from test to test, so encoded once."""
    key = (directory, held.uuids, tuple(sorted(held.inherited.items())))
    value = cache.held_values.get(key)
    if value is None:
        holders = {u: list(held.inherited.get(u, me)) for u in held.uuids}
        value = cache.held_values[key] = json.dumps({"dir": directory, "holders": holders})
    return value


def _me_now() -> tuple[int, int] | None:
    """(pid, start ticks) of this process, read once per process (``cache.me``)."""
    me = cache.me
    if me is None or me[0] != os.getpid():
        found = procfs.read_stat(os.getpid())
        me = cache.me = None if found is None else (found.pid, found.start_ticks)
    return me


def _me_checked() -> tuple[int, int] | None:
    """``_me_now`` where the caller has just made sure that ``cache.owner_pid`` is this process's pid
    (``GpuLocks._cached``, earlier in the same acquire: nothing between forks): no ``getpid``."""
    me = cache.me
    if me is None or me[0] != cache.owner_pid:
        return _me_now()
    return me


# ---- this user's holder files: opened once, written in place ----------------------------------------

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
        # Another user's file under our name, a link, or a hard link to some other file: never write into
        # it. Remove it if we may (root, or the directory's owner), and make our own.
        os.unlink(name, dir_fd=state.fd)
    raise OSError(errno.EEXIST, f"holder record {name} keeps being replaced")


def _write_holder(state: LockDir, name: str, payload: bytes) -> tuple[int, bool]:
    """Write this user's holder record (JSON) for one GPU into its (session-long open) file.

    Returns the descriptor and whether the record was padded to ``_RECORD_BYTES``.

    Overwritten in place: a file created, renamed or deleted per GPU and test costs more than the whole
    clean check. A reader that catches a half-written record fails to parse
    it and reads "unknown holder", as for a missing one.
    """
    fd = holder_fd(state, name)
    if len(payload) <= _RECORD_BYTES:
        # Padded to a fixed size (JSON allows trailing blanks): no ftruncate, which costs as much as the
        # write. Released records are blanked the same way (see HeldLocks.release).
        os.pwrite(fd, payload.ljust(_RECORD_BYTES), 0)
        return fd, True
    os.pwrite(fd, payload, 0)
    os.ftruncate(fd, len(payload))
    return fd, False

