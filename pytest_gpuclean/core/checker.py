"""The clean check: who owns which process, what is dirty, and reaping what is provably ours.

No pytest here: the plugin and the ``gpuclean`` command line drive the same ``Checker``.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

from pytest_gpuclean.core import pools, processes, procfs
from pytest_gpuclean.core.devices import Backend, DeviceError, DeviceLost
from pytest_gpuclean.core.outside import SLACK_BYTES as OUTSIDE_SLACK_BYTES
from pytest_gpuclean.core.outside import OutsideMemory, OutsideState
from pytest_gpuclean.core.ownership import (
    COOKIE_VAR,
    OWNER_VAR,
    PREEXISTING,
    SESSION,
    Ownership,
    SessionRef,
    innermost_session,
    live_outer_session,
    new_session_id,
)
from pytest_gpuclean.core.settings import DEFAULT_GRACE_S
from pytest_gpuclean.model.records import (
    MIB,
    UNKNOWN_OWNER,
    CheckResult,
    DeviceInfo,
    DeviceSnapshot,
    EndedBy,
    FoundBy,
    Offender,
    Outside,
    Owner,
    OwnerKind,
    Phase,
    ProcessInfo,
    Reaped,
    SiblingUse,
)
from pytest_gpuclean.model.text import mib_list as report_mib
from pytest_gpuclean.model.text import one_line

XDIST_RUN_VAR = "PYTEST_XDIST_TESTRUNUID"
XDIST_WORKER_VAR = "PYTEST_XDIST_WORKER"
POLL_S = 0.02
"""Polling interval while waiting for a device to come clean."""
RELEASE_POLL_S = 0.005
MAX_REAP_ROUNDS = 4
"""Rounds of reaping within one check; from the second on, what reappeared is frozen and SIGKILLed."""
MAX_FREEZE_PASSES = 20
"""Census passes while freezing a respawning set: each pass stops what the previous one missed, and a
stopped process forks no more, so this ends after as many passes as the tree is deep."""
MULTIPROCESSING_PACKAGES = ("multiprocessing", "multiprocess")
"""Packages whose resource tracker and forkserver serve the pytest process (``multiprocess`` is the
dill-based fork that vLLM's tests use)."""


class Found:
    """A process that is ours (a descendant, or carrying a cookie of ours or of a dead session). (A plain
    class: see ``ownership.Window``.)"""

    __slots__ = ("debris_of", "depth", "found_by", "handle", "owner_name", "pid", "start_ticks", "state",
                 "token")

    def __init__(self, pid: int, start_ticks: int, depth: int, found_by: FoundBy, token: str | None,
                 state: procfs.KernelState, handle: processes.Handle | None = None,
                 debris_of: SessionRef | None = None, owner_name: str | None = None) -> None:
        self.pid = pid
        self.start_ticks = start_ticks
        self.depth = depth
        self.found_by = found_by
        self.token = token
        self.state = state
        """``R`` for a zombie leader whose other threads still run."""
        self.handle = handle
        self.debris_of = debris_of
        """For debris of a dead session: that session."""
        self.owner_name = owner_name
        """For debris: the owner its ``OWNER_VAR`` names."""

    @property
    def key(self) -> tuple[int, int]:
        return self.pid, self.start_ticks

    @property
    def live(self) -> bool:
        return self.state not in procfs.EXITED


class Sibling(NamedTuple):
    """Who in a live sibling xdist worker started a process: the worker and the owner its cookie names."""

    worker: str
    owner: Owner


_OWNER_KINDS: dict[str, OwnerKind] = {"t": "test", "f": "fixture"}
"""A cookie token's first letter: the kind of owner (``Ownership.new_token``)."""


class Checker:
    """Checks devices and processes; reaps leaks that are provably this session's."""

    def __init__(self, backend: Backend | None, *, reap: bool = True, grace: float = DEFAULT_GRACE_S,
                 ignore: Sequence[str] = (), host_scope: bool = False,
                 session_id: str | None = None, settle: float = 0.0, xdist_run: str | None = None,
                 peer_cookie: str | None = None, dead_sessions: bool = True,
                 session_start_ticks: int | None = None, peers_since: int | None = None,
                 session_start_pid: int | None = None) -> None:
        self.backend = backend
        self.reap_enabled = reap
        self.grace = grace
        self.settle = settle
        self.ignore = tuple(ignore)
        self.host_scope = host_scope
        self.dead_sessions = dead_sessions
        self.uid = os.getuid()
        if session_start_ticks is None:
            session_start_ticks, session_start_pid = procfs.boot_ticks_now(), procfs.last_pid()
        self.session_start_ticks = session_start_ticks
        """When the session began (its cookie exported): a process carrying our cookie that is older is not
        ours, its value was recycled."""
        self.ownership = Ownership(session_id or new_session_id(), session_start_ticks, session_start_pid)
        self.xdist_run = xdist_run
        self.peer_cookie = peer_cookie
        """The cookie our xdist siblings started with (the controller's): theirs, not a leak's."""
        self.peers_since = peers_since
        """When the controller started its workers (boot ticks; ``cookie.WORKERS_SINCE_VAR``)."""
        self.last_lost: DeviceLost | None = None
        """The lost GPU that ended the last check (``check(device_errors=True)``), for the health watch."""
        self.hurry: Callable[[], bool] | None = None
        """Set while an interrupt asks the reaping to be quick: the grace ends at once."""
        self._me = -1
        self._never_touch: set[int] = set()
        self._handles: dict[tuple[int, int], processes.Handle] = {}
        self._tokens: dict[tuple[int, int], str | None] = {}
        self._debris: dict[tuple[int, int], tuple[SessionRef, str | None]] = {}
        """Processes under us that a nested session left when it died: (that session, owner name)."""
        self._debris_checked = False
        self._tree = procfs.DescendantWalk()
        self._last_readings: dict[str, DeviceSnapshot] = {}
        self.outside = OutsideMemory()
        """Per device UUID: the outside state a check waited out. A later check that finds the very same,
        unchanged for as long as its own timeout, does not wait for it again. (An xdist worker's session
        shares it with the run's other workers: ``outside.py``.)"""
        self.last_census: list[Found] = []
        """What the last census found (``--gpuclean-ray=auto`` looks there for a Ray cluster the session
        started)."""
        # What already runs under us belongs to the session set-up (a conftest imported before this
        # checker existed, a plugin's pytest_configure): never a test's leak. Unless it existed before the
        # session began, or descends from a process that did: a container entrypoint's `server & exec
        # pytest` leaves the server our child, and it is no part of the session.
        walked = self._walk()
        upto = procfs.last_pid()  # every process just walked had its pid by now
        tokens: dict[int, str] = {}
        for pid, _depth, parent in walked:
            stat = procfs.read_stat(pid)
            if stat is None:
                continue
            token = tokens.get(parent) or self._set_up_or_older(pid, stat.start_ticks, upto)
            tokens[pid] = self._tokens[(pid, stat.start_ticks)] = token

    def _set_up_or_older(self, pid: int, start_ticks: int, upto: int | None) -> str:
        """Whose is ``pid``, found under us when the checker starts and descended from none of our other
        processes: the session set-up's if it carries our cookie (exported before anything of the
        set-up ran) or was provably born after the session began; otherwise it existed before the session,
        or may have (born in the very tick the session began): either way it is left alone."""
        value = procfs.read_environ_vars(pid, (COOKIE_VAR,)).get(COOKIE_VAR)
        if value is not None and value.startswith(self.ownership.session_id + ":"):
            return SESSION
        return SESSION if self.ownership.existed_before(pid, start_ticks, upto) is False else PREEXISTING

    # ---- who we are (a forked test runner changes it) -------------------------------------------

    @property
    def me(self) -> int:
        """The process running the checks: under a forked runner, the forked child, not the session."""
        pid = os.getpid()
        if pid != self._me:
            self._me = pid
            self._never_touch = processes.ancestors(pid)
        return pid

    @property
    def never_touch(self) -> set[int]:
        """This process and its ancestors: never suspects, never signalled."""
        _ = self.me
        return self._never_touch

    @property
    def my_sid(self) -> int:
        return os.getsid(0)

    def close(self) -> None:
        """Close the pidfds of every process still pinned."""
        for handle in self._handles.values():
            handle.close()
        self._handles.clear()

    # ---- census -------------------------------------------------------------------------------

    def _helper_pids(self) -> set[int]:
        # multiprocessing's resource tracker and forkserver are long-lived helpers of the pytest
        # process itself, started lazily by whichever test first needs them; killing them breaks
        # later tests (forkserver's own waitpid would fail). They exit with pytest. The
        # ``multiprocess`` package (dill-based, used by vLLM's tests) has the same helpers.
        helpers: set[int] = set()
        for package in MULTIPROCESSING_PACKAGES:
            tracker = getattr(sys.modules.get(f"{package}.resource_tracker"), "_resource_tracker", None)
            if getattr(tracker, "_pid", None):
                helpers.add(tracker._pid)  # type: ignore[union-attr]
            forkserver = getattr(sys.modules.get(f"{package}.forkserver"), "_forkserver", None)
            if getattr(forkserver, "_forkserver_pid", None):
                helpers.add(forkserver._forkserver_pid)  # type: ignore[union-attr]
        return helpers

    def _walk(self) -> list[tuple[int, int, int]]:
        """Our descendants as (pid, depth, parent pid), parents before their children."""
        return self._tree.walk(self.me)

    def _pin(self, pid: int) -> tuple[processes.Handle, procfs.ProcStat] | None:
        """A pinned process and its current stat; pinned once, from the moment it is first found."""
        # The walk just read it: a process is placed in the tree and pinned by the same reading.
        stat = self._tree.stats.get(pid) or procfs.read_stat(pid)
        if stat is not None:
            handle = self._handles.get((pid, stat.start_ticks))
            if handle is not None:
                return handle, stat
        pinned = processes.pin(pid)
        if pinned is not None:
            self._handles[(pid, pinned[1].start_ticks)] = pinned[0]
        return pinned

    def _forget_gone(self, seen: set[tuple[int, int]]) -> None:
        for key in [k for k in self._handles if k not in seen]:
            handle = self._handles[key]
            if handle.exited():
                handle.close()
                del self._handles[key]

    def _token(self, pid: int, start_ticks: int, parent_token: str | None, parent_ours: bool) -> str | None:
        key = (pid, start_ticks)
        if key not in self._tokens:
            if parent_ours:
                # Made by one of our processes: whoever owns the parent owns the child, whatever the
                # child's environment or birth time say (a fixture's server forking a worker on request).
                token = parent_token
            else:
                values = procfs.read_environ_vars(pid, (COOKIE_VAR, OWNER_VAR))
                cookie = values.get(COOKIE_VAR)
                token = self.ownership.token_of_cookie(cookie)
                if token is None and self.ownership.existed_before(pid, start_ticks) is not False:
                    token = PREEXISTING  # older than the session (or maybe): no part of it
                elif token is None:
                    token = self.ownership.token_by_birth(pid, start_ticks)
                elif cookie is not None and self.ownership.is_protected(token):
                    # Started under our session set-up by a nested session that has since died (an
                    # xdist worker that crashed, adopted by us, its controller): that session's debris.
                    inner = innermost_session(cookie)
                    if (inner is not None and inner.session_id != self.ownership.session_id
                            and inner.is_dead()
                            and live_outer_session(cookie, self.ownership.session_id) is None):
                        self._debris[key] = (inner, values.get(OWNER_VAR))
            self._tokens[key] = token
        return self._tokens[key]

    def census(self, scan_cookies: bool = False, dead_sessions: bool = False) -> list[Found]:
        """Our processes: the descendant tree (cheap), plus cookie carriers outside it (a /proc scan).

        With ``dead_sessions``, the scan also returns the debris of dead gpuclean sessions of this user.
        """
        found: list[Found] = []
        helpers = self._helper_pids()
        by_pid: dict[int, Found] = {}
        me = self.me
        my_sid = self.my_sid
        seen_keys: set[tuple[int, int]] = set()
        for pid, depth, parent in self._walk():
            if pid in helpers:
                continue
            pinned = self._pin(pid)
            if pinned is None:
                continue
            handle, stat = pinned
            if stat.ppid != parent and stat.ppid not in by_pid and stat.ppid != me:
                continue  # not the process the walk found any more
            parent_found = by_pid.get(stat.ppid)
            token = self._token(pid, stat.start_ticks, parent_found.token if parent_found else None,
                                parent_found is not None)
            # A direct child in another session escaped with setsid and was re-parented to our subreaper.
            found_by: FoundBy = "adopted" if depth == 1 and stat.sid != my_sid else "descendant"
            state = "R" if procfs.live_state(pid, stat.state) else stat.state
            entry = Found(pid, stat.start_ticks, depth, found_by, token, state, handle)
            if entry.key in self._debris:
                entry.found_by = "dead session"
                entry.debris_of, entry.owner_name = self._debris[entry.key]
            by_pid[pid] = entry
            seen_keys.add(entry.key)
            found.append(entry)
        if scan_cookies or dead_sessions:
            found.extend(self._cookie_carriers(by_pid, helpers, dead_sessions, seen_keys))
        self._forget_gone(seen_keys)
        self.last_census = found
        return found

    def _cookie_carriers(self, known: dict[int, Found], helpers: set[int], dead_sessions: bool,
                         seen_keys: set[tuple[int, int]]) -> list[Found]:
        found: list[Found] = []
        prefix = "" if dead_sessions else self.ownership.session_id + ":"
        never_touch = self.never_touch
        for pid, value in processes.cookie_holders(COOKIE_VAR, prefix, self.uid):
            if pid in known or pid in never_touch or pid in helpers:
                continue
            token = self.ownership.token_of_cookie(value)
            debris = None
            if token is None:
                debris = innermost_session(value) if dead_sessions else None
                if (debris is None or not debris.is_dead()
                        or live_outer_session(value, self.ownership.session_id) is not None):
                    # A live session's (also when a nested session that one's test ran died: an xdist
                    # sibling's), or no session's: never ours.
                    continue
            pinned = self._pin(pid)
            if pinned is None:
                continue
            handle, stat = pinned
            if stat.start_ticks < self.session_start_ticks and debris is None:
                continue  # carries our cookie but predates us: a recycled value, not our child
            owner_name = procfs.read_environ_vars(pid, (OWNER_VAR,)).get(OWNER_VAR) if debris else None
            entry = Found(pid, stat.start_ticks, 0, "dead session" if debris else "cookie", token,
                          "R" if procfs.live_state(pid, stat.state) else stat.state, handle, debris,
                          owner_name)
            seen_keys.add(entry.key)
            found.append(entry)
        return found

    def owner_of(self, f: Found) -> Owner:
        if f.debris_of is not None:
            if f.owner_name:
                return Owner("test", f.owner_name)
            return Owner("session", f.debris_of.describe())
        return self.ownership.owner(f.token)

    def is_protected(self, f: Found) -> bool:
        """Not to be reaped now: an active fixture's, the session set-up's, or of unknown birth."""
        return f.debris_of is None and self.ownership.is_protected(f.token)

    def _peer_pids(self, pids: Iterable[int]) -> set[int]:
        # Sibling pytest-xdist workers of the same run hold their own CUDA contexts, like we do. A peer
        # is a direct child of the controller that started with the controller's own cookie: what a
        # worker's test starts (even an orphan of a crashed worker, adopted by the controller) carries
        # that worker's longer cookie, and is a leak, never a peer. xdist exports the run id in a worker
        # only once it runs, so its initial environment (all that others can read) lacks it: it was
        # started when the controller started its workers, not before (a process that a conftest started
        # while the controller was configured carries the controller's cookie too).
        if not self.xdist_run or not self.peer_cookie:
            return set()
        parent = os.getppid()
        peers: set[int] = set()
        for pid in pids:
            stat = procfs.read_stat(pid)
            if stat is None or stat.ppid != parent:
                continue
            values = procfs.read_environ_vars(pid, (XDIST_RUN_VAR, COOKIE_VAR))
            if values.get(COOKIE_VAR) == self.peer_cookie and (
                    values.get(XDIST_RUN_VAR) == self.xdist_run
                    or (self.peers_since is not None and stat.start_ticks >= self.peers_since)):
                peers.add(pid)
        return peers

    def _siblings(self, pids: Iterable[int]) -> dict[int, Sibling]:
        """Of ``pids``, those that a live sibling worker of our xdist run started, and who there did.

        The proof is the run's cookie: a worker's session id extends the controller's cookie (our
        ``peer_cookie``) by its own ``gc.<pid>.<start>.<namespace>.<random>``, and what its tests, fixtures
        and set-up start carry that id and a token, however deeply nested. The worker the cookie names
        must be alive and a peer of ours (``_peer_pids``); the process must carry our run's id (xdist
        exports it in a worker before any test runs) and be born after that worker. Such a process
        belongs to that live session: never ours to wait for or to signal; the sibling reaps it at its
        own next check if it leaked. A sibling that died is not one: what it left is a dead session's
        debris, as before.
        """
        if not self.xdist_run or not self.peer_cookie:
            return {}
        prefix = self.peer_cookie + "/"
        found: dict[int, Sibling] = {}
        peers: dict[int, bool] = {}
        for pid in pids:
            values = procfs.read_environ_vars(pid, (COOKIE_VAR, OWNER_VAR, XDIST_RUN_VAR, XDIST_WORKER_VAR))
            value = values.get(COOKIE_VAR, "")
            if not value.startswith(prefix) or values.get(XDIST_RUN_VAR) != self.xdist_run:
                continue
            own_id, sep, rest = value[len(prefix):].partition(":")
            token = rest.split("/", 1)[0]
            ref = innermost_session(f"{prefix}{own_id}:{token}") if sep and "/" not in own_id else None
            if ref is None or ref.session_id == self.ownership.session_id or not token:
                continue
            stat = procfs.read_stat(pid)
            if stat is None or stat.start_ticks < ref.start_ticks:
                continue  # older than the worker its cookie names: a recycled value, proves nothing
            if ref.pid not in peers:
                peers[ref.pid] = self._is_sibling_worker(ref)
            if not peers[ref.pid]:
                continue
            worker = values.get(XDIST_WORKER_VAR) or f"xdist worker pid {ref.pid}"
            name = values.get(OWNER_VAR, "?")
            kind: OwnerKind = "session" if token == SESSION else _OWNER_KINDS.get(token[0], "unknown")
            found[pid] = Sibling(worker, Owner(kind, name))
        return found

    def _is_sibling_worker(self, ref: SessionRef) -> bool:
        """Whether the session leader ``ref`` names is a live sibling worker: the very process (pid and start
        time, in our pid namespace), and a peer."""
        return (ref.pid_namespace == procfs.pid_namespace() and procfs.is_live(ref.pid, ref.start_ticks)
                and bool(self._peer_pids((ref.pid,))))

    def of_our_run(self, pid: int) -> bool:
        """A process that a sibling xdist worker of our run started (its cookie extends the controller's):
        the run's, never outside the session, though this worker does not account for it."""
        if not self.xdist_run or not self.peer_cookie:
            return False
        value = procfs.read_environ_vars(pid, (COOKIE_VAR,)).get(COOKIE_VAR)
        return value is not None and value.startswith(self.peer_cookie + "/")

    # ---- the check -----------------------------------------------------------------------------

    def snapshot(self, devices: Sequence[DeviceInfo]) -> tuple[DeviceSnapshot, ...]:
        if self.backend is None or not devices:
            return ()
        # A reading equal to the device's previous one is that object: the records of clean tests then
        # share their readings instead of each keeping two per device (the session keeps every record
        # for its report, and every full garbage collection, pytest's last ones included, walks them).
        last = self._last_readings
        readings = []
        for device in devices:
            reading = self.backend.snapshot(device)
            previous = last.get(device.uuid)
            if previous is not None and previous == reading:
                reading = previous
            else:
                last[device.uuid] = reading
            readings.append(reading)
        return tuple(readings)

    def check(self, phase: Phase, devices: Sequence[DeviceInfo], *, tolerance_mib: int, timeout: float,
              scan_cookies: bool = False, reap: bool | None = None,
              device_errors: bool = False, where: str = "an earlier check") -> CheckResult:
        """Check until clean or ``timeout``; reap what is ours first (if enabled). ``where`` names this
        check to later ones that find the same outside state (a test's node id).

        A device that cannot be read raises ``DeviceError``; with ``device_errors`` it ends the check
        instead, not clean, with the error (``CheckResult.error``) and what was reaped without readings.
        """
        dead_sessions = self.dead_sessions and not self._debris_checked
        self._debris_checked = True  # at start-up once; later only when something is unexplained
        check = _Check(self, phase, devices, tolerance_mib, timeout, scan_cookies, dead_sessions,
                       self.reap_enabled if reap is None else reap, where)
        self.last_lost = None
        if not device_errors:
            return check.run()
        try:
            return check.run()
        except DeviceError as exc:
            if isinstance(exc, DeviceLost):
                self.last_lost = exc
            return check.unreadable(exc)

    def _may_kill(self, f: Found, info: ProcessInfo | None) -> bool:
        if info is None:
            return True  # already gone: terminate() reports it without signalling
        if f.pid in self.never_touch or info.uid != self.uid:
            return False  # root too: another user's process is never ours to kill
        return not self.is_protected(f)

    def _relays_to_others(self, f: Found, info: ProcessInfo | None, everyone: Sequence[Found]) -> str | None:
        """Why signalling ``f`` would reach another user's process (``su``, ``sudo`` relay signals)."""
        if info is None:
            return None
        for other in everyone:
            if other.pid == f.pid or other.depth <= f.depth or not other.live:
                continue
            other_info = processes.describe(other.pid, other.start_ticks)
            if (other_info is not None and other_info.uid != self.uid
                    and f.pid in processes.ancestors(other.pid)):
                return (f"pid {f.pid} left alone: its descendant pid {other.pid} belongs to another user "
                        f"({other_info.user}), and {one_line(info.cmdline, 40)} may relay our signals to it")
        return None

    def _unlisted_overhead(self, snaps: Sequence[DeviceSnapshot], excused: set[int],
                           self_cuda: set[str]) -> dict[str, int]:
        """Per device: memory the driver charges to no process that is excused as ours.

        Only where every listed process is excused (ours), and at most CONTEXT_OVERHEAD_BYTES per excused
        process that uses CUDA there: listed ones (a context) and unlisted ones (CUDA initialised without
        a context: 3 MiB per H200). Anything beyond stays visible as dirty memory.
        """
        overhead: dict[str, int] = {}
        short: list[tuple[DeviceSnapshot, set[int], int, int]] = []  # (snap, listed, unlisted, allowed)
        for snap in snaps:
            if not snap.processes and snap.used_bytes <= 0:
                overhead[snap.device.uuid] = 0  # the clean path: an idle device
                continue
            listed = {p.pid for p in snap.processes}
            unlisted = snap.used_bytes - sum(p.used_bytes or 0 for p in snap.processes)
            allowed = CONTEXT_OVERHEAD_BYTES * len(listed)
            if unlisted <= 0 or not listed <= excused:
                overhead[snap.device.uuid] = 0
            elif unlisted <= allowed:
                overhead[snap.device.uuid] = unlisted  # the listed contexts explain it (the common case)
            else:
                short.append((snap, listed, unlisted, allowed))
        # Reading /proc/<pid>/fd costs a syscall per descriptor: only off the clean path, once per poll, and
        # for the other excused processes only if this one does not explain it all.
        found: dict[int, frozenset[str]] = {}
        if short and self.backend is not None:
            found.update(self.backend.cuda_users([self.me]))

        def users(snap: DeviceSnapshot, listed: set[int]) -> list[int]:
            return [pid for pid, uuids in found.items() if snap.device.uuid in uuids and pid not in listed]

        if self.backend is not None and any(
                u > a + CONTEXT_OVERHEAD_BYTES * len(users(s, ls)) for s, ls, u, a in short):
            found.update(self.backend.cuda_users(sorted(excused - {self.me})))
        for snap, listed, unlisted, allowed in short:
            unlisted_users = users(snap, listed)
            if self.me in unlisted_users:
                self_cuda.add(snap.device.label)
            overhead[snap.device.uuid] = min(unlisted, allowed + CONTEXT_OVERHEAD_BYTES * len(unlisted_users))
        return overhead

    def _offenders(self, snaps: Sequence[DeviceSnapshot], ours: Sequence[Found], foreign: set[int],
                   excused: set[int], tolerance: int, overhead: dict[str, int],
                   reap_enabled: bool) -> list[Offender]:
        offenders: list[Offender] = []
        ignored: set[int] = set()
        for pid in sorted(foreign):
            info = processes.describe(pid)
            if info is not None and self.ignore and processes.matches_any(info.cmdline, self.ignore):
                ignored.add(pid)
                continue
            offenders.append(Offender("foreign", info or vanished(pid), None, "gpu", mib_of(pid, snaps),
                                      detail="not started by this session: waited for, never killed"))
        for f in ours:
            info = processes.describe(f.pid, f.start_ticks)
            if info is None:
                continue
            if info.uid != self.uid:
                detail = f"belongs to another user ({info.user}): never killed"
            elif not reap_enabled:
                detail = "reaping is off"
            else:
                detail = f"could not be reaped ({info.state})"
            offenders.append(Offender("leaked", info, self.owner_of(f), f.found_by,
                                      mib_of(f.pid, snaps), detail=detail))
        # Memory of allowlisted processes still counts against the tolerance; only their presence is
        # excused. Memory explained by a listed offender is not reported twice.
        blamed = {o.process.pid for o in offenders if o.process is not None}
        for snap in snaps:
            extra = snap.used_bytes - snap.bytes_of(excused) - overhead.get(snap.device.uuid, 0)
            if extra > tolerance and not blamed & {p.pid for p in snap.processes}:
                holders = sorted(ignored & {p.pid for p in snap.processes})
                by = f"allowlisted pid(s) {holders}" if holders else "no process we can see"
                offenders.append(Offender(
                    "memory", None, None, "gpu", ((snap.device.label, extra / MIB),),
                    detail=f"{extra / MIB:.0f} MiB used on {snap.device.label} beyond the tolerance "
                           f"of {tolerance / MIB:.0f} MiB, held by {by}"))
        if self.host_scope:
            exclude = self.never_touch | excused | ignored | foreign | blamed | {f.pid for f in ours}
            strays = set(processes.stray_python_processes(self.uid, exclude, self.ignore))
            strays -= self._peer_pids(strays)
            # What our xdist siblings run is theirs, as on the GPUs (``_siblings``).
            for pid in sorted(strays - self._siblings(strays).keys()):
                info = processes.describe(pid)
                if info is not None:
                    offenders.append(Offender(
                        "host", info, None, "host", (),
                        detail="Python process of this user (host scope): never killed"))
        return offenders

    def _unknown_offenders(self, unknown: Sequence[Found], snaps: Sequence[DeviceSnapshot]) -> list[Offender]:
        offenders: list[Offender] = []
        for f in unknown:
            info = processes.describe(f.pid, f.start_ticks)
            if info is not None:
                offenders.append(Offender(
                    "leaked", info, UNKNOWN_OWNER, f.found_by, mib_of(f.pid, snaps),
                    detail="no evidence of which test or fixture started it: left alone, never signalled"))
        return offenders

    # ---- reaping -------------------------------------------------------------------------------

    def reap(self, ours: Sequence[Found], snaps: Sequence[DeviceSnapshot], devices: Sequence[DeviceInfo],
             notes: list[str], everyone: Sequence[Found] = (), kill_first: bool = False) -> list[Reaped]:
        """Kill ``ours`` (TERM, grace, KILL; or KILL at once), then wait until the driver lets them go."""
        infos = {f.pid: processes.describe(f.pid, f.start_ticks) for f in ours}
        safe: list[Found] = []
        for f in ours:
            relay = self._relays_to_others(f, infos[f.pid], everyone or ours)
            if self._may_kill(f, infos[f.pid]) and relay is None:
                safe.append(f)
            elif infos[f.pid] is not None:
                notes.append(relay or f"pid {f.pid} left alone: not provably ours")
        for f in safe:
            if f.debris_of is not None:
                notes.append(f"pid {f.pid}: left by {f.debris_of.describe()}")
        if any(f.depth == 1 for f in safe):
            notes.extend(pools.shutdown_pools({f.pid for f in safe}, wait=self.grace))
        holders = {p.pid for s in snaps for p in s.processes} & {f.pid for f in safe}
        targets = [processes.KillTarget(f.pid, f.start_ticks, f.depth, f.handle) for f in safe]
        ended, _released = self.kill_and_confirm(targets, devices, holders, kill_first=kill_first)
        return [reaped_record(infos[f.pid], f.pid, self.owner_of(f), f.found_by, ended[f.pid],
                              mib_of(f.pid, snaps)) for f in safe]

    def kill_and_confirm(self, targets: Sequence[processes.KillTarget], devices: Sequence[DeviceInfo],
                         holders: set[int], kill_first: bool = False
                         ) -> tuple[dict[int, tuple[processes.KillOutcome, float | None]], float | None]:
        """The kill ladder, then wait until the driver lists none of ``holders`` (GPU-holding targets).

        Returns per pid its outcome and the driver's release time, and the seconds from the first
        signal until every holder was gone from the devices (None if none held a GPU or one stayed).
        The plugin's reaper and ``gpuclean reap`` both end processes through here.
        """
        watch = ReleaseWatch(self, devices, holders)
        killed_at = time.monotonic()
        outcomes = processes.terminate(targets, self.grace, watch=watch.poll, hurry=self.hurry,
                                       kill_first=kill_first)
        watch.finish(deadline=time.monotonic() + max(self.grace, 10.0))
        ended: dict[int, tuple[processes.KillOutcome, float | None]] = {}
        for outcome in outcomes:
            release = None
            if outcome.pid in watch.gone_at and outcome.signal_s is not None:
                # The driver frees memory while the process exits (before it is a zombie), so time
                # the release from the signal that ended it, not from its exit.
                release = max(0.0, watch.gone_at[outcome.pid] - (killed_at + outcome.signal_s))
            ended[outcome.pid] = (outcome, release)
        all_released = None
        if holders and holders <= watch.gone_at.keys():
            all_released = max(watch.gone_at[p] for p in holders) - killed_at
        return ended, all_released

    def freeze(self, targets: Sequence[Found], owners: set[str | None], scan_cookies: bool) -> list[Found]:
        """SIGSTOP ``targets`` and whatever else of the same owners appears, until nothing new does.

        A stopped process forks no more, so the set stops growing; what it returns is killed at once.
        """
        frozen: dict[tuple[int, int], Found] = {f.key: f for f in targets}
        processes.stop([processes.KillTarget(f.pid, f.start_ticks, f.depth, f.handle) for f in targets])
        for _ in range(MAX_FREEZE_PASSES):
            new = [f for f in self.census(scan_cookies=scan_cookies)
                   if f.key not in frozen and f.live and not self.is_protected(f) and f.token in owners]
            if not new:
                break
            frozen.update((f.key, f) for f in new)
            processes.stop([processes.KillTarget(f.pid, f.start_ticks, f.depth, f.handle) for f in new])
        return list(frozen.values())

    def final_sweep(self, devices: Sequence[DeviceInfo], *, include_session: bool = False) -> list[Reaped]:
        """At session end: reap everything this session's tests and fixtures spawned that is still alive.

        No device data is needed to find and end them: devices are read only to time the release, and
        a device that cannot be read (a GPU lost at the end) does not stop the sweep. With
        ``include_session`` also what the session set-up started (conftest, plugins): for the very
        end, after every ``pytest_unconfigure``.
        """
        self.ownership.active_fixtures.clear()
        self.ownership.session_over = include_session
        found = []
        for f in self.census(scan_cookies=True):
            if f.live:
                found.append(f)
            else:
                # Exited, holding nothing: collected (if ours to wait for), not reported as a leftover.
                processes.reap_if_child(f.pid)
        if not include_session:
            found = [f for f in found if f.token != SESSION]
        found = [f for f in found if f.token is not None and f.token != PREEXISTING]
        if not found or not self.reap_enabled:
            return []
        try:
            snaps = self.snapshot(devices)
        except DeviceError:
            snaps, devices = (), ()
        try:
            return self.reap(found, snaps, devices, [], everyone=found)
        except DeviceError:
            return self.reap(found, (), (), [], everyone=found)

    def dead_session_debris(self) -> list[Found]:
        """Live processes of this user whose cookie names a gpuclean session that provably died."""
        return [f for f in self.census(dead_sessions=True) if f.debris_of is not None and f.live]

    def reap_dead_sessions(self, devices: Sequence[DeviceInfo]) -> tuple[list[Reaped], list[str]]:
        """Reap the debris of dead sessions now (an xdist controller, when a worker crashed)."""
        debris = self.dead_session_debris() if self.dead_sessions else []
        if not debris or not self.reap_enabled:
            return [], []
        notes: list[str] = []
        try:
            snaps = self.snapshot(devices)
        except DeviceError:
            snaps, devices = (), ()
        return self.reap(debris, snaps, devices, notes, everyone=debris), notes

    def survivors(self) -> list[ProcessInfo]:
        """Processes of this session still alive (what the final sweep would reap)."""
        infos = (processes.describe(f.pid, f.start_ticks) for f in self.census(scan_cookies=True)
                 if f.live and f.token not in (SESSION, PREEXISTING))  # zombies hold nothing
        return [info for info in infos if info is not None]

    def is_older(self, pid: int, start_ticks: int) -> bool:
        """Whether the census found ``pid`` (started at ``start_ticks``) to be no part of the session: it, or
        the process that started it, existed before the session."""
        return self._tokens.get((pid, start_ticks)) == PREEXISTING

    def no_part_of_the_session(self) -> list[ProcessInfo]:
        """Processes under us that are no part of the session (they, or the process that started them,
        existed before it), still alive: left alone."""
        infos = (processes.describe(f.pid, f.start_ticks) for f in self.census()
                 if f.live and f.token == PREEXISTING)
        return [info for info in infos if info is not None]


class _Check:
    """One check: observe, collect zombies, let leftovers settle, reap, and give the verdict."""

    def __init__(self, checker: Checker, phase: Phase, devices: Sequence[DeviceInfo], tolerance_mib: int,
                 timeout: float, scan_cookies: bool, dead_sessions: bool, reap: bool,
                 where: str = "an earlier check") -> None:
        self.c = checker
        self.where = where
        self.phase = phase
        self.devices = devices
        self.tolerance_mib = tolerance_mib
        self.tolerance = tolerance_mib * MIB
        self.timeout = timeout
        self.scan_cookies = scan_cookies
        self.dead_sessions = dead_sessions
        self.reap_enabled = reap
        self.started = time.monotonic()
        self.reaped: list[Reaped] = []
        self.notes: list[str] = []
        self.attempted: set[tuple[int, int]] = set()
        self.first_seen: dict[tuple[int, int], Offender] = {}
        self.collected: list[Reaped] = []
        self.collected_ids: set[tuple[int, int]] = set()
        self.settled = False
        self.rounds = 0
        self.reaped_owners: set[str | None] = set()
        # Filled by observe():
        self.snaps: tuple[DeviceSnapshot, ...] = ()
        self.found: list[Found] = []
        self.ours: list[Found] = []
        self.unknown: list[Found] = []
        self.excused: set[int] = set()
        self.unexplained: set[int] = set()
        self.overhead: dict[str, int] = {}
        self.self_cuda: set[str] = set()
        self.outside_seen: dict[str, OutsideState] = {}
        """Per device UUID: its outside state as this check last found it, and since when unchanged."""
        self._first: tuple[tuple[DeviceSnapshot, ...], list[Found] | None] | None = None
        """The readings ``quiet`` took, for the first round."""
        self.siblings: dict[tuple[int, int], SiblingUse] = {}
        """Processes of live sibling xdist workers seen on these devices, by identity."""
        self.peers: set[int] = set()
        """Sibling xdist workers themselves seen on these devices (their own CUDA contexts)."""

    def run(self) -> CheckResult:
        quiet = self.quiet()
        if quiet is not None:
            return quiet
        while True:
            self.observe()
            if self.needs_cookie_scan():
                continue
            self.collect_zombies()
            fresh = [f for f in self.ours if f.key not in self.attempted]
            if self.settle(fresh):
                continue
            if self.reap_round(fresh):
                continue
            result = self.verdict(fresh)
            if result is not None:
                return result
            time.sleep(POLL_S)

    def quiet(self) -> CheckResult | None:
        """The clean path's result, if nothing at all is there: no process of ours alive, and every device
        idle (no process listed, no memory used). It is what the rounds below conclude then, without
        their bookkeeping, which is most of a clean check's cost. Otherwise None, and the first round
        reuses these readings."""
        if self.scan_cookies or self.dead_sessions or self.c.host_scope:
            return None
        c = self.c
        snaps = c.snapshot(self.devices)
        found = c.census() if all(not s.processes and s.used_bytes <= 0 for s in snaps) else None
        if found is None or found:
            self._first = (snaps, found)
            return None
        c.outside.forget(d.uuid for d in self.devices)  # what held them from outside is gone
        waited = time.monotonic() - self.started
        return CheckResult(phase=self.phase, clean=True, devices=snaps, offenders=(), waited_s=waited,
                           clean_after_s=waited, tolerance_mib=self.tolerance_mib)

    def observe(self) -> None:
        c = self.c
        first, self._first = self._first, None
        self.snaps = first[0] if first is not None else c.snapshot(self.devices)
        self.self_cuda = set()
        if first is not None and first[1] is not None:
            self.found = first[1]
        else:
            self.found = c.census(scan_cookies=self.scan_cookies, dead_sessions=self.dead_sessions)
        self.dead_sessions = False
        unprotected = [f for f in self.found if not c.is_protected(f)]
        # Of unknown birth: no evidence says which test made it, so it is reported, never signalled.
        self.unknown = [f for f in self.found if f.token is None and f.debris_of is None and f.live]
        self.ours = unprotected
        # Our ancestors (an outer pytest running this session, a launcher) are us as far as the GPU
        # goes: their contexts are excused like our own; they are never killed either.
        excused = c.never_touch | c._helper_pids() | {f.pid for f in self.found
                                                      if c.is_protected(f) and f.token is not None}
        listed = {p.pid for s in self.snaps for p in s.processes}
        unexplained = listed - excused - {f.pid for f in self.ours} - {f.pid for f in self.unknown}
        peers = c._peer_pids(unexplained)
        self.peers |= peers
        excused |= peers
        # What a live sibling worker's test (or fixture) started is that worker's to reap: waiting for it
        # here, while this test holds the GPU locks that the sibling needs for its next check, would only
        # stall both. Named in the notes, and a finding of the test that started it (testcheck.py).
        siblings = c._siblings(unexplained - excused)
        for pid, sibling in siblings.items():
            self._saw_sibling(pid, sibling)
        excused |= siblings.keys()
        self.unexplained = unexplained - excused
        self.excused = excused
        # Our own CUDA context's unlisted overhead must not trigger the cookie scan on every check of a
        # pytest process that uses the GPU itself.
        self.overhead = c._unlisted_overhead(self.snaps, excused, self.self_cuda)

    def _saw_sibling(self, pid: int, sibling: Sibling) -> None:
        # Described once per check (the check polls while something else keeps it dirty); what it held
        # is the most it was seen with.
        held = mib_of(pid, self.snaps)
        known = next((u for u in self.siblings.values() if u.process.pid == pid), None)
        if known is not None:
            if sum(m for _, m in held) > sum(m for _, m in known.mib_per_device):
                key = (pid, known.process.start_ticks)
                self.siblings[key] = known.replace(mib_per_device=held)
            return
        info = processes.describe(pid)
        if info is not None:
            key = (info.pid, info.start_ticks)
            self.siblings[key] = SiblingUse(info, sibling.owner, sibling.worker, held)

    def needs_cookie_scan(self) -> bool:
        """Something holds a GPU that our tree does not explain: maybe an escapee with our cookie, or
        the debris of a dead session."""
        if self.scan_cookies:
            return False
        if self.unexplained or any(
                s.used_bytes - s.bytes_of(self.excused) - self.overhead[s.device.uuid] > self.tolerance
                for s in self.snaps):
            self.scan_cookies = True
            self.dead_sessions = self.c.dead_sessions
            return True
        return False

    def collect_zombies(self) -> None:
        # Exited processes nobody waited for hold no memory and are no leak: most are orphans that our
        # subreaper adopted (a double fork's middle process, a subprocess's resource tracker), which init
        # would have collected. Collect the ones that are now our children, by pid.
        for f in self.ours:
            if not f.live and f.key not in self.collected_ids:
                info = processes.describe(f.pid, f.start_ticks)
                if processes.reap_if_child(f.pid):
                    self._collect(f, info, "reaped zombie")
        self.ours = [f for f in self.ours if f.live]

    def settle(self, fresh: Sequence[Found]) -> bool:
        """Before the first reaping, give leftovers ``settle`` seconds to exit on their own (a
        subprocess's resource tracker that cleans up after its client, an engine finishing its shutdown).
        True if any did, so the caller looks again."""
        if not (self.reap_enabled and fresh and not self.rounds and not self.settled and self.c.settle > 0):
            return False
        self.settled = True
        infos = {f.pid: processes.describe(f.pid, f.start_ticks) for f in fresh}
        deadline = time.monotonic() + self.c.settle
        pending = list(fresh)
        while pending and time.monotonic() < deadline:
            time.sleep(POLL_S)
            for f in list(pending):
                if f.handle is None or f.handle.exited():
                    processes.reap_if_child(f.pid)
                    pending.remove(f)
                    self._collect(f, infos[f.pid], "exited by itself")
        return len(pending) < len(fresh)

    def reap_round(self, fresh: Sequence[Found]) -> bool:
        if not (self.reap_enabled and fresh and self.rounds < MAX_REAP_ROUNDS):
            return False
        kill_first = False
        targets = list(fresh)
        if self.rounds:
            # Killed processes were replaced (a SIGTERM handler that forks, a supervisor): stop the
            # whole set first, so nothing forks while we look, then SIGKILL it; no handler runs again.
            self.notes.append(f"new processes appeared while reaping (round {self.rounds + 1}): "
                              f"{sorted(f.pid for f in fresh)}; stopped and killed with SIGKILL")
            targets = self.c.freeze(fresh, {f.token for f in fresh} | self.reaped_owners, self.scan_cookies)
            kill_first = True
        self.rounds += 1
        self.attempted.update(f.key for f in targets)
        self.reaped_owners.update(f.token for f in targets)
        self.reaped.extend(self.c.reap(targets, self.snaps, self.devices, self.notes, everyone=self.found,
                                       kill_first=kill_first))
        # What could not be signalled is not retried: waiting for it is what the verdict does.
        return True

    def verdict(self, fresh: Sequence[Found]) -> CheckResult | None:
        """The result if the check is over (clean, hopeless or timed out), else None to look again."""
        c = self.c
        offenders = c._offenders(self.snaps, self.ours, self.unexplained, self.excused, self.tolerance,
                                 self.overhead, self.reap_enabled)
        offenders.extend(c._unknown_offenders(self.unknown, self.snaps))
        for o in offenders:
            if o.reason == "leaked" and o.process is not None:
                self.first_seen.setdefault((o.process.pid, o.process.start_ticks), o)
        waited = time.monotonic() - self.started
        # Processes that survived our SIGKILL, or that we may not signal, do not go away by waiting.
        unsignalled = {f.key for f in self.unknown} | {
            f.key for f in self.ours if f.key in self.attempted}
        # Nor does an outside state that an earlier check already waited out, and finds again unchanged.
        outside, states, clean = self._outside(offenders)
        known = self._known_outside(states)
        hopeless = bool(offenders) and all(
            (o.reason == "leaked" and o.process is not None
             and (o.process.pid, o.process.start_ticks) in unsignalled)
            or (bool(outside.get(id(o))) and outside[id(o)] <= known) for o in offenders)
        if offenders and not hopeless and waited < self.timeout:
            return None
        outside_found = self._remember_outside(offenders, outside, states, clean, known,
                                               waited_out=not hopeless)
        if fresh and self.rounds >= MAX_REAP_ROUNDS:
            self.notes.append(f"gave up after {self.rounds} reaping rounds: killed processes keep being "
                              f"replaced (a process pool or supervisor outside our reach?)")
        still = {(o.process.pid, o.process.start_ticks) for o in offenders if o.process is not None}
        lingered = tuple(
            o.replace(detail=f"outlived its test, ended by itself within {waited:.2f}s (reaping is off)")
            for key, o in self.first_seen.items() if key not in still)
        me = c.me
        siblings = tuple(self.siblings.values())
        notes = [*self.notes, *(
            f"pid {u.process.pid}: in use by {u.describe()} ({report_mib(u.mib_per_device)}); another worker "
            f"of this xdist run: not waited for, never signalled (its worker reaps it if it was leaked)"
            for u in siblings), *(
            f"pid {pid}: another worker of this xdist run, its pytest process itself "
            f"({report_mib(mib_of(pid, self.snaps)) or 'no memory now'}): excused like our own"
            for pid in sorted(self.peers))]
        return CheckResult(
            phase=self.phase, clean=not offenders, devices=self.snaps, offenders=tuple(offenders),
            lingered=lingered, collected=tuple(self.collected), reaped=tuple(self.reaped), waited_s=waited,
            clean_after_s=waited if not offenders else None, notes=tuple(notes), siblings=siblings,
            tolerance_mib=self.tolerance_mib,
            self_mib=tuple((s.device.label, s.bytes_of({me}) / MIB) for s in self.snaps if s.bytes_of({me})),
            self_cuda_only=() if not self.self_cuda else tuple(
                s.device.label for s in self.snaps if s.device.label in self.self_cuda),
            outside=outside_found,
        )

    def unreadable(self, error: DeviceError) -> CheckResult:
        """The result of a check that could not read a device: not clean, at once (no reading can say when
        the devices are clean), with the error. What is provably ours is reaped all the same: ownership
        needs no device reading (the final sweep copes the same way), and a test's leftovers must not
        wait for the session's end, nor make every later check fail."""
        c = self.c
        # The devices that can still be read tell what the reaped held there, and when it was released.
        readable: list[DeviceInfo] = []
        snaps: list[DeviceSnapshot] = []
        for device in self.devices:
            try:
                snaps.extend(c.snapshot((device,)))
                readable.append(device)
            except DeviceError:
                continue
        # No reading says whether something outside our tree holds a GPU: look for our cookie everywhere.
        self.found = c.census(scan_cookies=True)
        self.ours = [f for f in self.found if not c.is_protected(f)]
        self.unknown = [f for f in self.found if f.token is None and f.debris_of is None and f.live]
        self.collect_zombies()
        fresh = [f for f in self.ours if f.key not in self.attempted]
        if self.settle(fresh):  # what exits by itself within the settle time is no leak here either
            fresh = [f for f in fresh if f.key not in self.collected_ids]
            self.ours = [f for f in self.ours if f.key not in self.collected_ids]
        if self.reap_enabled and fresh:
            self.attempted.update(f.key for f in fresh)
            self.reaped.extend(c.reap(fresh, snaps, readable, self.notes, everyone=self.found))
            left = {f.key for f in c.census(scan_cookies=True) if f.live}
            self.ours = [f for f in self.ours if f.key in left]
        # Only what is ours is judged: without every reading, nothing else can be (no foreign holder; each
        # device's whole use passed as excused overhead, so no memory offender either).
        offenders = c._offenders(snaps, self.ours, set(), set(), self.tolerance,
                                 {s.device.uuid: s.used_bytes for s in snaps}, self.reap_enabled)
        offenders.extend(c._unknown_offenders(self.unknown, snaps))
        return CheckResult(
            phase=self.phase, clean=False, devices=tuple(snaps), offenders=tuple(offenders),
            collected=tuple(self.collected), reaped=tuple(self.reaped),
            waited_s=time.monotonic() - self.started, notes=tuple(self.notes),
            tolerance_mib=self.tolerance_mib, error=error.describe(),
            device_lost=isinstance(error, DeviceLost))

    def _outside(self, offenders: Sequence[Offender]) -> tuple[
            dict[int, frozenset[str]], dict[str, tuple[frozenset[tuple[int, int]], int]], list[str]]:
        """The findings that cannot be the session's (by ``id``, each with the UUIDs of the devices it is
        on); each of those devices as a later check compares it: the processes listed there that are not
        ours, and the memory there that is not ours; and the devices clean from outside.

        Cannot be the session's: a process the driver lists that is neither ours nor excused (a sibling
        xdist worker's processes are the run's, not outside), and memory that no process we can see holds.
        A leak of ours, or a process of unknown owner that carries our cookie, never is.
        """
        found: dict[int, frozenset[str]] = {}
        if not offenders:
            return found, {}, [d.uuid for d in self.devices]
        uuid_of = {s.device.label: s.device.uuid for s in self.snaps}
        for o in offenders:
            if o.reason == "memory" or (o.reason == "foreign" and o.process is not None
                                        and not self.c.of_our_run(o.process.pid)):
                found[id(o)] = frozenset(uuid_of[label] for label, _ in o.mib_per_device if label in uuid_of)
        states: dict[str, tuple[frozenset[tuple[int, int]], int]] = {}
        clean: list[str] = []
        dirty = frozenset().union(*found.values())
        ours = self.excused | {f.pid for f in self.found}
        for snap in self.snaps:
            uuid = snap.device.uuid
            unexplained = [p.pid for p in snap.processes if p.pid in self.unexplained]
            used = snap.used_bytes - snap.bytes_of(ours) - self.overhead.get(uuid, 0)
            if uuid in dirty:
                states[uuid] = (frozenset((pid, _start_ticks(pid)) for pid in unexplained), used)
            elif not unexplained and used <= self.tolerance:
                # (Not merely unreported: a leak of ours listed there hides memory nobody holds.)
                clean.append(uuid)
        return found, states, clean

    def _known_outside(self, states: dict[str, tuple[frozenset[tuple[int, int]], int]]) -> set[str]:
        """The devices whose outside state is one an earlier check waited out, unchanged since for at
        least this check's timeout: waiting longer for it is waiting for nothing. (A check with a longer
        timeout than that one's waits the difference.) Tracks, per device, since when this check has seen
        its outside state unchanged."""
        remembered = self.c.outside.load() if states else {}
        slack = max(self.tolerance, OUTSIDE_SLACK_BYTES)
        now = time.monotonic()
        known: set[str] = set()
        for uuid, (holders, used) in states.items():
            earlier = remembered.get(uuid)
            if earlier is not None and earlier.same(holders, used, slack):
                self.outside_seen[uuid] = earlier
                if now - earlier.since >= self.timeout:
                    known.add(uuid)
                continue
            seen = self.outside_seen.get(uuid)
            if seen is None or not seen.same(holders, used, slack):
                self.outside_seen[uuid] = OutsideState(holders, used, self.where, now)
        return known

    def _remember_outside(self, offenders: Sequence[Offender], outside: dict[int, frozenset[str]],
                          states: dict[str, tuple[frozenset[tuple[int, int]], int]], clean: list[str],
                          known: set[str], waited_out: bool) -> Outside | None:
        """Remember the outside state this check waited out (``waited_out``: it ran to its timeout), forget
        that of each device now ``clean`` from outside; what was found from outside, for the result."""
        # Clean from outside now: a later state there is new again. Waited out: remembered (an earlier
        # check's, if it is the same).
        remember = {u: self.outside_seen[u] for u in states if waited_out and u in self.outside_seen}
        if remember:
            self.c.outside.update(remember, forget=clean)
        else:
            self.c.outside.forget(clean)
        if not outside:
            return None
        devices = tuple((s.device.label, states[s.device.uuid][1] / MIB) for s in self.snaps
                        if s.device.uuid in states)
        # Not waited out here: every outside finding was a state an earlier check waited out.
        wheres = sorted({self.outside_seen[u].where for u in known & states.keys()})
        same_as = None if waited_out or not wheres else ", ".join(wheres)
        return Outside(devices, only=len(outside) == len(offenders), same_as=same_as)

    def _collect(self, f: Found, info: ProcessInfo | None, how: EndedBy) -> None:
        # One of ours that ended without being killed: reported in the summary, not a leak.
        self.collected_ids.add(f.key)
        self.collected.append(Reaped(info or vanished(f.pid), self.c.owner_of(f), f.found_by, how, (), None))


class ReleaseWatch:
    """Notes when each killed GPU holder disappears from the driver's process list."""

    def __init__(self, checker: Checker, devices: Sequence[DeviceInfo], holders: set[int]) -> None:
        self.checker = checker
        self.devices = devices
        self.holders = holders
        self.gone_at: dict[int, float] = {}

    def poll(self) -> None:
        if len(self.gone_at) == len(self.holders):
            return
        try:
            listed = {p.pid for s in self.checker.snapshot(self.devices) for p in s.processes}
        except DeviceError:
            # The killing goes on without timing the release; the check's next reading meets the error.
            self.holders = set(self.gone_at)
            return
        now = time.monotonic()
        for pid in self.holders - listed - self.gone_at.keys():
            self.gone_at[pid] = now

    def finish(self, deadline: float) -> None:
        self.poll()
        while len(self.gone_at) < len(self.holders) and time.monotonic() < deadline:
            time.sleep(RELEASE_POLL_S)
            self.poll()


CONTEXT_OVERHEAD_BYTES = 64 * MIB
"""Per excused CUDA context, memory the driver counts as used but lists under no process. Measured on
an H200 (driver 580): 877 MiB used with one context whose process was charged 868 MiB."""


def _start_ticks(pid: int) -> int:
    """When ``pid`` started (clock ticks since boot), as an outside holder's identity; 0 for a process we
    cannot see (another PID namespace's, listed by the driver) or that has exited (the driver is giving
    its memory back: not the state an earlier check waited out)."""
    stat = procfs.read_stat(pid)
    return 0 if stat is None or not procfs.live_state(pid, stat.state) else stat.start_ticks


def mib_of(pid: int, snaps: Sequence[DeviceSnapshot]) -> tuple[tuple[str, float], ...]:
    """(device label, MiB) of each device the driver lists ``pid`` on."""
    return tuple((s.device.label, s.bytes_of({pid}) / MIB) for s in snaps
                 if any(p.pid == pid for p in s.processes))


def vanished(pid: int) -> ProcessInfo:
    """A stand-in for a process that ended before it could be described."""
    return ProcessInfo(pid, 0, 0, -1, "?", "(exited)", "gone")


def reaped_record(info: ProcessInfo | None, pid: int, owner: Owner | None, found_by: FoundBy,
                  ended: tuple[processes.KillOutcome, float | None],
                  held: tuple[tuple[str, float], ...]) -> Reaped:
    """What the kill ladder did to one process, as reported."""
    outcome, release = ended
    return Reaped.after_kill(info or vanished(pid), owner, found_by, held, outcome, release)
