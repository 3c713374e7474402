"""The GPU locks: one per physical GPU (by UUID), taken all-or-nothing for a test. Each is a POSIX record
lock on ``<dir>/<uuid>.lock``: the kernel drops it when its process ends, and no forked child holds it (an
inherited BSD ``flock`` outlives pytest). Each user keeps an untrusted holder record beside it."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import random
import stat
import time
from collections.abc import Callable, Sequence

from pytest_gpuclean._locks.describe import describe_holders
from pytest_gpuclean._locks.directory import (
    MAKE_BASE,
    MARKS_LEN,
    MISSING,
    QUEUE_AFTER_S,
    LockDir,
    cache,
    cache_lock,
    clear,
    create,
    dir_error,
    forget,
    let_go,
    mark,
    mark_at,
    marked,
    marks_of,
    open_dir_once,
    share,
    unchanged,
    unlock,
    unqueue,
)
from pytest_gpuclean._locks.held import (
    HELD_VAR,
    HeldLocks,
    holder_fd,
    holder_name,
    resume,
    still_named,
    write_records,
)
from pytest_gpuclean._locks.holders import lock_holders, read_records
from pytest_gpuclean._model.records import HolderRecord, LockHolder
from pytest_gpuclean._reading import procfs

_RETRY_S = (0.02, 0.1)
"""Randomised, so competing sessions don't stay in step."""


class LockTimeout(Exception):
    """The locks could not be had in time; ``holders`` says who has them, ``waited_s`` how long we waited."""

    def __init__(self, message: str, holders: dict[str, LockHolder], waited_s: float = 0.0) -> None:
        super().__init__(message)
        self.holders = holders
        self.waited_s = waited_s


class GpuLocks:
    """Acquire per-GPU locks all-or-nothing, in one global (UUID) order, so no two sessions deadlock."""

    def __init__(self, directory: str) -> None:
        self.directory = os.path.abspath(directory)
        self._ident = open_dir_once(self.directory).ident

    def _cached(self) -> LockDir | None:
        if os.getpid() != cache.owner_pid:
            cache.forget_inherited()  # a raw fork() skipped the at-fork hook: nothing here is ours
        return cache.dirs.get(self._ident)

    def _state(self) -> LockDir:
        state = self._cached()
        if state is not None and unchanged(state, os.fstat(state.fd)):
            return state
        return self._looked_up(state)

    def _looked_up(self, state: LockDir | None) -> LockDir:
        """The directory the path names now (``state`` if still that one)."""
        try:
            now = os.stat(self.directory, follow_symlinks=False)
            same = (now.st_dev, now.st_ino) == self._ident and stat.S_ISDIR(now.st_mode)
        except OSError:
            same = False
        if state is not None and same:
            return state
        if state is not None:
            cache.notices.append(
                f"gpuclean: the GPU lock directory {self.directory} was removed or replaced while this "
                "session ran; the new one is used from now on (sessions still in the old one don't see its "
                "locks until their next test)")
        state = open_dir_once(self.directory)
        self._ident = state.ident
        return state

    def lock_path(self, uuid: str) -> str:
        return f"{self.directory}/{marks_of(uuid).lock}"

    def prepare(self, uuids: Sequence[str]) -> None:
        """Open (and create, where safe) the lock and holder files of ``uuids`` at session start: an
        unusable directory stops the session with a clear message, not a test later."""
        state = self._state()
        missing = [u for u in uuids if (name := marks_of(u).lock) not in state.lock_fds
                   and cache_lock(state, name) is None]
        if missing:
            create(state, missing)
            for uuid in missing:
                cache_lock(state, marks_of(uuid).lock)
        for uuid in uuids:
            try:
                holder_fd(state, holder_name(uuid, os.geteuid()))
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS):
                    raise dir_error(self.directory, "cannot create a holder record", exc) from None

    def holder(self, uuid: str) -> HolderRecord | None:
        """Who holds ``uuid``'s lock as recorded (None if nobody recorded). The newest record wins: an
        older one is a killed session's leftover."""
        return read_records(self._state(), [uuid]).get(uuid)

    def holders(self, uuids: Sequence[str], seen: dict[str, str] | None = None) -> dict[str, LockHolder]:
        """For each of ``uuids``: its newest valid record, and what the kernel and the marks say."""
        return lock_holders(self._state(), uuids, seen)

    def _try(self, state: LockDir, name: str) -> int | None:
        """Lock the GPU's file ``name``: its descriptor, None if busy, ``MISSING`` if absent. Not yet
        trusted."""
        fd = state.lock_fds.get(name)
        if fd is None:
            fd = cache_lock(state, name)
            if fd is None:
                return MISSING
        elif fd in state.held:
            # Held by this process already: a second POSIX lock would just succeed, so refuse as for another
            # process.
            return None
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            _busy_or_raise(state, name, exc)
            return None
        state.held.add(fd)
        return fd

    def _attempt(self, state: LockDir, ordered: Sequence[str], count: int,
                 inherited: dict[str, tuple[int, int]], queued: set[str], careful: bool,
                 seen: dict[str, str]) -> list[tuple[str, int | None]] | str:
        """One all-or-nothing attempt: ``count`` of ``ordered`` taken (locked, marked, names checked), or
        why not:

        - ``"busy"``: fewer are free; ``seen`` says per GPU ``"free"``, ``"missing"``, ``"queued"`` or
          ``"making"``;
        - ``"closed"``: the directory is locked exclusively, nothing was tried;
        - ``"careful"``: another session makes a lock file or queues: retry, looking at the marks;
        - ``"again"``: a lock file was replaced: retry.

        ``careful``: check each GPU's marks and leave a GPU another session queues for unless ``queued``."""
        if not share(state):
            return "closed"
        taken: list[tuple[str, int | None]] = []
        # Per GPU the lock, then the hold mark; names are checked after, once for all.
        try:
            for uuid in ordered:
                if uuid in inherited:
                    taken.append((uuid, None))
                else:
                    marks = marks_of(uuid)
                    if careful and uuid not in queued and marked(state, marks.queue) is not None:
                        seen[uuid] = "queued"  # a session that has waited long for it goes first
                        continue
                    fd = self._try(state, marks.lock)
                    if fd is None:
                        continue
                    if fd == MISSING:
                        seen[uuid] = "missing"
                        continue
                    taken.append((uuid, fd))
                    mark(state, marks.set_hold)
                    if careful and marked(state, marks.make) is not None:
                        # Somebody saw the name missing and is making a file: ours may be a deleted one.
                        taken.pop()
                        unlock(state, fd)
                        clear(state, marks.unset_hold)
                        seen[uuid] = "making"
                        continue
                if len(taken) == count:
                    break
            if len(taken) < count:
                seen.update((u, "free") for u, fd in taken if fd is not None)
                let_go(state, taken)
                return "busy"
            # With our hold marks up nobody makes a new file for these GPUs, so only now can the names be
            # trusted.
            if not careful and marked(state, MAKE_BASE, MARKS_LEN) is not None:
                let_go(state, taken)
                return "careful"
            # One look at the directory serves every GPU's name (see unchanged, still_named).
            info = os.fstat(state.fd)
            if not unchanged(state, info) and self._looked_up(state) is not state:
                let_go(state, taken)  # it was replaced: lock in the new one
                return "again"
            ctime = info.st_ctime_ns
            for _uuid, fd in taken:
                if fd is not None and not still_named(state, name := state.lock_names[fd], fd, ctime):
                    # Deleted since we opened it: a lock on that inode locks nothing.
                    let_go(state, taken)
                    forget(state, name)
                    return "again"
        except BaseException:
            # Also on KeyboardInterrupt or a timeout signal: a stray descriptor's lock would block our next
            # test.
            let_go(state, taken)
            raise
        return taken

    def acquire(self, candidates: Sequence[str], count: int, timeout: float, holder_id: str,
                prefer: Sequence[str] = (),
                on_wait: Callable[[dict[str, LockHolder]], None] | None = None,
                parked: HeldLocks | None = None) -> HeldLocks:
        """Lock ``count`` of ``candidates``. ``parked``: the previous test's locks, this test's if they
        fit, else released first. GPUs an ancestor holds come first; then free ones in UUID order,
        ``prefer`` first. If fewer are free, everything is released and the attempt repeats until
        ``timeout``.

        After ``QUEUE_AFTER_S`` the acquire queues for the GPUs it lacks: a stream of newcomers (or the
        holder's next test) can't keep a waiter out for ever."""
        if parked is not None:
            try:
                if resume(parked, candidates, count, holder_id, self.directory, self._cached):
                    return parked
            except BaseException:
                parked.release()  # (an interrupt: the caller no longer has them to let go)
                raise
            parked.release()
        inherited = {u: h for u, h in self.inherited().items() if u in candidates}
        ordered = (sorted(candidates, key=lambda u: (u not in inherited, u not in prefer, u))
                   if inherited or prefer else sorted(candidates))  # the same order: no key call per GPU
        started = time.monotonic()
        notified = False
        careful = False
        queued: set[str] = set()
        queued_in: LockDir | None = None
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
                    if fresh is not state or len(create(state, missing)) < len(missing):
                        state = fresh
                        continue  # we made lock files: try again at once
                waited = time.monotonic() - started
                if outcome == "closed" and waited < timeout:
                    # Someone holds the directory exclusively for a moment: nothing was tried.
                    time.sleep(random.uniform(*_RETRY_S))
                    state = None
                    continue
                busy = [u for u in ordered if u not in inherited and seen.get(u) != "free"]
                if waited >= timeout:
                    holders = self.holders(busy, seen)
                    raise LockTimeout(
                        f"waited {waited:.1f}s for {count} of {len(ordered)} GPU lock(s); held by: "
                        + describe_holders(holders), holders, waited)
                if waited >= QUEUE_AFTER_S:
                    if queued_in is not state:  # (the directory was replaced: queue in the new one)
                        if queued_in is not None:
                            unqueue(queued_in, queued)
                        queued_in, queued = state, set()
                    for uuid in busy:
                        if uuid not in queued:
                            mark_at(state, fcntl.F_RDLCK, marks_of(uuid).queue)
                            queued.add(uuid)
                    careful = True
                if on_wait is not None and not notified:
                    notified = True
                    on_wait(self.holders(busy, seen))
                time.sleep(random.uniform(*_RETRY_S))
                state = None  # (a wait is long enough for the directory to be replaced: look again)
        finally:
            if queued_in is not None:
                unqueue(queued_in, queued)

    def inherited(self) -> dict[str, tuple[int, int]]:
        """GPUs an ancestor holds per ``HELD_VAR``, trusted only if the holder is still our ancestor and
        the recorded holder: a process that outlived its test inherits nothing."""
        value = os.environ.get(HELD_VAR)
        if not value:
            return {}  # the usual case: no json.loads per test
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
        records = read_records(self._state(), list(holders))
        return {u: (pid, start) for u, (pid, start) in holders.items()
                if ancestors.get(pid) == start and (r := records.get(u)) is not None and r.pid == pid}

    def _record(self, state: LockDir, taken: list[tuple[str, int | None]], holder_id: str, waited_s: float,
                inherited: dict[str, tuple[int, int]]) -> HeldLocks:
        held = HeldLocks(taken, waited_s, {u: inherited[u] for u, fd in taken if fd is None}, state)
        write_records(state, held, holder_id, self.directory)
        return held


def _busy_or_raise(state: LockDir, name: str, exc: OSError) -> None:
    """A refused ``lockf`` of ``name``: returns if another process holds it; raises otherwise."""
    if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
        return
    raise dir_error(state.path, f"cannot lock {name}", exc) from None

