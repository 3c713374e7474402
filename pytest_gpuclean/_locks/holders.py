"""Who holds a GPU's lock: the holder records read back (untrusted: only the named user's, small, checked,
cleaned for printing), ``/proc/locks``, and the directory's marks."""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import pwd
import stat
import time
from collections.abc import Sequence
from typing import NamedTuple

from pytest_gpuclean._locks.directory import FILE_FLAGS, HOST, LockDir, cache_lock, marked, marks_of
from pytest_gpuclean._model.records import HolderRecord, LockHolder
from pytest_gpuclean._reading import procfs

_READ_LIMIT = 4096
"""A holder record is well under 1 KiB: a bigger file is not one."""
_CLOCK_SKEW_S = 300.0
"""How far in the future a record may say it was written (container clocks, NTP steps)."""
_TEXT_LIMIT = 300


def lock_holders(state: LockDir, uuids: Sequence[str], seen: dict[str, str] | None = None
                 ) -> dict[str, LockHolder]:
    """For each of ``uuids``: its newest valid record, the kernel's view of the lock, and the marks."""
    records = read_records(state, uuids)
    idents: dict[tuple[int, int], str] = {}
    found: dict[str, LockHolder] = {}
    for uuid in uuids:
        marks = marks_of(uuid)
        fd = state.lock_fds.get(marks.lock)
        if fd is None:
            with contextlib.suppress(OSError):
                fd = cache_lock(state, marks.lock)
        why = seen.get(uuid) if seen else None
        making = why == "making" or marked(state, marks.make) is not None
        held = queued = False
        if fd is None:
            held = marked(state, marks.hold) is not None
        else:
            idents[state.lock_idents[fd]] = uuid
            queued = why == "queued" or marked(state, marks.queue) is not None
        record = records.get(uuid)
        found[uuid] = LockHolder(record, _alive(record), missing=fd is None, held=held, making=making,
                                 queued=queued)
    lockers = _posix_lockers(set(idents))
    for ident, uuid in idents.items():
        pid = lockers.get(ident)
        if pid is not None:
            user, cmd = _describe_process(pid) if pid > 0 else (None, None)
            found[uuid] = found[uuid]._replace(lock_pid=pid, lock_user=user, lock_cmd=cmd)
    return found


def _alive(record: HolderRecord | None) -> bool | None:
    """Whether the recorded process still runs (None: no record, or another host's)."""
    if record is None or record.host != HOST:
        return None
    return procfs.is_live(record.pid, record.start)


# ---- holder records: read as untrusted input ---------------------------------------------------------

def read_records(state: LockDir, uuids: Sequence[str]) -> dict[str, HolderRecord]:
    """The newest valid holder record of each of ``uuids`` (absent: none)."""
    wanted = {marks_of(u).file: u for u in uuids}
    try:
        names = os.listdir(state.fd)
    except OSError:
        return {}
    now = time.time()
    newest: dict[str, HolderRecord] = {}
    for name in names:
        if not name.endswith(".holder"):
            continue
        base, _, uid_text = name[: -len(".holder")].rpartition(".")
        uuid = wanted.get(base)
        if uuid is None or not (uid_text.isascii() and uid_text.isdigit()):
            continue
        record = _read_record(state, name, int(uid_text), uuid, now)
        if record is not None and ((best := newest.get(uuid)) is None or record.since >= best.since):
            newest[uuid] = record
    return newest


def _read_record(state: LockDir, name: str, uid: int, uuid: str, now: float) -> HolderRecord | None:
    try:
        fd = os.open(name, os.O_RDONLY | FILE_FLAGS, dir_fd=state.fd)
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


def _valid_record(data: object, uid: int, uuid: str, now: float) -> HolderRecord | None:
    """The usable fields of a holder record, checked and cleaned; None if it is not a valid record."""
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
    return HolderRecord(pid, uid, _user_name(uid), _clean_host(data.get("host")),
                        clean_text(data.get("test")), float(since), uuid,
                        start if type(start) is int and start >= 0 else None)


def clean_text(value: object, limit: int = _TEXT_LIMIT) -> str:
    """Untrusted text made safe to print: one line, no control or format characters, at most ``limit``
    long, never starting like a CI workflow command."""
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


# ---- who really holds a lock: /proc/locks ------------------------------------------------------------

class _ProcLock(NamedTuple):
    """A lock ``/proc/locks`` lists (not a waiter): its kind, holder and file."""

    kind: str
    """``POSIX``, ``FLOCK``, ``OFDLCK``, ..."""
    pid: int
    """0: in another PID namespace; -1 for an OFD lock (nobody in particular)."""
    major: int
    minor: int
    inode: int


def _proc_locks() -> list[_ProcLock]:
    """Every lock on the host (not waiters)."""
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
            found.append(_ProcLock(parts[1], int(parts[4]), int(major, 16), int(minor, 16), int(inode)))
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
    for lock in _proc_locks():
        if lock.kind != "POSIX":
            continue
        ident = wanted.get((lock.major, lock.minor, lock.inode))
        if ident is not None:
            found[ident] = lock.pid
        else:
            by_inode.setdefault(lock.inode, []).append(((lock.major, lock.minor), lock.pid))
    # Some file systems (btrfs, overlayfs) report another device number in stat() than in /proc/locks: fall
    # back to the inode when only one lock has it.
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
