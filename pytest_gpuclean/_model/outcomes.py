"""The decisions over a test's record: whose a process is, what the test's outcome is, how many processes
were reaped. One place, so every output (summary, JSON, JUnit, annotations, the checks' own filtering)
answers the same question the same way."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Final, Literal, NamedTuple, Protocol, TypeVar

from pytest_gpuclean._model.records import (
    CheckResult,
    FoundBy,
    Offender,
    Owner,
    OwnerKind,
    Reaped,
    TestRecord,
)


class _Owned(Protocol):
    @property
    def owner(self) -> Owner | None: ...
    @property
    def found_by(self) -> FoundBy: ...


_O = TypeVar("_O", bound=_Owned)

ALL_KINDS: Final[tuple[OwnerKind, ...]] = ("test", "fixture", "session", "unknown")
_TESTS: Final[tuple[OwnerKind, ...]] = ("test",)


def split_own(found: Iterable[_O], mine: Callable[[Owner], bool],
              judged: Collection[OwnerKind] = ("test", "fixture"), *,
              dead_sessions_theirs: bool = True) -> tuple[list[_O], list[_O]]:
    """``(own, earlier)``: which of ``found`` are this test's, and which an earlier test's (or a dead
    session's), to be charged there instead. An owner of a kind not in ``judged``, or unknown, is the
    finder's."""
    own: list[_O] = []
    earlier: list[_O] = []
    for item in found:
        owner = item.owner
        if dead_sessions_theirs and item.found_by == "dead session":
            earlier.append(item)
        elif owner is None or owner.kind not in judged or mine(owner):
            own.append(item)
        else:
            earlier.append(item)
    return own, earlier


class OwnLeaks(NamedTuple):
    """Every process a test left behind, by where it was found, in the reports' order."""

    reaped: list[Reaped]
    later: list[Reaped]
    offenders: list[tuple[Offender, str | None]]
    """Not reaped: ``None`` if still running, ``"exited by itself"`` if gone while the check waited."""
    cluster_reaped: list[Reaped]
    cluster_left: list[Offender]

    def any(self) -> bool:
        return bool(self.reaped or self.later or self.offenders or self.cluster_reaped or self.cluster_left)


def own_leaks(record: TestRecord) -> OwnLeaks:
    """What the test leaked itself: the after-check also reaps earlier, unchecked tests' leftovers, which
    are charged to their spawner's ``found_later``."""
    after = record.after
    nodeid = record.nodeid

    def mine(owner: Owner) -> bool:
        return owner.name == nodeid

    reaped: list[Reaped] = []
    offenders: list[tuple[Offender, str | None]] = []
    if after is not None:
        # The check already set a dead session's reaped debris apart; such an offender is still listed.
        reaped = split_own(after.reaped, mine, _TESTS, dead_sessions_theirs=False)[0]
        for found, ended_by in ((after.offenders, None), (after.lingered, "exited by itself")):
            leaked = [o for o in found if o.reason == "leaked" and o.process is not None]
            offenders.extend((o, ended_by) for o in split_own(leaked, mine, _TESTS,
                                                              dead_sessions_theirs=False)[0])
    cluster = record.cluster_after
    cluster_reaped = [] if cluster is None else list(cluster.reaped)
    cluster_left = [] if cluster is None else [
        o for o in cluster.offenders if o.reason == "leaked" and o.process is not None]
    return OwnLeaks(reaped, list(record.found_later), offenders, cluster_reaped, cluster_left)


def _may_have_leaked(record: TestRecord) -> bool:
    """Whether ``own_leaks`` has anything to look at: every output asks each clean test's outcome."""
    after = record.after
    return bool(record.found_later) or record.cluster_after is not None or (
        after is not None and bool(after.reaped or after.offenders or after.lingered))


Outcome = Literal["leaked", "not_clean", "gpu_fault", "clean", "unchecked"]


def outcome(record: TestRecord) -> Outcome:
    """``unchecked``: no check finished (``lock_timeout`` says if it never got its locks). An unusable GPU
    is ``not_clean``; ``gpu_fault``: clean GPUs, but an Xid or setting change it caused. A fixture's leak
    is not the test's; a leak a later check found is."""
    if _may_have_leaked(record) and own_leaks(record).any():
        return "leaked"
    before, health = record.before, record.health
    if _not_clean(before) or _not_clean(record.after) or _not_clean(record.cluster_before) or _not_clean(
            record.cluster_after) or (health and any(f.effect in ("unusable", "lost") for f in health)):
        return "not_clean"
    if health and any(f.effect == "fault" for f in health):
        return "gpu_fault"
    return "clean" if before is not None else "unchecked"


def _not_clean(check: CheckResult | None) -> bool:
    return check is not None and not check.clean


def _found_something(check: CheckResult | None) -> bool:
    return check is not None and bool(not check.clean or check.offenders or check.reaped or check.collected)


def has_findings(record: TestRecord) -> bool:
    """Whether the test is at fault: an outcome other than clean, or a finding that does not fail it
    (in-process torch growth, a GPU used under another worker's lock). What a check did for others (another's
    leftover reaped, a zombie collected, a lock wait given up) is ``noticed`` instead."""
    if record.in_process_mib or record.gpu_without_lock:
        return True
    decided = outcome(record)
    if record.blocked_by and record.after is None and not record.health and not record.cluster_before:
        return decided == "leaked"  # its GPUs' state is its leaker's finding; its own leak is not
    return decided in _AT_FAULT


_AT_FAULT: Final[tuple[Outcome, ...]] = ("leaked", "not_clean", "gpu_fault")


def noticed(record: TestRecord) -> bool:
    """A check around the test found something that is not its finding: a summary line, not a count."""
    before, after, health = record.before, record.after, record.health
    return (record.lock_timeout is not None or _found_something(before) or _found_something(after)
            or (after is not None and bool(after.lingered)) or (
                bool(health) and any(f.effect != "info" for f in health))) and not has_findings(record)


def reaped_count(records: Sequence[TestRecord], session_reaped: Sequence[Reaped]) -> int:
    """Processes ended by any check, by the xdist controller, or at session end. Each counted once by
    identity: a leak a later check found is both in that check's ``reaped`` and its test's
    ``found_later``."""
    ended = {_identity(r) for r in session_reaped}
    for r in records:
        for c in (r.before, r.after, r.cluster_before, r.cluster_after):
            if c and c.reaped:
                ended.update(map(_identity, c.reaped))
        for f in r.fixture_leaks:
            ended.update(map(_identity, f.reaped))
        if r.found_later:
            ended.update(map(_identity, r.found_later))
    return len(ended)


def _identity(reaped: Reaped) -> tuple[str | None, int, int]:
    return reaped.node, reaped.process.pid, reaped.process.start_ticks
