"""What a check decides from its readings before the verdict: functions over plain data, no /proc, no
devices, no signals.

A check reads (``devices``: a snapshot of each GPU; ``census.py``: the session's processes and their
tokens), then decides here: which processes are the session's to judge and which are excused
(``sort_census``), what unlisted memory the excused contexts explain (``listed_overhead``,
``context_overhead``), whether something the session's tree does not explain is on the GPUs
(``unexplained_use``: the census then looks wider), and what the pass does next (``next_move``: let
leftovers settle, reap, or judge: ``verdict.py``), and what the session-end sweep ends (``of_the_sweep``).
What may be signalled at all is the gate's (``gate.py``). Each is unit-tested without processes
(``tests/test_checker_decisions.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Generic, Literal, TypeVar

from pytest_gpuclean._model.records import MIB, CensusEntry, DeviceSnapshot

__all__ = [
    "CHAIN_BIRTHS",
    "CONTEXT_OVERHEAD_BYTES",
    "MAX_REAP_ROUNDS",
    "C",
    "Move",
    "Short",
    "SortedCensus",
    "context_overhead",
    "listed_overhead",
    "next_move",
    "of_the_sweep",
    "self_replacing",
    "short_of_users",
    "sort_census",
    "unexplained_beside",
    "unexplained_use",
]


CONTEXT_OVERHEAD_BYTES = 64 * MIB
"""Per excused CUDA context, memory the driver counts as used but lists under no process (9 MiB on an H200:
docs/benchmarks.md 9); the margin keeps other drivers' larger overheads excused too."""
MAX_REAP_ROUNDS = 4
"""Rounds of reaping within one check; from the second on, what reappeared is frozen and SIGKILLed."""
CHAIN_BIRTHS = 3
"""Processes of one owner born while a check waits that make it a self-replacing chain, once nothing of that
owner older than the check is left alive: each process forks the next and exits at once, so none waits for a
signal (``self_replacing``). A daemon's double fork is two."""

C = TypeVar("C", bound=CensusEntry)


@dataclass(frozen=True, slots=True)
class SortedCensus(Generic[C]):
    """A census sorted against the pids the driver lists (``sort_census`` says what each part is). The sets
    are the caller's to go on with: it excuses more of what is unexplained (persistent processes, peers)."""

    ours: list[C]
    unknown: list[C]
    excused: set[int]
    unexplained: set[int]


def sort_census(found: Sequence[C], protected: Callable[[C], bool], never_touch: Collection[int],
                helpers: Collection[int], listed: set[int]) -> SortedCensus[C]:
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
    ours: list[C] = []
    unknown: list[C] = []
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


def of_the_sweep(found: Iterable[C], excluded: Collection[str]) -> list[C]:
    """What a session-end sweep ends of a census: each live process of known birth (a token: a test's, a
    fixture's, the session set-up's) whose token is not ``excluded`` (what is older than the session, and,
    until the very end, the session set-up's). One of unknown birth is reported, never signalled; an exited
    one holds nothing. The sweep reaps these, and with reaping off the session's closing note lists them."""
    return [f for f in found if f.live and f.token is not None and f.token not in excluded]

