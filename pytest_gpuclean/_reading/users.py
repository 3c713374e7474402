"""Who a process runs as: every uid of it and of its threads, and the names of users.

Credentials are a thread's: each uid of the ``Uid:`` line of ``/proc/<pid>/task/<tid>/status`` (real,
effective, saved, filesystem) of each thread counts, and a thread that changed its own (the raw ``setresuid``
system call) runs as that user. ``status`` is readable for every process, another user's and a non-dumpable
one's included. Read off the clean path only: by the signal gate's facts (``credentials.py``) and by the
simulated devices' check of who may speak for a process (``simulated.py``). A leaf, as ``procfs``: the
simulated devices, one floor above it, read through it.
"""

from __future__ import annotations

import os
import pwd

__all__ = [
    "uids_of",
    "user_name",
]


def uids_of(pid: int) -> frozenset[int] | None:
    """Every uid that ``pid`` or one of its threads runs as; None if it is gone."""
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
