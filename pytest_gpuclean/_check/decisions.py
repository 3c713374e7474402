"""What a pass of a check decides, as functions over plain data: no /proc, no devices, no signals.

Which processes are the session's to judge and which are excused (``sort_census``), what unlisted memory the
excused contexts explain (``listed_overhead``, ``context_overhead``), whether something the session does not
explain holds a GPU (``unexplained_use``), what the pass does next (``next_move``), which owners replace
themselves (``self_replacing``), what the session's end sweeps (``of_the_sweep``); then the verdict on the
pass's ``Snapshot`` (``Judge``, ``offenders``), and what of it is from outside the session and was waited out
before (``outside_of``, ``known_outside``). Tested by hand-built records (tests/test_checker_decisions.py)."""

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
"""Per excused CUDA context, memory the driver counts as used but lists under no process (9 MiB on an H200:
measured); the margin keeps other drivers' larger overheads excused too."""
MAX_REAP_ROUNDS = 4
"""Rounds of reaping within one check; from the second on, what reappeared is frozen and SIGKILLed."""
CHAIN_BIRTHS = 3
"""Processes of one owner born while a check waits that make it a self-replacing chain, once nothing of that
owner older than the check is left alive: each process forks the next and exits at once, so none waits for a
signal (``self_replacing``). A daemon's double fork is two."""

class SortedCensus(NamedTuple):
    """A census sorted against the pids the driver lists (``sort_census`` says what each part is). The sets
    are the caller's to go on with: it excuses more of what is unexplained (persistent processes, peers)."""

    ours: list[CensusEntry]
    unknown: list[CensusEntry]
    excused: set[int]
    unexplained: set[int]


def sort_census(found: Sequence[CensusEntry], protected: Callable[[CensusEntry], bool],
                never_touch: Collection[int],
                helpers: Collection[int], listed: set[int]) -> SortedCensus:
    """Sort ``found`` (a census) against ``listed`` (the pids the driver lists on the checked GPUs):
    ``ours``, ``unknown``, ``excused``, ``unexplained``.

    - ours: provably the session's and not ``protected`` now (``Census.is_protected``): judged, and reaped
      if reaping is on. Debris of a dead session is never protected, so it is ours.
    - unknown: alive and of unknown birth (no token): reported, never signalled.
    - excused: pids whose GPU use is the session's own: ``never_touch`` (this process and its ancestors),
      multiprocessing's ``helpers``, and what is protected now but of known owner (a live fixture's, the
      session set-up's, what is older than the session): their memory is not a leak of the test.
    - unexplained: the listed pids that none of the above explains: another session's, another user's, a
      sibling xdist worker's (the caller excuses those it can prove), or a stranger's.
    """
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
"""A device whose listed contexts do not explain its unlisted memory: (its snapshot, the pids listed there,
the unlisted bytes, the bytes its listed contexts allow)."""


def listed_overhead(snaps: Sequence[DeviceSnapshot], excused: set[int]) -> tuple[dict[str, int], list[Short]]:
    """Per device: memory the driver charges to no process that is excused as ours, as far as the listed
    processes explain it; and the devices where they fall short (``context_overhead`` decides those).

    Only where every listed process is excused (ours), and at most CONTEXT_OVERHEAD_BYTES per listed
    process (a CUDA context). Anything beyond stays visible as dirty memory.
    """
    overhead: dict[str, int] = {}
    short: list[Short] = []
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
    return overhead, short


def _unlisted_users(snap: DeviceSnapshot, listed: set[int], users: Mapping[int, frozenset[str]]) -> list[int]:
    return [pid for pid, uuids in users.items() if snap.device.uuid in uuids and pid not in listed]


def short_of_users(short: Sequence[Short], users: Mapping[int, frozenset[str]]) -> bool:
    """Whether ``users`` (pid: the UUIDs it has open) leave a device of ``short`` unexplained: then the
    other excused processes are worth asking about too (a syscall per descriptor each)."""
    return any(u > a + CONTEXT_OVERHEAD_BYTES * len(_unlisted_users(s, ls, users)) for s, ls, u, a in short)


def context_overhead(short: Sequence[Short], users: Mapping[int, frozenset[str]], me: int,
                     self_cuda: set[str]) -> dict[str, int]:
    """For each device of ``short``: the unlisted memory excused, at most CONTEXT_OVERHEAD_BYTES for each
    listed process and each excused one that uses CUDA there unlisted (``users``: pid: the UUIDs it has
    open; CUDA initialised without a context costs memory too). Adds to ``self_cuda`` each device where
    ``me`` is such a user."""
    overhead: dict[str, int] = {}
    for snap, listed, unlisted, allowed in short:
        unlisted_users = _unlisted_users(snap, listed, users)
        if me in unlisted_users:
            self_cuda.add(snap.device.label)
        overhead[snap.device.uuid] = min(unlisted, allowed + CONTEXT_OVERHEAD_BYTES * len(unlisted_users))
    return overhead


def unexplained_use(snaps: Sequence[DeviceSnapshot], unexplained: Collection[int],
                    excused: frozenset[int] | set[int], overhead: Mapping[str, int], tolerance: int) -> bool:
    """Whether something holds a GPU that the session does not explain: a listed process that is neither ours
    nor excused, or memory beyond ``tolerance`` that nothing excused holds. The census then looks wider (an
    escapee with our cookie, a dead session's debris), and what earlier checks waited out from outside is
    read (only then can a finding be from outside)."""
    return bool(unexplained) or any(
        s.used_bytes - s.bytes_of(excused) - overhead[s.device.uuid] > tolerance for s in snaps)


def unexplained_beside(snaps: Sequence[DeviceSnapshot], excused: frozenset[int] | set[int], tolerance: int
                       ) -> bool:
    """Whether memory beyond ``tolerance`` is on ``snaps`` that ``excused`` (with what their contexts cost
    unlisted, as ``listed_overhead`` and ``context_overhead`` allow it: the most, where they fall short) do
    not hold: something new beside them."""
    overhead, short = listed_overhead(snaps, set(excused))
    overhead.update((snap.device.uuid, allowed) for snap, _, _, allowed in short)
    return any(s.used_bytes - s.bytes_of(excused) - overhead[s.device.uuid] > tolerance for s in snaps)


Move = Literal["settle", "reap", "judge"]
"""What a pass of a check does once it has looked: give leftovers the settle time, reap, or judge."""


def next_move(fresh: bool, reap_enabled: bool, rounds: int, settled: bool, settle_s: float) -> Move:
    """What a pass does with leftovers of the session not yet signalled (``fresh``): before the first
    reaping, give them ``settle_s`` seconds to exit on their own (once); then reap them, for at most
    ``MAX_REAP_ROUNDS`` rounds; with nothing left to reap (or reaping off), judge."""
    if not (reap_enabled and fresh):
        return "judge"
    if not rounds and not settled and settle_s > 0:
        return "settle"
    return "reap" if rounds < MAX_REAP_ROUNDS else "judge"


def self_replacing(births: Mapping[str | None, Collection[tuple[int, int]]],
                   older_alive: Collection[str | None]) -> set[str | None]:
    """The owners whose processes replace themselves while a check waits: at least ``CHAIN_BIRTHS`` of
    theirs born since the check began (``births``: by owner token, the identities seen, alive or exited),
    and none of theirs from before it alive (``older_alive``: those owners have a process that could be
    waiting for a signal, a supervisor that a SIGTERM ends in order). Such a chain is frozen and SIGKILLed:
    a SIGTERM finds each of its processes gone, and a check that looks once may find only the exited ones
    and call it clean."""
    return {owner for owner, born in births.items()
            if owner is not None and len(born) >= CHAIN_BIRTHS and owner not in older_alive}


def of_the_sweep(found: Iterable[CensusEntry], excluded: Collection[str]) -> list[CensusEntry]:
    """What a session-end sweep ends of a census: each live process of known birth (a token: a test's, a
    fixture's, the session set-up's) whose token is not ``excluded`` (what is older than the session, and,
    until the very end, the session set-up's). One of unknown birth is reported, never signalled; an exited
    one holds nothing. The sweep reaps these, and with reaping off the session's closing note lists them."""
    return [f for f in found if f.live and f.token is not None and f.token not in excluded]


SLACK_BYTES = 16 * MIB
"""How far memory held from outside may move and still be "the same" state (or the check's tolerance, if
larger): a CUDA context of the session's that the driver lists under no process while a process that is
not ours is listed there must not make the same outside holder new again. Only how long
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


class Identities(NamedTuple):
    """Who the processes a pass judges are, by identity."""

    described: Mapping[Key, ProcessInfo]
    """Of ``ours`` and ``unknown``, each that could still be described."""
    vanished: Mapping[Key, ProcessInfo]
    """Of ``ours``, a stand-in (``reaping.vanished``) for each that ended before it could be described."""
    owners: Mapping[Key, Owner]
    """Of ``ours``, whose each is."""
    left_alone: Mapping[Key, str]
    """Of ``ours``, what the signal gate refused so far, and why (``gate.refusal``)."""


class Others(NamedTuple):
    """What a pass found that is not the session's: on its GPUs, among its xdist run's, on this host."""

    foreign: tuple[ProcessInfo, ...]
    """The unexplained processes but the allowlisted, in pid order (one that ended before it could be
    described: a stand-in, ``reaping.vanished``)."""
    allowlisted: frozenset[int]
    """Unexplained pids whose command line an ``--gpuclean-ignore`` glob matches."""
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
    strays: tuple[ProcessInfo, ...]
    """Under host scope: this user's other live Python processes, in pid order."""


class OwnUse(NamedTuple):
    """The GPU use of the process running the check (and the contexts it excuses)."""

    me: int
    """The process running the check."""
    overhead: Mapping[str, int]
    """Per device UUID: the memory the driver charges to no process that is excused as the contexts'."""
    self_cuda: frozenset[str]
    """Labels of the devices where this process uses CUDA without a context the driver lists."""


class Snapshot(NamedTuple):
    """Every fact one pass of a check decides on, read at once (``Checker.observe``)."""

    readings: tuple[DeviceSnapshot, ...]
    """The checked devices."""
    census: tuple[CensusEntry, ...]
    """The session's processes (``Census.take``)."""
    ours: tuple[CensusEntry, ...]
    """Of the census, what is judged (``sort_census``): provably the session's and not protected now; exited
    ones too (zombies the check collects)."""
    unknown: tuple[CensusEntry, ...]
    """Of the census, what is alive and of unknown birth: reported, never signalled."""
    excused: frozenset[int]
    """Pids whose GPU use is the session's own (this process, its ancestors, helpers, live fixtures'
    processes, persistent ones, sibling xdist workers and what they started)."""
    unexplained: frozenset[int]
    """Pids the driver lists that nothing of the session explains."""
    who: Identities
    others: Others
    own: OwnUse


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
        left (reaping is off), with nothing new beside them (``known_alone``): not waited for."""
        found = offenders(seen, self.tolerance, self.reap_enabled, self.my_uid)
        for o in found:
            if o.reason == "leaked" and o.process is not None:
                self.first_seen.setdefault((o.process.pid, o.process.start_ticks), o)
        # What cannot be the session's, as each of its devices is now (and was it waited out before?).
        outside, states, clean = outside_of(found, seen.readings, self.devices, seen.excused, seen.census,
                                            seen.unexplained, seen.own.overhead, self.tolerance,
                                            seen.others.of_our_run, seen.others.start_ticks)
        known_out = known_outside(states, seen.others.remembered if states else {}, self.outside_seen,
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
    (``sort_census``, ``listed_overhead``); ``start_ticks`` names each unexplained holder's
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
