"""The session's checker, and one check, pass after pass: observe, decide, act.

``_clean_path`` answers a clean check alone; otherwise ``_Passes`` observes a ``decisions.Snapshot``,
decides (``decisions.py`` reads nothing) and acts until a verdict. No pytest here: the plugin and the
``gpuclean`` command drive the same ``Checker``."""

from __future__ import annotations

import contextlib
import operator
import os
import time
from collections.abc import Callable, Collection, Sequence
from typing import NamedTuple

from pytest_gpuclean._check import decisions, reaping
from pytest_gpuclean._check.decisions import (
    MAX_REAP_ROUNDS,
    Identities,
    Judge,
    Key,
    Others,
    OwnUse,
    Snapshot,
    Verdict,
    leak_detail,
    mib_of,
    offenders,
)
from pytest_gpuclean._check.outside import OutsideMemory
from pytest_gpuclean._model.records import (
    MIB,
    CheckResult,
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
from pytest_gpuclean._ownership.census import Census, CensusEntry, Sibling
from pytest_gpuclean._ownership.evidence import PREEXISTING, SESSION
from pytest_gpuclean._reading import processes, procfs
from pytest_gpuclean._reading.backends import Backend
from pytest_gpuclean._reading.devices import DeviceError, DeviceLost
from pytest_gpuclean._settings import DEFAULT_GRACE_S
from pytest_gpuclean.report.text import mib_list, one_line

POLL_S = 0.02
SETTLE_POLL_S = 0.005
AT_REST_S = 0.02
"""Leftovers all off every CPU this long end the settle time early: a process exiting by itself runs on its
way out."""
MAX_FREEZE_PASSES = 20
"""A stopped process forks no more, so freezing ends after as many passes as the tree is deep."""
_LISTED = operator.attrgetter("processes")
_USED = operator.attrgetter("used_bytes")


class CheckSettings(NamedTuple):
    """The options that shape every check of a checker."""

    reap: bool = True
    grace: float = DEFAULT_GRACE_S
    """Seconds between SIGTERM and SIGKILL."""
    settle: float = 0.0
    """Seconds leftovers get to exit by themselves before the first reaping."""
    ignore: tuple[str, ...] = ()
    """Command-line globs of processes that are never strays."""
    host_scope: bool = False
    """Also look for this user's other Python processes."""
    dead_sessions: bool = True


class Checker:
    """Checks devices and processes; reaps leaks that are provably this session's."""

    def __init__(self, backend: Backend | None, settings: CheckSettings | None = None,
                 census: Census | None = None) -> None:
        """``census``: the session's (None: a session of its own, as the ``gpuclean`` command's)."""
        settings = settings or CheckSettings()
        self.backend = backend
        self.reap_enabled = settings.reap
        self.grace = settings.grace
        self.settle = settings.settle
        self.ignore = settings.ignore
        self.host_scope = settings.host_scope
        self.dead_sessions = settings.dead_sessions
        self.uid = os.getuid()
        self.census = census if census is not None else Census.of_its_own()
        self.ownership = self.census.ownership
        self.last_lost: DeviceLost | None = None
        """Set when a lost GPU ended the last check (``device_errors=True``), for the health watch."""
        self.hurry: Callable[[], bool] | None = None
        """Set while an interrupt asks for quick reaping: the grace ends at once."""
        self.before_grace: Callable[[list[int], float], None] | None = None
        """Told the pids about to get SIGTERM and their grace, first (the sweep after an interrupt says
        so)."""
        self._debris_checked = False
        self.left_alone: dict[tuple[int, int], str] = {}
        """Processes of ours the gate refused, by identity: why."""
        self._clean_again: CheckResult | None = None
        """The last clean check whose only GPU users were us and our ancestors: the same readings repeat
        its verdict."""
        self.outside = OutsideMemory()
        """Per device UUID, the outside state a check waited out, not waited for again (``outside.py``)."""

    # ---- the census, as the session and the command line ask it ----------------------------------

    @property
    def me(self) -> int:
        """The process running the checks: under a forked runner, the forked child, not the session."""
        return self.census.me

    @property
    def never_touch(self) -> set[int]:
        """This process and its ancestors: never suspects, never signalled."""
        return self.census.never_touch

    @property
    def last_census(self) -> list[CensusEntry]:
        """What the last census found (``--gpuclean-ray=auto`` looks there for a cluster the session
        started)."""
        return self.census.last

    @property
    def notices(self) -> list[str]:
        """Lines for the session's notes, once each (the census's and the backend's); taken by whoever
        reports them."""
        backend = self.backend
        if backend is not None and backend.notices:
            self.census.notices.extend(backend.notices)
            backend.notices.clear()
        return self.census.notices

    def take_census(self, scan_cookies: bool = False, dead_sessions: bool = False) -> list[CensusEntry]:
        return self.census.take(scan_cookies, dead_sessions)

    def owner_of(self, f: CensusEntry) -> Owner:
        return self.census.owner_of(f)

    def is_protected(self, f: CensusEntry) -> bool:
        return self.census.is_protected(f)

    def is_older(self, pid: int, start_ticks: int) -> bool:
        return self.census.is_older(pid, start_ticks)

    def of_our_run(self, pid: int) -> bool:
        return self.census.of_our_run(pid)

    def close(self) -> None:
        self.census.close()

    # ---- the check -----------------------------------------------------------------------------

    def snapshot(self, devices: Sequence[DeviceInfo]) -> tuple[DeviceSnapshot, ...]:
        if self.backend is None or not devices:
            return ()
        return self.backend.readings(devices)

    def check(self, phase: Phase, devices: Sequence[DeviceInfo], *, tolerance_mib: int, timeout: float,
              scan_cookies: bool = False, reap: bool | None = None,
              device_errors: bool = False, where: str = "an earlier check",
              known: Collection[tuple[int, int]] = ()) -> CheckResult:
        """Check until clean or ``timeout``, reaping ours first (if enabled). ``where`` names this check to
        later ones; ``known``: leaks an earlier check left (reaping off), not waited for alone.

        An unreadable device raises ``DeviceError``, or with ``device_errors`` ends the check, not clean."""
        started = time.monotonic()
        dead_sessions = self.dead_sessions and not self._debris_checked
        self._debris_checked = True  # at start-up once; later only when something is unexplained
        self.last_lost = None
        first: tuple[tuple[DeviceSnapshot, ...], bool] | None = None
        check: _Passes | None = None
        asked = _Asked(phase, devices, tolerance_mib, timeout, scan_cookies, dead_sessions,
                       self.reap_enabled if reap is None else reap, where, frozenset(known))
        try:
            if not (scan_cookies or dead_sessions or self.host_scope):
                quiet = self._clean_path(phase, devices, tolerance_mib, started)
                if isinstance(quiet, CheckResult):
                    return quiet
                first = quiet
            check = _Passes(self, asked, started, first)
            result = check.run()
            self._clean_again = result if self._only_ours(result) else None
            return result
        except DeviceError as exc:
            if not device_errors:
                raise
            if isinstance(exc, DeviceLost):
                self.last_lost = exc
            if check is None:  # (the first reading failed: nothing was reaped yet)
                check = _Passes(self, asked, started)
            return check.unreadable(exc)

    def _clean_path(self, phase: Phase, devices: Sequence[DeviceInfo], tolerance_mib: int, started: float
               ) -> CheckResult | tuple[tuple[DeviceSnapshot, ...], bool]:
        """The result when no process of ours is alive and every device is idle, without the passes'
        bookkeeping (most of a clean check's cost); otherwise the readings and whether the census was
        taken."""
        snaps = self.snapshot(devices)
        found: list[CensusEntry] | None = None
        if not any(map(_LISTED, snaps)) and not any(map(_USED, snaps)):
            found = self.census.take()
        else:
            again = self._clean_again
            # Our own CUDA context keeps the devices busy: readings identical to a clean check's (an unchanged
            # reading is the same object), with nothing of ours alive, repeat its verdict.
            if (again is not None and again.tolerance_mib == tolerance_mib
                    and len(snaps) == len(again.devices) and all(map(operator.is_, snaps, again.devices))):
                found = self.census.take()
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
        """Clean, only us and our ancestors on its devices, nothing done or said: a verdict its readings
        may repeat."""
        if not result.clean or result.reaped or result.collected or result.notes or result.siblings or (
                result.outside is not None or result.lingered or result.cluster is not None):
            return False
        mine = self.never_touch
        return all(p.pid in mine for s in result.devices for p in s.processes)

    # ---- reading a pass of a check (``_Passes``) --------------------------------------------

    def observe(self, check: _Passes) -> Snapshot:
        """Every fact one pass decides on. GPU use our tree does not explain widens the census and reads
        again."""
        census = self.census
        while True:
            first, check.first = check.first, None
            readings = first[0] if first is not None else self.snapshot(check.devices)
            listed = {p.pid for s in readings for p in s.processes}
            found = census.last if first is not None and first[1] else census.take(
                check.scan_cookies, check.dead_sessions, listed)
            # Scanned once, unless it found debris: then again, so a later pass still sees it as the dead
            # session's.
            check.dead_sessions = check.dead_sessions and any(f.debris_of is not None for f in found)
            # Excused: our ancestors (us as far as the GPU goes), helpers (the census judges one holding GPU
            # memory) and persistent processes. Of unknown birth: reported, never signalled.
            sort = decisions.sort_census(found, census.is_protected, census.never_touch,
                                      census.helpers.keys() | census.persistent.keys(), listed)
            ours, unknown, excused, unexplained = sort.ours, sort.unknown, sort.excused, sort.unexplained
            if unexplained and (persistent := census.persistent_of(unexplained)):
                census.persistent.update(persistent)
                excused |= persistent.keys()
                unexplained -= persistent.keys()
            peers = census.peer_pids(unexplained)
            check.peers |= peers
            excused |= peers
            # A live sibling worker's leftovers are its to reap: waiting here, holding the locks it needs,
            # stalls both.
            siblings = census.siblings(unexplained - excused)
            for pid, sibling in siblings.items():
                _saw_sibling(check, pid, sibling, readings)
            excused |= siblings.keys()
            unexplained -= excused
            # Our own CUDA context's unlisted overhead must not widen the census on every check.
            self_cuda: set[str] = set()
            overhead, short = decisions.listed_overhead(readings, excused)
            if short:
                overhead.update(self._context_overhead(short, excused, self_cuda))
            unexplained_use = decisions.unexplained_use(readings, unexplained, excused, overhead,
                                                        check.tolerance)
            if check.scan_cookies or not unexplained_use:
                break
            check.scan_cookies = True
            check.dead_sessions = self.dead_sessions
        # (excused and unexplained may be new sets by now: ``set -= dict_keys`` makes one)
        sort = decisions.SortedCensus(ours, unknown, excused, unexplained)
        return self._snapshot(check, readings, found, sort, (overhead, self_cuda),
                              maybe_outside=unexplained_use, strays=self.host_scope)

    def observe_unread(self, check: _Passes, readings: tuple[DeviceSnapshot, ...]) -> Snapshot:
        """A check that cannot read every device: nothing says whether an outsider holds a GPU, so the
        census looks for our cookie everywhere and only ours is judged (each device's whole use is
        overhead)."""
        found = self.census.take(scan_cookies=True)
        sort = decisions.sort_census(found, self.census.is_protected, (), (), set())
        return self._snapshot(check, readings, found, sort._replace(excused=set(), unexplained=set()),
                              ({s.device.uuid: s.used_bytes for s in readings}, set()), maybe_outside=False,
                              strays=False)

    def observe_left(self, check: _Passes, seen: Snapshot, ours: Sequence[CensusEntry], recount: bool
                     ) -> Snapshot:
        """After acting: what is left of ``ours`` (recounted if it reaped), and ``seen``'s unknown
        processes now."""
        if recount:
            left = {f.key for f in self.census.take(scan_cookies=True) if f.live}
            ours = [f for f in ours if f.key in left]
        sort = decisions.SortedCensus(self.census.pinned(ours), list(seen.unknown), set(), set())
        return self._snapshot(check, seen.readings, seen.census, sort, (dict(seen.own.overhead), set()),
                              maybe_outside=False, strays=self.host_scope)

    def _snapshot(self, check: _Passes, readings: tuple[DeviceSnapshot, ...], found: Sequence[CensusEntry],
                  sort: decisions.SortedCensus, own_use: tuple[dict[str, int], set[str]], *,
                  maybe_outside: bool, strays: bool) -> Snapshot:
        """A pass's snapshot. ``own_use``: the overhead excused per GPU and the GPUs where it is our own
        CUDA context's; ``maybe_outside``: read what earlier checks waited out; ``strays``: look for this
        user's other Python processes (host scope)."""
        census = self.census
        ours, unknown, excused, unexplained = sort
        overhead, self_cuda = own_use
        described: dict[tuple[int, int], ProcessInfo] = {}
        vanished: dict[tuple[int, int], ProcessInfo] = {}
        owners: dict[tuple[int, int], Owner] = {}
        for f in ours:
            info = processes.describe(f.pid, f.start_ticks)
            if info is not None:
                described[f.key] = info
            else:
                vanished[f.key] = reaping.vanished(f.pid)
            owners[f.key] = census.owner_of(f)
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
            exclude = census.never_touch | excused | unexplained | {f.pid for f in ours if f.live}
            python = set(processes.stray_python_processes(self.uid, exclude, self.ignore))
            python -= census.peer_pids(python)
            # What our xdist siblings run is theirs, as on the GPUs.
            python_strays = [info for pid in sorted(python - census.siblings(python).keys())
                             if (info := processes.describe(pid)) is not None]
        others = Others(
            tuple(foreign), frozenset(allowlisted),
            frozenset([info.pid for info in foreign if census.of_our_run(info.pid)] if foreign else ()),
            {pid: _start_ticks(pid) for pid in unexplained} if unexplained else {},
            self.outside.load() if maybe_outside else {}, tuple(check.siblings.values()),
            frozenset(check.peers), tuple(python_strays))
        who = Identities(described, vanished, owners, self._left_alone_of(ours))
        own = OwnUse(census.me, overhead, frozenset(self_cuda))
        return Snapshot(readings, tuple(found), tuple(ours), tuple(unknown), frozenset(excused),
                        frozenset(unexplained), who, others, own)

    def _left_alone_of(self, ours: Sequence[CensusEntry]) -> dict[tuple[int, int], str]:
        """Of ``ours``, what the gate refused so far, and why."""
        refused = self.left_alone
        return {f.key: refused[f.key] for f in ours if f.key in refused} if refused else {}

    def _context_overhead(self, short: list[decisions.Short], excused: set[int], self_cuda: set[str]
                          ) -> dict[str, int]:
        """The unlisted memory excused where listed contexts fall short. Reading /proc/<pid>/fd costs a
        syscall per descriptor, so other excused processes are asked only if we do not explain it."""
        backend, me = self.backend, self.census.me
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
        """Reap ``fresh``; with ``freeze`` (owners that keep reappearing) stop them and theirs first, then
        SIGKILL. Returns what it tried to signal, and the records."""
        targets = self.census.pinned(fresh)
        if freeze is None:
            return list(targets), self.reap(targets, readings, devices, notes)
        frozen: dict[tuple[int, int], CensusEntry] = {}
        stopped: list[processes.KillTarget] = []
        try:
            found = self.freeze(targets, freeze, scan_cookies, notes, frozen, stopped)
            reaped = self.reap(list(frozen.values()), readings, devices, notes, kill_first=True)
        finally:
            processes.resume(stopped)  # what was stopped and not killed (an error on the way, a survivor)
        return [*targets, *found], reaped

    def remember(self, verdict: Verdict) -> None:
        """Remember what a check waited out from outside; forget what is clean from outside now."""
        if verdict.remember:
            self.outside.update(verdict.remember, forget=verdict.forget)
        else:
            self.outside.forget(verdict.forget)

    # ---- reaping -------------------------------------------------------------------------------

    def refusal(self, f: CensusEntry) -> str | None:
        """Why ``f`` may not be signalled now (``gate.refusal``); None: it may."""
        # (imported here: needed only once something is to be signalled)
        from pytest_gpuclean._check import gate
        from pytest_gpuclean._reading import credentials
        itself, protected = f.pid in self.never_touch, self.is_protected(f)
        facts = None if itself or protected else credentials.credentials(f.pid, f.start_ticks)
        return gate.refusal(facts, self.uid, itself=itself, protected=protected)

    def gate(self, found: Sequence[CensusEntry], notes: list[str]) -> list[CensusEntry]:
        """Of ``found``, what may be signalled: the one gate before every signal, SIGSTOP included."""
        allowed: list[CensusEntry] = []
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

    def reap(self, ours: Sequence[CensusEntry], snaps: Sequence[DeviceSnapshot],
             devices: Sequence[DeviceInfo],
             notes: list[str], kill_first: bool = False) -> list[Reaped]:
        """Kill what of ``ours`` the gate lets through, then wait until the driver lets them go."""
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

    def freeze(self, targets: Sequence[CensusEntry], owners: set[str | None], scan_cookies: bool,
               notes: list[str], frozen: dict[tuple[int, int], CensusEntry],
               stopped: list[processes.KillTarget]) -> list[CensusEntry]:
        """SIGSTOP ``targets`` and whatever of ``owners`` appears until nothing new does, into ``frozen``
        (to kill) and ``stopped`` (the caller SIGCONTs what it does not kill). Returns what appeared.

        The gate runs again once a process is stopped: one that became a relay meanwhile is continued, left
        alone."""
        seen = {f.key for f in targets}
        appeared: list[CensusEntry] = []
        batch = self.gate(targets, notes)
        for _ in range(MAX_FREEZE_PASSES):
            now_stopped = processes.stop([processes.KillTarget(f.pid, f.start_ticks, f.depth, f.handle)
                                          for f in batch])
            stopped.extend(now_stopped)
            allowed = {f.key for f in self.gate(batch, notes)}
            processes.resume([t for t in now_stopped if (t.pid, t.start_ticks) not in allowed])
            frozen.update((f.key, f) for f in batch if f.key in allowed)
            new = [f for f in self.take_census(scan_cookies=scan_cookies)
                   if f.key not in seen and f.live and not self.is_protected(f) and f.token in owners]
            if not new:
                break
            seen.update(f.key for f in new)
            appeared.extend(new)
            batch = self.gate(new, notes)
        return appeared

    def check_owned(self, tokens: Collection[str], devices: Sequence[DeviceInfo]) -> CheckResult:
        """What ``tokens`` (fixtures that just ended) left alive: settle, then reap if enabled. The devices
        only time the release: no GPU lock is held, so another job's memory is not this check's business.
        Only our tree is walked; what left it is the final sweep's."""
        started = time.monotonic()
        found = [f for f in self.take_census()
                 if f.token in tokens and f.debris_of is None and not self.is_protected(f)]
        if not found:
            return CheckResult("teardown", True, (), (), waited_s=time.monotonic() - started)
        infos = {f.key: processes.describe(f.pid, f.start_ticks) or reaping.vanished(f.pid) for f in found}
        collected: list[Reaped] = []

        def gone(f: CensusEntry, how: EndedBy) -> None:
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
        """At session end: reap what this session's tests and fixtures spawned that is still alive; an
        unreadable device does not stop it. ``include_session``: also the set-up's, for the very end."""
        self.ownership.active_fixtures.clear()
        self.ownership.session_over = include_session
        census = self.take_census(scan_cookies=True)
        for f in census:
            if not f.live:
                # Exited, holding nothing: collected, not reported as a leftover.
                processes.reap_if_child(f.pid)
        excluded = (PREEXISTING,) if include_session else (PREEXISTING, SESSION)
        found = decisions.of_the_sweep(census, excluded)
        # (what may descend from a still protected process is not provably the session's)
        found = [f for f in found if not self.is_protected(f)]
        if not found or not self.reap_enabled:
            return []
        return self._reap_unread(found, devices, again=lambda: decisions.of_the_sweep(
            self.take_census(scan_cookies=True), excluded))

    def _reap_unread(self, found: list[CensusEntry], devices: Sequence[DeviceInfo],
                     notes: list[str] | None = None,
                     again: Callable[[], list[CensusEntry]] | None = None) -> list[Reaped]:
        """Reap ``found`` at the session's edges. ``again`` finds what replaced itself, which is frozen and
        SIGKILLed, for at most ``MAX_REAP_ROUNDS`` rounds."""
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
        """At the very end: end the helpers only ``--gpuclean-helpers`` vouched for; nothing else would. A
        library's own helpers are left to its exit handler."""
        alive: list[CensusEntry] = []
        for (pid, start_ticks), handle in list(self.census.declared_helpers.items()):
            if handle.exited() or not procfs.is_live(pid, start_ticks):
                continue
            alive.append(CensusEntry(pid, start_ticks, 1, "descendant", SESSION, "R", handle))
        self.census.declared_helpers.clear()
        if not alive or not self.reap_enabled:
            return []
        return self._reap_unread(alive, devices)

    def dead_session_debris(self) -> list[CensusEntry]:
        """Live processes of this user whose cookie names a gpuclean session that provably died."""
        return [f for f in self.take_census(dead_sessions=True) if f.debris_of is not None and f.live]

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
                 for f in decisions.of_the_sweep(self.take_census(scan_cookies=True), (PREEXISTING, SESSION))
                 if not self.is_protected(f))
        return [info for info in infos if info is not None]

    def no_part_of_the_session(self) -> list[ProcessInfo]:
        """Processes under us that predate the session (or whose starter does), still alive: left alone."""
        infos = (processes.describe(f.pid, f.start_ticks) for f in self.take_census()
                 if f.live and f.token == PREEXISTING)
        return [info for info in infos if info is not None]


class _Asked(NamedTuple):
    """What ``Checker.check`` was asked (its docstring says what each means)."""

    phase: Phase
    devices: Sequence[DeviceInfo]
    tolerance_mib: int
    timeout: float
    scan_cookies: bool
    dead_sessions: bool
    reap: bool
    where: str
    known: frozenset[Key]


class _Passes:
    """One check, pass after pass until its verdict."""

    def __init__(self, checker: Checker, asked: _Asked, started: float,
                 first: tuple[tuple[DeviceSnapshot, ...], bool] | None = None) -> None:
        phase, devices, tolerance_mib, timeout, scan_cookies, dead_sessions, reap, where, known = asked
        self.checker = checker
        self.phase = phase
        self.devices = devices
        self.tolerance_mib = tolerance_mib
        self.reap_enabled = reap
        self.started = started
        # How wide the census reaches, and what the passes saw.
        self.tolerance = tolerance_mib * MIB
        self.scan_cookies = scan_cookies
        """Our cookie looked for anywhere (a /proc scan): once something on the GPUs is unexplained, for
        the rest of the check."""
        self.dead_sessions = dead_sessions
        self.first = first
        """``Checker._clean_path``'s readings for the first pass, and whether it took the census too."""
        self.siblings: dict[Key, SiblingUse] = {}
        """Processes of live sibling xdist workers on these devices."""
        self.peers: set[int] = set()
        """Sibling xdist workers themselves on these devices (their own CUDA contexts)."""
        self.judge = Judge(devices, tolerance_mib, timeout, reap, checker.uid, where)
        self.known = known
        """Leaks an earlier check found and left (reaping off)."""
        # What the acts did:
        self.reaped: list[Reaped] = []
        self.notes: list[str] = []
        self.attempted: set[Key] = set()
        self.collected: list[Reaped] = []
        self.collected_ids: set[Key] = set()
        self.settled = False
        self.rounds = 0
        self.reaped_owners: set[str | None] = set()
        # When the check began, on the processes' start-time clock (its first census may predate this object).
        self.began_ticks = procfs.boot_ticks_now() - int(
            (time.monotonic() - self.started) * procfs.CLOCK_TICKS)
        self.births: dict[str | None, set[Key]] = {}
        """Per owner, its processes born since the check began (alive or exited)."""
        self.chains: dict[str | None, set[int]] = {}
        """Per owner found replacing itself: the pids of its chain."""
        self.collected_of: dict[str | None, set[int]] = {}
        """Per owner, the pids collected as exited (``result`` drops a chain's)."""

    def run(self) -> CheckResult:
        while True:
            # Observe.
            seen = self.checker.observe(self)
            now = time.monotonic()
            born = self.note_births(seen)
            # Decide: a self-replacing chain first; then ours alive and not signalled yet; else the verdict.
            chains = decisions.self_replacing(self.births, {
                f.token for f in seen.ours if f.live and f.start_ticks < self.began_ticks}) if born else set()
            fresh = [f for f in seen.ours if f.live and f.key not in self.attempted] if seen.ours else []
            if chains and self.reap_enabled and self.rounds < MAX_REAP_ROUNDS:
                move: decisions.Move | None = None
            else:
                move = decisions.next_move(bool(fresh), self.reap_enabled, self.rounds, self.settled,
                                        self.checker.settle)
            verdict = self.judge.verdict(seen, self.attempted, now - self.started, now,
                                         self._known_alone(seen)) if move == "judge" else None
            # Act.
            collected = len(self.collected)
            self.collect_zombies(seen)
            active = born or len(self.collected) > collected
            if move is None:
                self.stop_chains(chains, seen)
            elif move == "settle":
                self.settle(fresh, seen)
            elif move == "reap":
                self.reap_round(fresh, seen)
            elif verdict is not None and not verdict.again and not (
                    active and self.reap_enabled and now - self.started < self.judge.timeout):
                # Not while ours keep being born or exiting: the census may lag a chain that forks faster than
                # it reads.
                self.checker.remember(verdict)
                return self.result(seen, verdict, fresh, now - self.started)
            else:
                time.sleep(POLL_S)

    def note_births(self, seen: Snapshot) -> bool:
        """Note the processes of ours born since the check began; whether this pass saw a new one."""
        began, births, new = self.began_ticks, self.births, False
        for f in seen.ours:
            if f.start_ticks >= began:
                known = births.setdefault(f.token, set())
                if f.key not in known:
                    known.add(f.key)
                    new = True
        return new

    def _known_alone(self, seen: Snapshot) -> frozenset[Key]:
        """The known leaks alive in ``seen``, if nothing else unexplained holds memory: waiting for them is
        waiting for nothing."""
        if not self.known:
            return frozenset()
        alive = frozenset(f.key for f in seen.ours if f.live and f.key in self.known)
        if alive and decisions.unexplained_beside(seen.readings, seen.excused | {pid for pid, _ in alive},
                                               self.tolerance):
            return frozenset()
        return alive

    # ---- act ---------------------------------------------------------------------------------------

    def collect_zombies(self, seen: Snapshot) -> None:
        # Exited processes nobody waited for hold no memory: mostly orphans our subreaper adopted.
        for f in seen.ours:
            if not f.live and f.key not in self.collected_ids and processes.reap_if_child(f.pid):
                self._collect(f, seen, "reaped zombie")

    def settle(self, fresh: Sequence[CensusEntry], seen: Snapshot) -> None:
        """Before the first reaping, give leftovers up to ``settle`` seconds to exit on their own while one
        of them runs; once all rest for ``AT_REST_S`` they are reaped at once. The next pass looks again
        before any signal: a child caught between fork and exec now shows its command line."""
        self.settled = True
        now = time.monotonic()
        deadline, rest_from = now + self.checker.settle, now
        pending = list(fresh)
        demand = _cpu_demand(pending)
        while pending and now < deadline:
            time.sleep(SETTLE_POLL_S)
            for f in list(pending):
                if f.exited():
                    processes.reap_if_child(f.pid)
                    pending.remove(f)
                    self._collect(f, seen, "exited by itself")
            now = time.monotonic()
            latest = _cpu_demand(pending)
            if latest != demand:
                demand, rest_from = latest, now
            elif now - rest_from >= AT_REST_S:
                break

    def stop_chains(self, owners: set[str | None], seen: Snapshot) -> None:
        """Freeze and SIGKILL ``owners``' self-replacing processes and each that appears meanwhile."""
        self.rounds += 1
        alive = [f for f in seen.ours if f.live and f.token in owners]
        targets, reaped = self.checker.reap_round(alive, seen.readings, self.devices, self.notes,
                                                  freeze=owners,
                                            scan_cookies=self.scan_cookies)
        self.attempted.update(f.key for f in targets)
        self.reaped_owners.update(owners)
        self.reaped.extend(reaped)
        for owner in owners:
            chain = self.chains.setdefault(owner, set())
            chain.update(pid for pid, _ in self.births.pop(owner, ()))
            chain.update(f.pid for f in targets if f.token == owner)
        pids = sorted({pid for owner in owners for pid in self.chains[owner]})
        killed = sum(1 for r in reaped if r.ended_by == "SIGKILL")
        self.notes.append(
            f"a self-replacing chain (each process forks the next and exits at once; {len(pids)} born while "
            f"the check waited: {_few(pids)}): " + (
                f"stopped and killed with SIGKILL ({killed})" if killed else
                "none was caught alive this time; looking again"))

    def reap_round(self, fresh: Sequence[CensusEntry], seen: Snapshot) -> None:
        frozen: set[str | None] | None = None
        if self.rounds:
            # Killed processes were replaced (a forking SIGTERM handler, a supervisor): stop the set, then
            # SIGKILL.
            self.notes.append(respawned_note(self.rounds + 1, fresh))
            frozen = {f.token for f in fresh} | self.reaped_owners
        self.rounds += 1
        targets, reaped = self.checker.reap_round(fresh, seen.readings, self.devices, self.notes,
                                                  freeze=frozen,
                                            scan_cookies=self.scan_cookies)
        self.attempted.update(f.key for f in targets)
        self.reaped_owners.update(f.token for f in targets)
        self.reaped.extend(reaped)
        # What could not be signalled is not retried: waiting for it is what the verdict does.

    def _collect(self, f: CensusEntry, seen: Snapshot, how: EndedBy) -> None:
        # One of ours that ended without being killed: reported in the summary, not a leak.
        self.collected_ids.add(f.key)
        self.collected_of.setdefault(f.token, set()).add(f.pid)
        info = seen.who.described.get(f.key) or seen.who.vanished[f.key]
        self.collected.append(Reaped(info, seen.who.owners[f.key], f.found_by, how, (), None))

    # ---- the result ------------------------------------------------------------------------------

    def result(self, seen: Snapshot, verdict: Verdict, fresh: Collection[CensusEntry], waited: float
               ) -> CheckResult:
        """The check's result: the verdict on the last pass, with what the check did on the way."""
        if fresh and self.rounds >= MAX_REAP_ROUNDS:
            self.notes.append(f"gave up after {self.rounds} reaping rounds: killed processes keep being "
                              f"replaced (a process pool or supervisor outside our reach?)")
        notes = [*self.notes, *(
            f"pid {u.process.pid}: in use by {u.describe()} ({mib_list(u.mib_per_device)}); another worker "
            f"of this xdist run: not waited for, never signalled (its worker reaps it if it was leaked)"
            for u in seen.others.siblings), *(
            f"pid {pid}: another worker of this xdist run, its pytest process itself "
            f"({mib_list(mib_of(pid, seen.readings)) or 'no memory now'}): excused like our own"
            for pid in sorted(seen.others.peers))]
        found, readings, me = verdict.offenders, seen.readings, seen.own.me
        # A chain's processes did not exit by themselves: the chain replaced them.
        chained = {pid for owner in self.chains for pid in self.collected_of.get(owner, ())}
        collected = [r for r in self.collected if r.process.pid not in chained] if chained else self.collected
        return CheckResult(
            phase=self.phase, clean=not found, devices=readings, offenders=found,
            lingered=verdict.lingered, collected=tuple(collected), reaped=tuple(self.reaped),
            waited_s=waited, clean_after_s=waited if not found else None, notes=tuple(notes),
            siblings=seen.others.siblings, tolerance_mib=self.tolerance_mib,
            self_mib=tuple((s.device.label, s.bytes_of({me}) / MIB) for s in readings if s.bytes_of({me})),
            self_cuda_only=() if not seen.own.self_cuda else tuple(
                s.device.label for s in readings if s.device.label in seen.own.self_cuda),
            outside=verdict.outside,
        )

    def unreadable(self, error: DeviceError) -> CheckResult:
        """A check that could not read a device: not clean, at once. What is provably ours is reaped
        anyway, so a test's leftovers do not wait for the session's end nor fail every later check."""
        checker = self.checker
        # Observe: the readable devices time the release; the census looks for our cookie everywhere.
        readable: list[DeviceInfo] = []
        readings: list[DeviceSnapshot] = []
        for device in self.devices:
            try:
                readings.extend(checker.snapshot((device,)))
                readable.append(device)
            except DeviceError:
                continue
        seen = checker.observe_unread(self, tuple(readings))
        # Act: what exits by itself within the settle time is no leak here either; the rest is reaped.
        self.collect_zombies(seen)
        ours = [f for f in seen.ours if f.live]
        fresh = [f for f in ours if f.key not in self.attempted]
        move = decisions.next_move(bool(fresh), self.reap_enabled, self.rounds, self.settled, checker.settle)
        if move == "settle":
            self.settle(fresh, seen)
            fresh = [f for f in fresh if f.key not in self.collected_ids]
            ours = [f for f in ours if f.key not in self.collected_ids]
        reap = self.reap_enabled and bool(fresh)
        if reap:
            self.attempted.update(f.key for f in fresh)
            self.reaped.extend(checker.reap_round(fresh, readings, readable, self.notes)[1])
        # Observe again, and judge only what is ours.
        seen = checker.observe_left(self, seen, ours, recount=reap)
        return CheckResult(
            phase=self.phase, clean=False, devices=tuple(readings),
            offenders=tuple(offenders(seen, self.tolerance, self.reap_enabled, checker.uid)),
            collected=tuple(self.collected), reaped=tuple(self.reaped),
            waited_s=time.monotonic() - self.started, notes=tuple(self.notes),
            tolerance_mib=self.tolerance_mib, error=error.describe(),
            device_lost=isinstance(error, DeviceLost))


def respawned_note(round_no: int, new: Sequence[CensusEntry]) -> str:
    """A reaping round's note on new processes where it had killed some."""
    return (f"new processes appeared while reaping (round {round_no}): {sorted(f.pid for f in new)}; stopped "
            "and killed with SIGKILL")


def _few(pids: Sequence[int], shown: int = 8) -> str:
    """``pids``, the first ``shown`` of them and how many more."""
    listed = ", ".join(str(pid) for pid in pids[:shown])
    return listed + (f" and {len(pids) - shown} more" if len(pids) > shown else "")


def _cpu_demand(entries: Sequence[CensusEntry]) -> list[int | None]:
    """What each of ``entries`` has run or waited to run; -1 for one the kernel is taking down."""
    found: list[int | None] = []
    for f in entries:
        stat = procfs.read_stat(f.pid)
        found.append(-1 if stat is not None and stat.exiting else procfs.cpu_demand_ns(f.pid))
    return found


def _saw_sibling(check: _Passes, pid: int, sibling: Sibling, readings: Sequence[DeviceSnapshot]) -> None:
    # Described once per check; what it held is the most it was seen with.
    held = mib_of(pid, readings)
    known = next((u for u in check.siblings.values() if u.process.pid == pid), None)
    if known is not None:
        if sum(m for _, m in held) > sum(m for _, m in known.mib_per_device):
            check.siblings[(pid, known.process.start_ticks)] = known._replace(mib_per_device=held)
        return
    info = processes.describe(pid)
    if info is not None:
        check.siblings[(info.pid, info.start_ticks)] = SiblingUse(info, sibling.owner, sibling.worker, held)


def _start_ticks(pid: int) -> int:
    """``pid``'s start ticks, an outside holder's identity; 0 if not visible or exited (its memory is being
    given back: not a state to remember)."""
    stat = procfs.read_stat(pid)
    return 0 if stat is None or not procfs.live_state(pid, stat.state) else stat.start_ticks
