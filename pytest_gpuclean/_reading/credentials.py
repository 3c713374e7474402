"""Whom a signal to a process could reach: the facts of the signal gate (``deciding/gate.py``), read from
/proc.

Off the clean path: read only for a process about to be signalled. The users it runs as (``users.uids_of``:
every uid of every thread), and its descendants that run as a user it does not: those make it a relay
(``su``, ``runuser``, a setuid wrapper that forks).
"""

from __future__ import annotations

from pytest_gpuclean._model.records import Credentials, ProcessInfo
from pytest_gpuclean._reading import processes, procfs
from pytest_gpuclean._reading.users import uids_of, user_name

__all__ = [
    "credentials",
]


def credentials(pid: int, start_ticks: int | None = None) -> Credentials | None:
    """What the gate needs to know of ``pid`` (the process that started at ``start_ticks``, if given): the
    users it runs as, and its descendants that run as a user it does not. None if it is gone (or its pid now
    names another process)."""
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
