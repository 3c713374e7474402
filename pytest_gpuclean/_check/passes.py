"""One check, pass after pass until its verdict: observe, decide, act.

Each pass reads top to bottom:

1. **Observe** (``Checker.observe``): every fact the pass decides on, read in one place into a
   ``verdict.Snapshot``: the devices, the census sorted against them (something the session's tree does
   not explain widens it to a cookie scan), who each process is, the allowlist, under host scope the stray
   Python processes, what earlier checks waited out from outside.
2. **Decide** (``core/deciding``, which reads nothing): what the pass does with leftovers of the session not
   yet signalled (``decisions.next_move``: let them settle, reap them; ``decisions.self_replacing``: an owner
   whose
   processes keep being born while the check waits is a chain, frozen and killed) or, with none, the verdict
   (``verdict.Judge``): the offenders, and whether looking again can help.
3. **Act**: collect what exited, wait the settle time or reap (``Checker.reap_round``: the ladder, through
   the census's pidfds), remember what was waited out from outside; then look again, or give the
   ``CheckResult`` (not while processes of ours are still being born: then it looks again).

The ``Checker`` (``checker.py``) holds what lasts from one check to the next (the census, the devices,
the memory of outside states), reads and acts for the check, and starts one when its clean path cannot
answer. This module names the census's processes as ``CensusEntry``: it stands below the checker, which
imports it, and above nothing of the census (``tests/test_layers.py`` holds the floors).
"""

from __future__ import annotations

import time
from collections.abc import Collection, Sequence
from typing import Protocol

from pytest_gpuclean._check import decisions
from pytest_gpuclean._check.decisions import MAX_REAP_ROUNDS, Judge, Key, Snapshot, Verdict, mib_of, offenders
from pytest_gpuclean._model.outcomes import CheckResult
from pytest_gpuclean._model.records import (
    MIB,
    CensusEntry,
    DeviceInfo,
    DeviceSnapshot,
    EndedBy,
    Phase,
    Reaped,
    SiblingUse,
)
from pytest_gpuclean._reading import processes, procfs
from pytest_gpuclean._reading.devices import DeviceError, DeviceLost
from pytest_gpuclean.report.text import mib_list as report_mib

__all__ = [
    "AT_REST_S",
    "POLL_S",
    "SETTLE_POLL_S",
    "Check",
    "CheckerParts",
    "Look",
    "respawned_note",
]


POLL_S = 0.02
"""Polling interval while waiting for a device to come clean."""
SETTLE_POLL_S = 0.005
"""Polling interval of the settle time."""
AT_REST_S = 0.02
"""How long leftovers must all stay off every CPU for the settle time to end early: a process that exits
by itself runs on its way out (cleaning up, finishing a shutdown, reading the EOF of its client); one
that has not run for this long is waiting for something the test will not do any more."""


class Look:
    """How one check's passes observe (``Checker.observe``): which devices, how wide the census reaches,
    and what they have seen of sibling xdist workers so far."""

    def __init__(self, devices: Sequence[DeviceInfo], tolerance_mib: int, scan_cookies: bool,
                 dead_sessions: bool, first: tuple[tuple[DeviceSnapshot, ...], bool] | None = None) -> None:
        self.devices = devices
        self.tolerance = tolerance_mib * MIB
        self.scan_cookies = scan_cookies
        """Our cookie looked for anywhere (a /proc scan), not only in our tree: once something on the GPUs
        is unexplained, for the rest of the check."""
        self.dead_sessions = dead_sessions
        """The debris of dead sessions looked for too."""
        self.first = first
        """The readings ``Checker._quiet`` took, for the first pass, and whether it took the census too
        (``Census.last``)."""
        self.siblings: dict[Key, SiblingUse] = {}
        """Processes of live sibling xdist workers seen on these devices, by identity."""
        self.peers: set[int] = set()
        """Sibling xdist workers themselves seen on these devices (their own CUDA contexts)."""


class CheckerParts(Protocol):
    """What one check uses of its checker (``checker.Checker``, which imports this module)."""

    @property
    def uid(self) -> int: ...
    @property
    def settle(self) -> float: ...

    def snapshot(self, devices: Sequence[DeviceInfo]) -> tuple[DeviceSnapshot, ...]: ...

    def observe(self, look: Look) -> Snapshot: ...

    def observe_unread(self, look: Look, readings: tuple[DeviceSnapshot, ...]) -> Snapshot: ...

    def observe_left(self, look: Look, seen: Snapshot, ours: Sequence[CensusEntry], recount: bool
                     ) -> Snapshot: ...

    def reap_round(self, fresh: Sequence[CensusEntry], readings: Sequence[DeviceSnapshot],
                   devices: Sequence[DeviceInfo], notes: list[str], *, freeze: set[str | None] | None = None,
                   scan_cookies: bool = False) -> tuple[list[CensusEntry], list[Reaped]]: ...

    def remember(self, verdict: Verdict) -> None: ...


class Check:
    """One check of ``devices`` (``Checker.check`` says what the arguments mean)."""

    def __init__(self, checker: CheckerParts, phase: Phase, devices: Sequence[DeviceInfo], tolerance_mib: int,
                 timeout: float, scan_cookies: bool, dead_sessions: bool, reap: bool,
                 where: str = "an earlier check", started: float | None = None,
                 first: tuple[tuple[DeviceSnapshot, ...], bool] | None = None, known: Collection[Key] = ()
                 ) -> None:
        self.c = checker
        self.phase = phase
        self.devices = devices
        self.tolerance_mib = tolerance_mib
        self.reap_enabled = reap
        self.started = time.monotonic() if started is None else started
        self.look = Look(devices, tolerance_mib, scan_cookies, dead_sessions, first)
        self.judge = Judge(devices, tolerance_mib, timeout, reap, checker.uid, where)
        self.known = frozenset(known)
        """Leaks of ours an earlier check found and left (reaping is off), by identity."""
        # What the acts did:
        self.reaped: list[Reaped] = []
        self.notes: list[str] = []
        self.attempted: set[Key] = set()
        self.collected: list[Reaped] = []
        self.collected_ids: set[Key] = set()
        self.settled = False
        self.rounds = 0
        self.reaped_owners: set[str | None] = set()
        # When the check began, on the clock of the processes' start times (its first census may be older
        # than this object: ``Checker._quiet``'s).
        self.began_ticks = procfs.boot_ticks_now() - int(
            (time.monotonic() - self.started) * procfs.CLOCK_TICKS)
        self.births: dict[str | None, set[Key]] = {}
        """Per owner, its processes born since the check began, as the passes saw them (alive or exited)."""
        self.chains: dict[str | None, set[int]] = {}
        """Per owner found replacing itself (``decisions.self_replacing``): the pids of its chain seen."""
        self.collected_of: dict[str | None, set[int]] = {}
        """Per owner, the pids collected as exited (a chain's are none of those: ``result``)."""

    def run(self) -> CheckResult:
        while True:
            # Observe.
            seen = self.c.observe(self.look)
            now = time.monotonic()
            born = self.note_births(seen)
            # Decide: a chain that replaces itself first; then what of ours is alive and not signalled yet;
            # with none of it, the verdict.
            chains = decisions.self_replacing(self.births, {
                f.token for f in seen.ours if f.live and f.start_ticks < self.began_ticks}) if born else set()
            fresh = [f for f in seen.ours if f.live and f.key not in self.attempted] if seen.ours else []
            if chains and self.reap_enabled and self.rounds < MAX_REAP_ROUNDS:
                move: decisions.Move | None = None
            else:
                move = decisions.next_move(bool(fresh), self.reap_enabled, self.rounds, self.settled,
                                        self.c.settle)
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
                # (Processes of ours born or exited since the last look: not done while they keep coming and
                # going. The census may be a step behind a chain that forks faster than it reads: each of
                # the processes it saw has exited, the one alive now was born after it began.)
                self.c.remember(verdict)
                return self.result(seen, verdict, fresh, now - self.started)
            else:
                time.sleep(POLL_S)

    def note_births(self, seen: Snapshot) -> bool:
        """Note the processes of ours born since the check began, alive or exited; whether this pass saw any
        for the first time."""
        began, births, new = self.began_ticks, self.births, False
        for f in seen.ours:
            if f.start_ticks >= began:
                known = births.setdefault(f.token, set())
                if f.key not in known:
                    known.add(f.key)
                    new = True
        return new

    def _known_alone(self, seen: Snapshot) -> frozenset[Key]:
        """The known leaks (``known``) alive in ``seen``, if nothing but them and the excused holds memory on
        the devices: waiting for them is waiting for nothing (a new leak or process is judged as ever)."""
        if not self.known:
            return frozenset()
        alive = frozenset(f.key for f in seen.ours if f.live and f.key in self.known)
        if alive and decisions.unexplained_beside(seen.readings, seen.excused | {pid for pid, _ in alive},
                                               self.look.tolerance):
            return frozenset()
        return alive

    # ---- act ---------------------------------------------------------------------------------------

    def collect_zombies(self, seen: Snapshot) -> None:
        # Exited processes nobody waited for hold no memory and are no leak: most are orphans that our
        # subreaper adopted (a double fork's middle process, a subprocess's resource tracker), which init
        # would have collected. Collect the ones that are now our children, by pid.
        for f in seen.ours:
            if not f.live and f.key not in self.collected_ids and processes.reap_if_child(f.pid):
                self._collect(f, seen, "reaped zombie")

    def settle(self, fresh: Sequence[CensusEntry], seen: Snapshot) -> None:
        """Before the first reaping, give leftovers up to ``settle`` seconds to exit on their own (a
        subprocess's resource tracker that cleans up after its client, an engine finishing its shutdown),
        for as long as one of them runs: leftovers that all stay off the CPU for ``AT_REST_S`` are waiting
        for nothing that will come, and are reaped at once (a leak costs its release time, not the
        settle time). The next pass looks again before any signal: what exited is collected, and a child
        that was still between its fork and its exec when the check began now shows its command line (a
        helper or persistent process named by one)."""
        self.settled = True
        now = time.monotonic()
        deadline, rest_from = now + self.c.settle, now
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
        """Freeze and SIGKILL the processes of ``owners``, which replace themselves while the check waits
        (``decisions.self_replacing``): what is alive of them now, and each that appears while the freeze
        looks
        again, until none does. Their processes that exited meanwhile were the chain, not processes that
        exited by themselves."""
        self.rounds += 1
        alive = [f for f in seen.ours if f.live and f.token in owners]
        targets, reaped = self.c.reap_round(alive, seen.readings, self.devices, self.notes, freeze=owners,
                                            scan_cookies=self.look.scan_cookies)
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
            # Killed processes were replaced (a SIGTERM handler that forks, a supervisor): stop the
            # whole set first, so nothing forks while we look, then SIGKILL it; no handler runs again.
            self.notes.append(respawned_note(self.rounds + 1, fresh))
            frozen = {f.token for f in fresh} | self.reaped_owners
        self.rounds += 1
        targets, reaped = self.c.reap_round(fresh, seen.readings, self.devices, self.notes, freeze=frozen,
                                            scan_cookies=self.look.scan_cookies)
        self.attempted.update(f.key for f in targets)
        self.reaped_owners.update(f.token for f in targets)
        self.reaped.extend(reaped)
        # What could not be signalled is not retried: waiting for it is what the verdict does.

    def _collect(self, f: CensusEntry, seen: Snapshot, how: EndedBy) -> None:
        # One of ours that ended without being killed: reported in the summary, not a leak.
        self.collected_ids.add(f.key)
        self.collected_of.setdefault(f.token, set()).add(f.pid)
        info = seen.described.get(f.key) or seen.vanished[f.key]
        self.collected.append(Reaped(info, seen.owners[f.key], f.found_by, how, (), None))

    # ---- the result ------------------------------------------------------------------------------

    def result(self, seen: Snapshot, verdict: Verdict, fresh: Collection[CensusEntry], waited: float
               ) -> CheckResult:
        """The check's result: the verdict on the last pass, with what the check did on the way."""
        if fresh and self.rounds >= MAX_REAP_ROUNDS:
            self.notes.append(f"gave up after {self.rounds} reaping rounds: killed processes keep being "
                              f"replaced (a process pool or supervisor outside our reach?)")
        notes = [*self.notes, *(
            f"pid {u.process.pid}: in use by {u.describe()} ({report_mib(u.mib_per_device)}); another worker "
            f"of this xdist run: not waited for, never signalled (its worker reaps it if it was leaked)"
            for u in seen.siblings), *(
            f"pid {pid}: another worker of this xdist run, its pytest process itself "
            f"({report_mib(mib_of(pid, seen.readings)) or 'no memory now'}): excused like our own"
            for pid in sorted(seen.peers))]
        found, readings, me = verdict.offenders, seen.readings, seen.me
        # A chain's processes did not exit by themselves: the chain replaced them.
        chained = {pid for owner in self.chains for pid in self.collected_of.get(owner, ())}
        collected = [r for r in self.collected if r.process.pid not in chained] if chained else self.collected
        return CheckResult(
            phase=self.phase, clean=not found, devices=readings, offenders=found,
            lingered=verdict.lingered, collected=tuple(collected), reaped=tuple(self.reaped),
            waited_s=waited, clean_after_s=waited if not found else None, notes=tuple(notes),
            siblings=seen.siblings, tolerance_mib=self.tolerance_mib,
            self_mib=tuple((s.device.label, s.bytes_of({me}) / MIB) for s in readings if s.bytes_of({me})),
            self_cuda_only=() if not seen.self_cuda else tuple(
                s.device.label for s in readings if s.device.label in seen.self_cuda),
            outside=verdict.outside,
        )

    def unreadable(self, error: DeviceError) -> CheckResult:
        """The result of a check that could not read a device: not clean, at once (no reading can say when
        the devices are clean), with the error. What is provably ours is reaped all the same: ownership
        needs no device reading (the final sweep copes the same way), and a test's leftovers must not
        wait for the session's end, nor make every later check fail."""
        c = self.c
        # Observe: the devices that can still be read tell what the reaped held there, and when it was
        # released; the census looks for our cookie everywhere (``Checker.observe_unread``).
        readable: list[DeviceInfo] = []
        readings: list[DeviceSnapshot] = []
        for device in self.devices:
            try:
                readings.extend(c.snapshot((device,)))
                readable.append(device)
            except DeviceError:
                continue
        seen = c.observe_unread(self.look, tuple(readings))
        # Act: what exits by itself within the settle time is no leak here either; the rest is reaped.
        self.collect_zombies(seen)
        ours = [f for f in seen.ours if f.live]
        fresh = [f for f in ours if f.key not in self.attempted]
        move = decisions.next_move(bool(fresh), self.reap_enabled, self.rounds, self.settled, c.settle)
        if move == "settle":
            self.settle(fresh, seen)
            fresh = [f for f in fresh if f.key not in self.collected_ids]
            ours = [f for f in ours if f.key not in self.collected_ids]
        reap = self.reap_enabled and bool(fresh)
        if reap:
            self.attempted.update(f.key for f in fresh)
            self.reaped.extend(c.reap_round(fresh, readings, readable, self.notes)[1])
        # Observe again, and decide: only what is ours is judged (nothing excused, each device's whole use
        # as overhead), as it is left.
        seen = c.observe_left(self.look, seen, ours, recount=reap)
        return CheckResult(
            phase=self.phase, clean=False, devices=tuple(readings),
            offenders=tuple(offenders(seen, self.look.tolerance, self.reap_enabled, c.uid)),
            collected=tuple(self.collected), reaped=tuple(self.reaped),
            waited_s=time.monotonic() - self.started, notes=tuple(self.notes),
            tolerance_mib=self.tolerance_mib, error=error.describe(),
            device_lost=isinstance(error, DeviceLost))


def respawned_note(round_no: int, new: Sequence[CensusEntry]) -> str:
    """The note of a reaping round that found new processes where it had killed some: frozen, then killed."""
    return (f"new processes appeared while reaping (round {round_no}): {sorted(f.pid for f in new)}; stopped "
            "and killed with SIGKILL")


def _few(pids: Sequence[int], shown: int = 8) -> str:
    """``pids``, the first ``shown`` of them and how many more."""
    listed = ", ".join(str(pid) for pid in pids[:shown])
    return listed + (f" and {len(pids) - shown} more" if len(pids) > shown else "")


def _cpu_demand(entries: Sequence[CensusEntry]) -> list[int | None]:
    """What each of ``entries`` has run or waited to run (``procfs.cpu_demand_ns``); -1 for one the kernel
    is taking down (never at rest)."""
    found: list[int | None] = []
    for f in entries:
        stat = procfs.read_stat(f.pid)
        found.append(-1 if stat is not None and stat.exiting else procfs.cpu_demand_ns(f.pid))
    return found
