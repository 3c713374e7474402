"""What held a GPU from outside the session when a check waited it out, remembered for the later checks.

A check that waits out its timeout on GPUs dirty from outside the session (processes the driver lists that
are not ours, memory no process we can see holds) remembers that state per device. A later check that finds
the very same state, unchanged for at least its own timeout, does not wait for it again (``checker.py``).

The workers of one pytest-xdist run share what they remember: they take turns on the same GPUs (the GPU
locks), and each would otherwise wait out the same holder once. The controller makes a private directory
for the run and names a file in it in ``STATE_VAR``, which the workers inherit; each worker reads and
updates that file under an exclusive ``flock``. It holds only this optimisation: a lost or unreadable file
costs a check its wait, never makes one pass.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple, Protocol

from pytest_gpuclean.model.records import MIB, DeviceInfo, DeviceSnapshot, Offender

STATE_VAR = "GPUCLEAN_OUTSIDE_STATE"
"""Set by an xdist controller for its workers: the file where they share what held a GPU from outside."""
SLACK_BYTES = 16 * MIB
"""How far memory held from outside may move and still be "the same" state (or the check's tolerance, if
larger): a CUDA context of the session's that the driver lists under no process while a process that is
not ours is listed there (9 MiB per context on an H200, 3 MiB for CUDA without one) must not make the same
outside holder new again. Only how long a check waits depends on it: never its verdict."""
_READ_LIMIT = 1 << 20


class OutsideState(NamedTuple):
    """What held one device from outside the session, unchanged since ``since``."""

    holders: frozenset[tuple[int, int]]
    """(pid, start ticks) of each process listed there that is not ours (start ticks 0: not visible)."""
    used_bytes: int
    """Memory there that is not ours."""
    where: str
    """The check that saw it: a test's node id."""
    since: float
    """``time.monotonic()`` (the same clock in every process of the host) when a check first saw it so;
    it did not change while that check waited."""

    def same(self, holders: frozenset[tuple[int, int]], used_bytes: int, slack: int) -> bool:
        """The same processes (pid and start time: not a new process that reused a pid), the same memory
        give or take ``slack``."""
        return self.holders == holders and abs(self.used_bytes - used_bytes) <= slack


Holders = frozenset[tuple[int, int]]
"""(pid, start ticks) of each process listed on a device that is not ours (start ticks 0: not visible)."""


class Counted(Protocol):
    """A process of the session's census: its pid is all this module reads."""

    @property
    def pid(self) -> int: ...


def outside_of(offenders: Sequence[Offender], snaps: Sequence[DeviceSnapshot], devices: Sequence[DeviceInfo],
               excused: set[int], found: Iterable[Counted], unexplained: set[int],
               overhead: Mapping[str, int], tolerance: int, of_our_run: Callable[[int], bool],
               start_ticks: Callable[[int], int]
               ) -> tuple[dict[int, frozenset[str]], dict[str, tuple[Holders, int]], list[str]]:
    """The findings of a check that cannot be the session's (by ``id``, each with the UUIDs of the devices
    it is on); each of those devices as a later check compares it (``known_outside``): the processes
    listed there that are not ours, and the memory there that is not ours; and the devices clean from
    outside.

    Cannot be the session's: a process the driver lists that is neither ours nor excused (a sibling
    xdist worker's processes are the run's, ``of_our_run``: not outside), and memory that no process we can
    see holds. A leak of ours, or a process of unknown owner that carries our cookie, never is. ``found``
    is the check's census, ``excused``, ``unexplained`` and ``overhead`` what it made of the snapshot
    (``decide.sort_census``, ``decide.listed_overhead``); ``start_ticks`` names a holder's start time (0 if
    it cannot be seen).
    """
    outside: dict[int, frozenset[str]] = {}
    if not offenders:
        return outside, {}, [d.uuid for d in devices]
    uuid_of = {s.device.label: s.device.uuid for s in snaps}
    for o in offenders:
        if o.reason == "memory" or (o.reason == "foreign" and o.process is not None
                                    and not of_our_run(o.process.pid)):
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
            states[uuid] = (frozenset((pid, start_ticks(pid)) for pid in listed), used)
        elif not listed and used <= tolerance:
            # (Not merely unreported: a leak of ours listed there hides memory nobody holds.)
            clean.append(uuid)
    return outside, states, clean


def known_outside(states: dict[str, tuple[Holders, int]], remembered: dict[str, OutsideState],
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


class OutsideMemory:
    """Per device UUID, the outside state a check waited out: in this process, or shared through the file
    ``path`` (an xdist run's)."""

    def __init__(self, path: str | None = None) -> None:
        self.path = path
        self._states: dict[str, OutsideState] = {}

    def load(self) -> dict[str, OutsideState]:
        """What is remembered now (not to be changed: ``update`` does)."""
        if self.path is None:
            return self._states
        with self._open(fcntl.LOCK_SH) as fd:
            return _parse(_read(fd)) if fd is not None else {}

    def update(self, remember: dict[str, OutsideState], forget: Iterable[str]) -> None:
        """Remember ``remember``, forget the devices in ``forget``."""
        gone = set(forget) - remember.keys()
        if self.path is None:
            self._states.update(remember)
            for uuid in gone:
                self._states.pop(uuid, None)
            return
        with self._open(fcntl.LOCK_EX) as fd:
            if fd is None:
                return
            before = _parse(_read(fd))
            after = {u: s for u, s in before.items() if u not in gone}
            after.update(remember)
            if after != before:
                data = json.dumps({u: {"holders": sorted(s.holders), "used_bytes": s.used_bytes,
                                       "where": s.where, "since": s.since} for u, s in after.items()})
                os.lseek(fd, 0, os.SEEK_SET)
                os.ftruncate(fd, 0)
                os.write(fd, data.encode())

    def forget(self, uuids: Iterable[str]) -> None:
        """Forget the devices ``uuids`` (found clean); cheap when nothing is remembered: the clean path."""
        if self.path is None:
            if self._states:
                self.update({}, uuids)
            return
        try:
            if os.stat(self.path).st_size <= 2:  # nothing, or "{}"
                return
        except OSError:
            return
        self.update({}, uuids)

    @contextlib.contextmanager
    def _open(self, how: int) -> Iterator[int | None]:
        assert self.path is not None
        try:
            # In a private directory the controller made (mkdtemp: 0700): no other user plants anything.
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        except OSError:
            yield None  # gone (the run is ending) or unusable: remember nothing
            return
        try:
            fcntl.flock(fd, how)
            yield fd
        finally:
            os.close(fd)  # (drops the lock)


def _read(fd: int) -> bytes:
    os.lseek(fd, 0, os.SEEK_SET)
    return os.read(fd, _READ_LIMIT)


def _parse(data: bytes) -> dict[str, OutsideState]:
    try:
        raw: Any = json.loads(data) if data else {}
        return {str(uuid): OutsideState(frozenset((int(p), int(t)) for p, t in entry["holders"]),
                                        int(entry["used_bytes"]), str(entry["where"]), float(entry["since"]))
                for uuid, entry in raw.items()}
    except (ValueError, TypeError, KeyError, AttributeError):
        return {}  # (only an optimisation: start afresh)
