"""The clean check: who owns which process, what is dirty, and reaping what is provably ours.

No pytest here: the plugin and the ``gpuclean`` command line drive the same ``Checker``.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from pytest_gpuclean import pools, processes, procfs
from pytest_gpuclean.devices import Backend
from pytest_gpuclean.model import (
    MIB,
    UNKNOWN_OWNER,
    CheckResult,
    DeviceInfo,
    DeviceSnapshot,
    Offender,
    Owner,
    ProcessInfo,
    Reaped,
)

COOKIE_VAR = "GPUCLEAN_TEST"
"""Set in the pytest process while a test or higher-scoped fixture runs: every process spawned then
inherits ``<session id>:<owner token>`` and so says who started it, wherever it ends up."""
XDIST_RUN_VAR = "PYTEST_XDIST_TESTRUNUID"
POLL_S = 0.02
"""Polling interval while waiting for a device to come clean (the brief asks for <= 20 ms)."""
RELEASE_POLL_S = 0.005
MAX_REAP_ROUNDS = 3
"""A pool that respawns killed workers would otherwise keep us killing forever."""


@dataclass
class Found:
    """A process that is ours (a descendant, or carrying our session's cookie)."""

    pid: int
    start_ticks: int
    depth: int
    found_by: str
    token: str | None
    state: str


@dataclass
class _Window:
    start: int
    end: int | None
    token: str


@dataclass
class Ownership:
    """Who spawned what: cookie tokens, their owners, and the time windows they ran in."""

    session_id: str
    owners: dict[str, Owner] = field(default_factory=dict)
    active_fixtures: set[str] = field(default_factory=set)
    windows: list[_Window] = field(default_factory=list)
    _counter: int = 0

    def new_token(self, owner: Owner) -> str:
        self._counter += 1
        token = f"{owner.kind[0]}{self._counter}"
        self.owners[token] = owner
        return token

    def cookie(self, token: str) -> str:
        return f"{self.session_id}:{token}"

    def token_of_cookie(self, value: str | None) -> str | None:
        if value is None or not value.startswith(self.session_id + ":"):
            return None
        # A nested gpuclean session prefixes its own cookies with ours ("<ours>:t5/<its id>:t1"): what
        # it spawns belongs, for us, to our test t5.
        token = value[len(self.session_id) + 1 :].split("/", 1)[0]
        return token if token in self.owners else None

    def open_window(self, token: str) -> None:
        self.windows.append(_Window(procfs.boot_ticks_now(), None, token))

    def close_window(self, token: str) -> None:
        now = procfs.boot_ticks_now()
        for window in reversed(self.windows):
            if window.token == token and window.end is None:
                window.end = now
                return

    def token_at(self, start_ticks: int) -> str | None:
        # Fall-back for processes without a cookie (started with a scrubbed environment): the most
        # recently opened window that was open when the process started, i.e. the innermost.
        for window in reversed(self.windows):
            if window.start <= start_ticks and (window.end is None or start_ticks <= window.end):
                return window.token
        return None

    def owner(self, token: str | None) -> Owner:
        return self.owners.get(token or "", UNKNOWN_OWNER)

    def is_protected(self, token: str | None) -> bool:
        return token is not None and token in self.active_fixtures


class Checker:
    """Checks devices and processes; reaps leaks that are provably this session's."""

    def __init__(self, backend: Backend | None, *, reap: bool = True, grace: float = 5.0,
                 ignore: Sequence[str] = (), host_scope: bool = False,
                 session_id: str | None = None, settle: float = 0.0) -> None:
        self.backend = backend
        self.reap_enabled = reap
        self.grace = grace
        self.settle = settle
        self.ignore = tuple(ignore)
        self.host_scope = host_scope
        self.me = os.getpid()
        self.uid = os.getuid()
        self.my_sid = os.getsid(0)
        self.never_touch = processes.ancestors(self.me)
        self.session_start_ticks = procfs.boot_ticks_now()
        self.ownership = Ownership(session_id or f"{self.me}-{uuid.uuid4().hex[:10]}")
        self._token_cache: dict[tuple[int, int], str | None] = {}
        self.xdist_run = os.environ.get(XDIST_RUN_VAR)

    def _follow_fork(self) -> None:
        # A forked child (pytest-forked, a fork-per-test helper) runs the hooks with the checker its
        # parent built: the process running the check and its ancestors, the session's pytest among
        # them, are us, never suspects.
        pid = os.getpid()
        if pid != self.me:
            self.me = pid
            self.my_sid = os.getsid(0)
            self.never_touch = processes.ancestors(pid)

    # ---- census -------------------------------------------------------------------------------

    def _helper_pids(self) -> set[int]:
        # multiprocessing's resource tracker and forkserver are long-lived helpers of the pytest
        # process itself, started lazily by whichever test first needs them; killing them breaks
        # later tests (forkserver's own waitpid would fail). They exit with pytest.
        helpers: set[int] = set()
        tracker = getattr(sys.modules.get("multiprocessing.resource_tracker"), "_resource_tracker", None)
        if getattr(tracker, "_pid", None):
            helpers.add(tracker._pid)  # type: ignore[union-attr]
        forkserver = getattr(sys.modules.get("multiprocessing.forkserver"), "_forkserver", None)
        if getattr(forkserver, "_forkserver_pid", None):
            helpers.add(forkserver._forkserver_pid)  # type: ignore[union-attr]
        return helpers

    def _token(self, pid: int, start_ticks: int) -> str | None:
        key = (pid, start_ticks)
        if key not in self._token_cache:
            token = self.ownership.token_of_cookie(procfs.read_environ_var(pid, COOKIE_VAR))
            if token is None:
                token = self.ownership.token_at(start_ticks)
            self._token_cache[key] = token
        return self._token_cache[key]

    def census(self, scan_cookies: bool = False) -> list[Found]:
        """Our processes: the descendant tree (cheap), plus cookie carriers outside it (a /proc scan)."""
        self._follow_fork()
        found: list[Found] = []
        helpers = self._helper_pids()
        seen: set[int] = set()
        for pid, depth in procfs.descendants(self.me):
            stat = procfs.read_stat(pid)
            if stat is None or pid in helpers:
                continue
            seen.add(pid)
            # A direct child in another session escaped with setsid and was re-parented to our subreaper.
            found_by = "adopted" if depth == 1 and stat.sid != self.my_sid else "descendant"
            found.append(Found(pid, stat.start_ticks, depth, found_by, self._token(pid, stat.start_ticks),
                               stat.state))
        if scan_cookies:
            prefix = self.ownership.session_id + ":"
            for pid, value in processes.cookie_holders(COOKIE_VAR, prefix, self.uid):
                stat = procfs.read_stat(pid)
                if (stat is None or pid in seen or pid in self.never_touch or pid in helpers
                        or stat.start_ticks < self.session_start_ticks):
                    continue
                token = self.ownership.token_of_cookie(value)
                found.append(Found(pid, stat.start_ticks, 0, "cookie", token, stat.state))
        return found

    def _peer_pids(self, pids: Iterable[int]) -> set[int]:
        # Sibling pytest-xdist workers of the same run hold their own CUDA contexts, like we do. Every
        # process a worker's test starts inherits the run id too, so a peer must also be our sibling
        # (a direct child of the controller); a worker's leak is its descendant, never our sibling.
        if not self.xdist_run:
            return set()
        parent = os.getppid()
        peers: set[int] = set()
        for pid in pids:
            stat = procfs.read_stat(pid)
            if (stat is not None and stat.ppid == parent
                    and procfs.read_environ_var(pid, XDIST_RUN_VAR) == self.xdist_run):
                peers.add(pid)
        return peers

    # ---- the check -----------------------------------------------------------------------------

    def snapshot(self, devices: Sequence[DeviceInfo]) -> tuple[DeviceSnapshot, ...]:
        if self.backend is None or not devices:
            return ()
        return tuple(self.backend.snapshot(d) for d in devices)

    def check(self, phase: str, devices: Sequence[DeviceInfo], *, tolerance_mib: int, timeout: float,
              scan_cookies: bool = False, reap: bool | None = None) -> CheckResult:
        """Check until clean or ``timeout``; reap what is ours first (if enabled)."""
        reap = self.reap_enabled if reap is None else reap
        started = time.monotonic()
        tolerance = tolerance_mib * MIB
        reaped: list[Reaped] = []
        notes: list[str] = []
        attempted: set[tuple[int, int]] = set()
        first_seen: dict[tuple[int, int], Offender] = {}
        collected: list[Reaped] = []
        collected_ids: set[tuple[int, int]] = set()
        settled = False
        rounds = 0
        while True:
            snaps = self.snapshot(devices)
            self_cuda: set[str] = set()  # devices where this process uses CUDA without a (listed) context
            found = self.census(scan_cookies=scan_cookies)
            ours = [f for f in found if not self.ownership.is_protected(f.token)]
            # Our ancestors (an outer pytest running this session, a launcher) are us as far as the GPU
            # goes: their contexts are excused like our own; they are never killed either.
            excused = self.never_touch | self._helper_pids() | {f.pid for f in found if f not in ours}
            unexplained = {p.pid for s in snaps for p in s.processes} - excused - {f.pid for f in ours}
            excused |= self._peer_pids(unexplained)
            unexplained -= excused
            # Our own CUDA context's unlisted overhead must not trigger the cookie scan (a full /proc
            # scan, ~1 ms) on every check of a pytest process that uses the GPU itself.
            overhead = self._unlisted_overhead(snaps, excused, self_cuda)
            if not scan_cookies and (unexplained or any(
                    s.used_bytes - s.bytes_of(excused) - overhead[s.device.uuid] > tolerance for s in snaps)):
                # Something holds a GPU that our tree doesn't explain: maybe an escapee with our cookie.
                scan_cookies = True
                continue
            # Exited processes nobody waited for hold no memory and are no leak: most are orphans that
            # our subreaper adopted (a double fork's middle process, a subprocess's resource tracker),
            # which init would have collected. Collect the ones that are now our children, by pid.
            for f in ours:
                if f.state in ("Z", "X") and (f.pid, f.start_ticks) not in collected_ids:
                    info = processes.describe(f.pid, f.start_ticks)
                    if processes.reap_if_child(f.pid):
                        self._collect(f, info, "reaped zombie", collected, collected_ids)
            ours = [f for f in ours if f.state not in ("Z", "X")]
            fresh = [f for f in ours if (f.pid, f.start_ticks) not in attempted]
            if reap and fresh and not rounds and not settled and self.settle > 0:
                # Some leftovers are already on their way out (a subprocess's resource tracker that
                # cleans up after its client, an engine finishing its shutdown): let them go first.
                settled = True
                if self._settle(fresh, collected, collected_ids):
                    continue
            if reap and fresh and rounds < MAX_REAP_ROUNDS:
                if rounds:
                    notes.append(f"new processes appeared while reaping (round {rounds + 1}): "
                                 f"{sorted(f.pid for f in fresh)}")
                rounds += 1
                attempted.update((f.pid, f.start_ticks) for f in fresh)
                reaped.extend(self.reap(fresh, snaps, devices, notes))
                continue
            offenders = self._offenders(snaps, ours, unexplained, excused, tolerance, overhead)
            for o in offenders:
                if o.reason == "leaked" and o.process is not None:
                    first_seen.setdefault((o.process.pid, o.process.start_ticks), o)
            waited = time.monotonic() - started
            # Processes that survived our SIGKILL do not go away by waiting; anything else may.
            hopeless = bool(offenders) and all(
                o.reason == "leaked" and o.process is not None
                and (o.process.pid, o.process.start_ticks) in attempted for o in offenders)
            if not offenders or hopeless or waited >= timeout:
                if fresh and rounds >= MAX_REAP_ROUNDS:
                    notes.append(f"gave up after {rounds} reaping rounds: killed processes keep being "
                                 f"replaced (a process pool or supervisor outside our reach?)")
                still = {(o.process.pid, o.process.start_ticks) for o in offenders if o.process is not None}
                lingered = tuple(
                    dataclasses.replace(o, detail=f"outlived its test, ended by itself within {waited:.2f}s "
                                        "(reaping is off)")
                    for key, o in first_seen.items() if key not in still)
                return CheckResult(
                    phase=phase, clean=not offenders, devices=snaps, offenders=tuple(offenders),
                    lingered=lingered, collected=tuple(collected),
                    reaped=tuple(reaped), waited_s=waited,
                    clean_after_s=waited if not offenders else None, notes=tuple(notes),
                    tolerance_mib=tolerance_mib,
                    self_mib=tuple((s.device.label, s.bytes_of({self.me}) / MIB) for s in snaps
                                   if s.bytes_of({self.me})),
                    self_cuda_only=() if not self_cuda else tuple(
                        s.device.label for s in snaps if s.device.label in self_cuda),
                )
            time.sleep(POLL_S)

    def _settle(self, fresh: Sequence[Found], collected: list[Reaped],
                collected_ids: set[tuple[int, int]]) -> bool:
        """Wait up to ``settle`` seconds for ``fresh`` to exit on their own; True if any did."""
        infos = {f.pid: processes.describe(f.pid, f.start_ticks) for f in fresh}
        deadline = time.monotonic() + self.settle
        pending = list(fresh)
        while pending and time.monotonic() < deadline:
            time.sleep(POLL_S)
            for f in list(pending):
                stat = procfs.read_stat(f.pid)
                if stat is None or stat.start_ticks != f.start_ticks or stat.state in ("Z", "X"):
                    processes.reap_if_child(f.pid)
                    pending.remove(f)
                    self._collect(f, infos[f.pid], "exited by itself", collected, collected_ids)
        return len(pending) < len(fresh)

    def _collect(self, f: Found, info: ProcessInfo | None, how: str, collected: list[Reaped],
                 collected_ids: set[tuple[int, int]]) -> None:
        # One of ours that ended without being killed: reported in the summary, not a leak.
        collected_ids.add((f.pid, f.start_ticks))
        collected.append(Reaped(info or _vanished(f.pid), self.ownership.owner(f.token), f.found_by, how,
                                (), None))

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
        # Reading /proc/<pid>/fd costs ~2 us per descriptor: only off the clean path, once per poll, and
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
                   excused: set[int], tolerance: int, overhead: dict[str, int]) -> list[Offender]:
        offenders: list[Offender] = []
        ignored: set[int] = set()
        for pid in sorted(foreign):
            info = processes.describe(pid)
            if info is not None and self.ignore and processes.matches_any(info.cmdline, self.ignore):
                ignored.add(pid)
                continue
            offenders.append(Offender("foreign", info or _vanished(pid), None, "gpu", _mib_of(pid, snaps),
                                      detail="not started by this session: waited for, never killed"))
        for f in ours:
            info = processes.describe(f.pid, f.start_ticks)
            if info is None:
                continue
            if info.uid != self.uid:
                detail = f"belongs to another user ({info.user}): never killed"
            elif not self.reap_enabled:
                detail = "reaping is off"
            else:
                detail = f"could not be reaped ({info.state})"
            offenders.append(Offender("leaked", info, self.ownership.owner(f.token), f.found_by,
                                      _mib_of(f.pid, snaps), detail=detail))
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
            strays = processes.stray_python_processes(self.uid, exclude, self.ignore)
            for pid in sorted(set(strays) - self._peer_pids(strays)):
                info = processes.describe(pid)
                if info is not None:
                    offenders.append(Offender(
                        "host", info, None, "host", (),
                        detail="Python process of this user (host scope): never killed"))
        return offenders

    # ---- reaping -------------------------------------------------------------------------------

    def reap(self, ours: Sequence[Found], snaps: Sequence[DeviceSnapshot], devices: Sequence[DeviceInfo],
             notes: list[str]) -> list[Reaped]:
        """Kill ``ours`` (TERM, grace, KILL), then wait until the driver no longer lists them."""
        infos = {f.pid: processes.describe(f.pid, f.start_ticks) for f in ours}
        safe = [f for f in ours if self._may_kill(f, infos[f.pid])]
        for f in ours:
            if f not in safe and infos[f.pid] is not None:
                notes.append(f"pid {f.pid} left alone: not provably ours")
        if any(f.depth == 1 for f in safe):
            notes.extend(pools.shutdown_pools({f.pid for f in safe}, wait=self.grace))
        holders = {p.pid for s in snaps for p in s.processes} & {f.pid for f in safe}
        targets = [processes.KillTarget(f.pid, f.start_ticks, f.depth) for f in safe]
        ended, _released = self.kill_and_confirm(targets, devices, holders)
        result: list[Reaped] = []
        for f in safe:
            outcome, release = ended[f.pid]
            ended_by = outcome.ended_by if not outcome.state else f"survived ({outcome.state})"
            result.append(Reaped(infos[f.pid] or _vanished(f.pid), self.ownership.owner(f.token), f.found_by,
                                 ended_by, _mib_of(f.pid, snaps), outcome.exit_s, release))
        return result

    def kill_and_confirm(self, targets: Sequence[processes.KillTarget], devices: Sequence[DeviceInfo],
                         holders: set[int]) -> tuple[dict[int, tuple[processes.KillOutcome, float | None]],
                                                     float | None]:
        """The kill ladder, then wait until the driver lists none of ``holders`` (GPU-holding targets).

        Returns per pid its outcome and the driver's release time, and the seconds from the first
        signal until every holder was gone from the devices (None if none held a GPU or one stayed).
        The plugin's reaper and ``gpuclean reap`` both end processes through here.
        """
        watch = ReleaseWatch(self, devices, holders)
        killed_at = time.monotonic()
        outcomes = processes.terminate(targets, self.grace, watch=watch.poll)
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

    def _may_kill(self, f: Found, info: ProcessInfo | None) -> bool:
        if info is None:
            return True  # already gone: terminate() reports it without signalling
        if f.pid in self.never_touch or info.uid != self.uid:
            return False  # root too: another user's process is never ours to kill
        if f.found_by == "cookie" and f.start_ticks < self.session_start_ticks:
            return False
        return not self.ownership.is_protected(f.token)

    def final_sweep(self, devices: Sequence[DeviceInfo]) -> list[Reaped]:
        """At session end: reap everything this session spawned that is still alive."""
        self.ownership.active_fixtures.clear()
        found = self.census(scan_cookies=True)
        if not found or not self.reap_enabled:
            return []
        return self.reap(found, self.snapshot(devices), devices, [])

    def survivors(self) -> list[ProcessInfo]:
        """Processes of this session still alive (what the final sweep would reap)."""
        infos = (processes.describe(f.pid, f.start_ticks) for f in self.census(scan_cookies=True))
        return [info for info in infos if info is not None and info.state != "zombie"]


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
        listed = {p.pid for s in self.checker.snapshot(self.devices) for p in s.processes}
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


def _mib_of(pid: int, snaps: Sequence[DeviceSnapshot]) -> tuple[tuple[str, float], ...]:
    return tuple((s.device.label, s.bytes_of({pid}) / MIB) for s in snaps
                 if any(p.pid == pid for p in s.processes))


def _vanished(pid: int) -> ProcessInfo:
    return ProcessInfo(pid, 0, 0, -1, "?", "(exited)", "gone")
