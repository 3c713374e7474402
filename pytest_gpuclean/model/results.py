"""A check's verdict and a test's record: the records that carry what a check found.

Above ``model`` (the readings) and ``findings`` (what a check found, on this host or a Ray cluster's
nodes), which they name in their annotations only: a clean check does not load it (``findings`` says
why), and ``serialize`` resolves those names when a value needs building.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from typing import TYPE_CHECKING, Final, Literal, NamedTuple, Protocol, TypeVar

from pytest_gpuclean.model.readings import (
    DeviceSnapshot,
    Fields,
    FoundBy,
    Outside,
    OutsideAction,
    Owner,
    OwnerKind,
    Phase,
)

if TYPE_CHECKING:
    from pytest_gpuclean.model.findings import ClusterReading, HealthFinding, Offender, Reaped, SiblingUse

__all__ = ["CheckResult", "DeviceSnapshot", "FixtureLeak", "Outcome", "Outside", "OutsideAction", "OwnLeaks",
           "Owner", "Phase", "TestRecord", "has_findings", "outcome", "own_leaks", "split_own"]
"""(The readings' names are here for ``serialize``, which resolves a record's annotations in its module.)"""


class CheckResult(Fields):
    """The verdict of one check of the devices and processes."""

    __slots__ = (
        "clean",
        "clean_after_s",
        "cluster",
        "collected",
        "device_lost",
        "devices",
        "error",
        "lingered",
        "notes",
        "offenders",
        "outside",
        "phase",
        "reaped",
        "self_cuda_only",
        "self_mib",
        "siblings",
        "tolerance_mib",
        "waited_s",
    )
    phase: Final[Phase]
    clean: Final[bool]
    devices: Final[tuple[DeviceSnapshot, ...]]
    offenders: Final[tuple[Offender, ...]]
    reaped: Final[tuple[Reaped, ...]]
    waited_s: Final[float]
    clean_after_s: Final[float | None]
    """Seconds from the start of this check to confirmed clean (None if it never got clean)."""
    notes: Final[tuple[str, ...]]
    tolerance_mib: Final[int]
    collected: Final[tuple[Reaped, ...]]
    """Processes of ours that had exited without anybody waiting for them (zombies), or that exited by
    themselves within the settle time: collected and reported, not counted as leaks."""
    lingered: Final[tuple[Offender, ...]]
    """Our processes that were alive when the check started and ended by themselves while it waited
    (reaping off): not dirty any more, but still leaked by whoever spawned them."""
    self_mib: Final[tuple[tuple[str, float], ...]]
    """This process's own memory per device (a CUDA context of the pytest process): not a leak."""
    self_cuda_only: Final[tuple[str, ...]]
    """Devices where this process initialised CUDA without a context (charged to no process): not a leak."""
    error: Final[str | None]
    """Why a device could not be read (naming it), which ended the check at once, not clean: what was
    provably ours was still reaped, as process ownership needs no device reading. None if every read
    succeeded."""
    device_lost: Final[bool]
    """The device that could not be read is gone (NVML's GPU_IS_LOST, a simulated device's folder removed):
    no later check can succeed."""
    siblings: Final[tuple[SiblingUse, ...]]
    """Processes of other workers of the same xdist run on these devices: excused, not waited for, never
    signalled (the notes name them)."""
    outside: Final[Outside | None]
    """What of the findings came from outside the session; None if nothing did."""
    cluster: Final[ClusterReading | None]
    """A Ray cluster's check: the cluster and each node's devices (``devices`` is empty: they are the
    nodes'), its offenders and reaped naming their ``node``; None for this host's check."""

    def __init__(self, phase: Phase, clean: bool, devices: tuple[DeviceSnapshot, ...],
                 offenders: tuple[Offender, ...], reaped: tuple[Reaped, ...] = (), waited_s: float = 0.0,
                 clean_after_s: float | None = None, notes: tuple[str, ...] = (), tolerance_mib: int = 0,
                 collected: tuple[Reaped, ...] = (), lingered: tuple[Offender, ...] = (),
                 self_mib: tuple[tuple[str, float], ...] = (), self_cuda_only: tuple[str, ...] = (),
                 error: str | None = None, device_lost: bool = False,
                 siblings: tuple[SiblingUse, ...] = (), outside: Outside | None = None,
                 cluster: ClusterReading | None = None) -> None:
        self.phase = phase
        self.clean = clean
        self.devices = devices
        self.offenders = offenders
        self.reaped = reaped
        self.waited_s = waited_s
        self.clean_after_s = clean_after_s
        self.notes = notes
        self.tolerance_mib = tolerance_mib
        self.collected = collected
        self.lingered = lingered
        self.self_mib = self_mib
        self.self_cuda_only = self_cuda_only
        self.error = error
        self.device_lost = device_lost
        self.siblings = siblings
        self.outside = outside
        self.cluster = cluster


class FixtureLeak(Fields):
    """What a fixture wider than a test (module, class, package or session scope) left behind, found at the
    teardown of the test that finalized it: the fixture's finding, not that test's."""

    __slots__ = ("leaked", "lingered", "location", "name", "reaped", "reported_on", "scope")
    name: Final[str]
    scope: Final[str]
    location: Final[tuple[str, int]]
    """Where the fixture is defined: file (relative to rootdir where it is under it) and 1-based line of its
    first decorator (pytest's convention for a test); ("", 0) if unknown."""
    reported_on: Final[str]
    """The node id of the test at whose teardown the fixture ended and its leftovers were found."""
    reaped: Final[tuple[Reaped, ...]]
    leaked: Final[tuple[Offender, ...]]
    """Its processes still there after the check: not reaped (reaping off, or they could not be ended)."""
    lingered: Final[tuple[Offender, ...]]
    """Its processes that ended by themselves while the check waited (reaping off)."""

    def __init__(self, name: str, scope: str, location: tuple[str, int], reported_on: str,
                 reaped: tuple[Reaped, ...] = (), leaked: tuple[Offender, ...] = (),
                 lingered: tuple[Offender, ...] = ()) -> None:
        self.name = name
        self.scope = scope
        self.location = location
        self.reported_on = reported_on
        self.reaped = reaped
        self.leaked = leaked
        self.lingered = lingered

    @property
    def where(self) -> str:
        """``conftest.py:12``, or "" if unknown."""
        return f"{self.location[0]}:{self.location[1]}" if self.location[0] else ""

    def __str__(self) -> str:
        """``fixture engine (session-scoped, conftest.py:12)``."""
        return f"fixture {self.name} ({self.scope}-scoped" + (f", {self.where})" if self.where else ")")


class TestRecord(Fields):
    """Everything gpuclean saw for one checked test; feeds the summary, JSON and JUnit output."""

    __slots__ = (
        "after",
        "after_s",
        "before",
        "before_s",
        "cluster_after",
        "cluster_before",
        "devices",
        "fixture_leaks",
        "found_later",
        "gpu_without_lock",
        "health",
        "in_process_mib",
        "location",
        "lock_timeout",
        "lock_wait_s",
        "nodeid",
        "outside_action",
    )
    __hash__ = None  # type: ignore[assignment]  # (filled in as the test runs)
    nodeid: str
    location: tuple[str, int]
    before: CheckResult | None
    after: CheckResult | None
    found_later: list[Reaped]
    """Processes this test leaked that a later check found (e.g. the test was not checked)."""
    in_process_mib: list[tuple[str, float]]
    """Growth of ``torch.cuda.memory_allocated`` during the test, per device."""
    devices: tuple[str, ...]
    """UUIDs the test held the locks of."""
    lock_wait_s: float
    lock_timeout: str | None
    """Why the test never got its GPU locks (it waited ``lock_wait_s``); None if it got them."""
    before_s: float
    after_s: float
    cluster_before: CheckResult | None
    """The Ray cluster check before the test (``--gpuclean-ray``); None without it."""
    cluster_after: CheckResult | None
    fixture_leaks: tuple[FixtureLeak, ...]
    """Leaks of fixtures wider than a test that ended at this test's teardown: found by its check, but
    the fixtures' findings (its ``after`` keeps only what is this test's own). A tuple: the empty one is
    shared by every record (the session keeps them all, and the garbage collector walks them)."""
    gpu_without_lock: list[SiblingUse]
    """Processes this test started that another xdist worker found holding memory on a GPU whose lock
    that worker's test held (recorded there, merged in by the controller)."""
    health: list[HealthFinding]
    """What the health watch (``health.py``) found on this test's GPUs: Xid events, a GPU that needs a reset,
    a changed setting, a lost GPU, a failed probe, clock event reasons."""
    outside_action: OutsideAction | None
    """What the test got because a check found its GPUs dirty only from outside the session
    (``--gpuclean-outside``); None if none did."""

    def __init__(self, nodeid: str, location: tuple[str, int] = ("", 0), before: CheckResult | None = None,
                 after: CheckResult | None = None, found_later: list[Reaped] | None = None,
                 in_process_mib: list[tuple[str, float]] | None = None, devices: tuple[str, ...] = (),
                 lock_wait_s: float = 0.0, lock_timeout: str | None = None, before_s: float = 0.0,
                 after_s: float = 0.0, cluster_before: CheckResult | None = None,
                 cluster_after: CheckResult | None = None,
                 fixture_leaks: tuple[FixtureLeak, ...] = (),
                 gpu_without_lock: list[SiblingUse] | None = None,
                 health: list[HealthFinding] | None = None,
                 outside_action: OutsideAction | None = None) -> None:
        self.nodeid = nodeid
        self.location = location
        self.before = before
        self.after = after
        self.found_later = [] if found_later is None else found_later
        self.in_process_mib = [] if in_process_mib is None else in_process_mib
        self.devices = devices
        self.lock_wait_s = lock_wait_s
        self.lock_timeout = lock_timeout
        self.before_s = before_s
        self.after_s = after_s
        self.cluster_before = cluster_before
        self.cluster_after = cluster_after
        self.fixture_leaks = fixture_leaks
        self.gpu_without_lock = [] if gpu_without_lock is None else gpu_without_lock
        self.health = [] if health is None else health
        self.outside_action = outside_action

    @property
    def leaked(self) -> bool:
        """True if this test left processes behind (found by its own teardown check or later)."""
        return own_leaks(self).any()

    @property
    def dirty(self) -> bool:
        """True if any check around this test failed or found something."""
        return has_findings(self)


# ---- the decisions over a record: whose a process is, and what a test's outcome is ---------------------
# Plain functions over the records above, so every output (summary, JSON, JUnit, the checks' own
# filtering) asks the same question the same way, and a table of records tests them without processes.


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
        return any(self)


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


Outcome = Literal["leaked", "not_clean", "gpu_fault", "clean", "unchecked"]


def outcome(record: TestRecord) -> Outcome:
    """``leaked``, ``not_clean``, ``gpu_fault``, ``clean`` or ``unchecked`` (no check finished for this
    test: see ``lock_timeout`` for one that never got its GPU locks).

    A GPU that is not usable (it needs a reset, is lost, failed the probe) is not clean; ``gpu_fault``: the
    test's GPUs were clean, but an Xid it caused (or a setting it changed) fails it. A fixture's leak is
    the fixture's (``fixture_leaks``), not the test's; a leak found by a later check is the test's."""
    if own_leaks(record).any():
        return "leaked"
    if any(c is not None and not c.clean for c in (record.before, record.after)) or any(
            c is not None and not c.clean for c in (record.cluster_before, record.cluster_after)) or any(
            f.effect in ("unusable", "lost") for f in record.health):
        return "not_clean"
    if any(f.effect == "fault" for f in record.health):
        return "gpu_fault"
    return "clean" if record.before is not None else "unchecked"


def has_findings(record: TestRecord) -> bool:
    """True if any check around this test failed or found something: an outcome other than clean, or a
    finding that does not fail it (a collected zombie, an earlier test's leftover reaped, torch memory
    grown in-process, a lock wait given up, a GPU used without its lock, a health notice)."""
    after, cluster = record.after, record.cluster_after
    return outcome(record) not in ("clean", "unchecked") or bool(
        record.found_later or record.in_process_mib or record.gpu_without_lock) or (
        record.lock_timeout is not None) or (after is not None and bool(after.lingered)) or (
        cluster is not None and (bool(cluster.reaped) or any(o.reason == "leaked" for o in cluster.offenders))
    ) or any(
            c is not None and (not c.clean or c.offenders or c.reaped or c.collected)
            for c in (record.before, record.after)) or any(f.effect != "info" for f in record.health)
