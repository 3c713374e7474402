"""The records that flow through the package: what is read, what a check found, and what a check and a test
came to (``CheckResult``, ``TestRecord``).

Records are ``NamedTuple``s (immutable, cheap to define at import); a dataclass only where a tuple will
not do (filled in as the test runs, public, or a field that would shadow ``tuple.index``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, NamedTuple, Protocol, cast, get_args

MIB = 1024 * 1024

# Closed sets of words, as types so that mypy catches a misspelt one. The JSON report publishes them
# verbatim: report_schema.json must list the same values.
Reason = Literal["leaked", "foreign", "host", "memory", "unreachable"]
"""``leaked``: ours; ``foreign``: on our GPU, not ours; ``host``: a stray Python process; ``memory``: no
process accounts for it; ``unreachable``: a Ray cluster or node."""
FoundBy = Literal["descendant", "adopted", "cookie", "gpu", "host", "dead session"]
"""``adopted``: re-parented to our subreaper; ``dead session``: left by a gpuclean session that died."""
EndedBy = Literal["SIGTERM", "SIGKILL", "already exited", "reaped zombie", "exited by itself", "pid reused",
                  "survived"]
"""``pid reused``: its identity changed, so it was left alone; ``survived``: still there after SIGKILL."""
OwnerKind = Literal["test", "fixture", "session", "unknown"]
"""``session`` is gpuclean's own session, outside any test."""
Phase = Literal["setup", "teardown", "check"]
"""Before a test, after it, or a ``gpuclean check``."""
ProcessState = Literal["running", "sleeping", "disk-sleep", "stopped", "tracing-stop", "zombie", "dead",
                       "wake-kill", "waking", "parked", "idle", "running (main thread exited)", "gone", "?"]
"""psutil's names, plus ``gone`` (ended before it could be described) and ``?`` (another node's)."""
OnOff = Literal["on", "off"]
Via = Literal["", "ray.kill", "ladder"]
"""How a Ray cluster's check ended something on a node; '' on this host."""
HealthKind = Literal["xid", "needs_reset", "changed", "lost", "probe", "clocks"]
"""``needs_reset``: row remapping pending or failed, or uncorrectable ECC errors; ``changed``: compute mode,
MIG or persistence changed under the session."""
HealthEffect = Literal["fault", "unusable", "lost", "info"]
"""``fault`` fails the test that caused it; ``unusable`` makes the GPU dirty for the rest of the session;
``lost`` stops the session; ``info`` is only recorded."""
Scope = Literal["session", "host"]
OutsideAction = Literal["fail", "skip", "stop"]
"""``--gpuclean-outside``."""


@dataclass(frozen=True, slots=True)
class DeviceInfo:
    """A device under check: a whole GPU or a MIG instance."""

    index: int
    """NVML index of the physical GPU (what nvidia-smi shows)."""
    uuid: str
    name: str
    mig_index: int | None = None

    @property
    def label(self) -> str:
        """``GPU 0`` or ``GPU 0/MIG 1``."""
        return f"GPU {self.index}" if self.mig_index is None else f"GPU {self.index}/MIG {self.mig_index}"


class GpuProcess(NamedTuple):
    """A process the driver lists on a device; ``used_bytes`` is None when the driver can't tell."""

    pid: int
    used_bytes: int | None


class DeviceSnapshot(NamedTuple):
    """One reading of a device; ``used_bytes`` is NVML v2's ``used``."""

    device: DeviceInfo
    used_bytes: int
    total_bytes: int
    processes: tuple[GpuProcess, ...]

    def bytes_of(self, pids: frozenset[int] | set[int]) -> int:
        """Memory the driver attributes to ``pids`` on this device."""
        if not self.processes:
            return 0
        return sum(p.used_bytes or 0 for p in self.processes if p.pid in pids)


class DeviceHealth(NamedTuple):
    """The slow health reads of one device; None where the device cannot tell."""

    remap_pending: int | None = None
    """Rows waiting for a reset to be remapped (retired pages, before Ampere)."""
    remap_failed: bool | None = None
    ecc_uncorrected: int | None = None
    """Volatile count: since the last reset or driver load."""
    compute_mode: str | None = None
    mig_mode: str | None = None
    persistence: str | None = None


class Selection(NamedTuple):
    """The devices to check, and where that choice came from."""

    devices: tuple[DeviceInfo, ...]
    source: str
    """``all devices``, ``from CUDA_VISIBLE_DEVICES='1'``, or the source of an explicit list."""
    found: int
    """How many devices the backend has, chosen or not."""

    def none_reason(self, kind: str) -> str:
        """Why there is nothing to check, when ``devices`` is empty."""
        if not self.found:
            return f"the {kind} backend has no devices"
        return f"none of the {self.found} {kind} device(s) is selected ({self.source})"


class Owner(NamedTuple):
    """The test or higher-scoped fixture that was running when a process was spawned."""

    kind: OwnerKind
    name: str

    def __str__(self) -> str:
        return self.name if self.kind == "test" else f"{self.kind} {self.name}"


UNKNOWN_OWNER = Owner("unknown", "unknown (spawned outside any test)")


class KillResult(Protocol):
    """How the kill ladder (``processes.terminate``) ended one process."""

    @property
    def ended_by(self) -> str: ...
    @property
    def exit_s(self) -> float | None: ...
    @property
    def state(self) -> str:
        """Non-empty when the process survived: its state then."""
        ...


class Outside(NamedTuple):
    """What a check found that cannot be the session's."""

    devices: tuple[tuple[str, float], ...]
    """(device label, MiB held from outside) per dirty device."""
    only: bool
    """Every finding was from outside: nothing of the session's kept the GPUs dirty."""
    same_as: str | None = None
    """The node id of the check that already waited out this same state, so this one did not."""


# ---- who holds a GPU lock: read by ``_locks/holders.py``, worded by ``_locks/describe.py`` -------

class HolderRecord(NamedTuple):
    """A lock holder's record as read back from next to the lock: checked and cleaned, since another user
    may have written anything there."""

    pid: int
    uid: int
    """The uid the file is named after and the kernel says owns it."""
    user: str
    host: str
    test: str
    since: float
    """``time.time``."""
    uuid: str
    start: int | None = None
    """Clock ticks since boot: tells the holder from a later process of the same pid."""


class LockHolder(NamedTuple):
    """Who holds a GPU's lock, as a waiting session names it."""

    record: HolderRecord | None = None
    """The newest valid record: an older one was left by a session killed while holding the lock."""
    alive: bool | None = None
    """None: no record, or one written on another host."""
    lock_pid: int | None = None
    """The POSIX lock's holder per ``/proc/locks`` (0: one in another PID namespace; None: nobody named)."""
    lock_user: str | None = None
    lock_cmd: str | None = None
    """None unless ``lock_pid`` is a process we see."""
    missing: bool = False
    """The lock file is missing."""
    held: bool = False
    """(Where ``missing``.) A session holds the GPU through its deleted lock file."""
    making: bool = False
    """A session is creating the lock file."""
    queued: bool = False
    """Another session has waited long for it, and goes first."""


# ---- what a check found: on this host, or on a Ray cluster's node (``node``) ---------------------------


class ProcessInfo(NamedTuple):
    """A process as reported to the user; ``(pid, start_ticks)`` is its identity."""

    pid: int
    start_ticks: int
    ppid: int
    uid: int
    user: str
    cmdline: str
    state: ProcessState


class Credentials(NamedTuple):
    """Whom a signal to a process can reach: the users it runs as, and its descendants that run as another."""

    pid: int
    users: tuple[tuple[int, str], ...]
    """(uid, name) of every uid any of its threads runs as (real, effective, saved, filesystem)."""
    relays_to: tuple[ProcessInfo, ...] = ()
    """Descendants (threads included) that run as a user the process does not, nearest first."""


class Offender(NamedTuple):
    """Something that makes a check fail: a process, or memory nobody accounts for."""

    reason: Reason
    process: ProcessInfo | None
    owner: Owner | None
    found_by: FoundBy
    mib_per_device: tuple[tuple[str, float], ...] = ()
    detail: str = ""
    node: str | None = None
    """The Ray node's id ('' for the whole cluster); None: this host."""


class Reaped(NamedTuple):
    """What happened to one process during reaping."""

    process: ProcessInfo
    owner: Owner | None
    found_by: FoundBy
    ended_by: EndedBy
    mib_per_device: tuple[tuple[str, float], ...]
    exit_s: float | None
    """From the first signal to the process being gone."""
    release_s: float | None = None
    """From the ending signal until the driver stopped listing it (GPU holders only)."""
    survived_as: str = ""
    """Its state when it outlived SIGKILL, e.g. ``stopped``."""
    node: str | None = None
    via: Via = ""
    actor_id: str = ""
    """'' for a process a Ray worker started, or on this host."""
    job_id: str = ""

    @property
    def how_ended(self) -> str:
        """``ended_by`` as the reports show it: ``survived (<state>)`` names the state."""
        return f"survived ({self.survived_as})" if self.ended_by == "survived" else self.ended_by

    @classmethod
    def after_kill(cls, process: ProcessInfo, owner: Owner | None, found_by: FoundBy,
                   mib_per_device: tuple[tuple[str, float], ...], outcome: KillResult,
                   release_s: float | None) -> Reaped:
        """What the kill ladder did to ``process``, as a report entry."""
        if outcome.state:
            return cls(process, owner, found_by, "survived", mib_per_device, outcome.exit_s, release_s,
                       survived_as=outcome.state)
        if outcome.ended_by not in _ENDED_BY:
            raise ValueError(f"unknown way for a process to end: {outcome.ended_by!r}")
        return cls(process, owner, found_by, cast(EndedBy, outcome.ended_by), mib_per_device, outcome.exit_s,
                   release_s)


_ENDED_BY = frozenset(get_args(EndedBy))


class SiblingUse(NamedTuple):
    """Another xdist worker's process (its cookie proves it) on a GPU this worker checked: excused, never
    signalled; a finding of the sibling's test only if this worker's test held that GPU's lock."""

    process: ProcessInfo
    owner: Owner
    """Who in the sibling worker started it (its ``GPUCLEAN_OWNER``)."""
    worker: str
    """``PYTEST_XDIST_WORKER`` in the process's environment."""
    mib_per_device: tuple[tuple[str, float], ...]
    seen_by: str = ""
    """This worker's test whose check found it; set when recorded as a finding."""
    seen_worker: str = ""
    phase: Phase | None = None

    def describe(self) -> str:
        """``gw0's test test_x.py::test_a``."""
        if self.owner.kind == "session":
            return f"{self.worker}'s session set-up"
        return f"{self.worker}'s {self.owner.kind} {self.owner.name}"


class HealthFinding(NamedTuple):
    """Something the health watch found on a GPU (``health.py`` decides the ``effect``)."""

    kind: HealthKind
    effect: HealthEffect
    device: str
    uuid: str
    message: str
    """``GPU 3: Xid 31 (GPU memory page fault ...)``."""
    phase: Phase
    """``setup``: found before the test, so not caused by it."""
    xid: int | None = None


# ---- what a check and a test came to ----------------------------------------------------------------------


class NodeReading(NamedTuple):
    """One alive Ray node as a cluster's check read it."""

    node_id: str
    devices: tuple[DeviceSnapshot, ...]
    error: str = ""


class NodeRelease(NamedTuple):
    """How long one Ray node's devices took to let go of what was ended there."""

    node_id: str
    release_s: float | None
    """From the first kill on the node until its devices listed none of the ended processes; None if none
    was on a device, or some were still listed at the deadline."""
    pids: tuple[int, ...] = ()


class ClusterReading(NamedTuple):
    """What a Ray cluster's check read beside its findings (which are ordinary ``Offender``/``Reaped``
    records naming their ``node``)."""

    address: str
    nodes: tuple[NodeReading, ...] = ()
    releases: tuple[NodeRelease, ...] = ()


class CheckResult(NamedTuple):
    """The verdict of one check of the devices and processes."""

    phase: Phase
    clean: bool
    devices: tuple[DeviceSnapshot, ...]
    offenders: tuple[Offender, ...]
    reaped: tuple[Reaped, ...] = ()
    waited_s: float = 0.0
    clean_after_s: float | None = None
    """From the start of this check to confirmed clean (None if never)."""
    notes: tuple[str, ...] = ()
    tolerance_mib: int = 0
    collected: tuple[Reaped, ...] = ()
    """Ours, but zombies or exited by themselves within the settle time: not counted as leaks."""
    lingered: tuple[Offender, ...] = ()
    """Ours, ended by themselves while the check waited (reaping off): not dirty now, but still leaked."""
    self_mib: tuple[tuple[str, float], ...] = ()
    """The pytest process's own memory per device (its CUDA context): not a leak."""
    self_cuda_only: tuple[str, ...] = ()
    """Where this process initialised CUDA without a context (charged to no process): not a leak."""
    error: str | None = None
    """Why a device could not be read, which ended the check at once, not clean (what was provably ours
    was still reaped)."""
    device_lost: bool = False
    """The unreadable device is gone (NVML's GPU_IS_LOST, a simulated device's folder removed): no later
    check can succeed."""
    siblings: tuple[SiblingUse, ...] = ()
    """Other xdist workers' processes on these devices: excused."""
    outside: Outside | None = None
    cluster: ClusterReading | None = None
    """Set for a Ray cluster's check, whose ``devices`` is then empty (they are the nodes')."""


class FixtureLeak(NamedTuple):
    """What a fixture wider than a test left behind, found at the teardown of the test that finalized it:
    the fixture's finding, not that test's."""

    name: str
    scope: str
    location: tuple[str, int]
    """As pytest locates a test; ("", 0) if unknown."""
    reported_on: str
    """The test at whose teardown the fixture ended."""
    reaped: tuple[Reaped, ...] = ()
    leaked: tuple[Offender, ...] = ()
    """Still there after the check: reaping off, or they could not be ended."""
    lingered: tuple[Offender, ...] = ()

    @property
    def where(self) -> str:
        """``conftest.py:12``, or "" if unknown."""
        return f"{self.location[0]}:{self.location[1]}" if self.location[0] else ""

    def __str__(self) -> str:
        """``fixture engine (session-scoped, conftest.py:12)``."""
        return f"fixture {self.name} ({self.scope}-scoped" + (f", {self.where})" if self.where else ")")


@dataclass(slots=True)
class TestRecord:
    """Everything gpuclean saw for one checked test; feeds the summary, JSON and JUnit output.

    Collections are tuples: the empty one is shared by every record, and the session keeps them all."""

    nodeid: str
    location: tuple[str, int] = ("", 0)
    before: CheckResult | None = None
    after: CheckResult | None = None
    found_later: tuple[Reaped, ...] = ()
    """Processes this test leaked that a later check found."""
    in_process_mib: tuple[tuple[str, float], ...] = ()
    """Growth of ``torch.cuda.memory_allocated`` during the test, per device."""
    devices: tuple[str, ...] = ()
    """UUIDs the test held the locks of."""
    lock_wait_s: float = 0.0
    lock_timeout: str | None = None
    before_s: float = 0.0
    after_s: float = 0.0
    cluster_before: CheckResult | None = None
    cluster_after: CheckResult | None = None
    fixture_leaks: tuple[FixtureLeak, ...] = ()
    """Leaks of wider fixtures that ended at this test's teardown: found by its check, but the fixtures'
    findings (``after`` keeps only this test's own)."""
    gpu_without_lock: tuple[SiblingUse, ...] = ()
    """Processes this test started that another xdist worker found on a GPU its test held the lock of."""
    health: tuple[HealthFinding, ...] = ()
    outside_action: OutsideAction | None = None
    """What the test got because its GPUs were dirty only from outside the session."""
    blocked_by: tuple[str, ...] = ()
    """Who leaked what its check before found, if that was all: the test was skipped, not waited for."""


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
