"""Plain data that flows between the modules: snapshots in, verdicts and reports out.

Only ``devices.py`` knows NVML and only ``processes.py`` knows psutil; everything else works on these.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, Final, Literal, Protocol, TypeVar

if TYPE_CHECKING:
    # What a check found loads at the first finding (findings.py says why); the Ray cluster's records load
    # with the cluster code, only with --gpuclean-ray.
    from pytest_gpuclean.findings import HealthFinding, Offender, Reaped, SiblingUse
    from pytest_gpuclean.ray_model import ClusterCheck

MIB = 1024 * 1024

# Closed sets of words, as types so that ``mypy --strict`` catches a misspelt one. The JSON report
# publishes them verbatim (report_schema.json lists the same values).
Reason = Literal["leaked", "foreign", "host", "memory"]
"""Why a check failed: ``leaked`` (ours: a descendant or carries our cookie), ``foreign`` (on our GPU,
not ours), ``host`` (stray Python process, host scope), ``memory`` (memory no process accounts for)."""
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


_F = TypeVar("_F", bound="Fields")


class Fields:
    """The records below: equality, hash, ``repr`` and ``replace`` from the fields in ``__slots__``.

    Not dataclasses: every checked session imports this module, and creating a dataclass compiles each of
    its generated methods (0.3-1.8 ms a class on the CPU box; the six here took ~8 ms, a quarter of a
    checked session's start). A subclass lists its fields in ``__slots__`` (in ``__init__``'s order) and
    annotates them; ``Final`` makes ``mypy --strict`` refuse an assignment, as ``frozen=True`` did at run
    time (a reading is shared by the records of every clean test). ``serialize`` walks the fields.
    """

    __slots__: tuple[str, ...] = ()
    _values_of: ClassVar[Callable[[Fields], tuple[object, ...]]]
    """The fields' values, in order: one ``attrgetter`` per class (C speed; a reading's hash and
    equality are on every check's path)."""

    def __init_subclass__(cls) -> None:
        getter = operator.attrgetter(*cls.__slots__)
        cls._values_of = getter if len(cls.__slots__) > 1 else lambda obj: (getter(obj),)

    def __eq__(self, other: object) -> bool:
        if other is self:
            return True
        values_of = type(self)._values_of
        return isinstance(other, Fields) and type(other) is type(self) and values_of(self) == values_of(other)

    def __hash__(self) -> int:
        return hash(type(self)._values_of(self))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(" + ", ".join(
            f"{name}={getattr(self, name)!r}" for name in self.__slots__) + ")"

    def replace(self: _F, **changes: Any) -> _F:
        """A copy with ``changes`` (``dataclasses.replace``)."""
        values = {name: getattr(self, name) for name in self.__slots__}
        values.update(changes)
        return type(self)(**values)  # (each subclass's __init__ takes its fields)


class DeviceInfo(Fields):
    """A device under check: a whole GPU or a MIG instance."""

    __slots__ = ("index", "uuid", "name", "mig_index")
    index: Final[int]
    """NVML index of the physical GPU (what nvidia-smi shows)."""
    uuid: Final[str]
    name: Final[str]
    mig_index: Final[int | None]

    def __init__(self, index: int, uuid: str, name: str, mig_index: int | None = None) -> None:
        self.index = index
        self.uuid = uuid
        self.name = name
        self.mig_index = mig_index

    @property
    def label(self) -> str:
        """Human label, e.g. ``GPU 0`` or ``GPU 0/MIG 1``."""
        return f"GPU {self.index}" if self.mig_index is None else f"GPU {self.index}/MIG {self.mig_index}"


class GpuProcess(Fields):
    """A process the driver lists on a device, with its memory (None when the driver can't tell)."""

    __slots__ = ("pid", "used_bytes")
    pid: Final[int]
    used_bytes: Final[int | None]

    def __init__(self, pid: int, used_bytes: int | None) -> None:
        self.pid = pid
        self.used_bytes = used_bytes


class DeviceSnapshot(Fields):
    """One reading of a device: memory (NVML v2 ``used``) and the processes on it."""

    __slots__ = ("device", "used_bytes", "total_bytes", "processes")
    device: Final[DeviceInfo]
    used_bytes: Final[int]
    total_bytes: Final[int]
    processes: Final[tuple[GpuProcess, ...]]

    def __init__(self, device: DeviceInfo, used_bytes: int, total_bytes: int,
                 processes: tuple[GpuProcess, ...]) -> None:
        self.device = device
        self.used_bytes = used_bytes
        self.total_bytes = total_bytes
        self.processes = processes

    def bytes_of(self, pids: frozenset[int] | set[int]) -> int:
        """Memory the driver attributes to ``pids`` on this device."""
        if not self.processes:
            return 0  # the clean path asks several times per device and check: skip the generator
        return sum(p.used_bytes or 0 for p in self.processes if p.pid in pids)


class DeviceHealth(Fields):
    """The slow health reads of one device (``devices.py``): None where the device cannot tell."""

    __slots__ = ("remap_pending", "remap_failed", "ecc_uncorrected", "compute_mode", "mig_mode",
                 "persistence")
    remap_pending: Final[int | None]
    """Memory rows waiting for a reset to be remapped (retired pages pending, on GPUs before Ampere)."""
    remap_failed: Final[bool | None]
    ecc_uncorrected: Final[int | None]
    """Uncorrectable ECC errors since the last reset or driver load (the volatile count)."""
    compute_mode: Final[str | None]
    """``Default``, ``Exclusive_Process``, ``Prohibited`` (``Exclusive_Thread`` on old drivers)."""
    mig_mode: Final[str | None]
    persistence: Final[str | None]

    def __init__(self, remap_pending: int | None = None, remap_failed: bool | None = None,
                 ecc_uncorrected: int | None = None, compute_mode: str | None = None,
                 mig_mode: str | None = None, persistence: str | None = None) -> None:
        self.remap_pending = remap_pending
        self.remap_failed = remap_failed
        self.ecc_uncorrected = ecc_uncorrected
        self.compute_mode = compute_mode
        self.mig_mode = mig_mode
        self.persistence = persistence


class Owner(Fields):
    """Who a process belongs to: the test or higher-scoped fixture that was running when it was spawned."""

    __slots__ = ("kind", "name")
    kind: Final[OwnerKind]
    name: Final[str]

    def __init__(self, kind: OwnerKind, name: str) -> None:
        self.kind = kind
        self.name = name

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


class Outside(Fields):
    """What a check found on its devices that cannot be the session's: processes the driver lists that are
    not ours (nor excused), and memory no process we can see holds."""

    __slots__ = ("devices", "only", "same_as")
    devices: Final[tuple[tuple[str, float], ...]]
    """(device label, MiB held from outside) of each device dirty from outside."""
    only: Final[bool]
    """Every finding of the check was from outside: nothing of the session's kept the GPUs dirty."""
    same_as: Final[str | None]
    """Not waited for: the same outside state (same holders, same memory) that this check (a test's node
    id) already waited out; None if this check waited for it."""

    def __init__(self, devices: tuple[tuple[str, float], ...], only: bool, same_as: str | None = None
                 ) -> None:
        self.devices = devices
        self.only = only
        self.same_as = same_as


class CheckResult(Fields):
    """The verdict of one check of the devices and processes."""

    __slots__ = (
        "phase", "clean", "devices", "offenders", "reaped", "waited_s", "clean_after_s", "notes",
        "tolerance_mib", "collected", "lingered", "self_mib", "self_cuda_only", "error", "device_lost",
        "siblings", "outside",
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

    def __init__(self, phase: Phase, clean: bool, devices: tuple[DeviceSnapshot, ...],
                 offenders: tuple[Offender, ...], reaped: tuple[Reaped, ...] = (), waited_s: float = 0.0,
                 clean_after_s: float | None = None, notes: tuple[str, ...] = (), tolerance_mib: int = 0,
                 collected: tuple[Reaped, ...] = (), lingered: tuple[Offender, ...] = (),
                 self_mib: tuple[tuple[str, float], ...] = (), self_cuda_only: tuple[str, ...] = (),
                 error: str | None = None, device_lost: bool = False,
                 siblings: tuple[SiblingUse, ...] = (), outside: Outside | None = None) -> None:
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


class FixtureLeak(Fields):
    """What a fixture wider than a test (module, class, package or session scope) left behind, found at the
    teardown of the test that finalized it: the fixture's finding, not that test's."""

    __slots__ = ("name", "scope", "location", "reported_on", "reaped", "leaked", "lingered")
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
        "nodeid", "location", "before", "after", "found_later", "in_process_mib", "devices", "lock_wait_s",
        "lock_timeout", "before_s", "after_s", "cluster_before", "cluster_after", "fixture_leaks",
        "gpu_without_lock", "health", "outside_action",
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
    cluster_before: ClusterCheck | None
    """The Ray cluster check before the test (``--gpuclean-ray``); None without it."""
    cluster_after: ClusterCheck | None
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
                 after_s: float = 0.0, cluster_before: ClusterCheck | None = None,
                 cluster_after: ClusterCheck | None = None,
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
        after = self.after
        return bool(self.found_later) or (after is not None and bool(
            after.reaped or after.lingered or any(o.reason == "leaked" for o in after.offenders))) or (
            self.cluster_after is not None and self.cluster_after.leaked)

    @property
    def dirty(self) -> bool:
        """True if any check around this test failed or found something."""
        return (self.leaked or bool(self.in_process_mib) or self.lock_timeout is not None
                or bool(self.gpu_without_lock)) or any(
            c is not None and (not c.clean or c.offenders or c.reaped or c.collected)
            for c in (self.before, self.after)) or any(
            c is not None and not c.clean for c in (self.cluster_before, self.cluster_after)) or any(
            f.effect != "info" for f in self.health)
