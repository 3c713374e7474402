"""The package's records of what is read and found: plain data that flows between the layers, one style
(as psutil keeps its result tuples in ``_ntuples.py``). What is read (devices, snapshots, owners, who holds a
GPU lock) and the closed sets of words; what a check found (offenders, reaped processes, health findings; on a
Ray node, naming it). What a check and a test came to (``CheckResult``, ``TestRecord``, ...) is in
``outcomes.py``, beside the decisions over them.

Only ``nvml.py`` knows NVML and only ``processes.py`` knows psutil; everything else works on these.
Every record is a ``Fields`` class, not a dataclass: every checked session imports this module (``Fields``
says why that matters). ``serialize`` walks the fields and their type hints.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any, ClassVar, Final, Literal, Protocol, TypeVar, cast, get_args

__all__ = [
    "MIB",
    "UNKNOWN_OWNER",
    "CensusEntry",
    "DeviceHealth",
    "DeviceInfo",
    "DeviceSnapshot",
    "EndedBy",
    "Fields",
    "FoundBy",
    "GpuProcess",
    "HealthEffect",
    "HealthFinding",
    "HealthKind",
    "HolderRecord",
    "KillResult",
    "LockHolder",
    "Offender",
    "OnOff",
    "Outside",
    "OutsideAction",
    "Owner",
    "OwnerKind",
    "Phase",
    "ProcessInfo",
    "ProcessState",
    "Reaped",
    "Reason",
    "Scope",
    "Selection",
    "SiblingUse",
    "Via",
]

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


_F = TypeVar("_F", bound="Fields")


class Fields:
    """The records below: equality, hash, ``repr`` and ``replace`` from the fields in ``__slots__``.

    Not dataclasses: every checked session imports this module, and creating a dataclass compiles each of
    its generated methods (docs/benchmarks.md, section 9, has what that costs), where a ``Fields``
    class costs one ``attrgetter``. So every record is one, and the whole model loads at once (this module and
    ``outcomes.py``, which a checked session imports from the start): no record waits in a module of its own
    for the first finding. A subclass lists its fields in ``__slots__`` (in
    ``__init__``'s order) and annotates them; ``Final`` makes ``mypy --strict`` refuse an assignment, as
    ``frozen=True`` did at run time (a reading is shared by the records of every clean test).
    ``serialize`` walks the fields and their type hints.
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
    """The slow health reads of one device (a backend's ``health``: ``backends.HealthSource``): None where the
    device cannot tell."""

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


class Selection(Fields):
    """The devices to check, and where that choice came from (for headers and error messages):
    ``backends.choose_devices``' answer."""

    __slots__ = ("devices", "source", "found")
    devices: Final[tuple[DeviceInfo, ...]]
    source: Final[str]
    """``all devices``, ``from CUDA_VISIBLE_DEVICES='1'``, or the source of an explicit list."""
    found: Final[int]
    """How many devices the backend has."""

    def __init__(self, devices: tuple[DeviceInfo, ...], source: str, found: int) -> None:
        self.devices = devices
        self.source = source
        self.found = found

    def none_reason(self, kind: str) -> str:
        """Why there is nothing to check, when ``devices`` is empty."""
        if not self.found:
            return f"the {kind} backend has no devices"
        return f"none of the {self.found} {kind} device(s) is selected ({self.source})"


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


class CensusEntry(Protocol):
    """A process as the census found it (``census.Found``), as read where the census may not be imported:
    the check's decisions (``decide.py``, ``verdict.py``), a check's passes (``check.py``) and a started
    session's extensions (``started.py``)."""

    @property
    def pid(self) -> int: ...
    @property
    def start_ticks(self) -> int: ...
    @property
    def key(self) -> tuple[int, int]:
        """``(pid, start_ticks)``: its identity."""
        ...
    @property
    def found_by(self) -> FoundBy: ...
    @property
    def token(self) -> str | None:
        """Whose it is (a test's, a fixture's, the session set-up's token); None: of unknown birth."""
        ...
    @property
    def debris_of(self) -> object:
        """The dead session that left it behind; None for any other."""
        ...
    @property
    def live(self) -> bool: ...
    def exited(self) -> bool:
        """Whether it has exited since it was found (its pidfd says so)."""
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


# ---- who holds a GPU lock: read by ``core/locks/holders.py``, worded by ``core/locks/describe.py`` -------

class HolderRecord(Fields):
    """A GPU lock's holder record, as its holder wrote it next to the lock (``core/locks/held.py``), read back
    checked and cleaned: another user may have written anything there."""

    __slots__ = ("pid", "uid", "user", "host", "test", "since", "uuid", "start")
    pid: Final[int]
    uid: Final[int]
    """The uid the record's file is named after, and the kernel says it owns: who wrote it."""
    user: Final[str]
    """That uid's name here (``uid N`` if it has none)."""
    host: Final[str]
    """The host it was written on (``?`` if it named none that can be printed)."""
    test: Final[str]
    """The test that holds the GPU (its node id), cleaned for printing."""
    since: Final[float]
    """When it was written (``time.time``)."""
    uuid: Final[str]
    start: Final[int | None]
    """The holder's start (clock ticks since boot), to tell it from a later process of the same pid."""

    def __init__(self, pid: int, uid: int, user: str, host: str, test: str, since: float, uuid: str,
                 start: int | None = None) -> None:
        self.pid = pid
        self.uid = uid
        self.user = user
        self.host = host
        self.test = test
        self.since = since
        self.uuid = uuid
        self.start = start


class LockHolder(Fields):
    """Who holds a GPU's lock, as a waiting session names it: the newest valid holder record, and what the
    kernel (``/proc/locks``) and the marks on the lock directory say."""

    __slots__ = ("record", "alive", "lock_pid", "lock_user", "lock_cmd", "missing", "held", "making",
                 "queued")
    record: Final[HolderRecord | None]
    """The newest valid record (None: nobody recorded). The newest wins: a holder writes its record after it
    got the lock, so an older one is left over from a session that ended without releasing (killed)."""
    alive: Final[bool | None]
    """Whether the recorded process still runs (None: no record, or one written on another host)."""
    lock_pid: Final[int | None]
    """The process that holds the POSIX lock per ``/proc/locks`` (0: one in another PID namespace; None:
    ``/proc/locks`` names nobody)."""
    lock_user: Final[str | None]
    lock_cmd: Final[str | None]
    """``lock_pid``'s user and command line, cleaned for printing (None unless it is a process we see)."""
    missing: Final[bool]
    """The lock file is missing."""
    held: Final[bool]
    """(Where ``missing``.) A session holds the GPU through its deleted lock file (its hold mark is up)."""
    making: Final[bool]
    """A session is creating the lock file."""
    queued: Final[bool]
    """Another session has waited long for it, and goes first."""

    def __init__(self, record: HolderRecord | None = None, alive: bool | None = None,
                 lock_pid: int | None = None, lock_user: str | None = None, lock_cmd: str | None = None,
                 missing: bool = False, held: bool = False, making: bool = False, queued: bool = False
                 ) -> None:
        self.record = record
        self.alive = alive
        self.lock_pid = lock_pid
        self.lock_user = lock_user
        self.lock_cmd = lock_cmd
        self.missing = missing
        self.held = held
        self.making = making
        self.queued = queued


# ---- what a check found: on this host, or on a Ray cluster's node (``node``) ---------------------------


class ProcessInfo(Fields):
    """A process as reported to the user; ``(pid, start_ticks)`` is its identity."""

    __slots__ = ("pid", "start_ticks", "ppid", "uid", "user", "cmdline", "state")
    pid: Final[int]
    start_ticks: Final[int]
    ppid: Final[int]
    uid: Final[int]
    user: Final[str]
    cmdline: Final[str]
    state: Final[ProcessState]

    def __init__(self, pid: int, start_ticks: int, ppid: int, uid: int, user: str, cmdline: str,
                 state: ProcessState) -> None:
        self.pid = pid
        self.start_ticks = start_ticks
        self.ppid = ppid
        self.uid = uid
        self.user = user
        self.cmdline = cmdline
        self.state = state


class Offender(Fields):
    """Something that makes a check fail: a process, or memory nobody accounts for."""

    __slots__ = ("reason", "process", "owner", "found_by", "mib_per_device", "detail", "node")
    reason: Final[Reason]
    process: Final[ProcessInfo | None]
    owner: Final[Owner | None]
    found_by: Final[FoundBy]
    mib_per_device: Final[tuple[tuple[str, float], ...]]
    """(device label, MiB) pairs for devices this process holds memory on."""
    detail: Final[str]
    node: Final[str | None]
    """The Ray node it is on (its id; '' for the whole cluster); None: this host."""

    def __init__(self, reason: Reason, process: ProcessInfo | None, owner: Owner | None, found_by: FoundBy,
                 mib_per_device: tuple[tuple[str, float], ...] = (), detail: str = "",
                 node: str | None = None) -> None:
        self.reason = reason
        self.process = process
        self.owner = owner
        self.found_by = found_by
        self.mib_per_device = mib_per_device
        self.detail = detail
        self.node = node


class Reaped(Fields):
    """What happened to one leaked process during reaping."""

    __slots__ = ("process", "owner", "found_by", "ended_by", "mib_per_device", "exit_s", "release_s",
                 "survived_as", "node", "via", "actor_id", "job_id")
    process: Final[ProcessInfo]
    owner: Final[Owner | None]
    found_by: Final[FoundBy]
    ended_by: Final[EndedBy]
    mib_per_device: Final[tuple[tuple[str, float], ...]]
    exit_s: Final[float | None]
    """Seconds from the first signal to the process being gone."""
    release_s: Final[float | None]
    """Seconds from the signal that ended the process to the driver no longer listing it (GPU holders
    only): how long the driver took to give the memory back."""
    survived_as: Final[str]
    """The process's state when it outlived SIGKILL (``ended_by == "survived"``), e.g. ``stopped``."""
    node: Final[str | None]
    """The Ray node it was on (its id); None: this host."""
    via: Final[Via]
    """On a Ray node: ``ray.kill`` (its worker then exited by itself) or the signal ``ladder``."""
    actor_id: Final[str]
    """The Ray actor whose worker it was ('' for a process a worker started, or on this host)."""
    job_id: Final[str]
    """The Ray job it was of ('' on this host)."""

    def __init__(self, process: ProcessInfo, owner: Owner | None, found_by: FoundBy, ended_by: EndedBy,
                 mib_per_device: tuple[tuple[str, float], ...], exit_s: float | None,
                 release_s: float | None = None, survived_as: str = "", node: str | None = None,
                 via: Via = "", actor_id: str = "", job_id: str = "") -> None:
        self.process = process
        self.owner = owner
        self.found_by = found_by
        self.ended_by = ended_by
        self.mib_per_device = mib_per_device
        self.exit_s = exit_s
        self.release_s = release_s
        self.survived_as = survived_as
        self.node = node
        self.via = via
        self.actor_id = actor_id
        self.job_id = job_id

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


class SiblingUse(Fields):
    """A process that another worker of the same xdist run started (its cookie proves it), found holding
    memory on a GPU that a check of this worker covered: excused there, never waited for, never signalled.
    When this worker's test held that GPU's lock, it is a finding of the test that started the process."""

    __slots__ = ("process", "owner", "worker", "mib_per_device", "seen_by", "seen_worker", "phase")
    process: Final[ProcessInfo]
    owner: Final[Owner]
    """Who in the sibling worker started it: a test, a fixture or its session set-up (``GPUCLEAN_OWNER``)."""
    worker: Final[str]
    """The sibling worker (``gw0``): ``PYTEST_XDIST_WORKER`` in the process's environment."""
    mib_per_device: Final[tuple[tuple[str, float], ...]]
    seen_by: Final[str]
    """The test of this worker whose check found it, holding the GPU's lock (set when recorded as a
    finding)."""
    seen_worker: Final[str]
    phase: Final[Phase | None]
    """That test's check: ``setup`` or ``teardown``."""

    def __init__(self, process: ProcessInfo, owner: Owner, worker: str,
                 mib_per_device: tuple[tuple[str, float], ...], seen_by: str = "", seen_worker: str = "",
                 phase: Phase | None = None) -> None:
        self.process = process
        self.owner = owner
        self.worker = worker
        self.mib_per_device = mib_per_device
        self.seen_by = seen_by
        self.seen_worker = seen_worker
        self.phase = phase

    def describe(self) -> str:
        """``gw0's test test_x.py::test_a``."""
        if self.owner.kind == "session":
            return f"{self.worker}'s session set-up"
        return f"{self.worker}'s {self.owner.kind} {self.owner.name}"


class HealthFinding(Fields):
    """Something the health watch found on a GPU (``health.py`` decides the ``effect``)."""

    __slots__ = ("kind", "effect", "device", "uuid", "message", "phase", "xid")
    kind: Final[HealthKind]
    effect: Final[HealthEffect]
    device: Final[str]
    """The device's label (``GPU 3``)."""
    uuid: Final[str]
    message: Final[str]
    """One line that names the device: ``GPU 3: Xid 31 (GPU memory page fault ...)``."""
    phase: Final[Phase]
    """``setup``: found before the test (not caused by it); ``teardown``: during or right after it."""
    xid: Final[int | None]

    def __init__(self, kind: HealthKind, effect: HealthEffect, device: str, uuid: str, message: str,
                 phase: Phase, xid: int | None = None) -> None:
        self.kind = kind
        self.effect = effect
        self.device = device
        self.uuid = uuid
        self.message = message
        self.phase = phase
        self.xid = xid

