"""Raw, allocation-light reads of /proc: a process's state, parent and start time, the descendant walk, and
the pid readings that bracket a birth. Every session loads this module."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Literal, NamedTuple, cast

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")

KernelState = Literal["R", "S", "D", "T", "t", "Z", "X", "x", "K", "W", "P", "I"]
"""The state letter of ``/proc/<pid>/stat`` (proc(5)), a type so that mypy catches a misspelt one."""
EXITED: frozenset[KernelState] = frozenset({"Z", "X"})
"""Zombie or dead: the process (its thread-group leader, at least) has exited."""


class ProcStat(NamedTuple):
    """The fields of ``/proc/<pid>/stat`` that gpuclean uses."""

    pid: int
    state: KernelState
    ppid: int
    sid: int
    start_ticks: int
    """Clock ticks since boot: with the pid, a process's identity (pid reuse guard)."""
    thread: bool = False
    """A non-leader thread: ``/proc/<tid>/stat`` reads like a process's and shows the whole group's parent."""
    exiting: bool = False
    """``PF_EXITING``: on its way out, though not a zombie yet."""

SETTLED_NS = 50_000_000
"""A ctime this old (five ticks of the coarsest kernel clock) is settled: a change within the tick seen
could leave a coarse ctime as it was, but any later change moves a settled one."""


def read_file(path: str, whole: bool = False) -> bytes:
    """The content of a /proc file; raises OSError. A bare descriptor, not a file object: half the cost.
    ``whole``: a one-record file the kernel hands out in one read."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        data = os.read(fd, _CHUNK)
        if whole or not data:
            return data
        parts = [data]
        while True:
            chunk = os.read(fd, _CHUNK)
            if not chunk:
                return b"".join(parts)
            parts.append(chunk)
    finally:
        os.close(fd)


_CHUNK = 65536


def read_stat(pid: int) -> ProcStat | None:
    """The stat fields of ``pid``, or None if it no longer exists."""
    try:
        data = read_file(f"/proc/{pid}/stat", whole=True)
    except OSError:
        return None
    # The command name (field 2) may contain spaces and parentheses: split after the last ')'.
    close = data.rfind(b")")
    fields = data[close + 2 :].split()
    return ProcStat(
        pid=pid,
        state=cast(KernelState, fields[0].decode()),  # (the kernel's word: a check per read costs)
        ppid=int(fields[1]),
        sid=int(fields[3]),
        start_ticks=int(fields[19]),
        # exit_signal (field 38) is -1 only for a thread other than the group leader.
        thread=len(fields) > 35 and fields[35] == b"-1",
        exiting=bool(int(fields[6]) & _PF_EXITING),
    )


_PF_EXITING = 0x4


def is_live(pid: int, start_ticks: int | None = None) -> bool:
    """True if ``pid`` (started at ``start_ticks``, if given) exists and is not a zombie or dead."""
    st = read_stat(pid)
    return st is not None and (start_ticks is None or st.start_ticks == start_ticks) and live_state(
        pid, st.state)


def live_state(pid: int, state: KernelState) -> bool:
    """Whether a process in ``state`` still runs code: a leader that called ``pthread_exit`` shows Z while
    its other threads run on, GPU memory and all."""
    if state not in EXITED:
        return True
    return any(tid != pid for tid in thread_ids(pid))


def ancestry(pid: int) -> dict[int, int]:
    """pid -> start ticks of each ancestor of ``pid``."""
    found: dict[int, int] = {}
    current = read_stat(pid)
    while current is not None and current.ppid > 0 and current.ppid not in found:
        current = read_stat(current.ppid)
        if current is not None:
            found[current.pid] = current.start_ticks
    return found


def thread_ids(pid: int) -> list[int]:
    """The ids of ``pid``'s threads (none if it is gone)."""
    try:
        return [int(tid) for tid in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return []


def cpu_demand_ns(pid: int) -> int | None:
    """Nanoseconds ``pid``'s live threads have run or waited to run; None once gone. A process starved on a
    busy machine still changes it, so it is not taken for at rest."""
    total = 0
    tids = thread_ids(pid)
    if not tids:
        return None
    for tid in tids:
        try:
            fields = read_file(f"/proc/{pid}/task/{tid}/schedstat", whole=True).split()
            total += int(fields[0]) + int(fields[1])
        except (OSError, ValueError, IndexError):
            continue  # (a thread that just ended)
    return total


def last_pid() -> int | None:
    """The pid most recently allocated here (None where the kernel does not say). Pids are allocated in
    order until they wrap, so two readings bracket everything created between them, finer than start ticks."""
    kept = _last_pid_file
    if kept is not None:
        fd, dev, ino = kept
        try:
            # Still the file we opened (a test may close every descriptor, and the number be reused)?
            found = os.fstat(fd)
            if found.st_ino == ino and found.st_dev == dev:
                return int(os.pread(fd, 32, 0))
        except (OSError, ValueError):
            pass
    return _open_last_pid()


_LAST_PID_PATH = "/proc/sys/kernel/ns_last_pid"
_last_pid_file: tuple[int, int, int] | None = None
"""(descriptor, device, inode) of ``ns_last_pid``, kept open: a reading is one ``pread``. A forked child
closes it at once (a test's child sees no descriptor of the plugin) and opens its own if it reads."""


def _open_last_pid() -> int | None:
    global _last_pid_file
    try:
        fd = os.open(_LAST_PID_PATH, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        found = os.fstat(fd)
        value = int(os.pread(fd, 32, 0))
    except (OSError, ValueError):
        os.close(fd)
        return None
    # Two threads opening it at once keep one descriptor each, one unused: harmless.
    _last_pid_file = (fd, found.st_dev, found.st_ino)
    return value


def _forget_last_pid_in_child() -> None:
    # A test's forked child must not hold the plugin's descriptors (docs/guest.md).
    global _last_pid_file
    kept, _last_pid_file = _last_pid_file, None
    if kept is not None:
        try:
            os.close(kept[0])
        except OSError:
            return  # (closed already)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_last_pid_in_child)


def pid_max() -> int:
    """The pid after which allocation wraps around."""
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


def self_identity() -> tuple[int, int]:
    """This process's start ticks (0 if unreadable) and pid namespace: what a session id names it by."""
    stat = read_stat(os.getpid())
    return (stat.start_ticks if stat is not None else 0), pid_namespace()


def children(pid: int) -> list[int]:
    """From ``/proc/<pid>/task/*/children`` (a file per thread)."""
    return _children(pid)[0]


def _children(pid: int) -> tuple[list[int], int]:
    """Direct children of ``pid``, and how many files that took."""
    result: list[int] = []
    where = f"/proc/{pid}/task"
    try:
        # A link count of 3 (2 + threads) means the one entry is the process's own: a stat is one system call,
        # the listing five.
        tasks = [str(pid)] if os.stat(where).st_nlink == 3 else os.listdir(where)
    except OSError:
        return result, 1
    for tid in tasks:
        try:
            data = read_file(f"/proc/{pid}/task/{tid}/children")
        except OSError:
            continue
        if data:
            result.extend(int(c) for c in data.split())
    return result, 1 + len(tasks)


WALK_RANGE_LIMIT = 256
"""Past this many pids, a full walk is cheaper than an incremental one."""
WALK_LOOKBACK = 32
"""After a full walk, look back this many pids: a fork in progress had its pid but no children entry yet."""
WALK_PENDING_S = 0.1
"""How long an allocated pid missing from /proc stays watched (a fork in progress); then it exited."""
WALK_FULL_EVERY_S = 5.0
"""A full walk at least this often: a process that slipped through is found within seconds."""


class DescendantWalk:
    """The descendants of one process, at a cost independent of its thread count and of the host.

    A full walk reads a ``children`` file per thread of every process in the tree: costly under torch's
    threads. The incremental walk reads the stat of each known process and each pid allocated since (pids
    are allocated in order) and builds the tree from their parents; nothing moves into the tree from
    outside. Each walk takes the cheaper, with a full walk at least every ``WALK_FULL_EVERY_S``."""

    def __init__(self) -> None:
        self._root = -1
        self._cursor: int | None = None
        self._known: set[int] = set()
        self._pending: dict[int, tuple[float, int]] = {}
        """pid -> (when first found absent, times found absent): allocated, not in /proc (yet)."""
        self._full_at = 0.0
        self._full_cost = 0
        """One file per process and one per thread in the tree."""
        self._space = pid_max()
        self.stats: dict[int, ProcStat] = {}
        """The stat each process of the last incremental walk was placed by (empty after a full walk)."""

    def walk(self, root: int, me: int | None = None) -> list[tuple[int, int, int]]:
        """``root``'s descendants as (pid, depth, parent pid), parents first. ``me``: this process's pid,
        if just read."""
        clock = time.monotonic()
        if root != self._root or clock - self._full_at >= WALK_FULL_EVERY_S or not _own_namespace(me):
            return self._full(root, last_pid(), clock)
        now = last_pid()
        span = None if now is None or self._cursor is None else (now - self._cursor) % self._space
        if span == 0 and not self._known and not self._pending:
            self.stats = {}
            return []  # no pid allocated since an empty tree was seen: still empty
        # A lone single-threaded process rereads its one children file: a stat of one new pid costs as much.
        if span is None or self._full_cost <= 2 or span + len(self._pending) + len(self._known) > min(
                WALK_RANGE_LIMIT, self._full_cost):
            return self._full(root, now, clock)
        assert self._cursor is not None
        born = [(self._cursor + i) % self._space for i in range(1, span + 1)]
        by_parent: dict[int, list[int]] = {}
        stats: dict[int, ProcStat] = {}
        for pid in (*self._known, *self._pending, *born):
            if pid in stats:
                continue
            stat = read_stat(pid)
            if stat is None:
                if pid not in self._known:
                    first, absent = self._pending.get(pid, (clock, 0))
                    if clock - first < WALK_PENDING_S or absent < 1:
                        self._pending[pid] = (first, absent + 1)  # watched until the next walk at least
                    else:
                        del self._pending[pid]
                continue
            self._pending.pop(pid, None)
            stats[pid] = stat
            if not stat.thread:
                by_parent.setdefault(stat.ppid, []).append(pid)
        found = _tree(root, lambda pid: by_parent.get(pid, ()))
        self._known = {pid for pid, _depth, _parent in found}
        self.stats = {pid: stats[pid] for pid in self._known}
        self._cursor = now
        return found

    def _full(self, root: int, now: int | None, clock: float) -> list[tuple[int, int, int]]:
        cost = 0

        def counted(pid: int) -> list[int]:
            nonlocal cost
            found, reads = _children(pid)
            cost += reads
            return found

        found = _tree(root, counted)
        self._root = root
        self._full_at = clock
        self._full_cost = cost
        self._known = {pid for pid, _depth, _parent in found}
        self._pending.clear()
        self.stats = {}
        # Look back for forks in progress, but not for a lone single-threaded process (nobody else can fork).
        lookback = 0 if cost <= 2 and not found else WALK_LOOKBACK
        self._cursor = None if now is None else (now - lookback) % self._space
        return found


def _tree(root: int, children_of: Callable[[int], Iterable[int]]) -> list[tuple[int, int, int]]:
    """Breadth first from ``root``: (pid, depth, parent pid), parents first."""
    found: list[tuple[int, int, int]] = []
    frontier = [(root, 0)]
    seen = {root}
    while frontier:
        pid, depth = frontier.pop(0)
        for child in children_of(pid):
            if child not in seen:
                seen.add(child)
                found.append((child, depth + 1, pid))
                frontier.append((child, depth + 1))
    return found


_NAMESPACE_OK: dict[int, bool] = {}


def _own_namespace(me: int | None = None) -> bool:
    """Whether /proc shows this process's pid namespace (pid numbers and ``ns_last_pid`` agree). ``me``:
    this process's pid, if just read."""
    if me is None:
        me = os.getpid()
    if me not in _NAMESPACE_OK:
        try:
            _NAMESPACE_OK[me] = os.readlink("/proc/self") == str(me)
        except OSError:
            _NAMESPACE_OK[me] = False
    return _NAMESPACE_OK[me]


def descendants(root: int) -> list[tuple[int, int]]:
    """All descendants of ``root`` as ``(pid, depth)``, depth 1 for direct children."""
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
    """Now, in ``start_ticks``' clock (CLOCK_BOOTTIME in clock ticks)."""
    return int(time.clock_gettime(time.CLOCK_BOOTTIME) * CLOCK_TICKS)


def wall_minus_boot() -> float:
    """The wall clock's time at boot, as it says now."""
    return time.time() - time.clock_gettime(time.CLOCK_BOOTTIME)


def ticks_to_wall(ticks: int) -> float:
    return wall_minus_boot() + ticks / CLOCK_TICKS


def read_environ_var(pid: int, name: str) -> str | None:
    """Value of ``name`` in ``pid``'s initial environment; None if absent or unreadable (only the owner or
    root may read it: the processes gpuclean may act on)."""
    return read_environ_vars(pid, (name,)).get(name)


def read_environ_vars(pid: int, names: tuple[str, ...]) -> dict[str, str]:
    """The values of those of ``names`` in ``pid``'s initial environment (one read)."""
    try:
        data = read_file(f"/proc/{pid}/environ")
    except OSError:
        return {}
    found: dict[str, str] = {}
    for name in names:
        # Searched, not split: the cookie scan reads every process of this user. The last occurrence counts.
        key = name.encode() + b"="
        at = data.rfind(b"\0" + key)
        if at >= 0:
            start = at + 1 + len(key)
        elif data.startswith(key):
            start = len(key)
        else:
            continue
        end = data.find(b"\0", start)
        found[name] = data[start : end if end >= 0 else len(data)].decode(errors="replace")
    return found


def pids_of_uid(uid: int) -> list[int]:
    """All pids whose /proc entry belongs to ``uid`` (one stat each, no psutil)."""
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


def owned_by(pid: int, uid: int) -> bool:
    try:
        return os.stat(f"/proc/{pid}").st_uid == uid
    except OSError:
        return False


def exe_path(pid: int) -> str:
    try:
        return os.readlink(f"/proc/{pid}/exe")
    except OSError:
        return ""


def exe_name(pid: int) -> str:
    """Basename of ``pid``'s executable ('' if unreadable); survives setproctitle renames."""
    try:
        return os.path.basename(os.readlink(f"/proc/{pid}/exe"))
    except OSError:
        return ""


def fd_target(pid: int, fd: int) -> str:
    """What ``pid``'s descriptor ``fd`` refers to ('' if unreadable); ``pipe:[inode]`` for a pipe."""
    try:
        return os.readlink(f"/proc/{pid}/fd/{fd}")
    except OSError:
        return ""


def _fd_targets(pid: int) -> Iterator[str]:
    """What each of ``pid``'s open descriptors refers to (none if unreadable)."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return
    for fd in fds:
        try:
            yield os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue  # closed while we looked


def pipes_of(pid: int) -> frozenset[str]:
    """``pid``'s pipes as ``pipe:[inode]`` (none if its fds are unreadable)."""
    return frozenset(target for target in _fd_targets(pid) if target.startswith("pipe:"))


def _nvidia_files(pid: int) -> Iterator[str]:
    """The ``/dev/nvidia*`` paths among ``pid``'s open files (none if unreadable)."""
    return (target for target in _fd_targets(pid) if target.startswith("/dev/nvidia"))


def cuda_device_minors(pid: int) -> frozenset[int] | None:
    """Minor numbers of the ``/dev/nvidia<N>`` files ``pid`` has open if it initialised CUDA, else None:
    ``cuInit`` opens ``/dev/nvidia-uvm``, NVML alone does not."""
    minors: set[int] = set()
    uvm = False
    for target in _nvidia_files(pid):
        if target == "/dev/nvidia-uvm":
            uvm = True
        elif target[11:].isdigit():
            minors.add(int(target[11:]))
    return frozenset(minors) if uvm else None


def has_nvidia_device_open(pid: int) -> bool:
    """As every process with a CUDA context does."""
    return next(_nvidia_files(pid), None) is not None
