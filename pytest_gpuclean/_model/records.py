"""The records that flow through the package: what is read (devices, their snapshots, processes, owners, who
holds a GPU lock), what a check found (offenders, reaped processes, health findings; on a Ray node, naming
it), what a check and a test came to (``CheckResult``, ``TestRecord``), and the closed sets of words.

A record is a ``NamedTuple``: immutable, compared and hashed by value, and cheap to define (a checked session
defines some thirty at its start: a tenth of a millisecond each, a frozen dataclass ten times that:
benchmarks/import_cost.py). A dataclass where a tuple will not do: a record filled in as the test runs
(``TestRecord``), the fixture's public values (``CleanGpus``, ``DeviceState``) and ``DeviceInfo``, whose
``index`` would shadow ``tuple.index``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, NamedTuple, Protocol, cast, get_args

MIB = 1024 * 1024

# Closed sets of words, as types so that ``mypy --strict`` catches a misspelt one. The JSON report
# publishes them verbatim (report_schema.json lists the same values).
Reason = Literal["leaked", "foreign", "host", "memory", "unreachable"]
"""Why a check failed: ``leaked`` (ours: a descendant or carries our cookie), ``foreign`` (on our GPU,
not ours), ``host`` (stray Python process, host scope), ``memory`` (memory no process accounts for),
``unreachable`` (a Ray cluster or node that could not be read, or a node that died)."""
FoundBy = Literal["descendant", "adopted", "cookie", "gpu", "host", "dead session"]
"""How a process was found: in our process tree, re-parented to our subreaper (``adopted``), by our
cookie in its environment, listed on a device (``gpu``), as a stray Python process (``host``), or as
what a gpuclean session that died left behind (``dead session``)."""
EndedBy = Literal["SIGTERM", "SIGKILL", "already exited", "reaped zombie", "exited by itself", "pid reused",
                  "survived"]
"""How a process ended: the signal that ended it; ``already exited`` before any signal; ``reaped zombie``
(it had exited, nobody had waited for it); ``exited by itself`` within the settle time; ``pid reused``
(its identity changed: left alone); ``survived`` (still there after SIGKILL)."""
OwnerKind = Literal["test", "fixture", "session", "unknown"]
"""``session`` is gpuclean's own session, outside any test."""
Phase = Literal["setup", "teardown", "check"]
"""Before a test, after it, or a ``gpuclean check``."""
ProcessState = Literal["running", "sleeping", "disk-sleep", "stopped", "tracing-stop", "zombie", "dead",
                       "wake-kill", "waking", "parked", "idle", "running (main thread exited)", "gone", "?"]
"""A process's state as reported: psutil's names of the kernel's states; ``running (main thread exited)``
for a leader whose other threads still run; ``gone`` for one that ended before it could be described;
``?`` where nobody could tell (another node's process)."""
OnOff = Literal["on", "off"]
Via = Literal["", "ray.kill", "ladder"]
"""How a Ray cluster's check ended something on a node: ``ray.kill`` of a named actor (Ray frees its GPU
through its own path), or the TERM -> grace -> KILL ladder in a task pinned to the node; '' on this host."""
HealthKind = Literal["xid", "needs_reset", "changed", "lost", "probe", "clocks"]
"""What a health finding is about (``health.py``): an Xid event, a GPU that needs a reset (row remapping
pending or failed, uncorrectable ECC errors), a setting changed under the session (compute mode, MIG,
persistence), a lost GPU, a failed CUDA probe, or clock event reasons (information)."""
HealthEffect = Literal["fault", "unusable", "lost", "info"]
"""What a health finding does: ``fault`` fails the test that caused it; ``unusable`` makes the GPU not clean
for the rest of the session; ``lost`` stops the session; ``info`` is recorded only (JSON report)."""
Scope = Literal["session", "host"]
OutsideAction = Literal["fail", "skip", "stop"]
"""What a test gets when its GPUs are dirty only from outside the session (``--gpuclean-outside``)."""


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
        """Human label, e.g. ``GPU 0`` or ``GPU 0/MIG 1``."""
        return f"GPU {self.index}" if self.mig_index is None else f"GPU {self.index}/MIG {self.mig_index}"


class GpuProcess(NamedTuple):
    """A process the driver lists on a device, with its memory (None when the driver can't tell)."""

    pid: int
    used_bytes: int | None


class DeviceSnapshot(NamedTuple):
    """One reading of a device: memory (NVML v2 ``used``) and the processes on it."""

    device: DeviceInfo
    used_bytes: int
    total_bytes: int
    processes: tuple[GpuProcess, ...]

    def bytes_of(self, pids: frozenset[int] | set[int]) -> int:
        """Memory the driver attributes to ``pids`` on this device."""
        if not self.processes:
            return 0  # (an idle device)
        return sum(p.used_bytes or 0 for p in self.processes if p.pid in pids)


class DeviceHealth(NamedTuple):
    """The slow health reads of one device (a backend's ``health``: ``backends.HealthSource``): None where the
    device cannot tell."""

    remap_pending: int | None = None
    """Memory rows waiting for a reset to be remapped (retired pages pending, on GPUs before Ampere)."""
    remap_failed: bool | None = None
    ecc_uncorrected: int | None = None
    """Uncorrectable ECC errors since the last reset or driver load (the volatile count)."""
    compute_mode: str | None = None
    """``Default``, ``Exclusive_Process``, ``Prohibited`` (``Exclusive_Thread`` on old drivers)."""
    mig_mode: str | None = None
    persistence: str | None = None


class Selection(NamedTuple):
    """The devices to check, and where that choice came from (for headers and error messages):
    ``backends.choose_devices``' answer."""

    devices: tuple[DeviceInfo, ...]
    source: str
    """``all devices``, ``from CUDA_VISIBLE_DEVICES='1'``, or the source of an explicit list."""
    found: int
    """How many devices the backend has."""

    def none_reason(self, kind: str) -> str:
        """Why there is nothing to check, when ``devices`` is empty."""
        if not self.found:
            return f"the {kind} backend has no devices"
        return f"none of the {self.found} {kind} device(s) is selected ({self.source})"


class Owner(NamedTuple):
    """Who a process belongs to: the test or higher-scoped fixture that was running when it was spawned."""

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
    """What a check found on its devices that cannot be the session's: processes the driver lists that are
    not ours (nor excused), and memory no process we can see holds."""

    devices: tuple[tuple[str, float], ...]
    """(device label, MiB held from outside) of each device dirty from outside."""
    only: bool
    """Every finding of the check was from outside: nothing of the session's kept the GPUs dirty."""
    same_as: str | None = None
    """Not waited for: the same outside state (same holders, same memory) that this check (a test's node
    id) already waited out; None if this check waited for it."""


# ---- who holds a GPU lock: read by ``_locks/holders.py``, worded by ``_locks/describe.py`` -------

class HolderRecord(NamedTuple):
    """A GPU lock's holder record, as its holder wrote it next to the lock (``_locks/held.py``), read back
    checked and cleaned: another user may have written anything there."""

    pid: int
    uid: int
    """The uid the record's file is named after, and the kernel says it owns: who wrote it."""
    user: str
    """That uid's name here (``uid N`` if it has none)."""
    host: str
    """The host it was written on (``?`` if it named none that can be printed)."""
    test: str
    """The test that holds the GPU (its node id), cleaned for printing."""
    since: float
    """When it was written (``time.time``)."""
    uuid: str
    start: int | None = None
    """The holder's start (clock ticks since boot), to tell it from a later process of the same pid."""


class LockHolder(NamedTuple):
    """Who holds a GPU's lock, as a waiting session names it: the newest valid holder record, and what the
    kernel (``/proc/locks``) and the marks on the lock directory say."""

    record: HolderRecord | None = None
    """The newest valid record (None: nobody recorded). The newest wins: a holder writes its record after it
    got the lock, so an older one is left over from a session that ended without releasing (killed)."""
    alive: bool | None = None
    """Whether the recorded process still runs (None: no record, or one written on another host)."""
    lock_pid: int | None = None
    """The process that holds the POSIX lock per ``/proc/locks`` (0: one in another PID namespace; None:
    ``/proc/locks`` names nobody)."""
    lock_user: str | None = None
    lock_cmd: str | None = None
    """``lock_pid``'s user and command line, cleaned for printing (None unless it is a process we see)."""
    missing: bool = False
    """The lock file is missing."""
    held: bool = False
    """(Where ``missing``.) A session holds the GPU through its deleted lock file (its hold mark is up)."""
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
    """(uid, user name) of every uid the process or one of its threads runs as (real, effective, saved,
    filesystem), in uid order."""
    relays_to: tuple[ProcessInfo, ...] = ()
    """Its descendants that run as a user the process does not run as (their threads included), nearest
    first."""


class Offender(NamedTuple):
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


class Reaped(NamedTuple):
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


_ENDED_BY = frozenset(get_args(EndedBy))


class SiblingUse(NamedTuple):
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


class HealthFinding(NamedTuple):
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


# ---- what a check and a test came to ----------------------------------------------------------------------


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
