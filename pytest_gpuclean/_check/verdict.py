"""The verdict of one pass of a check, over its snapshot: functions of plain data, no /proc, no devices, no
signals.

A pass of a check (``checking/check.py``) first reads every fact it decides on into a ``Snapshot``
(``Checker.observe``): the devices, the census sorted (``decide.sort_census``), who each process is, what
earlier checks waited out from outside. ``Judge.verdict`` makes of it the offenders (``offenders``: a leak
of the session's, a process on its GPUs that is not its own, memory no process accounts for, under host
scope a stray Python process), what of them cannot be the session's and was waited out before
(``outside_of``, ``known_outside``), and whether looking again can help (``hopeless``). The check then acts
on the verdict.

What held a GPU from outside the session when a check waited it out is remembered per device
(``OutsideState``, kept by ``checking/outside.py``): a later check that finds the very same state, unchanged
for at least its own timeout, does not wait for it again.

Unit-tested without processes (``tests/test_checker_decisions.py``).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from typing import NamedTuple

from pytest_gpuclean._model.records import (
    MIB,
    UNKNOWN_OWNER,
    CensusEntry,
    DeviceInfo,
    DeviceSnapshot,
    Offender,
    Outside,
    Owner,
    ProcessInfo,
    SiblingUse,
)

__all__ = [
    "SLACK_BYTES",
    "Holders",
    "Judge",
    "Key",
    "OutsideState",
    "Snapshot",
    "Verdict",
    "excess_memory",
    "hopeless",
    "known_outside",
    "leak_detail",
    "mib_of",
    "offenders",
    "outside_of",
]


SLACK_BYTES = 16 * MIB
"""How far memory held from outside may move and still be "the same" state (or the check's tolerance, if
larger): a CUDA context of the session's that the driver lists under no process while a process that is
not ours is listed there (seen on an H200) must not make the same outside holder new again. Only how long
a check waits depends on it: never its verdict."""

Holders = frozenset[tuple[int, int]]
"""(pid, start ticks) of each process listed on a device that is not ours (start ticks 0: not visible)."""


class OutsideState(NamedTuple):
    """What held one device from outside the session, unchanged since ``since``."""

    holders: Holders
    """(pid, start ticks) of each process listed there that is not ours (start ticks 0: not visible)."""
    used_bytes: int
    """Memory there that is not ours."""
    where: str
    """The check that saw it: a test's node id."""
    since: float
    """``time.monotonic()`` (the same clock in every process of the host) when a check first saw it so;
    it did not change while that check waited."""

    def same(self, holders: Holders, used_bytes: int, slack: int) -> bool:
        """The same processes (pid and start time: not a new process that reused a pid), the same memory
        give or take ``slack``."""
        return self.holders == holders and abs(self.used_bytes - used_bytes) <= slack


Key = tuple[int, int]
"""A process's identity: (pid, start ticks)."""


class Snapshot(NamedTuple):
    """Every fact one pass of a check decides on, read at once (``Checker.observe``)."""

    readings: tuple[DeviceSnapshot, ...]
    """The checked devices."""
    census: tuple[CensusEntry, ...]
    """The session's processes (``Census.take``)."""
    ours: tuple[CensusEntry, ...]
    """Of the census, what is judged (``decide.sort_census``): provably the session's and not protected now;
    exited ones too (zombies the check collects)."""
    unknown: tuple[CensusEntry, ...]
    """Of the census, what is alive and of unknown birth: reported, never signalled."""
    excused: frozenset[int]
    """Pids whose GPU use is the session's own (this process, its ancestors, helpers, live fixtures'
    processes, persistent ones, sibling xdist workers and what they started)."""
    unexplained: frozenset[int]
    """Pids the driver lists that nothing of the session explains."""
    overhead: Mapping[str, int]
    """Per device UUID: the memory the driver charges to no process that is excused as the contexts'."""
    described: Mapping[Key, ProcessInfo]
    """Of ``ours`` and ``unknown``, each that could still be described, by its identity."""
    vanished: Mapping[Key, ProcessInfo]
    """Of ``ours``, a stand-in (``reaping.vanished``) for each that ended before it could be described."""
    owners: Mapping[Key, Owner]
    """Of ``ours``, whose each is."""
    foreign: tuple[ProcessInfo, ...]
    """The unexplained processes but the allowlisted, in pid order (one that ended before it could be
    described: a stand-in, ``reaping.vanished``)."""
    allowlisted: frozenset[int]
    """Unexplained pids whose command line an ``--gpuclean-ignore`` glob matches."""
    strays: tuple[ProcessInfo, ...]
    """Under host scope: this user's other live Python processes, in pid order."""
    of_our_run: frozenset[int]
    """Of ``foreign``, the pids a sibling xdist worker of our run started: the run's, not outside."""
    start_ticks: Mapping[int, int]
    """When each unexplained pid started: an outside holder's identity (0: not visible, or exited)."""
    remembered: Mapping[str, OutsideState]
    """Per device UUID, the outside state an earlier check waited out; read only where something here may
    be from outside."""
    siblings: tuple[SiblingUse, ...]
    """What sibling xdist workers' tests ran on these devices, as this check has seen it so far."""
    peers: frozenset[int]
    """The sibling xdist workers seen on these devices so far (their own CUDA contexts)."""
    self_cuda: frozenset[str]
    """Labels of the devices where this process uses CUDA without a context the driver lists."""
    me: int
    """The process running the check."""
    left_alone: Mapping[Key, str]
    """Of ``ours``, what the signal gate refused so far, and why (``gate.refusal``)."""


class Verdict(NamedTuple):
    """What a pass of a check decided: the offenders, and whether to look again; if not, what outlived its
    test and ended by itself, what was found from outside, and what later checks remember of it."""

    offenders: tuple[Offender, ...]
    again: bool
    """Something may still go away: look again (the rest is then empty)."""
    lingered: tuple[Offender, ...]
    outside: Outside | None
    remember: Mapping[str, OutsideState]
    """Per device UUID: the outside state this check waited out, for the later checks."""
    forget: tuple[str, ...]
    """The devices clean from outside now: a later state there is new again."""


class Judge:
    """The verdicts of one check: its settings, and what it carries from one pass to the next (each leak as
    first seen, for one that then ends by itself; each device's outside state, and since when)."""

    def __init__(self, devices: Sequence[DeviceInfo], tolerance_mib: int, timeout: float, reap_enabled: bool,
                 my_uid: int, where: str) -> None:
        self.devices = devices
        self.tolerance = tolerance_mib * MIB
        self.timeout = timeout
        self.reap_enabled = reap_enabled
        self.my_uid = my_uid
        self.where = where
        self.first_seen: dict[Key, Offender] = {}
        self.outside_seen: dict[str, OutsideState] = {}
        """Per device UUID: its outside state as this check last found it, and since when unchanged."""

    def verdict(self, seen: Snapshot, attempted: AbstractSet[Key], waited: float, now: float,
                known: AbstractSet[Key] = frozenset()) -> Verdict:
        """The verdict on ``seen``, ``waited`` seconds into the check (at ``now``, ``time.monotonic``);
        ``attempted``: what the check has signalled; ``known``: leaks of ours that an earlier check found and
        left (reaping is off), with nothing new beside them (``decide.known_alone``): not waited for."""
        found = offenders(seen, self.tolerance, self.reap_enabled, self.my_uid)
        for o in found:
            if o.reason == "leaked" and o.process is not None:
                self.first_seen.setdefault((o.process.pid, o.process.start_ticks), o)
        # What cannot be the session's, as each of its devices is now (and was it waited out before?).
        outside, states, clean = outside_of(found, seen.readings, self.devices, seen.excused, seen.census,
                                            seen.unexplained, seen.overhead, self.tolerance, seen.of_our_run,
                                            seen.start_ticks)
        known_out = known_outside(states, seen.remembered if states else {}, self.outside_seen,
                                  max(self.tolerance, SLACK_BYTES), now, self.timeout, self.where)
        # Processes that survived our SIGKILL, or that we may not signal, do not go away by waiting; nor does
        # an outside state that an earlier check already waited out, and finds again unchanged.
        unsignalled = {f.key for f in seen.unknown} | {
            f.key for f in seen.ours if f.live and (f.key in attempted or f.key in known)} if found else set()
        waited_out = not hopeless(found, unsignalled, outside, known_out)
        if found and waited_out and waited < self.timeout:
            return Verdict(tuple(found), True, (), None, {}, ())
        # Waited out: remembered (an earlier check's, if it is the same). Clean from outside: forgotten.
        remember = {u: self.outside_seen[u] for u in states if waited_out and u in self.outside_seen}
        return Verdict(tuple(found), False, self._lingered(found, waited),
                       self._outside_found(seen, found, outside, states, known_out, waited_out), remember,
                       tuple(clean))

    def _lingered(self, found: Sequence[Offender], waited: float) -> tuple[Offender, ...]:
        """The leaks first seen by this check that are gone now: they outlived their test, and ended by
        themselves (reaping is off, or they ended before it)."""
        if not self.first_seen:
            return ()
        still = {(o.process.pid, o.process.start_ticks) for o in found if o.process is not None}
        return tuple(
            o._replace(detail=f"outlived its test, ended by itself within {waited:.2f}s (reaping is off)")
            for key, o in self.first_seen.items() if key not in still)

    def _outside_found(self, seen: Snapshot, found: Sequence[Offender], outside: Mapping[int, frozenset[str]],
                       states: Mapping[str, tuple[Holders, int]], known: AbstractSet[str], waited_out: bool
                       ) -> Outside | None:
        """What was found from outside, for the result."""
        if not outside:
            return None
        held = tuple((s.device.label, states[s.device.uuid][1] / MIB) for s in seen.readings
                     if s.device.uuid in states)
        # Not waited out here: every outside finding was a state an earlier check waited out.
        wheres = sorted({self.outside_seen[u].where for u in known & states.keys()})
        same_as = None if waited_out or not wheres else ", ".join(wheres)
        return Outside(held, only=len(outside) == len(found), same_as=same_as)


def offenders(seen: Snapshot, tolerance: int, reap_enabled: bool, my_uid: int) -> list[Offender]:
    """What keeps ``seen``'s devices from being clean, in the report's order: processes there that are not
    the session's (but the allowlisted), its leaks, memory beyond ``tolerance`` that no process we can see
    holds, under host scope this user's other Python processes, and what is of unknown birth."""
    readings = seen.readings
    found: list[Offender] = []
    for process in seen.foreign:
        found.append(Offender("foreign", process, None, "gpu", mib_of(process.pid, readings),
                              detail="not started by this session: waited for, never killed"))
    for f in seen.ours:
        info = seen.described.get(f.key)
        if f.live and info is not None:
            found.append(Offender("leaked", info, seen.owners[f.key], f.found_by, mib_of(f.pid, readings),
                                  detail=leak_detail(info.uid, info.user, info.state, my_uid, reap_enabled,
                                                     seen.left_alone.get(f.key))))
    blamed = {o.process.pid for o in found if o.process is not None}
    for snap, extra in excess_memory(readings, seen.excused, seen.overhead, tolerance, blamed):
        holders = sorted(seen.allowlisted & {p.pid for p in snap.processes})
        by = f"allowlisted pid(s) {holders}" if holders else "no process we can see"
        found.append(Offender(
            "memory", None, None, "gpu", ((snap.device.label, extra / MIB),),
            detail=f"{extra / MIB:.0f} MiB used on {snap.device.label} beyond the tolerance "
                   f"of {tolerance / MIB:.0f} MiB, held by {by}"))
    for process in seen.strays:
        found.append(Offender("host", process, None, "host", (),
                              detail="Python process of this user (host scope): never killed"))
    for f in seen.unknown:
        info = seen.described.get(f.key)
        if info is not None:
            found.append(Offender(
                "leaked", info, UNKNOWN_OWNER, f.found_by, mib_of(f.pid, readings),
                detail="no evidence of which test or fixture started it: left alone, never signalled"))
    return found


def excess_memory(snaps: Sequence[DeviceSnapshot], excused: frozenset[int] | set[int],
                  overhead: Mapping[str, int], tolerance: int, blamed: Collection[int]
                  ) -> list[tuple[DeviceSnapshot, int]]:
    """The devices with memory beyond ``tolerance`` that nothing excused holds, and how much: the memory an
    offender of its own. Memory of allowlisted processes counts (only their presence is excused); memory
    on a device where a ``blamed`` process (an offender already) is listed is not reported twice."""
    found = []
    for snap in snaps:
        extra = snap.used_bytes - snap.bytes_of(excused) - overhead.get(snap.device.uuid, 0)
        if extra > tolerance and not any(p.pid in blamed for p in snap.processes):
            found.append((snap, extra))
    return found


def leak_detail(process_uid: int, user: str, state: str, my_uid: int, reap_enabled: bool,
                left_alone: str | None = None) -> str:
    """Why a leaked process of the session is still there (``left_alone``: why the signal gate refused
    it)."""
    if process_uid != my_uid:
        return f"belongs to another user ({user}): never killed"
    if left_alone is not None:
        return f"left alone, never signalled: {left_alone}"
    if not reap_enabled:
        return "reaping is off"
    return f"could not be reaped ({state})"


def mib_of(pid: int, snaps: Sequence[DeviceSnapshot]) -> tuple[tuple[str, float], ...]:
    """(device label, MiB) of each device the driver lists ``pid`` on."""
    return tuple((s.device.label, s.bytes_of({pid}) / MIB) for s in snaps
                 if any(p.pid == pid for p in s.processes))


def hopeless(offenders: Sequence[Offender], unsignalled: Collection[Key],
             outside: Mapping[int, frozenset[str]], known: AbstractSet[str]) -> bool:
    """Whether waiting longer cannot make a check clean: there are offenders, and each is a leak that
    survived our SIGKILL or that we may not signal (its (pid, start ticks) in ``unsignalled``), or was found
    from outside the session (``outside``: its devices' UUIDs, by the offender's ``id``) only on devices
    whose outside state an earlier check already waited out (``known``)."""
    return bool(offenders) and all(
        (o.reason == "leaked" and o.process is not None
         and (o.process.pid, o.process.start_ticks) in unsignalled)
        or (bool(outside.get(id(o))) and outside[id(o)] <= known) for o in offenders)


def outside_of(offenders: Sequence[Offender], snaps: Sequence[DeviceSnapshot], devices: Sequence[DeviceInfo],
               excused: frozenset[int] | set[int], found: Iterable[CensusEntry],
               unexplained: AbstractSet[int], overhead: Mapping[str, int], tolerance: int,
               of_our_run: AbstractSet[int], start_ticks: Mapping[int, int]
               ) -> tuple[dict[int, frozenset[str]], dict[str, tuple[Holders, int]], list[str]]:
    """The findings of a check that cannot be the session's (by ``id``, each with the UUIDs of the devices
    it is on); each of those devices as a later check compares it (``known_outside``): the processes
    listed there that are not ours, and the memory there that is not ours; and the devices clean from
    outside.

    Cannot be the session's: a process the driver lists that is neither ours nor excused (a sibling
    xdist worker's processes are the run's, ``of_our_run``: not outside), and memory that no process we can
    see holds. A leak of ours, or a process of unknown owner that carries our cookie, never is. ``found``
    is the check's census, ``excused``, ``unexplained`` and ``overhead`` what it made of the snapshot
    (``decide.sort_census``, ``decide.listed_overhead``); ``start_ticks`` names each unexplained holder's
    start time (0 if it cannot be seen).
    """
    outside: dict[int, frozenset[str]] = {}
    if not offenders:
        return outside, {}, [d.uuid for d in devices]
    uuid_of = {s.device.label: s.device.uuid for s in snaps}
    for o in offenders:
        if o.reason == "memory" or (o.reason == "foreign" and o.process is not None
                                    and o.process.pid not in of_our_run):
            outside[id(o)] = frozenset(uuid_of[label] for label, _ in o.mib_per_device if label in uuid_of)
    states: dict[str, tuple[Holders, int]] = {}
    clean: list[str] = []
    dirty = frozenset().union(*outside.values())
    ours = excused | {f.pid for f in found}
    for snap in snaps:
        uuid = snap.device.uuid
        listed = [p.pid for p in snap.processes if p.pid in unexplained]
        used = snap.used_bytes - snap.bytes_of(ours) - overhead.get(uuid, 0)
        if uuid in dirty:
            states[uuid] = (frozenset((pid, start_ticks[pid]) for pid in listed), used)
        elif not listed and used <= tolerance:
            # (Not merely unreported: a leak of ours listed there hides memory nobody holds.)
            clean.append(uuid)
    return outside, states, clean


def known_outside(states: Mapping[str, tuple[Holders, int]], remembered: Mapping[str, OutsideState],
                  seen: dict[str, OutsideState], slack: int, now: float, timeout: float,
                  where: str) -> set[str]:
    """The devices whose outside state (``states``: per UUID, the holders and the memory not ours) is one an
    earlier check waited out (``remembered``), give or take ``slack``, unchanged since for at least this
    check's ``timeout``: waiting longer for it is waiting for nothing. (A check with a longer timeout than
    that one's waits the difference.)

    Updates ``seen``, per device, with the state this check (``where``) has seen unchanged, and since when:
    the remembered one when it is the same, else the state first seen at ``now``.
    """
    known: set[str] = set()
    for uuid, (holders, used) in states.items():
        earlier = remembered.get(uuid)
        if earlier is not None and earlier.same(holders, used, slack):
            seen[uuid] = earlier
            if now - earlier.since >= timeout:
                known.add(uuid)
            continue
        last = seen.get(uuid)
        if last is None or not last.same(holders, used, slack):
            seen[uuid] = OutsideState(holders, used, where, now)
    return known
