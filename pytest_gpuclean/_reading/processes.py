"""The only module that talks to psutil or sends signals. A process is ``(pid, start_ticks)``, pinned by a
pidfd where the kernel has them, so a recycled pid is never signalled. psutil is imported lazily."""

from __future__ import annotations

import os
import pwd
import select
import signal
import time
from collections.abc import Callable, Iterable, Sequence
from fnmatch import fnmatchcase
from typing import Any, NamedTuple

from pytest_gpuclean._model.records import ProcessInfo, ProcessState
from pytest_gpuclean._reading import procfs

PR_SET_CHILD_SUBREAPER = 36
_POLL_S = 0.005


def set_child_subreaper() -> bool:
    """Adopt orphans of our subtree instead of PID 1: an orphaned vLLM EngineCore would otherwise leave our
    tree."""
    try:
        return _prctl(PR_SET_CHILD_SUBREAPER, 1) == 0
    except (OSError, AttributeError, TypeError, ImportError):
        return False


def _prctl(option: int, value: int) -> int:
    """``prctl`` from ``_ctypes``' pieces: ``import ctypes`` costs every checked session's start, for one
    call. Falls back to ctypes."""
    try:
        import _ctypes

        class _Int(_ctypes._SimpleCData):  # type: ignore[type-arg]  # (ctypes.c_int)
            _type_ = "i"

        class _Function(_ctypes.CFuncPtr):
            _flags_ = _ctypes.FUNCFLAG_CDECL
            _restype_ = _Int

        # dlopen(None): this process's own symbols, libc's among them.
        handle = _ctypes.dlopen(None, _ctypes.RTLD_LOCAL)  # type: ignore[arg-type]
        prctl: Callable[..., Any] = _Function(_ctypes.dlsym(handle, "prctl"))
    except (ImportError, AttributeError, TypeError):
        import ctypes

        prctl = ctypes.CDLL(None).prctl
    return int(prctl(option, value, 0, 0, 0))


def describe(pid: int, start_ticks: int | None = None) -> ProcessInfo | None:
    """User-facing details of a process, or None if it is gone (or its pid was reused)."""
    stat = procfs.read_stat(pid)
    if stat is None or (start_ticks is not None and stat.start_ticks != start_ticks):
        return None
    import psutil

    try:
        proc = psutil.Process(pid)
        with proc.oneshot():
            uid = proc.uids().real
            try:
                user = proc.username()
            except (KeyError, psutil.Error):
                user = str(uid)
            try:
                cmdline = " ".join(proc.cmdline()) or f"[{proc.name()}]"
            except psutil.AccessDenied:
                cmdline = f"[{proc.name()}]"
    except psutil.ZombieProcess:
        if not procfs.live_state(pid, stat.state):
            return None
        return _zombie_leader(pid, stat)
    except psutil.NoSuchProcess:
        return None
    except psutil.Error:
        return ProcessInfo(pid, stat.start_ticks, stat.ppid, -1, "?", "?", state_name(stat.state))
    return ProcessInfo(pid=pid, start_ticks=stat.start_ticks, ppid=stat.ppid, uid=uid, user=user,
                       cmdline=cmdline, state=state_name(stat.state))


def state_name(state: procfs.KernelState) -> ProcessState:
    """The reported name of a kernel state letter (psutil's, whichever way the process was read)."""
    return _PSUTIL_NAMES.get(state, "?")


_PSUTIL_NAMES: dict[procfs.KernelState, ProcessState] = {
    "R": "running", "S": "sleeping", "D": "disk-sleep", "T": "stopped", "t": "tracing-stop", "Z": "zombie",
    "X": "dead", "x": "dead", "K": "wake-kill", "W": "waking", "P": "parked", "I": "idle",
}


def _zombie_leader(pid: int, stat: procfs.ProcStat) -> ProcessInfo | None:
    # Its main thread exited, so psutil calls it a zombie; its other threads still run.
    try:
        uid = os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None
    cmdline = ""
    for tid in procfs.thread_ids(pid):
        try:
            with open(f"/proc/{pid}/task/{tid}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        if cmdline:
            break
    try:
        user = pwd.getpwuid(uid).pw_name
    except KeyError:
        user = str(uid)
    return ProcessInfo(pid=pid, start_ticks=stat.start_ticks, ppid=stat.ppid, uid=uid, user=user,
                       cmdline=cmdline or f"[{pid}]", state="running (main thread exited)")


def ancestors(pid: int) -> set[int]:
    """``pid`` and all its ancestors: processes gpuclean must never touch."""
    return {pid, *procfs.ancestry(pid)}


def cookie_holders(variable: str, prefix: str, uid: int) -> list[tuple[int, str]]:
    """Processes of ``uid`` whose ``variable`` starts with ``prefix``: a full /proc scan, only when
    evidence says something is off."""
    found: list[tuple[int, str]] = []
    me = os.getpid()
    for pid in procfs.pids_of_uid(uid):
        if pid == me:
            continue
        value = procfs.read_environ_var(pid, variable)
        if value is not None and value.startswith(prefix):
            found.append((pid, value))
    return found


def stray_python_processes(uid: int, exclude: set[int], ignore: Sequence[str]) -> list[int]:
    """Live Python processes of ``uid`` outside ``exclude``, by executable: vLLM renames its processes."""
    found: list[int] = []
    for pid in procfs.pids_of_uid(uid):
        if pid in exclude or not procfs.exe_name(pid).startswith("python"):
            continue
        if not procfs.is_live(pid):
            continue
        if ignore and matches_any(command_line(pid), ignore):
            continue
        found.append(pid)
    return found


def command_line(pid: int) -> str:
    """Joined by spaces ('' if unreadable)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def matches_any(text: str, patterns: Iterable[str]) -> bool:
    """True if ``text`` matches one of the glob ``patterns`` (case-sensitive, like file names)."""
    return any(fnmatchcase(text, pattern) for pattern in patterns)


class Handle:
    """A process pinned by a pidfd when found: signals reach it and nothing else, even if the pid is
    recycled within its start tick. Without pidfds (before Linux 5.3) the (pid, start ticks) identity is
    re-checked before each signal. Not a record: it owns a descriptor, and is equal only to itself."""

    __slots__ = ("pid", "pidfd", "start_ticks")

    def __init__(self, pid: int, start_ticks: int, pidfd: int | None) -> None:
        self.pid = pid
        self.start_ticks = start_ticks
        self.pidfd = pidfd

    def exited(self) -> bool:
        """True once the process has ended (its last thread, for a leader that exited early)."""
        if self.pidfd is not None:
            # Readable once the whole thread group has exited (zombie or reaped).
            poller = select.poll()
            poller.register(self.pidfd, select.POLLIN)
            return bool(poller.poll(0))
        return not procfs.is_live(self.pid, self.start_ticks)

    def signal(self, sig: int) -> bool:
        """Send ``sig``; False if the process is gone."""
        try:
            if self.pidfd is not None:
                signal.pidfd_send_signal(self.pidfd, sig)
            else:
                stat = procfs.read_stat(self.pid)
                if stat is None or stat.start_ticks != self.start_ticks:
                    return False
                os.kill(self.pid, sig)
        except ProcessLookupError:
            return False
        return True

    def close(self) -> None:
        if self.pidfd is not None:
            try:  # noqa: SIM105 (a closed handle is closed)
                os.close(self.pidfd)
            except OSError:
                pass
            self.pidfd = None

    def __repr__(self) -> str:
        return f"Handle(pid={self.pid}, start_ticks={self.start_ticks})"


def pin(pid: int, start_ticks: int | None = None) -> tuple[Handle, procfs.ProcStat] | None:
    """Pin ``pid``; None if it is gone or not ``start_ticks``. The stat read after the pidfd opens is
    trusted only if the process is still alive: a live process keeps its pid."""
    pidfd: int | None
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return None
    except (OSError, AttributeError):
        pidfd = None
    stat = procfs.read_stat(pid)
    handle = Handle(pid, stat.start_ticks if stat else -1, pidfd)
    if stat is None or (start_ticks is not None and stat.start_ticks != start_ticks) or (
            pidfd is not None and handle.exited() and stat.state not in procfs.EXITED):
        handle.close()
        return None
    return handle, stat


class KillTarget(NamedTuple):
    """A process to end; ``depth`` orders children first. Here, not in ``records.py``: its ``handle`` is
    this module's. Without one, ``terminate`` pins by ``(pid, start_ticks)``."""

    pid: int
    start_ticks: int
    depth: int = 0
    handle: Handle | None = None


class KillOutcome(NamedTuple):
    """How one target ended (``Reaped.after_kill`` makes its report entry)."""

    pid: int
    ended_by: str
    exit_s: float | None
    state: str = ""
    signal_s: float | None = None
    """Seconds from the start of ``terminate`` to the signal that ended it."""


class _Tracked:
    def __init__(self, target: KillTarget, handle: Handle) -> None:
        self.target = target
        self.handle = handle
        self.gone_at: float | None = None
        self.ended_by = ""


def reap_if_child(pid: int) -> bool:
    """Collect ``pid``'s status if it is our exited child; never ``waitpid(-1)``, which steals tests'
    ``Popen`` statuses."""
    try:
        done, _status = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return False
    return done == pid


def _has_exited(tracked: _Tracked) -> bool:
    exited = tracked.handle.exited()
    if exited:
        reap_if_child(tracked.target.pid)
    return exited


def _wait(tracked: list[_Tracked], deadline: float, started: float, label: str,
          watch: Callable[[], None] | None, hurry: Callable[[], bool] | None = None) -> None:
    pending = [t for t in tracked if t.gone_at is None]
    while pending:
        if watch is not None:
            watch()
        now = time.monotonic()
        for t in pending:
            if _has_exited(t):
                t.gone_at = now - started
                t.ended_by = label
        pending = [t for t in pending if t.gone_at is None]
        if not pending or now >= deadline or (hurry is not None and hurry()):
            return
        time.sleep(_POLL_S)


def stop(targets: Sequence[KillTarget]) -> list[KillTarget]:
    """SIGSTOP ``targets``: a stopped process forks no replacement. Returns those this stopped (one already
    stopped stays so)."""
    stopped: list[KillTarget] = []
    for target in targets:
        if target.handle is None:
            continue
        stat = procfs.read_stat(target.pid)
        if stat is not None and stat.state in ("T", "t"):
            continue
        if target.handle.signal(signal.SIGSTOP):
            stopped.append(target)
    return stopped


def resume(targets: Sequence[KillTarget]) -> None:
    """SIGCONT those of ``targets`` still alive: nothing gpuclean stops and does not kill is left stopped."""
    for target in targets:
        if target.handle is not None and not target.handle.exited():
            target.handle.signal(signal.SIGCONT)


def terminate(targets: Sequence[KillTarget], grace: float, kill_wait: float = 5.0,
              watch: Callable[[], None] | None = None, hurry: Callable[[], bool] | None = None,
              kill_first: bool = False) -> list[KillOutcome]:
    """SIGTERM every target (deepest first), wait up to ``grace``, SIGKILL survivors. A reused pid is
    reported, never signalled. ``watch`` runs on every poll; ``hurry`` ends the grace; ``kill_first`` skips
    SIGTERM (for processes that answered one by forking)."""
    started = time.monotonic()
    outcomes: list[KillOutcome] = []
    tracked: list[_Tracked] = []
    opened: list[Handle] = []
    for target in sorted(targets, key=lambda t: -t.depth):
        handle = target.handle
        if handle is None:
            pinned = pin(target.pid, target.start_ticks)
            if pinned is None:
                outcomes.append(KillOutcome(target.pid, "pid reused" if procfs.read_stat(target.pid)
                                            else "already exited", None))
                continue
            handle = pinned[0]
            opened.append(handle)
        t = _Tracked(target, handle)
        if handle.exited():
            reap_if_child(target.pid)
            t.gone_at = 0.0
            t.ended_by = "reaped zombie"
        tracked.append(t)
    try:
        first = signal.SIGKILL if kill_first else signal.SIGTERM
        first_label = "SIGKILL" if kill_first else "SIGTERM"
        for t in tracked:
            if t.gone_at is None and not t.handle.signal(first):
                t.gone_at, t.ended_by = 0.0, "already exited"
        if kill_first:
            _wait(tracked, started + kill_wait, started, first_label, watch)
        else:
            _wait(tracked, started + grace, started, first_label, watch, hurry)
        survivors = [t for t in tracked if t.gone_at is None]
        kill_sent = time.monotonic() - started
        if not kill_first:
            for t in survivors:
                if not t.handle.signal(signal.SIGKILL):
                    t.gone_at, t.ended_by = time.monotonic() - started, "SIGTERM"
            if survivors:
                _wait(tracked, time.monotonic() + kill_wait, started, "SIGKILL", watch)
        for t in tracked:
            state = ""
            if t.gone_at is None:
                stat = procfs.read_stat(t.target.pid)
                state = _STATE_NAMES.get(stat.state, stat.state) if stat else "gone"
                if stat is not None and stat.state == "Z" and procfs.live_state(t.target.pid, "Z"):
                    state = "zombie leader with live threads"
            sent = {"SIGTERM": 0.0, "SIGKILL": 0.0 if kill_first else kill_sent}.get(t.ended_by)
            outcomes.append(KillOutcome(t.target.pid, t.ended_by or "survived", t.gone_at, state, sent))
    finally:
        for handle in opened:
            handle.close()
    return outcomes


_STATE_NAMES: dict[procfs.KernelState, str] = {
    "R": "running",
    "S": "sleeping",
    "D": "uninterruptible sleep (D)",
    "T": "stopped",
    "t": "traced",
    "Z": "zombie",
}
