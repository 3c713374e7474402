"""Who a process runs as, and whom a signal to it could reach: the signal gate's facts, from /proc.

Every uid of every thread counts, since a thread may change its own. A process whose descendants run as a
user it does not is a relay (``su``, a forking setuid wrapper)."""

from __future__ import annotations

import os
import pwd

from pytest_gpuclean._model.records import Credentials, ProcessInfo
from pytest_gpuclean._reading import processes, procfs


def credentials(pid: int, start_ticks: int | None = None) -> Credentials | None:
    """The users ``pid`` runs as, and its descendants running as a user it does not; None if it is gone or
    its pid was reused."""
    mine = uids_of(pid)
    stat = procfs.read_stat(pid)
    if mine is None or stat is None or (start_ticks is not None and stat.start_ticks != start_ticks):
        return None
    relays: list[ProcessInfo] = []
    for child, _depth in sorted(procfs.descendants(pid), key=lambda pair: pair[1]):
        theirs = uids_of(child)
        child_stat = procfs.read_stat(child)
        if theirs is None or child_stat is None or theirs <= mine:
            continue
        uid = min(theirs - mine)
        relays.append(ProcessInfo(child, child_stat.start_ticks, child_stat.ppid, uid, user_name(uid),
                                  processes.command_line(child) or "?", "?"))
    return Credentials(pid, tuple((uid, user_name(uid)) for uid in sorted(mine)), tuple(relays))


def uids_of(pid: int) -> frozenset[int] | None:
    """Every uid ``pid`` or one of its threads runs as; None if it is gone."""
    found: set[int] = set()
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    for tid in threads:
        try:
            with open(f"/proc/{pid}/task/{tid}/status", "rb") as f:
                found.update(_uids_in(f.read()))
        except OSError:
            continue  # (a thread that ended meanwhile)
    return frozenset(found) if found else None


def _uids_in(status: bytes) -> list[int]:
    start = status.find(b"\nUid:")
    if start < 0:
        return []
    line = status[start + 5:status.find(b"\n", start + 1)]
    return [int(word) for word in line.split()]


def user_name(uid: int) -> str:
    """The name of ``uid`` (the number, for a uid without one)."""
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)
