"""Raw, allocation-light reads of /proc: the fast path shared by the device and process modules.

psutil is the richer interface (user names, command lines) and lives in ``processes.py``; the hot path
of a clean check only needs a process's state, parent and start time, which one read of
``/proc/<pid>/stat`` gives in a few microseconds.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import NamedTuple

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


class ProcStat(NamedTuple):
    """The fields of ``/proc/<pid>/stat`` that gpuclean uses."""

    pid: int
    state: str
    ppid: int
    sid: int
    start_ticks: int
    """Start time in clock ticks since boot: with the pid, a process's identity (pid reuse guard)."""


def read_stat(pid: int) -> ProcStat | None:
    """Return the stat fields of ``pid``, or None if it no longer exists."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    except OSError:
        return None
    # The command name (field 2) may contain spaces and parentheses: split after the last ')'.
    close = data.rfind(b")")
    fields = data[close + 2 :].split()
    return ProcStat(
        pid=pid,
        state=fields[0].decode(),
        ppid=int(fields[1]),
        sid=int(fields[3]),
        start_ticks=int(fields[19]),
    )


def is_live(pid: int) -> bool:
    """True if ``pid`` exists and is not a zombie or dead (the driver frees memory at exit)."""
    st = read_stat(pid)
    return st is not None and live_state(pid, st.state)


def live_state(pid: int, state: str) -> bool:
    """Whether a process whose stat says ``state`` still runs code.

    A thread-group leader that called ``pthread_exit`` shows state Z while its other threads run on
    (and, on a GPU, keep its memory): such a "zombie" is alive until its last thread ends.
    """
    if state not in ("Z", "X"):
        return True
    return any(tid != pid for tid in thread_ids(pid))


def thread_ids(pid: int) -> list[int]:
    """The ids of ``pid``'s threads (none if it is gone)."""
    try:
        return [int(tid) for tid in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return []


def last_pid() -> int | None:
    """The pid most recently allocated in this pid namespace (None where the kernel does not say).

    Pids are handed out in increasing order until they wrap at ``pid_max``, so two readings bracket the
    pids of everything created between them: evidence of when a process was born that does not depend
    on the 10 ms resolution of its start time.
    """
    try:
        with open("/proc/sys/kernel/ns_last_pid", "rb") as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def pid_max() -> int:
    """The pid after which allocation wraps around (32768 on many hosts)."""
    try:
        with open("/proc/sys/kernel/pid_max", "rb") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 4194304


def pid_namespace() -> int:
    """Inode of this process's pid namespace: pids from another namespace mean nothing here."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def children(pid: int) -> list[int]:
    """Direct children of ``pid``, from ``/proc/<pid>/task/*/children`` (tens of microseconds)."""
    result: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return result
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
                data = f.read()
        except OSError:
            continue
        if data:
            result.extend(int(c) for c in data.split())
    return result


def descendants(root: int) -> list[tuple[int, int]]:
    """All descendants of ``root`` as ``(pid, depth)`` pairs, depth 1 for direct children."""
    found: list[tuple[int, int]] = []
    frontier = [(root, 0)]
    seen = {root}
    while frontier:
        pid, depth = frontier.pop()
        for child in children(pid):
            if child not in seen:
                seen.add(child)
                found.append((child, depth + 1))
                frontier.append((child, depth + 1))
    return found


def boot_ticks_now() -> int:
    """Now, in the clock that ``start_ticks`` uses (CLOCK_BOOTTIME in clock ticks)."""
    return int(time.clock_gettime(time.CLOCK_BOOTTIME) * CLOCK_TICKS)


def ticks_to_wall(ticks: int) -> float:
    """Convert a start time in ticks since boot to a wall-clock timestamp."""
    return time.time() - time.clock_gettime(time.CLOCK_BOOTTIME) + ticks / CLOCK_TICKS


def read_environ_var(pid: int, name: str) -> str | None:
    """Value of ``name`` in the environment ``pid`` started with; None if absent or unreadable.

    Only the owner (or root) can read another process's environ, which is exactly the set of
    processes gpuclean may ever act on.
    """
    return read_environ_vars(pid, (name,)).get(name)


def read_environ_vars(pid: int, names: tuple[str, ...]) -> dict[str, str]:
    """The values of those of ``names`` that are in ``pid``'s initial environment (one read)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            data = f.read()
    except OSError:
        return {}
    keys = [(name, name.encode() + b"=") for name in names]
    found: dict[str, str] = {}
    for entry in data.split(b"\0"):
        for name, key in keys:
            if entry.startswith(key):
                found[name] = entry[len(key) :].decode(errors="replace")
    return found


def pids_of_uid(uid: int) -> list[int]:
    """All pids whose /proc entry belongs to ``uid`` (one stat per process, no psutil)."""
    result: list[int] = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            if os.stat(f"/proc/{name}").st_uid == uid:
                result.append(int(name))
        except OSError:
            continue
    return result


def exe_name(pid: int) -> str:
    """Basename of the executable of ``pid`` ('' if unreadable); survives setproctitle renames."""
    try:
        return os.path.basename(os.readlink(f"/proc/{pid}/exe"))
    except OSError:
        return ""


def _nvidia_files(pid: int) -> Iterator[str]:
    """The ``/dev/nvidia*`` paths among ``pid``'s open files (none if its fds are unreadable)."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue  # closed while we looked
        if target.startswith("/dev/nvidia"):
            yield target


def cuda_device_minors(pid: int) -> frozenset[int] | None:
    """Minor numbers of the ``/dev/nvidia<N>`` files ``pid`` has open, if it has initialised CUDA.

    None when it has not: CUDA (``cuInit``) opens ``/dev/nvidia-uvm``, NVML alone does not, although both
    open the ``/dev/nvidia<N>`` files. So a pytest process that merely reads NVML is not taken for one
    that the driver charges memory to.
    """
    minors: set[int] = set()
    uvm = False
    for target in _nvidia_files(pid):
        if target == "/dev/nvidia-uvm":
            uvm = True
        elif target[11:].isdigit():
            minors.add(int(target[11:]))
    return frozenset(minors) if uvm else None


def has_nvidia_device_open(pid: int) -> bool:
    """True if ``pid`` has a ``/dev/nvidia*`` file open, as every process with a CUDA context does."""
    return next(_nvidia_files(pid), None) is not None
