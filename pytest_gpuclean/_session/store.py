"""What a gpuclean session found, test by test: one ``RecordStore`` per session (``config.stash``), a test's
record in ``item.stash[TEST]``. Records travel as plain dicts from an xdist worker to its controller and
from a forked child to its parent; the serialiser is imported only then."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, NamedTuple

import pytest

from pytest_gpuclean._model.records import CheckResult, FixtureLeak, Reaped, SiblingUse, TestRecord

Payload = dict[str, Any]
"""A session's findings as plain dicts (JSON-able, picklable): what a process ships to another."""


class RecordSet(NamedTuple):
    """Everything a session and (in the xdist controller) its workers found: what every output reads."""

    records: list[TestRecord]
    session_reaped: list[Reaped]
    notes: list[str]


class RecordStore:
    """One session's records, its last sweep's reaps, its notes, and what workers sent."""

    def __init__(self) -> None:
        self.records: list[TestRecord] = []
        """In order."""
        self.late: dict[str, TestRecord] = {}
        """Records of unchecked tests, made when a later check found what they leaked."""
        self.session_reaped: list[Reaped] = []
        self.notes: list[str] = []
        self.worker_payloads: list[Payload] = []
        """xdist controller: each worker's payload, sent when it ends."""
        self.streamed: dict[str, TestRecord] = {}
        """xdist controller: each worker's records as its tests ended: stand-ins for a lost payload."""

    def new(self, nodeid: str, location: tuple[str, int]) -> TestRecord:
        """A record for the test checked now."""

        record = TestRecord(nodeid, location=location)
        self.records.append(record)
        return record

    def record_for(self, nodeid: str) -> TestRecord:
        """The record of ``nodeid``: its own if it was checked, a late one otherwise."""
        for record in self.records:
            if record.nodeid == nodeid:
                return record
        found = self.late.get(nodeid)
        if found is None:

            found = self.late[nodeid] = TestRecord(nodeid)
        return found

    def found_later(self, reaped: Reaped, otherwise: str | None = None) -> None:
        """Put ``reaped`` in the record of the test that leaked it: its owner if a test, else ``otherwise``
        (a node id; None: no test's)."""
        owner = reaped.owner
        nodeid = owner.name if owner is not None and owner.kind == "test" else otherwise
        if nodeid is not None:
            record = self.record_for(nodeid)
            record.found_later += (reaped,)

    def note(self, message: str, once: bool = False) -> None:
        """Add a line to the session's notes (``once``: unless already there)."""
        if not once or message not in self.notes:
            self.notes.append(message)

    def note_replacing(self, prefix: str, message: str) -> None:
        """Put ``message`` in place of the note that starts with ``prefix`` (a running count), or add it."""
        for i, note in enumerate(self.notes):
            if note.startswith(prefix):
                self.notes[i] = message
                return
        self.notes.append(message)

    def own(self) -> list[TestRecord]:
        """The checked tests' records, then the late ones."""
        known = {id(r) for r in self.records}
        return self.records + [r for r in self.late.values() if id(r) not in known]

    # ---- between processes ---------------------------------------------------------------------------

    def payload(self) -> Payload:
        """This process's findings, for an xdist worker's ``workeroutput``."""
        from pytest_gpuclean.report.serialize import to_dict

        return {"records": [to_dict(r) for r in self.own()],
                "session_reaped": [to_dict(r) for r in self.session_reaped],
                "notes": list(self.notes)}

    def add_worker(self, payload: Payload) -> None:
        self.worker_payloads.append(payload)

    def stream(self, nodeid: str, record: dict[str, Any]) -> None:
        """A worker's record of ``nodeid`` as the test ended."""
        from pytest_gpuclean.report.serialize import from_dict

        self.streamed[nodeid] = from_dict(TestRecord, record)

    def ship(self) -> Payload:
        """What a forked child found, for the session's process; forgotten here."""
        from pytest_gpuclean.report.serialize import to_dict

        shipped = {"records": [to_dict(r) for r in self.records],
                   "found_later": {nodeid: [to_dict(r) for r in record.found_later]
                                   for nodeid, record in self.late.items()},
                   "gpu_without_lock": {nodeid: [to_dict(u) for u in record.gpu_without_lock]
                                        for nodeid, record in self.late.items() if record.gpu_without_lock},
                   "fixture_leaks": {nodeid: [to_dict(f) for f in record.fixture_leaks]
                                     for nodeid, record in self.late.items() if record.fixture_leaks}}
        self.forget()
        return shipped

    def receive(self, shipped: Payload) -> None:
        """Take in what a forked child shipped (``ship``)."""
        from pytest_gpuclean.report.serialize import from_dict

        self.records.extend(from_dict(TestRecord, r) for r in shipped["records"])
        for nodeid, reaped in shipped["found_later"].items():
            record = self.record_for(nodeid)
            record.found_later += tuple(from_dict(Reaped, r) for r in reaped)
        for nodeid, uses in shipped.get("gpu_without_lock", {}).items():
            record = self.record_for(nodeid)
            record.gpu_without_lock += tuple(from_dict(SiblingUse, u) for u in uses)
        for nodeid, leaks in shipped.get("fixture_leaks", {}).items():
            record = self.record_for(nodeid)
            record.fixture_leaks += tuple(from_dict(FixtureLeak, f) for f in leaks)

    def forget(self) -> None:
        """Drop a forked child's copy of its parent's records: the parent keeps its own."""
        self.records, self.late = [], {}

    def merged(self) -> RecordSet:
        """Records, session-end reaps and notes of this process and of the workers."""
        from pytest_gpuclean.report.serialize import from_dict

        records = self.own()
        mine = len(records)
        session_reaped = list(self.session_reaped)
        notes = list(self.notes)
        # A worker's streamed records stand in for a payload that never came (interrupted, crashed); what
        # only this controller found of such a test (a crashed worker's orphans) folds into them.
        for payload in self.worker_payloads:
            records.extend(from_dict(TestRecord, r) for r in payload["records"])
            session_reaped.extend(from_dict(Reaped, r) for r in payload["session_reaped"])
            notes.extend(payload["notes"])
        checked = {r.nodeid for r in records if not _late(r)}
        shipped = {r.nodeid for r in records[mine:]}
        records.extend(r for nodeid, r in self.streamed.items()
                       if nodeid not in checked and (not _late(r) or nodeid not in shipped))
        return RecordSet(_reaped_once(_one_per_test(records), session_reaped), session_reaped, notes)


def _late(record: TestRecord) -> bool:
    """For a test not checked here: made for what was found later, or for a fixture that ended at its
    teardown."""
    return record.before is None and record.after is None and record.lock_timeout is None


def _one_per_test(records: list[TestRecord]) -> list[TestRecord]:
    """``records`` with each late record folded into the test's own, or the first late one: under xdist,
    every worker that found what a test left makes one. The records are not changed: this runs per
    output."""
    firsts: dict[str, TestRecord] = {}
    for record in records:
        first = firsts.get(record.nodeid)
        if first is None or (_late(first) and not _late(record)):
            firsts[record.nodeid] = record
    if len(firsts) == len(records):
        return records  # one record per test: the usual case
    folded: dict[int, TestRecord] = {}
    for record in records:
        into = firsts[record.nodeid]
        if record is into or not _late(record):
            continue
        target = folded.get(id(into), into)
        uses = list(target.gpu_without_lock)
        seen = {(u.process.pid, u.process.start_ticks) for u in uses}
        uses.extend(u for u in record.gpu_without_lock if (u.process.pid, u.process.start_ticks) not in seen)
        folded[id(into)] = replace(target, found_later=(*target.found_later, *record.found_later),
                                          gpu_without_lock=tuple(uses),
                                          fixture_leaks=(*target.fixture_leaks, *record.fixture_leaks))
    if not folded:
        return records
    return [folded.get(id(r), r) for r in records
            if firsts[r.nodeid] is r or not _late(r)]


def _reaped_once(records: list[TestRecord], session_reaped: list[Reaped]) -> list[TestRecord]:
    """``records`` less what a check collected as "exited by itself" that something else reaped: under xdist
    a worker can see a crashed worker's orphan end while the controller reaps it. Reported once, as
    reaped; the records are not changed."""
    collected = [r for r in records for c in (r.before, r.after) if c is not None and c.collected]
    if not collected:
        return records
    ended = {(x.process.pid, x.process.start_ticks) for x in session_reaped}
    for r in records:
        ended.update((x.process.pid, x.process.start_ticks) for x in r.found_later)
        for c in (r.before, r.after):
            if c is not None:
                ended.update((x.process.pid, x.process.start_ticks) for x in c.reaped)
        for f in r.fixture_leaks:
            ended.update((x.process.pid, x.process.start_ticks) for x in f.reaped)
    pids = {pid for pid, _ in ended}

    def reaped(x: Reaped) -> bool:
        # A process that ended before it could be described has no start time: its pid decides.
        pid, start = x.process.pid, x.process.start_ticks
        return (pid, start) in ended if start else pid in pids

    def without(check: CheckResult | None) -> CheckResult | None:
        if check is None or not any(map(reaped, check.collected)):
            return check
        return check._replace(collected=tuple(x for x in check.collected if not reaped(x)))

    changed = {id(r): replace(r, before=without(r.before), after=without(r.after)) for r in collected}
    return [changed.get(id(r), r) for r in records]


_SESSION = pytest.StashKey[RecordStore]()
TEST = pytest.StashKey["TestRecord"]()
"""In ``item.stash``: a checked test's record, from its setup check on."""

EMPTY_PAYLOAD: Payload = {"records": [], "session_reaped": [], "notes": []}
"""The payload of a worker that checked nothing."""


def of(config: pytest.Config) -> RecordStore:
    """The session's records (made on first use)."""
    found = config.stash.get(_SESSION, None)
    if found is None:
        found = config.stash[_SESSION] = RecordStore()
    return found
