"""What a pass of a check decides, as functions over plain data: no /proc, no devices, no signals."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from typing import TYPE_CHECKING, Literal, NamedTuple

from pytest_gpuclean._model.records import (
    MIB,
    UNKNOWN_OWNER,
    DeviceInfo,
    DeviceSnapshot,
    Offender,
    Outside,
    Owner,
    ProcessInfo,
    SiblingUse,
)

if TYPE_CHECKING:
    from pytest_gpuclean._ownership.census import CensusEntry


CONTEXT_OVERHEAD_BYTES = 64 * MIB
"""Per excused CUDA context, memory the driver lists under no process (measured: 9 MiB), with a margin."""
MAX_REAP_ROUNDS = 4
"""From the second round on, what reappeared is frozen and SIGKILLed."""
CHAIN_BIRTHS = 3
"""Births during a check that make an owner a self-replacing chain (none of it older alive). A daemon's
double fork is two."""

class SortedCensus(NamedTuple):
    """A census sorted against the driver's list (``sort_census``). The caller goes on to excuse more of
    the unexplained (persistent processes, peers)."""

    ours: list[CensusEntry]
    unknown: list[CensusEntry]
    excused: set[int]
    unexplained: set[int]


def sort_census(found: Sequence[CensusEntry], protected: Callable[[CensusEntry], bool],
                never_touch: Collection[int],
                helpers: Collection[int], listed: set[int]) -> SortedCensus:
    """Sort ``found`` (a census) against ``listed`` (the pids on the checked GPUs).

    - ours: provably the session's and not ``protected`` now: judged and reaped. A dead session's debris is
      never protected.
    - unknown: alive, of unknown birth: reported, never signalled.
    - excused: GPU use that is the session's own (``never_touch``, ``helpers``, protected but of known
      owner).
    - unexplained: listed pids none of the above explains."""
    ours: list[CensusEntry] = []
    unknown: list[CensusEntry] = []
    excused = {*never_touch, *helpers}
    for f in found:
        if not protected(f):
            ours.append(f)
        elif f.token is not None:
            excused.add(f.pid)
        if f.token is None and f.debris_of is None and f.live:
            unknown.append(f)
    unexplained = listed - excused
    for f in ours:
        unexplained.discard(f.pid)
    for f in unknown:
        unexplained.discard(f.pid)
    return SortedCensus(ours, unknown, excused, unexplained)


Short = tuple[DeviceSnapshot, set[int], int, int]
"""A device whose listed contexts do not explain its unlisted memory: (snapshot, listed pids, unlisted
bytes, bytes the listed contexts allow)."""


def listed_overhead(snaps: Sequence[DeviceSnapshot], excused: set[int]) -> tuple[dict[str, int], list[Short]]:
    """Per device, the unlisted memory excused as ours (at most CONTEXT_OVERHEAD_BYTES per listed process,
    all of them excused), and the devices where that falls short. Anything beyond stays dirty."""
    overhead: dict[str, int] = {}
    short: list[Short] = []
    for snap in snaps:
        if not snap.processes and snap.used_bytes <= 0:
            overhead[snap.device.uuid] = 0
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
    return overhead, short


def _unlisted_users(snap: DeviceSnapshot, listed: set[int], users: Mapping[int, frozenset[str]]) -> list[int]:
    return [pid for pid, uuids in users.items() if snap.device.uuid in uuids and pid not in listed]


def short_of_users(short: Sequence[Short], users: Mapping[int, frozenset[str]]) -> bool:
    """Whether ``users`` leave a device of ``short`` unexplained: only then are other excused processes
    worth asking."""
    return any(u > a + CONTEXT_OVERHEAD_BYTES * len(_unlisted_users(s, ls, users)) for s, ls, u, a in short)


def context_overhead(short: Sequence[Short], users: Mapping[int, frozenset[str]], me: int,
                     self_cuda: set[str]) -> dict[str, int]:
    """For each device of ``short``, the unlisted memory excused: CONTEXT_OVERHEAD_BYTES per listed process
    and per excused one with CUDA open there (CUDA without a context costs memory too)."""
    overhead: dict[str, int] = {}
    for snap, listed, unlisted, allowed in short:
        unlisted_users = _unlisted_users(snap, listed, users)
        if me in unlisted_users:
            self_cuda.add(snap.device.label)
        overhead[snap.device.uuid] = min(unlisted, allowed + CONTEXT_OVERHEAD_BYTES * len(unlisted_users))
    return overhead


def unexplained_use(snaps: Sequence[DeviceSnapshot], unexplained: Collection[int],
                    excused: frozenset[int] | set[int], overhead: Mapping[str, int], tolerance: int) -> bool:
    """Whether something the session does not explain holds a GPU. Only then can a finding be from outside."""
    return bool(unexplained) or any(
        s.used_bytes - s.bytes_of(excused) - overhead[s.device.uuid] > tolerance for s in snaps)


def unexplained_beside(snaps: Sequence[DeviceSnapshot], excused: frozenset[int] | set[int], tolerance: int
                       ) -> bool:
    """Whether memory beyond ``tolerance`` is held beside ``excused`` (with the most their contexts may
    cost)."""
    overhead, short = listed_overhead(snaps, set(excused))
    overhead.update((snap.device.uuid, allowed) for snap, _, _, allowed in short)
    return any(s.used_bytes - s.bytes_of(excused) - overhead[s.device.uuid] > tolerance for s in snaps)


Move = Literal["settle", "reap", "judge"]


def next_move(fresh: bool, reap_enabled: bool, rounds: int, settled: bool, settle_s: float) -> Move:
    """Settle once, then reap for at most ``MAX_REAP_ROUNDS`` rounds; with nothing to reap, judge."""
    if not (reap_enabled and fresh):
        return "judge"
    if not rounds and not settled and settle_s > 0:
        return "settle"
    return "reap" if rounds < MAX_REAP_ROUNDS else "judge"


def self_replacing(births: Mapping[str | None, Collection[tuple[int, int]]],
                   older_alive: Collection[str | None]) -> set[str | None]:
    """Owners with ``CHAIN_BIRTHS`` or more born during the check and none older alive (that could be a
    supervisor a SIGTERM ends in order). A chain is frozen and SIGKILLed: a SIGTERM finds each process
    gone, and one look may see only the exited ones and call it clean."""
    return {owner for owner, born in births.items()
            if owner is not None and len(born) >= CHAIN_BIRTHS and owner not in older_alive}


def of_the_sweep(found: Iterable[CensusEntry], excluded: Collection[str]) -> list[CensusEntry]:
    """Each live process of known birth whose token is not ``excluded``."""
    return [f for f in found if f.live and f.token is not None and f.token not in excluded]


SLACK_BYTES = 16 * MIB
"""How far outside memory may move and still be the same state: our unlisted context must not make the same
holder new. It sets only how long a check waits, never its verdict."""

Holders = frozenset[tuple[int, int]]
"""(pid, start ticks) of each process listed on a device that is not ours (start ticks 0: not visible)."""


class OutsideState(NamedTuple):
    """What held one device from outside the session, unchanged since ``since``."""

    holders: Holders
    used_bytes: int
    where: str
    """A test's node id."""
    since: float
    """Monotonic (one clock for the host's processes): when a check first saw this state, unchanged since."""

    def same(self, holders: Holders, used_bytes: int, slack: int) -> bool:
        """Start times tell a reused pid from the same process; memory may differ by ``slack``."""
        return self.holders == holders and abs(self.used_bytes - used_bytes) <= slack


Key = tuple[int, int]


class Identities(NamedTuple):
    """Who the processes a pass judges are, by identity."""

    described: Mapping[Key, ProcessInfo]
    """Of ``ours`` and ``unknown``, each that could still be described."""
    vanished: Mapping[Key, ProcessInfo]
    """Of ``ours``, a stand-in for each that ended before it could be described."""
    owners: Mapping[Key, Owner]
    left_alone: Mapping[Key, str]
    """Of ``ours``, why the signal gate refused each so far."""


class Others(NamedTuple):
    """What a pass found that is not the session's: on its GPUs, in its xdist run, on this host."""

    foreign: tuple[ProcessInfo, ...]
    """The unexplained processes but the allowlisted, in pid order (a stand-in for one that ended)."""
    allowlisted: frozenset[int]
    of_our_run: frozenset[int]
    """The pids a sibling xdist worker of our run started: the run's, not outside."""
    start_ticks: Mapping[int, int]
    """Start ticks of each unexplained pid (0: not visible, or exited)."""
    remembered: Mapping[str, OutsideState]
    """Per device UUID, the outside state an earlier check waited out; read only when something may be from
    outside."""
    siblings: tuple[SiblingUse, ...]
    peers: frozenset[int]
    """Sibling xdist workers seen on these devices (their own CUDA contexts)."""
    strays: tuple[ProcessInfo, ...]
    """Host scope: this user's other live Python processes, in pid order."""


class OwnUse(NamedTuple):
    """The GPU use of the process running the check."""

    me: int
    overhead: Mapping[str, int]
    """Per device UUID, the unlisted memory excused as the contexts'."""
    self_cuda: frozenset[str]
    """Labels of devices where this process uses CUDA without a listed context."""


class Snapshot(NamedTuple):
    """Every fact one pass of a check decides on, read at once (``Checker.observe``)."""

    readings: tuple[DeviceSnapshot, ...]
    census: tuple[CensusEntry, ...]
    ours: tuple[CensusEntry, ...]
    """What is judged: provably the session's and not protected now; exited ones too (the check collects
    them)."""
    unknown: tuple[CensusEntry, ...]
    excused: frozenset[int]
    """Pids whose GPU use is the session's own (us, ancestors, helpers, live fixtures', persistent, sibling
    workers and theirs)."""
    unexplained: frozenset[int]
    who: Identities
    others: Others
    own: OwnUse


class Verdict(NamedTuple):
    """The offenders and whether to look again; if not, what ended by itself, what was from outside, and
    what to remember."""

    offenders: tuple[Offender, ...]
    again: bool
    """Look again (the rest is then empty)."""
    lingered: tuple[Offender, ...]
    outside: Outside | None
    remember: Mapping[str, OutsideState]
    """Per device UUID: the outside state this check waited out."""
    forget: tuple[str, ...]
    """Devices clean from outside now: a later state there is new again."""


class Judge:
    """The verdicts of one check, and what it carries between passes (leaks as first seen, outside states)."""

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

    def verdict(self, seen: Snapshot, attempted: AbstractSet[Key], waited: float, now: float,
                known: AbstractSet[Key] = frozenset()) -> Verdict:
        """The verdict ``waited`` seconds in. ``known``: leaks an earlier check left, not waited for alone."""
        found = offenders(seen, self.tolerance, self.reap_enabled, self.my_uid)
        for o in found:
            if o.reason == "leaked" and o.process is not None:
                self.first_seen.setdefault((o.process.pid, o.process.start_ticks), o)
        # What cannot be the session's (and was it waited out before?).
        outside, states, clean = outside_of(found, seen.readings, self.devices, seen.excused, seen.census,
                                            seen.unexplained, seen.own.overhead, self.tolerance,
                                            seen.others.of_our_run, seen.others.start_ticks)
        known_out = known_outside(states, seen.others.remembered if states else {}, self.outside_seen,
                                  max(self.tolerance, SLACK_BYTES), now, self.timeout, self.where)
        # Survivors of SIGKILL and what we may not signal do not go away by waiting; nor does a known outside
        # state.
        unsignalled = {f.key for f in seen.unknown} | {
            f.key for f in seen.ours if f.live and (f.key in attempted or f.key in known)} if found else set()
        waited_out = not hopeless(found, unsignalled, outside, known_out)
        if found and waited_out and waited < self.timeout:
            return Verdict(tuple(found), True, (), None, {}, ())
        # Waited out: remembered (an earlier check's, if the same). Clean from outside: forgotten.
        remember = {u: self.outside_seen[u] for u in states if waited_out and u in self.outside_seen}
        return Verdict(tuple(found), False, self._lingered(found, waited),
                       self._outside_found(seen, found, outside, states, known_out, waited_out), remember,
                       tuple(clean))

    def _lingered(self, found: Sequence[Offender], waited: float) -> tuple[Offender, ...]:
        """Leaks first seen by this check that are gone now: they ended by themselves."""
        if not self.first_seen:
            return ()
        still = {(o.process.pid, o.process.start_ticks) for o in found if o.process is not None}
        return tuple(
            o._replace(detail=f"outlived its test, ended by itself within {waited:.2f}s (reaping is off)")
            for key, o in self.first_seen.items() if key not in still)

    def _outside_found(self, seen: Snapshot, found: Sequence[Offender], outside: Mapping[int, frozenset[str]],
                       states: Mapping[str, tuple[Holders, int]], known: AbstractSet[str], waited_out: bool
                       ) -> Outside | None:
        if not outside:
            return None
        held = tuple((s.device.label, states[s.device.uuid][1] / MIB) for s in seen.readings
                     if s.device.uuid in states)
        # Not waited out here: every outside finding was a state an earlier check waited out.
        wheres = sorted({self.outside_seen[u].where for u in known & states.keys()})
        same_as = None if waited_out or not wheres else ", ".join(wheres)
        return Outside(held, only=len(outside) == len(found), same_as=same_as)


def offenders(seen: Snapshot, tolerance: int, reap_enabled: bool, my_uid: int) -> list[Offender]:
    """What keeps ``seen``'s devices from being clean, in the report's order."""
    readings = seen.readings
    found: list[Offender] = []
    for process in seen.others.foreign:
        found.append(Offender("foreign", process, None, "gpu", mib_of(process.pid, readings),
                              detail="not started by this session: waited for, never killed"))
    for f in seen.ours:
        info = seen.who.described.get(f.key)
        if f.live and info is not None:
            found.append(Offender("leaked", info, seen.who.owners[f.key], f.found_by, mib_of(f.pid, readings),
                                  detail=leak_detail(info.uid, info.user, info.state, my_uid, reap_enabled,
                                                     seen.who.left_alone.get(f.key))))
    blamed = {o.process.pid for o in found if o.process is not None}
    for snap, extra in excess_memory(readings, seen.excused, seen.own.overhead, tolerance, blamed):
        holders = sorted(seen.others.allowlisted & {p.pid for p in snap.processes})
        by = f"allowlisted pid(s) {holders}" if holders else "no process we can see"
        found.append(Offender(
            "memory", None, None, "gpu", ((snap.device.label, extra / MIB),),
            detail=f"{extra / MIB:.0f} MiB used on {snap.device.label} beyond the tolerance "
                   f"of {tolerance / MIB:.0f} MiB, held by {by}"))
    for process in seen.others.strays:
        found.append(Offender("host", process, None, "host", (),
                              detail="Python process of this user (host scope): never killed"))
    for f in seen.unknown:
        info = seen.who.described.get(f.key)
        if info is not None:
            found.append(Offender(
                "leaked", info, UNKNOWN_OWNER, f.found_by, mib_of(f.pid, readings),
                detail="no evidence of which test or fixture started it: left alone, never signalled"))
    return found


def excess_memory(snaps: Sequence[DeviceSnapshot], excused: frozenset[int] | set[int],
                  overhead: Mapping[str, int], tolerance: int, blamed: Collection[int]
                  ) -> list[tuple[DeviceSnapshot, int]]:
    """Devices with unexplained memory beyond ``tolerance``, and how much. Allowlisted processes' memory
    counts; a device with a ``blamed`` offender listed is not reported twice."""
    found = []
    for snap in snaps:
        extra = snap.used_bytes - snap.bytes_of(excused) - overhead.get(snap.device.uuid, 0)
        if extra > tolerance and not any(p.pid in blamed for p in snap.processes):
            found.append((snap, extra))
    return found


def leak_detail(process_uid: int, user: str, state: str, my_uid: int, reap_enabled: bool,
                left_alone: str | None = None) -> str:
    """Why a leaked process is still there (``left_alone``: why the gate refused it)."""
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
    """Whether waiting cannot help: each offender survived SIGKILL, may not be signalled, or is from
    outside only on devices whose state an earlier check waited out."""
    return bool(offenders) and all(
        (o.reason == "leaked" and o.process is not None
         and (o.process.pid, o.process.start_ticks) in unsignalled)
        or (bool(outside.get(id(o))) and outside[id(o)] <= known) for o in offenders)


def outside_of(offenders: Sequence[Offender], snaps: Sequence[DeviceSnapshot], devices: Sequence[DeviceInfo],
               excused: frozenset[int] | set[int], found: Iterable[CensusEntry],
               unexplained: AbstractSet[int], overhead: Mapping[str, int], tolerance: int,
               of_our_run: AbstractSet[int], start_ticks: Mapping[int, int]
               ) -> tuple[dict[int, frozenset[str]], dict[str, tuple[Holders, int]], list[str]]:
    """The findings that cannot be the session's (by ``id``, with their devices' UUIDs), each device's
    outside state, and the devices clean from outside. A leak of ours, or an unknown process with our
    cookie, never is outside."""
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
            # Not merely unreported: a leak of ours listed there hides memory nobody holds.
            clean.append(uuid)
    return outside, states, clean


def known_outside(states: Mapping[str, tuple[Holders, int]], remembered: Mapping[str, OutsideState],
                  seen: dict[str, OutsideState], slack: int, now: float, timeout: float,
                  where: str) -> set[str]:
    """The devices whose outside state an earlier check waited out (``remembered``, give or take
    ``slack``), unchanged for at least this ``timeout``: waiting longer is waiting for nothing. Updates
    ``seen``."""
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
