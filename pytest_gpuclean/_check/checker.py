"""The session's checker: what lasts from one check to the next, the clean path, and reaping what is
provably the session's.

``Checker.check`` answers a clean check itself (``_quiet``: every device idle, nothing of ours alive);
otherwise it runs a ``check.Check``: readings -> snapshot -> verdict -> action, pass after pass. The
checker holds the census (``census.py``), the device backend, what was waited out from outside
(``outside.py``), and the reaping (``reap``: what may be signalled, the one gate ``gate``; the ladder,
``reaping.py``) that a check and the session's edges (the final sweep, a dead session's debris) share.
No pytest here: the plugin and the ``gpuclean`` command line drive the same ``Checker``.
"""

from __future__ import annotations

import contextlib
import operator
import os
import time
from collections.abc import Callable, Collection, Sequence

from pytest_gpuclean._check import decisions, reaping
from pytest_gpuclean._check.decisions import Snapshot, Verdict, leak_detail, mib_of
from pytest_gpuclean._check.outside import OutsideMemory
from pytest_gpuclean._check.passes import POLL_S, Check, Look, respawned_note
from pytest_gpuclean._model.outcomes import CheckResult
from pytest_gpuclean._model.records import (
    CensusEntry,
    DeviceInfo,
    DeviceSnapshot,
    EndedBy,
    Offender,
    Owner,
    Phase,
    ProcessInfo,
    Reaped,
    SiblingUse,
)
from pytest_gpuclean._ownership.census import Census, Found, Registry, Sibling
from pytest_gpuclean._ownership.cookie import new_session_id
from pytest_gpuclean._ownership.evidence import PREEXISTING, SESSION, Ownership
from pytest_gpuclean._reading import processes, procfs
from pytest_gpuclean._reading.backends import Backend
from pytest_gpuclean._reading.devices import DeviceError, DeviceLost
from pytest_gpuclean._settings import DEFAULT_GRACE_S
from pytest_gpuclean.report.text import one_line

__all__ = [
    "MAX_FREEZE_PASSES",
    "Checker",
]


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
        self.before_grace: Callable[[list[int], float], None] | None = None
        """Told the pids about to get SIGTERM and the grace they get before SIGKILL, first (the sweep after
        an interrupt says at once what it waits for)."""
        self._debris_checked = False
        self.left_alone: dict[tuple[int, int], str] = {}
        """Processes of ours the gate refused (``gate``), by identity: why, for the verdict."""
        self._clean_again: CheckResult | None = None
        """The last clean check whose only GPU users were this process and its ancestors (the pytest
        process's own CUDA context): the same readings with nothing of ours alive are the same verdict."""
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
        as they are first seen, and what a device reading could not trust (``Backend.notices``); taken by
        whoever reports them."""
        backend = self.backend
        if backend is not None and backend.notices:
            self.procs.notices.extend(backend.notices)
            backend.notices.clear()
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
              device_errors: bool = False, where: str = "an earlier check",
              known: Collection[tuple[int, int]] = ()) -> CheckResult:
        """Check until clean or ``timeout``; reap what is ours first (if enabled). ``where`` names this
        check to later ones that find the same outside state (a test's node id). ``known``: leaks an earlier
        check found and left (reaping off), by (pid, start ticks): found alone, they are not waited for.

        A device that cannot be read raises ``DeviceError``; with ``device_errors`` it ends the check
        instead, not clean, with the error (``CheckResult.error``) and what was reaped without readings.
        """
        started = time.monotonic()
        dead_sessions = self.dead_sessions and not self._debris_checked
        self._debris_checked = True  # at start-up once; later only when something is unexplained
        self.last_lost = None
        first: tuple[tuple[DeviceSnapshot, ...], bool] | None = None
        check: Check | None = None
        try:
            if not (scan_cookies or dead_sessions or self.host_scope):
                quiet = self._quiet(phase, devices, tolerance_mib, started)
                if isinstance(quiet, CheckResult):
                    return quiet
                first = quiet
            check = Check(self, phase, devices, tolerance_mib, timeout, scan_cookies, dead_sessions,
                          self.reap_enabled if reap is None else reap, where, started, first, known)
            result = check.run()
            self._clean_again = result if self._only_ours(result) else None
            return result
        except DeviceError as exc:
            if not device_errors:
                raise
            if isinstance(exc, DeviceLost):
                self.last_lost = exc
            if check is None:  # (the first reading failed: nothing was reaped yet)
                check = Check(self, phase, devices, tolerance_mib, timeout, scan_cookies, dead_sessions,
                              self.reap_enabled if reap is None else reap, where, started)
            return check.unreadable(exc)

    def _quiet(self, phase: Phase, devices: Sequence[DeviceInfo], tolerance_mib: int, started: float
               ) -> CheckResult | tuple[tuple[DeviceSnapshot, ...], bool]:
        """The clean path's result, if nothing at all is there: no process of ours alive, and every device
        idle (no process listed, no memory used). It is what a check's passes conclude then, without
        their bookkeeping (a ``Check`` and its dozen containers), which is most of a clean check's cost.
        Otherwise the readings taken, for the check's first pass, and whether the census was taken too
        (``Census.last``)."""
        snaps = self.snapshot(devices)
        found: list[Found] | None = None
        # (C-level passes, no frame per device: a device with processes listed or memory used is busy)
        if not any(map(_LISTED, snaps)) and not any(map(_USED, snaps)):
            found = self.procs.take()
        else:
            again = self._clean_again
            # The pytest process's own CUDA context keeps its devices busy: readings equal to those a
            # clean check judged (the backend gives an unchanged reading as the very same object) with
            # nothing of ours alive are that verdict again, without a check's passes.
            if (again is not None and again.tolerance_mib == tolerance_mib
                    and len(snaps) == len(again.devices) and all(map(operator.is_, snaps, again.devices))):
                found = self.procs.take()
                if not found:
                    waited = time.monotonic() - started
                    return again._replace(phase=phase, waited_s=waited, clean_after_s=waited)
        if found is None or found:
            return snaps, found is not None
        self.outside.forget(d.uuid for d in devices)  # what held them from outside is gone
        waited = time.monotonic() - started
        return CheckResult(phase=phase, clean=True, devices=snaps, offenders=(), waited_s=waited,
                           clean_after_s=waited, tolerance_mib=tolerance_mib)

    def _only_ours(self, result: CheckResult) -> bool:
        """Whether ``result`` is clean with nothing on its devices but this process's and its ancestors'
        use, and nothing done or said on the way (the verdict a repeat of its readings may take over)."""
        if not result.clean or result.reaped or result.collected or result.notes or result.siblings or (
                result.outside is not None or result.lingered or result.cluster is not None):
            return False
        mine = self.never_touch
        return all(p.pid in mine for s in result.devices for p in s.processes)

    # ---- reading a pass of a check (``check.Check``) --------------------------------------------

    def observe(self, look: Look) -> Snapshot:
        """Every fact one pass of a check decides on. The devices and the census first, sorted against
        each other; what holds a GPU that the session's tree does not explain makes the census look wider
        (our cookie anywhere, a dead session's debris) and the pass read again. Then what only the verdict
        needs (``_snapshot``)."""
        procs = self.procs
        while True:
            first, look.first = look.first, None
            readings = first[0] if first is not None else self.snapshot(look.devices)
            listed = {p.pid for s in readings for p in s.processes}
            found = procs.last if first is not None and first[1] else procs.take(
                look.scan_cookies, look.dead_sessions, listed)
            # Scanned once, unless it found debris: looked for again while there is some, so that a later
            # look in this check (after the settle time) still sees it as the dead session's.
            look.dead_sessions = look.dead_sessions and any(f.debris_of is not None for f in found)
            # Our ancestors (an outer pytest running this session, a launcher) are us as far as the GPU
            # goes: their contexts are excused like our own; they are never killed either. So are the pytest
            # process's helpers (they hold no GPU memory: the census judges one that does) and what is meant
            # to outlive the session (persistent: a warm model server's memory is its own, said once). Of
            # unknown birth: no evidence says which test made it, so it is reported, never signalled.
            sort = decisions.sort_census(found, procs.is_protected, procs.never_touch,
                                      procs.helpers.keys() | procs.persistent.keys(), listed)
            ours, unknown, excused, unexplained = sort.ours, sort.unknown, sort.excused, sort.unexplained
            if unexplained and (persistent := procs.persistent_of(unexplained)):
                procs.persistent.update(persistent)
                excused |= persistent.keys()
                unexplained -= persistent.keys()
            peers = procs.peer_pids(unexplained)
            look.peers |= peers
            excused |= peers
            # What a live sibling worker's test (or fixture) started is that worker's to reap: waiting for it
            # here, while this test holds the GPU locks that the sibling needs for its next check, would only
            # stall both. Named in the notes, and a finding of the test that started it (testcheck.py).
            siblings = procs.siblings(unexplained - excused)
            for pid, sibling in siblings.items():
                _saw_sibling(look, pid, sibling, readings)
            excused |= siblings.keys()
            unexplained -= excused
            # Our own CUDA context's unlisted overhead must not widen the census on every check of a pytest
            # process that uses the GPU itself.
            self_cuda: set[str] = set()
            overhead, short = decisions.listed_overhead(readings, excused)
            if short:
                overhead.update(self._context_overhead(short, excused, self_cuda))
            unexplained_use = decisions.unexplained_use(readings, unexplained, excused, overhead,
                                                        look.tolerance)
            if look.scan_cookies or not unexplained_use:
                break
            look.scan_cookies = True
            look.dead_sessions = self.dead_sessions
        return self._snapshot(look, readings, found, ours, unknown, excused, unexplained, overhead, self_cuda,
                              maybe_outside=unexplained_use, strays=self.host_scope)

    def observe_unread(self, look: Look, readings: tuple[DeviceSnapshot, ...]) -> Snapshot:
        """A check that cannot read every device (``readings``: those it can), before it acts: no reading
        says whether something outside our tree holds a GPU, so the census looks for our cookie everywhere,
        and only what is ours can be judged: nothing is excused, and each device's whole use is overhead (no
        memory offender)."""
        found = self.procs.take(scan_cookies=True)
        sort = decisions.sort_census(found, self.procs.is_protected, (), (), set())
        return self._snapshot(look, readings, found, sort.ours, sort.unknown, set(), set(),
                              {s.device.uuid: s.used_bytes for s in readings}, set(), maybe_outside=False,
                              strays=False)

    def observe_left(self, look: Look, seen: Snapshot, ours: Sequence[CensusEntry], recount: bool
                     ) -> Snapshot:
        """The same check after it acted: what is left of ``ours`` (its processes not collected meanwhile),
        alive in a new census if it reaped (``recount``), and ``seen``'s processes of unknown birth, as they
        are now."""
        if recount:
            left = {f.key for f in self.procs.take(scan_cookies=True) if f.live}
            ours = [f for f in ours if f.key in left]
        return self._snapshot(look, seen.readings, seen.census, self.procs.pinned(ours), seen.unknown,
                              set(), set(), dict(seen.overhead), set(), maybe_outside=False,
                              strays=self.host_scope)

    def _snapshot(self, look: Look, readings: tuple[DeviceSnapshot, ...], found: Sequence[CensusEntry],
                  ours: list[Found], unknown: Sequence[CensusEntry], excused: set[int],
                  unexplained: set[int], overhead: dict[str, int], self_cuda: set[str], maybe_outside: bool,
                  strays: bool) -> Snapshot:
        """A pass's snapshot: the census as sorted, and what the verdict needs to know of each process
        (``maybe_outside``: something may be from outside the session, so what earlier checks waited out is
        read; ``strays``: under host scope, this user's other Python processes are looked for)."""
        procs = self.procs
        # Who each process is (loops, not comprehensions: a check of a GPU that this process uses itself has
        # none, and builds nothing for them).
        described: dict[tuple[int, int], ProcessInfo] = {}
        vanished: dict[tuple[int, int], ProcessInfo] = {}
        owners: dict[tuple[int, int], Owner] = {}
        for f in ours:
            info = processes.describe(f.pid, f.start_ticks)
            if info is not None:
                described[f.key] = info
            else:
                vanished[f.key] = reaping.vanished(f.pid)
            owners[f.key] = procs.owner_of(f)
        for e in unknown:
            info = processes.describe(e.pid, e.start_ticks)
            if info is not None:
                described[e.key] = info
        foreign: list[ProcessInfo] = []
        allowlisted: set[int] = set()
        for pid in sorted(unexplained):
            info = processes.describe(pid)
            if info is not None and self.ignore and processes.matches_any(info.cmdline, self.ignore):
                allowlisted.add(pid)
            else:
                foreign.append(info or reaping.vanished(pid))
        python_strays: list[ProcessInfo] = []
        if strays:
            exclude = procs.never_touch | excused | unexplained | {f.pid for f in ours if f.live}
            python = set(processes.stray_python_processes(self.uid, exclude, self.ignore))
            python -= procs.peer_pids(python)
            # What our xdist siblings run is theirs, as on the GPUs (``Census.siblings``).
            python_strays = [info for pid in sorted(python - procs.siblings(python).keys())
                             if (info := processes.describe(pid)) is not None]
        return Snapshot(
            readings, tuple(found), tuple(ours), tuple(unknown), frozenset(excused), frozenset(unexplained),
            overhead, described, vanished, owners, tuple(foreign), frozenset(allowlisted),
            tuple(python_strays),
            frozenset([info.pid for info in foreign if procs.of_our_run(info.pid)] if foreign else ()),
            {pid: _start_ticks(pid) for pid in unexplained} if unexplained else {},
            self.outside.load() if maybe_outside else {}, tuple(look.siblings.values()),
            frozenset(look.peers), frozenset(self_cuda), procs.me, self._left_alone_of(ours))

    def _left_alone_of(self, ours: Sequence[Found]) -> dict[tuple[int, int], str]:
        """Of ``ours``, what the gate refused so far, and why."""
        refused = self.left_alone
        return {f.key: refused[f.key] for f in ours if f.key in refused} if refused else {}

    def _context_overhead(self, short: list[decisions.Short], excused: set[int], self_cuda: set[str]
                          ) -> dict[str, int]:
        """The unlisted memory excused where the listed contexts fall short: asks which excused processes
        use CUDA there unlisted. Reading /proc/<pid>/fd costs a syscall per descriptor: only off the clean
        path, once per poll, and for the other excused processes only if this one does not explain it all."""
        backend, me = self.backend, self.procs.me
        users: dict[int, frozenset[str]] = {}
        if backend is not None:
            users.update(backend.cuda_users([me]))
            if decisions.short_of_users(short, users):
                users.update(backend.cuda_users(sorted(excused - {me})))
        return decisions.context_overhead(short, users, me, self_cuda)

    # ---- acting for a check ----------------------------------------------------------------------

    def reap_round(self, fresh: Sequence[CensusEntry], readings: Sequence[DeviceSnapshot],
                   devices: Sequence[DeviceInfo], notes: list[str], *, freeze: set[str | None] | None = None,
                   scan_cookies: bool = False) -> tuple[list[CensusEntry], list[Reaped]]:
        """A check's round of reaping ``fresh`` (as its snapshot names them: the last census's processes):
        with ``freeze`` (the owners whose processes keep reappearing), stopped first with whatever else of
        theirs appears, then killed at once. What it tried to signal, and the records."""
        targets = self.procs.pinned(fresh)
        if freeze is None:
            return list(targets), self.reap(targets, readings, devices, notes)
        frozen: dict[tuple[int, int], Found] = {}
        stopped: list[processes.KillTarget] = []
        try:
            found = self.freeze(targets, freeze, scan_cookies, notes, frozen, stopped)
            reaped = self.reap(list(frozen.values()), readings, devices, notes, kill_first=True)
        finally:
            processes.resume(stopped)  # what was stopped and not killed (an error on the way, a survivor)
        return [*targets, *found], reaped

    def remember(self, verdict: Verdict) -> None:
        """What a check waited out from outside, for the later checks; what is clean from outside now,
        forgotten."""
        if verdict.remember:
            self.outside.update(verdict.remember, forget=verdict.forget)
        else:
            self.outside.forget(verdict.forget)

    # ---- reaping -------------------------------------------------------------------------------

    def refusal(self, f: Found) -> str | None:
        """Why ``f`` may not be signalled now (``gate.refusal``; its credentials are read now, off the clean
        path); None: it may."""
        # (imported here: a session whose checks find nothing to signal never needs them)
        from pytest_gpuclean._check import gate
        from pytest_gpuclean._reading import credentials
        itself, protected = f.pid in self.never_touch, self.is_protected(f)
        facts = None if itself or protected else credentials.credentials(f.pid, f.start_ticks)
        return gate.refusal(facts, self.uid, itself=itself, protected=protected)

    def gate(self, found: Sequence[Found], notes: list[str]) -> list[Found]:
        """Of ``found``, what may be signalled: the one gate before every signal gpuclean sends, SIGSTOP
        included. Each process it refuses is named in ``notes`` (once), and remembered for the verdict
        (``left_alone``)."""
        allowed: list[Found] = []
        for f in found:
            why = self.refusal(f)
            if why is None:
                allowed.append(f)
                continue
            self.left_alone[f.key] = why
            info = processes.describe(f.pid, f.start_ticks)
            line = None if info is None else (
                f"left alone: pid {f.pid} (user {info.user}, {one_line(info.cmdline, 60)}): {why}")
            if line is not None and line not in notes:
                notes.append(line)
        return allowed

    def reap(self, ours: Sequence[Found], snaps: Sequence[DeviceSnapshot], devices: Sequence[DeviceInfo],
             notes: list[str], kill_first: bool = False) -> list[Reaped]:
        """Kill what of ``ours`` the gate lets through (TERM, grace, KILL; or KILL at once), then wait until
        the driver lets them go."""
        safe = self.gate(ours, notes)
        infos = {f.pid: processes.describe(f.pid, f.start_ticks) for f in safe}
        for f in safe:
            if f.debris_of is not None:
                notes.append(f"pid {f.pid}: left by {f.debris_of.describe()}")
        if self.before_grace is not None and safe and not kill_first and self.grace > 0:
            self.before_grace(sorted(f.pid for f in safe), self.grace)
        if any(f.depth == 1 for f in safe):
            notes.extend(reaping.shutdown_pools({f.pid for f in safe}, wait=self.grace))
        holders = {p.pid for s in snaps for p in s.processes} & {f.pid for f in safe}
        targets = [processes.KillTarget(f.pid, f.start_ticks, f.depth, f.handle) for f in safe]
        ended, _released = self.kill_and_confirm(targets, devices, holders, kill_first=kill_first)
        return [reaping.reaped_record(infos[f.pid], f.pid, self.owner_of(f), f.found_by, ended[f.pid],
                                      mib_of(f.pid, snaps)) for f in safe]

    def kill_and_confirm(self, targets: Sequence[processes.KillTarget], devices: Sequence[DeviceInfo],
                         holders: set[int], kill_first: bool = False
                         ) -> tuple[dict[int, tuple[processes.KillOutcome, float | None]], float | None]:
        """The reap ladder (``reaping.kill_and_confirm``) with this checker's grace, devices and hurry."""
        return reaping.kill_and_confirm(targets, devices, holders, read=self.snapshot, grace=self.grace,
                                        hurry=self.hurry, kill_first=kill_first)

    def freeze(self, targets: Sequence[Found], owners: set[str | None], scan_cookies: bool, notes: list[str],
               frozen: dict[tuple[int, int], Found], stopped: list[processes.KillTarget]) -> list[Found]:
        """SIGSTOP ``targets`` and whatever else of the same ``owners`` appears, until nothing new does: into
        ``frozen`` (what is to be killed) and ``stopped`` (what this stopped, the caller's to SIGCONT if it
        does not kill it). A stopped process forks no more, so the set stops growing. Returns what appeared
        besides ``targets``, whether the gate let it through or not (it was considered).

        Each process passes the gate before it is stopped, and again once stopped: one that became a relay
        between the two (it started another user's process) is continued and left alone.
        """
        seen = {f.key for f in targets}
        appeared: list[Found] = []
        batch = self.gate(targets, notes)
        for _ in range(MAX_FREEZE_PASSES):
            now_stopped = processes.stop([processes.KillTarget(f.pid, f.start_ticks, f.depth, f.handle)
                                          for f in batch])
            stopped.extend(now_stopped)
            allowed = {f.key for f in self.gate(batch, notes)}
            processes.resume([t for t in now_stopped if (t.pid, t.start_ticks) not in allowed])
            frozen.update((f.key, f) for f in batch if f.key in allowed)
            new = [f for f in self.census(scan_cookies=scan_cookies)
                   if f.key not in seen and f.live and not self.is_protected(f) and f.token in owners]
            if not new:
                break
            seen.update(f.key for f in new)
            appeared.extend(new)
            batch = self.gate(new, notes)
        return appeared

    def check_owned(self, tokens: Collection[str], devices: Sequence[DeviceInfo]) -> CheckResult:
        """What ``tokens`` (fixtures that just ended) left alive, judged without a test's check around it (the
        test that ended them was not checked after): given the settle time to exit by themselves, then reaped
        if reaping is on, as at the session's edges (``_reap_unread``). The devices are read only for what
        each held and to time its release, never judged: no GPU lock is held, so another job's memory there
        is none of this check's business. The census walks the session's tree (where this subreaper keeps
        what double-forked), not all of /proc: a module's end costs what a clean check costs; what left the
        tree is the final sweep's."""
        started = time.monotonic()
        found = [f for f in self.census()
                 if f.token in tokens and f.debris_of is None and not self.is_protected(f)]
        if not found:
            return CheckResult("teardown", True, (), (), waited_s=time.monotonic() - started)
        infos = {f.key: processes.describe(f.pid, f.start_ticks) or reaping.vanished(f.pid) for f in found}
        collected: list[Reaped] = []

        def gone(f: Found, how: EndedBy) -> None:
            processes.reap_if_child(f.pid)
            collected.append(Reaped(infos[f.key], self.owner_of(f), f.found_by, how, (), None))

        for f in found:
            if not f.live:
                gone(f, "reaped zombie")
        live = [f for f in found if f.live]
        deadline = time.monotonic() + self.settle
        while live and time.monotonic() < deadline:
            time.sleep(POLL_S)
            for f in [f for f in live if f.exited()]:
                live.remove(f)
                gone(f, "exited by itself")
        notes: list[str] = []
        reaped = self._reap_unread(live, devices, notes) if live and self.reap_enabled else []
        snaps: tuple[DeviceSnapshot, ...] = ()
        with contextlib.suppress(DeviceError):  # (the devices as they are now: what was ended is released)
            snaps = self.snapshot(devices)
        ended = {(r.process.pid, r.process.start_ticks) for r in reaped if r.ended_by != "survived"}
        left = tuple(Offender("leaked", infos[f.key], self.owner_of(f), f.found_by, mib_of(f.pid, snaps),
                              leak_detail(infos[f.key].uid, infos[f.key].user, infos[f.key].state, self.uid,
                                          self.reap_enabled))
                     for f in live if f.key not in ended)
        waited = time.monotonic() - started
        return CheckResult("teardown", not left, snaps, left, tuple(reaped), waited, None if left else waited,
                           tuple(notes), collected=tuple(collected))

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
        excluded = (PREEXISTING,) if include_session else (PREEXISTING, SESSION)
        found = decisions.of_the_sweep(census, excluded)
        # (what may descend from a process that is still protected is not provably the session's: never swept)
        found = [f for f in found if not self.is_protected(f)]
        if not found or not self.reap_enabled:
            return []
        return self._reap_unread(found, devices, again=lambda: decisions.of_the_sweep(
            self.census(scan_cookies=True), excluded))

    def _reap_unread(self, found: list[Found], devices: Sequence[DeviceInfo], notes: list[str] | None = None,
                     again: Callable[[], list[Found]] | None = None) -> list[Reaped]:
        """Reap ``found`` at the session's edges: the devices only time the release, and one that cannot be
        read (a GPU lost at the end) does not stop it. ``again`` finds what is left to reap now: what
        replaced itself meanwhile (a SIGTERM handler that forks, a chain) is frozen and SIGKILLed, round
        after round (at most ``MAX_REAP_ROUNDS``), as in a check: none of it outlives the session."""
        notes = [] if notes is None else notes
        try:
            snaps = self.snapshot(devices)
        except DeviceError:
            snaps, devices = (), ()
        try:
            reaped = self.reap(found, snaps, devices, notes)
        except DeviceError:
            snaps, devices = (), ()
            reaped = self.reap(found, snaps, devices, notes)
        done = {f.key for f in found}
        for round_no in range(2, decisions.MAX_REAP_ROUNDS + 1):
            new = [f for f in again() if f.key not in done] if again is not None else []
            if not new:
                break
            done.update(f.key for f in new)
            notes.append(respawned_note(round_no, new))
            owners = {f.token for f in new}
            try:
                reaped += self.reap_round(new, snaps, devices, notes, freeze=owners, scan_cookies=True)[1]
            except DeviceError:
                snaps, devices = (), ()
                reaped += self.reap_round(new, snaps, devices, notes, freeze=owners, scan_cookies=True)[1]
        return reaped

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
        return self._reap_unread(debris, devices, notes, again=self.dead_session_debris), notes

    def survivors(self) -> list[ProcessInfo]:
        """Processes of this session still alive (what the final sweep would reap)."""
        infos = (processes.describe(f.pid, f.start_ticks)
                 for f in decisions.of_the_sweep(self.census(scan_cookies=True), (PREEXISTING, SESSION))
                 if not self.is_protected(f))
        return [info for info in infos if info is not None]

    def no_part_of_the_session(self) -> list[ProcessInfo]:
        """Processes under us that are no part of the session (they, or the process that started them,
        existed before it), still alive: left alone."""
        infos = (processes.describe(f.pid, f.start_ticks) for f in self.census()
                 if f.live and f.token == PREEXISTING)
        return [info for info in infos if info is not None]


def _saw_sibling(look: Look, pid: int, sibling: Sibling, readings: Sequence[DeviceSnapshot]) -> None:
    # Described once per check (the check polls while something else keeps it dirty); what it held is the
    # most it was seen with.
    held = mib_of(pid, readings)
    known = next((u for u in look.siblings.values() if u.process.pid == pid), None)
    if known is not None:
        if sum(m for _, m in held) > sum(m for _, m in known.mib_per_device):
            look.siblings[(pid, known.process.start_ticks)] = known._replace(mib_per_device=held)
        return
    info = processes.describe(pid)
    if info is not None:
        look.siblings[(info.pid, info.start_ticks)] = SiblingUse(info, sibling.owner, sibling.worker, held)


def _start_ticks(pid: int) -> int:
    """When ``pid`` started (clock ticks since boot), as an outside holder's identity; 0 for a process we
    cannot see (another PID namespace's, listed by the driver) or that has exited (the driver is giving
    its memory back: not the state an earlier check waited out)."""
    stat = procfs.read_stat(pid)
    return 0 if stat is None or not procfs.live_state(pid, stat.state) else stat.start_ticks
