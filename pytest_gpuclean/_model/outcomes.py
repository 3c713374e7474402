"""What a check and a test came to, and the decisions over them.

The records: a check's verdict (``CheckResult``, with a Ray cluster's reading beside this host's:
``ClusterReading`` of ``NodeReading`` and ``NodeRelease``), a fixture's leak (``FixtureLeak``), a test's
record (``TestRecord``), and what the ``clean_gpus`` fixture gives a test (``CleanGpus`` of ``DeviceState``).

The decisions: whose a process is (``split_own``), what a test's outcome is (``own_leaks``, ``outcome``,
``has_findings``, ``noticed``), how many processes a session reaped (``reaped_count``). Plain functions over
plain data, so every output (summary, JSON, JUnit, annotations, the checks' own filtering) asks the same
question the same way, and a table of records tests them without processes (tests/test_outcomes.py).

Why the results live beside the decisions and not in a module of their own: the decisions read them, so such a
module would sit between ``records.py`` and this one, a floor more under every import chain that ends at a
result (tests/test_layers.py holds every chain to six floors; docs/architecture.md).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Final, Literal, NamedTuple, Protocol, TypeVar

from pytest_gpuclean._model.records import (
    DeviceSnapshot,
    FoundBy,
    HealthFinding,
    Offender,
    Outside,
    OutsideAction,
    Owner,
    OwnerKind,
    Phase,
    Reaped,
    SiblingUse,
)

__all__ = [
    "ALL_KINDS",
    "CheckResult",
    "CleanGpus",
    "ClusterReading",
    "DeviceState",
    "FixtureLeak",
    "NodeReading",
    "NodeRelease",
    "Outcome",
    "OwnLeaks",
    "TestRecord",
    "has_findings",
    "noticed",
    "outcome",
    "own_leaks",
    "reaped_count",
    "split_own",
]


# ---- a Ray cluster's reading, beside this host's -----------------------------------------------------


class NodeReading(NamedTuple):
    """One alive Ray node as a cluster's check read it; its devices are named with the node."""

    node_id: str
    devices: tuple[DeviceSnapshot, ...]
    error: str = ""


class NodeRelease(NamedTuple):
    """How long one Ray node's devices took to let go of what a cluster's check ended there."""

    node_id: str
    release_s: float | None
    """Seconds from the first kill on the node (``ray.kill`` or SIGTERM) until its devices listed none of
    the ended processes; None if none of them was on a device, or they were still listed at the deadline."""
    pids: tuple[int, ...] = ()
    """The ended processes that were on the node's devices."""


class ClusterReading(NamedTuple):
    """What a check of a Ray cluster read beside its findings (``CheckResult.cluster``): the cluster, each
    alive node's devices, and how long each node took to release what was ended there. The findings
    themselves are ordinary ``Offender``/``Reaped`` records that name their ``node``."""

    address: str
    nodes: tuple[NodeReading, ...] = ()
    releases: tuple[NodeRelease, ...] = ()


# ---- a check's verdict and a test's record ---------------------------------------------------------------


class CheckResult(NamedTuple):
    """The verdict of one check of the devices and processes."""

    phase: Phase
    clean: bool
    devices: tuple[DeviceSnapshot, ...]
    offenders: tuple[Offender, ...]
    reaped: tuple[Reaped, ...] = ()
    waited_s: float = 0.0
    clean_after_s: float | None = None
    """Seconds from the start of this check to confirmed clean (None if it never got clean)."""
    notes: tuple[str, ...] = ()
    tolerance_mib: int = 0
    collected: tuple[Reaped, ...] = ()
    """Processes of ours that had exited without anybody waiting for them (zombies), or that exited by
    themselves within the settle time: collected and reported, not counted as leaks."""
    lingered: tuple[Offender, ...] = ()
    """Our processes that were alive when the check started and ended by themselves while it waited
    (reaping off): not dirty any more, but still leaked by whoever spawned them."""
    self_mib: tuple[tuple[str, float], ...] = ()
    """This process's own memory per device (a CUDA context of the pytest process): not a leak."""
    self_cuda_only: tuple[str, ...] = ()
    """Devices where this process initialised CUDA without a context (charged to no process): not a leak."""
    error: str | None = None
    """Why a device could not be read (naming it), which ended the check at once, not clean: what was
    provably ours was still reaped, as process ownership needs no device reading. None if every read
    succeeded."""
    device_lost: bool = False
    """The device that could not be read is gone (NVML's GPU_IS_LOST, a simulated device's folder removed):
    no later check can succeed."""
    siblings: tuple[SiblingUse, ...] = ()
    """Processes of other workers of the same xdist run on these devices: excused, not waited for, never
    signalled (the notes name them)."""
    outside: Outside | None = None
    """What of the findings came from outside the session; None if nothing did."""
    cluster: ClusterReading | None = None
    """A Ray cluster's check: the cluster and each node's devices (``devices`` is empty: they are the
    nodes'), its offenders and reaped naming their ``node``; None for this host's check."""


class FixtureLeak(NamedTuple):
    """What a fixture wider than a test (module, class, package or session scope) left behind, found at the
    teardown of the test that finalized it: the fixture's finding, not that test's."""

    name: str
    scope: str
    location: tuple[str, int]
    """Where the fixture is defined: file (relative to rootdir where it is under it) and 1-based line of its
    first decorator (pytest's convention for a test); ("", 0) if unknown."""
    reported_on: str
    """The node id of the test at whose teardown the fixture ended and its leftovers were found."""
    reaped: tuple[Reaped, ...] = ()
    leaked: tuple[Offender, ...] = ()
    """Its processes still there after the check: not reaped (reaping off, or they could not be ended)."""
    lingered: tuple[Offender, ...] = ()
    """Its processes that ended by themselves while the check waited (reaping off)."""

    @property
    def where(self) -> str:
        """``conftest.py:12``, or "" if unknown."""
        return f"{self.location[0]}:{self.location[1]}" if self.location[0] else ""

    def __str__(self) -> str:
        """``fixture engine (session-scoped, conftest.py:12)``."""
        return f"fixture {self.name} ({self.scope}-scoped" + (f", {self.where})" if self.where else ")")


@dataclass(slots=True)
class TestRecord:
    """Everything gpuclean saw for one checked test; feeds the summary, JSON and JUnit output."""

    nodeid: str
    location: tuple[str, int] = ("", 0)
    before: CheckResult | None = None
    after: CheckResult | None = None
    found_later: tuple[Reaped, ...] = ()
    """Processes this test leaked that a later check found (e.g. the test was not checked)."""
    in_process_mib: tuple[tuple[str, float], ...] = ()
    """Growth of ``torch.cuda.memory_allocated`` during the test, per device."""
    devices: tuple[str, ...] = ()
    """UUIDs the test held the locks of."""
    lock_wait_s: float = 0.0
    lock_timeout: str | None = None
    """Why the test never got its GPU locks (it waited ``lock_wait_s``); None if it got them."""
    before_s: float = 0.0
    after_s: float = 0.0
    cluster_before: CheckResult | None = None
    """The Ray cluster check before the test (``--gpuclean-ray``); None without it."""
    cluster_after: CheckResult | None = None
    fixture_leaks: tuple[FixtureLeak, ...] = ()
    """Leaks of fixtures wider than a test that ended at this test's teardown: found by its check, but
    the fixtures' findings (its ``after`` keeps only what is this test's own). Like the other collections
    of a record, a tuple: the empty one is shared by every record (the session keeps them all, and the
    garbage collector walks them)."""
    gpu_without_lock: tuple[SiblingUse, ...] = ()
    """Processes this test started that another xdist worker found holding memory on a GPU whose lock
    that worker's test held (recorded there, merged in by the controller)."""
    health: tuple[HealthFinding, ...] = ()
    """What the health watch (``health.py``) found on this test's GPUs: Xid events, a GPU that needs a reset,
    a changed setting, a lost GPU, a failed probe, clock event reasons."""
    outside_action: OutsideAction | None = None
    """What the test got because a check found its GPUs dirty only from outside the session
    (``--gpuclean-outside``); None if none did."""
    blocked_by: tuple[str, ...] = ()
    """Who leaked what its check before found and nothing else: leaks an earlier check found and left
    (reaping is off), not waited for again; the test was skipped. Each a test's node id or a fixture
    (``fixture NAME (SCOPE-scoped)``); empty if no such leak kept it from running."""


# ---- what the ``clean_gpus`` fixture gives a test ---------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DeviceState:
    """A device under check as the ``clean_gpus`` fixture shows it (figures from the setup check). Made only
    for a test that requests the fixture, from its setup check's readings."""

    index: int
    """NVML index of the physical GPU (what nvidia-smi shows)."""
    uuid: str
    name: str
    used_bytes: int
    total_bytes: int


@dataclass(frozen=True, slots=True)
class CleanGpus:
    """What the ``clean_gpus`` fixture yields: the devices this test checks (and holds locks of)."""

    devices: tuple[DeviceState, ...]

    @property
    def uuids(self) -> tuple[str, ...]:
        return tuple(d.uuid for d in self.devices)


# ---- the decisions over them -------------------------------------------------------------------------------


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
    # (no generator over a test's checks or an empty health list: every output asks this once per test)
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
    for r in records:  # (a loop: once per test of the session)
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
