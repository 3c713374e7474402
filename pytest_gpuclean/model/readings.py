"""Plain data that flows between the modules: what is read (devices, snapshots, owners) and the closed sets
of words; what a check found is in ``findings.py``, its verdict and a test's record in ``results.py``.

Only ``devices.py`` knows NVML and only ``processes.py`` knows psutil; everything else works on these.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any, ClassVar, Final, Literal, Protocol, TypeVar

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
