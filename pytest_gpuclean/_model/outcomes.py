"""The decisions over a test's record: whose a process is (``split_own``), what a test's outcome is
(``own_leaks``, ``outcome``, ``has_findings``, ``noticed``), how many processes a session reaped
(``reaped_count``). Plain functions over plain data, so every output (summary, JSON, JUnit, annotations, the
checks' own filtering) asks the same question the same way; tests/test_outcomes.py tables them."""

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
    """``(own, earlier)``: which of ``found`` (reaped processes or offenders) are this test's own, and which
    belong to an earlier test (or a dead session), to be charged to it instead.

    An owner of a kind in ``judged`` is this test's only if ``mine`` says so (its token is the test's or a
    fixture's ending with it; or, in a record that lost the tokens, its name is the test's); an unknown
    owner, or one of a kind not judged (the session's), is the finder's. A dead session's debris is that
    session's leak, never this test's (``dead_sessions_theirs``).
    """
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
    """Every process a test left behind, by where it was found (the order the reports list them in)."""

    reaped: list[Reaped]
    """Reaped by the check after it."""
    later: list[Reaped]
    """Found (and reaped) by a later check."""
    offenders: list[tuple[Offender, str | None]]
    """Not reaped: still running (``None``: reaping off, or it survived), or gone by itself while the check
    waited (``"exited by itself"``)."""
    cluster_reaped: list[Reaped]
    cluster_left: list[Offender]
    """Still on the Ray cluster after it."""

    def any(self) -> bool:
        return bool(self.reaped or self.later or self.offenders or self.cluster_reaped or self.cluster_left)


def own_leaks(record: TestRecord) -> OwnLeaks:
    """What ``record``'s test leaked, its own only: the after-check also reaps leftovers of earlier,
    unchecked tests; those are charged to the test that spawned them (its ``found_later``)."""
    after = record.after
    nodeid = record.nodeid

    def mine(owner: Owner) -> bool:
        return owner.name == nodeid

    reaped: list[Reaped] = []
    offenders: list[tuple[Offender, str | None]] = []
    if after is not None:
        # (The check already set a dead session's reaped debris apart; an offender that is one is listed,
        # as the reports always did.)
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
    """Whether ``own_leaks`` has anything to look at: what every clean test's outcome, asked by every
    output once per test, settles without building its lists."""
    after = record.after
    return bool(record.found_later) or record.cluster_after is not None or (
        after is not None and bool(after.reaped or after.offenders or after.lingered))


Outcome = Literal["leaked", "not_clean", "gpu_fault", "clean", "unchecked"]


def outcome(record: TestRecord) -> Outcome:
    """``leaked``, ``not_clean``, ``gpu_fault``, ``clean`` or ``unchecked`` (no check finished for this
    test: see ``lock_timeout`` for one that never got its GPU locks).

    A GPU that is not usable (it needs a reset, is lost, failed the probe) is not clean; ``gpu_fault``: the
    test's GPUs were clean, but an Xid it caused (or a setting it changed) fails it. A fixture's leak is
    the fixture's (``fixture_leaks``), not the test's; a leak found by a later check is the test's."""
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
    """Whether the test is at fault: its outcome is not clean (``leaked``, ``not_clean``, ``gpu_fault``), or
    it has a finding of its own that does not fail it (torch memory grown in-process beyond what counts, a GPU
    used while another xdist worker's test held its lock). The summary's count of tests "with findings" and
    the JSON report's ``findings`` and ``with_findings`` are this.

    What a check around the test did for others is ``noticed``, not this test's finding: an earlier test's
    leftover reaped (charged to that test), a fixture's or an earlier test's process that exited by itself
    while the check waited, a zombie collected, a lock wait given up (the test never ran: ``unchecked``),
    GPUs that held only what an earlier test or fixture leaked and was left (``blocked_by``: that leak is
    its leaker's finding; the test was skipped, ``not_clean``)."""
    if record.in_process_mib or record.gpu_without_lock:
        return True
    decided = outcome(record)
    if record.blocked_by and record.after is None and not record.health and not record.cluster_before:
        return decided == "leaked"  # (its GPUs' state is its leaker's finding; a leak of its own is not)
    return decided in _AT_FAULT


_AT_FAULT: Final[tuple[Outcome, ...]] = ("leaked", "not_clean", "gpu_fault")


def noticed(record: TestRecord) -> bool:
    """Whether a check around the test found something that is not its finding (``has_findings``): worth a
    line in the summary, not a count."""
    # (the clean path asks nothing more than its checks' fields: every output asks this once per test)
    before, after, health = record.before, record.after, record.health
    return (record.lock_timeout is not None or _found_something(before) or _found_something(after)
            or (after is not None and bool(after.lingered)) or (
                bool(health) and any(f.effect != "info" for f in health))) and not has_findings(record)


def reaped_count(records: Sequence[TestRecord], session_reaped: Sequence[Reaped]) -> int:
    """Processes ended by any check (a fixture's included, which its test's record no longer holds), by an
    xdist controller for a worker that died (a test's ``found_later`` only), and at session end: the summary
    line's count and the JSON report's. Each process once, by its identity (node, pid and start time): a leak
    a later check found is in that check's ``reaped`` and in its test's ``found_later``."""
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
