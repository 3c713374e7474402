"""What a check found: a process described for the user, an offender, a reaped process.

Plain data like ``model``'s, in a module of its own because a clean check makes none of it: it loads at
the first finding, not with every checked session (creating a dataclass costs about a millisecond at
import; docs/benchmarks.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, cast, get_args

from pytest_gpuclean.model.readings import (
    DeviceSnapshot,
    EndedBy,
    FoundBy,
    HealthEffect,
    HealthKind,
    Owner,
    Phase,
    ProcessState,
    Reason,
    Via,
)

if TYPE_CHECKING:
    from pytest_gpuclean.model.readings import KillResult


@dataclass(frozen=True)
class ProcessInfo:
    """A process as reported to the user; ``(pid, start_ticks)`` is its identity."""

    pid: int
    start_ticks: int
    ppid: int
    uid: int
    user: str
    cmdline: str
    state: ProcessState


@dataclass(frozen=True)
class Offender:
    """Something that makes a check fail: a process, or memory nobody accounts for."""

    reason: Reason
    process: ProcessInfo | None
    owner: Owner | None
    found_by: FoundBy
    mib_per_device: tuple[tuple[str, float], ...] = ()
    """(device label, MiB) pairs for devices this process holds memory on."""
    detail: str = ""
    node: str | None = None
    """The Ray node it is on (its id; '' for the whole cluster); None: this host."""


@dataclass(frozen=True)
class Reaped:
    """What happened to one leaked process during reaping."""

    process: ProcessInfo
    owner: Owner | None
    found_by: FoundBy
    ended_by: EndedBy
    mib_per_device: tuple[tuple[str, float], ...]
    exit_s: float | None
    """Seconds from the first signal to the process being gone."""
    release_s: float | None = None
    """Seconds from the signal that ended the process to the driver no longer listing it (GPU holders
    only): how long the driver took to give the memory back."""
    survived_as: str = ""
    """The process's state when it outlived SIGKILL (``ended_by == "survived"``), e.g. ``stopped``."""
    node: str | None = None
    """The Ray node it was on (its id); None: this host."""
    via: Via = ""
    """On a Ray node: ``ray.kill`` (its worker then exited by itself) or the signal ``ladder``."""
    actor_id: str = ""
    """The Ray actor whose worker it was ('' for a process a worker started, or on this host)."""
    job_id: str = ""
    """The Ray job it was of ('' on this host)."""

    @property
    def how_ended(self) -> str:
        """``ended_by`` as the reports show it: ``survived (<state>)`` names the state."""
        return f"survived ({self.survived_as})" if self.ended_by == "survived" else self.ended_by

    @classmethod
    def after_kill(cls, process: ProcessInfo, owner: Owner | None, found_by: FoundBy,
                   mib_per_device: tuple[tuple[str, float], ...], outcome: KillResult,
                   release_s: float | None) -> Reaped:
        """What the kill ladder did to ``process`` (``outcome``), as a report entry."""
        if outcome.state:
            return cls(process, owner, found_by, "survived", mib_per_device, outcome.exit_s, release_s,
                       survived_as=outcome.state)
        if outcome.ended_by not in _ENDED_BY:
            raise ValueError(f"unknown way for a process to end: {outcome.ended_by!r}")
        return cls(process, owner, found_by, cast(EndedBy, outcome.ended_by), mib_per_device, outcome.exit_s,
                   release_s)


@dataclass(frozen=True)
class SiblingUse:
    """A process that another worker of the same xdist run started (its cookie proves it), found holding
    memory on a GPU that a check of this worker covered: excused there, never waited for, never signalled.
    When this worker's test held that GPU's lock, it is a finding of the test that started the process."""

    process: ProcessInfo
    owner: Owner
    """Who in the sibling worker started it: a test, a fixture or its session set-up (``GPUCLEAN_OWNER``)."""
    worker: str
    """The sibling worker (``gw0``): ``PYTEST_XDIST_WORKER`` in the process's environment."""
    mib_per_device: tuple[tuple[str, float], ...]
    seen_by: str = ""
    """The test of this worker whose check found it, holding the GPU's lock (set when recorded as a
    finding)."""
    seen_worker: str = ""
    phase: Phase | None = None
    """That test's check: ``setup`` or ``teardown``."""

    def describe(self) -> str:
        """``gw0's test test_x.py::test_a``."""
        if self.owner.kind == "session":
            return f"{self.worker}'s session set-up"
        return f"{self.worker}'s {self.owner.kind} {self.owner.name}"


@dataclass(frozen=True)
class HealthFinding:
    """Something the health watch found on a GPU (``health.py`` decides the ``effect``)."""

    kind: HealthKind
    effect: HealthEffect
    device: str
    """The device's label (``GPU 3``)."""
    uuid: str
    message: str
    """One line that names the device: ``GPU 3: Xid 31 (GPU memory page fault ...)``."""
    phase: Phase
    """``setup``: found before the test (not caused by it); ``teardown``: during or right after it."""
    xid: int | None = None


@dataclass(frozen=True)
class NodeReading:
    """One alive Ray node as a cluster's check read it; its devices are named with the node."""

    node_id: str
    devices: tuple[DeviceSnapshot, ...]
    error: str = ""


@dataclass(frozen=True)
class NodeRelease:
    """How long one Ray node's devices took to let go of what a cluster's check ended there."""

    node_id: str
    release_s: float | None
    """Seconds from the first kill on the node (``ray.kill`` or SIGTERM) until its devices listed none of
    the ended processes; None if none of them was on a device, or they were still listed at the deadline."""
    pids: tuple[int, ...] = ()
    """The ended processes that were on the node's devices."""


@dataclass(frozen=True)
class ClusterReading:
    """What a check of a Ray cluster read beside its findings (``CheckResult.cluster``): the cluster, each
    alive node's devices, and how long each node took to release what was ended there. The findings
    themselves are ordinary ``Offender``/``Reaped`` records that name their ``node``."""

    address: str
    nodes: tuple[NodeReading, ...] = ()
    releases: tuple[NodeRelease, ...] = ()


_ENDED_BY = frozenset(get_args(EndedBy))
