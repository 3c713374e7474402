"""The clean check: readings -> snapshot -> verdict, and reaping what is provably the session's.

A check reads the devices (``Checker.snapshot``) and the session's processes (``census.py``), decides
over those readings (``decide.py``: ours, excused, unexplained; the offenders; what may be signalled),
reaps through the ladder (``reaping.py``) and gives a ``CheckResult``. ``Checker`` holds what lasts from
one check to the next; ``_Check`` is one check. No pytest here: the plugin and the ``gpuclean`` command
line drive the same ``Checker``.
"""

from __future__ import annotations

import operator
import os
import time
from collections.abc import Callable, Sequence

from pytest_gpuclean.core.acting import pools, reaping
from pytest_gpuclean.core.deciding import decide
from pytest_gpuclean.core.deciding.outside import SLACK_BYTES as OUTSIDE_SLACK_BYTES
from pytest_gpuclean.core.deciding.outside import OutsideMemory, OutsideState, known_outside, outside_of
from pytest_gpuclean.core.options.settings import DEFAULT_GRACE_S
from pytest_gpuclean.core.ownership.census import Census, Found, Registry, Sibling
from pytest_gpuclean.core.ownership.cookie import new_session_id
from pytest_gpuclean.core.ownership.evidence import PREEXISTING, SESSION, Ownership
from pytest_gpuclean.core.reading import processes, procfs
from pytest_gpuclean.core.reading.backends import Backend
from pytest_gpuclean.core.reading.devices import DeviceError, DeviceLost
from pytest_gpuclean.model.records import (
    MIB,
    UNKNOWN_OWNER,
    CheckResult,
    DeviceInfo,
    DeviceSnapshot,
    EndedBy,
    Offender,
    Outside,
    Owner,
    Phase,
    ProcessInfo,
    Reaped,
    SiblingUse,
)
from pytest_gpuclean.model.text import mib_list as report_mib
from pytest_gpuclean.model.text import one_line

POLL_S = 0.02
"""Polling interval while waiting for a device to come clean."""
MAX_REAP_ROUNDS = 4
"""Rounds of reaping within one check; from the second on, what reappeared is frozen and SIGKILLed."""
MAX_FREEZE_PASSES = 20
"""Census passes while freezing a respawning set: each pass stops what the previous one missed, and a
stopped process forks no more, so this ends after as many passes as the tree is deep."""
_LISTED = operator.attrgetter("processes")
_USED = operator.attrgetter("used_bytes")


class Checker:
    """Checks devices and processes; reaps leaks that are provably this session's."""

    def __init__(self, backend: Backend | None, *, reap: bool = True, grace: float = DEFAULT_GRACE_S,
                 ignore: Sequence[str] = (), host_scope: bool = False,
                 session_id: str | None = None, settle: float = 0.0, xdist_run: str | None = None,
                 peer_cookie: str | None = None, dead_sessions: bool = True,
                 session_start_ticks: int | None = None, peers_since: int | None = None,
                 session_start_pid: int | None = None, helpers: Sequence[str] = (),
                 persistent: Sequence[str] = (), persistent_registry: Registry | None = None) -> None:
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
        if session_id is None:  # a checker of its own (the command line's, a test's)
            session_id = new_session_id(None, *procfs.self_identity())
        self.ownership = Ownership(session_id, session_start_ticks, session_start_pid)
        self.procs = Census(self.ownership, uid=self.uid, session_start_ticks=session_start_ticks,
                            xdist_run=xdist_run, peer_cookie=peer_cookie, peers_since=peers_since,
                            helper_globs=helpers, persistent_globs=persistent,
                            persistent_registry=persistent_registry)
        """The session's processes and their tokens."""
        self.last_lost: DeviceLost | None = None
        """The lost GPU that ended the last check (``check(device_errors=True)``), for the health watch."""
        self.hurry: Callable[[], bool] | None = None
        """Set while an interrupt asks the reaping to be quick: the grace ends at once."""
        self._debris_checked = False
        self.outside = OutsideMemory()
        """Per device UUID: the outside state a check waited out. A later check that finds the very same,
        unchanged for as long as its own timeout, does not wait for it again. (An xdist worker's session
        shares it with the run's other workers: ``outside.py``.)"""

    # ---- the census (census.py), as the session and the command line ask it --------------------

    @property
    def me(self) -> int:
        """The process running the checks: under a forked runner, the forked child, not the session."""
        return self.procs.me

    @property
    def never_touch(self) -> set[int]:
        """This process and its ancestors: never suspects, never signalled."""
        return self.procs.never_touch

    @property
    def last_census(self) -> list[Found]:
        """What the last census found (``--gpuclean-ray=auto`` looks there for a Ray cluster the session
        started)."""
        return self.procs.last

    @property
    def notices(self) -> list[str]:
        """Lines for the session's notes, once each: helpers of the pytest process and persistent processes
        as they are first seen (taken by whoever reports them)."""
        return self.procs.notices

    def census(self, scan_cookies: bool = False, dead_sessions: bool = False) -> list[Found]:
        """Our processes (``Census.take``)."""
        return self.procs.take(scan_cookies, dead_sessions)

    def owner_of(self, f: Found) -> Owner:
        return self.procs.owner_of(f)

    def is_protected(self, f: Found) -> bool:
        return self.procs.is_protected(f)

    def is_older(self, pid: int, start_ticks: int) -> bool:
        return self.procs.is_older(pid, start_ticks)

    def of_our_run(self, pid: int) -> bool:
        return self.procs.of_our_run(pid)

    def close(self) -> None:
        """Close the pidfds of every process still pinned."""
        self.procs.close()

    # ---- the check -----------------------------------------------------------------------------

    def snapshot(self, devices: Sequence[DeviceInfo]) -> tuple[DeviceSnapshot, ...]:
        if self.backend is None or not devices:
            return ()
        return self.backend.readings(devices)

    def check(self, phase: Phase, devices: Sequence[DeviceInfo], *, tolerance_mib: int, timeout: float,
              scan_cookies: bool = False, reap: bool | None = None,
              device_errors: bool = False, where: str = "an earlier check") -> CheckResult:
        """Check until clean or ``timeout``; reap what is ours first (if enabled). ``where`` names this
        check to later ones that find the same outside state (a test's node id).

        A device that cannot be read raises ``DeviceError``; with ``device_errors`` it ends the check
        instead, not clean, with the error (``CheckResult.error``) and what was reaped without readings.
        """
        started = time.monotonic()
        dead_sessions = self.dead_sessions and not self._debris_checked
        self._debris_checked = True  # at start-up once; later only when something is unexplained
        self.last_lost = None
        first: tuple[tuple[DeviceSnapshot, ...], list[Found] | None] | None = None
        check: _Check | None = None
        try:
            if not (scan_cookies or dead_sessions or self.host_scope):
                quiet = self._quiet(phase, devices, tolerance_mib, started)
                if isinstance(quiet, CheckResult):
                    return quiet
                first = quiet
            check = _Check(self, phase, devices, tolerance_mib, timeout, scan_cookies, dead_sessions,
                           self.reap_enabled if reap is None else reap, where, started, first)
            return check.run()
        except DeviceError as exc:
            if not device_errors:
                raise
            if isinstance(exc, DeviceLost):
                self.last_lost = exc
            if check is None:  # (the first reading failed: nothing was reaped yet)
                check = _Check(self, phase, devices, tolerance_mib, timeout, scan_cookies, dead_sessions,
                               self.reap_enabled if reap is None else reap, where, started)
            return check.unreadable(exc)

    def _quiet(self, phase: Phase, devices: Sequence[DeviceInfo], tolerance_mib: int, started: float
               ) -> CheckResult | tuple[tuple[DeviceSnapshot, ...], list[Found] | None]:
        """The clean path's result, if nothing at all is there: no process of ours alive, and every device
        idle (no process listed, no memory used). It is what a check's rounds conclude then, without
        their bookkeeping (a ``_Check`` and its dozen containers), which is most of a clean check's cost.
        Otherwise the readings taken, for the check's first round."""
        snaps = self.snapshot(devices)
        found: list[Found] | None = None
        # (C-level passes, no frame per device: a device with processes listed or memory used is busy)
        if not any(map(_LISTED, snaps)) and not any(map(_USED, snaps)):
            found = self.procs.take()
        if found is None or found:
            return snaps, found
        self.outside.forget(d.uuid for d in devices)  # what held them from outside is gone
        waited = time.monotonic() - started
        return CheckResult(phase=phase, clean=True, devices=snaps, offenders=(), waited_s=waited,
                           clean_after_s=waited, tolerance_mib=tolerance_mib)

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

    # ---- reaping -------------------------------------------------------------------------------

    def reap(self, ours: Sequence[Found], snaps: Sequence[DeviceSnapshot], devices: Sequence[DeviceInfo],
             notes: list[str], everyone: Sequence[Found] = (), kill_first: bool = False) -> list[Reaped]:
        """Kill ``ours`` (TERM, grace, KILL; or KILL at once), then wait until the driver lets them go."""
        infos = {f.pid: processes.describe(f.pid, f.start_ticks) for f in ours}
        safe: list[Found] = []
        for f in ours:
            info = infos[f.pid]
            relay = self._relays_to_others(f, info, everyone or ours)
            if relay is None and decide.may_signal(f.pid, None if info is None else info.uid,
                                                   self.never_touch, self.uid, self.is_protected(f)):
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
        return [reaping.reaped_record(infos[f.pid], f.pid, self.owner_of(f), f.found_by, ended[f.pid],
                                      decide.mib_of(f.pid, snaps)) for f in safe]

    def kill_and_confirm(self, targets: Sequence[processes.KillTarget], devices: Sequence[DeviceInfo],
                         holders: set[int], kill_first: bool = False
                         ) -> tuple[dict[int, tuple[processes.KillOutcome, float | None]], float | None]:
        """The reap ladder (``reaping.kill_and_confirm``) with this checker's grace, devices and hurry."""
        return reaping.kill_and_confirm(targets, devices, holders, read=self.snapshot, grace=self.grace,
                                        hurry=self.hurry, kill_first=kill_first)

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
        census = self.census(scan_cookies=True)
        for f in census:
            if not f.live:
                # Exited, holding nothing: collected (if ours to wait for), not reported as a leftover.
                processes.reap_if_child(f.pid)
        found = decide.of_the_sweep(census, (PREEXISTING,) if include_session else (PREEXISTING, SESSION))
        if not found or not self.reap_enabled:
            return []
        return self._reap_unread(found, devices)

    def _reap_unread(self, found: list[Found], devices: Sequence[DeviceInfo],
                     notes: list[str] | None = None) -> list[Reaped]:
        """Reap ``found`` at the session's edges: the devices only time the release, and one that cannot be
        read (a GPU lost at the end) does not stop it."""
        notes = [] if notes is None else notes
        try:
            snaps = self.snapshot(devices)
        except DeviceError:
            snaps, devices = (), ()
        try:
            return self.reap(found, snaps, devices, notes, everyone=found)
        except DeviceError:
            return self.reap(found, (), (), notes, everyone=found)

    def end_declared_helpers(self, devices: Sequence[DeviceInfo]) -> list[Reaped]:
        """At the very end (after every ``pytest_unconfigure``): end the helpers that only
        ``--gpuclean-helpers`` vouched for and that are still alive: they served the pytest process, which is
        about to exit, and nothing else would end them. A library's own helpers are left to the shutdown
        their library registered for the process's exit."""
        alive: list[Found] = []
        for (pid, start_ticks), handle in list(self.procs.declared_helpers.items()):
            if handle.exited() or not procfs.is_live(pid, start_ticks):
                continue
            alive.append(Found(pid, start_ticks, 1, "descendant", SESSION, "R", handle))
        self.procs.declared_helpers.clear()
        if not alive or not self.reap_enabled:
            return []
        return self._reap_unread(alive, devices)

    def dead_session_debris(self) -> list[Found]:
        """Live processes of this user whose cookie names a gpuclean session that provably died."""
        return [f for f in self.census(dead_sessions=True) if f.debris_of is not None and f.live]

    def reap_dead_sessions(self, devices: Sequence[DeviceInfo]) -> tuple[list[Reaped], list[str]]:
        """Reap the debris of dead sessions now (an xdist controller, when a worker crashed)."""
        debris = self.dead_session_debris() if self.dead_sessions else []
        if not debris or not self.reap_enabled:
            return [], []
        notes: list[str] = []
        return self._reap_unread(debris, devices, notes), notes

    def survivors(self) -> list[ProcessInfo]:
        """Processes of this session still alive (what the final sweep would reap)."""
        infos = (processes.describe(f.pid, f.start_ticks)
                 for f in decide.of_the_sweep(self.census(scan_cookies=True), (PREEXISTING, SESSION)))
        return [info for info in infos if info is not None]

    def no_part_of_the_session(self) -> list[ProcessInfo]:
        """Processes under us that are no part of the session (they, or the process that started them,
        existed before it), still alive: left alone."""
        infos = (processes.describe(f.pid, f.start_ticks) for f in self.census()
                 if f.live and f.token == PREEXISTING)
        return [info for info in infos if info is not None]


class _Check:
    """One check: observe (the readings, sorted by ``decide.sort_census``), collect zombies, let leftovers
    settle, reap (``Checker.reap``), and give the verdict (the offenders; ``outside.outside_of`` and
    ``known_outside``; ``decide.hopeless``: whether to look again)."""

    def __init__(self, checker: Checker, phase: Phase, devices: Sequence[DeviceInfo], tolerance_mib: int,
                 timeout: float, scan_cookies: bool, dead_sessions: bool, reap: bool,
                 where: str = "an earlier check", started: float | None = None,
                 first: tuple[tuple[DeviceSnapshot, ...], list[Found] | None] | None = None) -> None:
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
        self.started = time.monotonic() if started is None else started
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
        self._first = first
        """The readings ``Checker._quiet`` took, for the first round."""
        self.siblings: dict[tuple[int, int], SiblingUse] = {}
        """Processes of live sibling xdist workers seen on these devices, by identity."""
        self.peers: set[int] = set()
        """Sibling xdist workers themselves seen on these devices (their own CUDA contexts)."""

    def run(self) -> CheckResult:
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

    def observe(self) -> None:
        c = self.c
        first, self._first = self._first, None
        self.snaps = first[0] if first is not None else c.snapshot(self.devices)
        self.self_cuda = set()
        listed = {p.pid for s in self.snaps for p in s.processes}
        if first is not None and first[1] is not None:
            self.found = first[1]
        else:
            self.found = c.procs.take(self.scan_cookies, self.dead_sessions, listed)
        # Scanned once, unless it found debris: looked for again while there is some, so that a later look
        # in this check (after the settle time) still sees it as the dead session's.
        self.dead_sessions = self.dead_sessions and any(f.debris_of is not None for f in self.found)
        procs = c.procs
        # Our ancestors (an outer pytest running this session, a launcher) are us as far as the GPU
        # goes: their contexts are excused like our own; they are never killed either. So are the pytest
        # process's helpers (they hold no GPU memory: the census judges one that does) and what is meant to
        # outlive the session (persistent: a warm model server's memory is its own, said once). Of unknown
        # birth: no evidence says which test made it, so it is reported, never signalled.
        self.ours, self.unknown, excused, unexplained = decide.sort_census(
            self.found, procs.is_protected, procs.never_touch, procs.helpers.keys() | procs.persistent.keys(),
            listed)
        if unexplained and (persistent := procs.persistent_of(unexplained)):
            procs.persistent.update(persistent)
            excused |= persistent.keys()
            unexplained -= persistent.keys()
        peers = procs.peer_pids(unexplained)
        self.peers |= peers
        excused |= peers
        # What a live sibling worker's test (or fixture) started is that worker's to reap: waiting for it
        # here, while this test holds the GPU locks that the sibling needs for its next check, would only
        # stall both. Named in the notes, and a finding of the test that started it (testcheck.py).
        siblings = procs.siblings(unexplained - excused)
        for pid, sibling in siblings.items():
            self._saw_sibling(pid, sibling)
        excused |= siblings.keys()
        self.unexplained = unexplained - excused
        self.excused = excused
        # Our own CUDA context's unlisted overhead must not trigger the cookie scan on every check of a
        # pytest process that uses the GPU itself.
        self.overhead, short = decide.listed_overhead(self.snaps, excused)
        if short:
            self.overhead.update(self._context_overhead(short, excused))

    def _context_overhead(self, short: list[decide.Short], excused: set[int]) -> dict[str, int]:
        """The unlisted memory excused where the listed contexts fall short: asks which excused processes
        use CUDA there unlisted. Reading /proc/<pid>/fd costs a syscall per descriptor: only off the clean
        path, once per poll, and for the other excused processes only if this one does not explain it all."""
        backend, me = self.c.backend, self.c.procs.me
        users: dict[int, frozenset[str]] = {}
        if backend is not None:
            users.update(backend.cuda_users([me]))
            if decide.short_of_users(short, users):
                users.update(backend.cuda_users(sorted(excused - {me})))
        return decide.context_overhead(short, users, me, self.self_cuda)

    def _saw_sibling(self, pid: int, sibling: Sibling) -> None:
        # Described once per check (the check polls while something else keeps it dirty); what it held
        # is the most it was seen with.
        held = decide.mib_of(pid, self.snaps)
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
        True if it waited, so the caller looks again before any signal: what exited is collected, and a child
        that was still between its fork and its exec when the check began now shows its command line (a
        helper or persistent process named by one)."""
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
        return True

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
        offenders = self.offenders(self.snaps, self.ours, self.unexplained, self.excused, self.tolerance,
                                   self.overhead, self.reap_enabled)
        offenders.extend(self.unknown_offenders(self.unknown, self.snaps))
        for o in offenders:
            if o.reason == "leaked" and o.process is not None:
                self.first_seen.setdefault((o.process.pid, o.process.start_ticks), o)
        waited = time.monotonic() - self.started
        # Processes that survived our SIGKILL, or that we may not signal, do not go away by waiting.
        unsignalled = {f.key for f in self.unknown} | {
            f.key for f in self.ours if f.key in self.attempted}
        # Nor does an outside state that an earlier check already waited out, and finds again unchanged.
        outside, states, clean = outside_of(offenders, self.snaps, self.devices, self.excused, self.found,
                                            self.unexplained, self.overhead, self.tolerance,
                                            self.c.procs.of_our_run, _start_ticks)
        known = known_outside(states, self.c.outside.load() if states else {}, self.outside_seen,
                              max(self.tolerance, OUTSIDE_SLACK_BYTES), time.monotonic(), self.timeout,
                              self.where)
        hopeless = decide.hopeless(offenders, unsignalled, outside, known)
        if offenders and not hopeless and waited < self.timeout:
            return None
        outside_found = self._remember_outside(offenders, outside, states, clean, known,
                                               waited_out=not hopeless)
        if fresh and self.rounds >= MAX_REAP_ROUNDS:
            self.notes.append(f"gave up after {self.rounds} reaping rounds: killed processes keep being "
                              f"replaced (a process pool or supervisor outside our reach?)")
        still = {(o.process.pid, o.process.start_ticks) for o in offenders if o.process is not None}
        lingered = tuple(
            o.replace(detail=f"outlived its test, ended by itself within {waited:.2f}s "
                                "(reaping is off)")
            for key, o in self.first_seen.items() if key not in still)
        me = c.procs.me
        siblings = tuple(self.siblings.values())
        notes = [*self.notes, *(
            f"pid {u.process.pid}: in use by {u.describe()} ({report_mib(u.mib_per_device)}); another worker "
            f"of this xdist run: not waited for, never signalled (its worker reaps it if it was leaked)"
            for u in siblings), *(
            f"pid {pid}: another worker of this xdist run, its pytest process itself "
            f"({report_mib(decide.mib_of(pid, self.snaps)) or 'no memory now'}): excused like our own"
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
        procs = c.procs
        self.ours, self.unknown, _, _ = decide.sort_census(self.found, procs.is_protected, (), (), set())
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
        offenders = self.offenders(snaps, self.ours, set(), set(), self.tolerance,
                                   {s.device.uuid: s.used_bytes for s in snaps}, self.reap_enabled)
        offenders.extend(self.unknown_offenders(self.unknown, snaps))
        return CheckResult(
            phase=self.phase, clean=False, devices=tuple(snaps), offenders=tuple(offenders),
            collected=tuple(self.collected), reaped=tuple(self.reaped),
            waited_s=time.monotonic() - self.started, notes=tuple(self.notes),
            tolerance_mib=self.tolerance_mib, error=error.describe(),
            device_lost=isinstance(error, DeviceLost))

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

    def offenders(self, snaps: Sequence[DeviceSnapshot], ours: Sequence[Found], foreign: set[int],
                   excused: set[int], tolerance: int, overhead: dict[str, int],
                   reap_enabled: bool) -> list[Offender]:
        c = self.c
        offenders: list[Offender] = []
        ignored: set[int] = set()
        for pid in sorted(foreign):
            info = processes.describe(pid)
            if info is not None and c.ignore and processes.matches_any(info.cmdline, c.ignore):
                ignored.add(pid)
                continue
            offenders.append(Offender("foreign", info or reaping.vanished(pid), None, "gpu",
                                      decide.mib_of(pid, snaps),
                                      detail="not started by this session: waited for, never killed"))
        for f in ours:
            info = processes.describe(f.pid, f.start_ticks)
            if info is None:
                continue
            offenders.append(Offender("leaked", info, c.owner_of(f), f.found_by, decide.mib_of(f.pid, snaps),
                                      detail=decide.leak_detail(info.uid, info.user, info.state, c.uid,
                                                                reap_enabled)))
        blamed = {o.process.pid for o in offenders if o.process is not None}
        for snap, extra in decide.excess_memory(snaps, excused, overhead, tolerance, blamed):
            holders = sorted(ignored & {p.pid for p in snap.processes})
            by = f"allowlisted pid(s) {holders}" if holders else "no process we can see"
            offenders.append(Offender(
                "memory", None, None, "gpu", ((snap.device.label, extra / MIB),),
                detail=f"{extra / MIB:.0f} MiB used on {snap.device.label} beyond the tolerance "
                       f"of {tolerance / MIB:.0f} MiB, held by {by}"))
        if c.host_scope:
            exclude = c.never_touch | excused | ignored | foreign | blamed | {f.pid for f in ours}
            strays = set(processes.stray_python_processes(c.uid, exclude, c.ignore))
            strays -= c.procs.peer_pids(strays)
            # What our xdist siblings run is theirs, as on the GPUs (``Census.siblings``).
            for pid in sorted(strays - c.procs.siblings(strays).keys()):
                info = processes.describe(pid)
                if info is not None:
                    offenders.append(Offender(
                        "host", info, None, "host", (),
                        detail="Python process of this user (host scope): never killed"))
        return offenders

    def unknown_offenders(self, unknown: Sequence[Found], snaps: Sequence[DeviceSnapshot]) -> list[Offender]:
        offenders: list[Offender] = []
        for f in unknown:
            info = processes.describe(f.pid, f.start_ticks)
            if info is not None:
                offenders.append(Offender(
                    "leaked", info, UNKNOWN_OWNER, f.found_by, decide.mib_of(f.pid, snaps),
                    detail="no evidence of which test or fixture started it: left alone, never signalled"))
        return offenders

    def _collect(self, f: Found, info: ProcessInfo | None, how: EndedBy) -> None:
        # One of ours that ended without being killed: reported in the summary, not a leak.
        self.collected_ids.add(f.key)
        self.collected.append(Reaped(info or reaping.vanished(f.pid), self.c.owner_of(f), f.found_by, how, (),
                                     None))


def _start_ticks(pid: int) -> int:
    """When ``pid`` started (clock ticks since boot), as an outside holder's identity; 0 for a process we
    cannot see (another PID namespace's, listed by the driver) or that has exited (the driver is giving
    its memory back: not the state an earlier check waited out)."""
    stat = procfs.read_stat(pid)
    return 0 if stat is None or not procfs.live_state(pid, stat.state) else stat.start_ticks
