"""The only module that reads GPUs: NVML (through pynvml) or simulated devices in a directory.

Both backends produce the same ``DeviceSnapshot``s, so every other module runs the same code on a CPU
CI box as on a GPU runner.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
import uuid as uuid_mod
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from stat import S_ISDIR
from typing import Any, NamedTuple, Protocol, runtime_checkable

from pytest_gpuclean.core.reading import procfs
from pytest_gpuclean.model.records import DeviceHealth, DeviceInfo, DeviceSnapshot, GpuProcess

DEFAULT_SIM_TOTAL = 80 * 1024**3
SIM_NAME = "Simulated GPU"


class DeviceError(Exception):
    """The driver (or the simulated directory) could not be read."""

    device: DeviceInfo | None = None
    """The device whose reading failed, where the message does not name it (a simulated device's file)."""

    def describe(self) -> str:
        """The message, naming the device first: the one line of a check that could not read it."""
        return str(self) if self.device is None else f"{self.device.label} ({self.device.uuid}): {self}"


class BackendUnavailable(DeviceError):
    """No usable device backend: no NVML library, no driver, or no such simulate directory."""


class DeviceLost(DeviceError):
    """A device is gone: NVML answers GPU_IS_LOST (fallen off the bus, needs a reset), or it vanished (a
    simulated device's ``lost`` file, or its folder removed).

    Unlike other errors, no later reading can succeed."""

    device: DeviceInfo  # (always known: the device that is gone)

    def __init__(self, device: DeviceInfo, reason: str) -> None:
        super().__init__(f"{device.label} ({device.uuid}) is lost: {reason}")
        self.device = device
        self.reason = reason

    def describe(self) -> str:
        return str(self)  # names the device already


class SimulationError(DeviceError):
    """A file of the simulated devices holds something no driver would report (``abc`` bytes), or the
    devices' directory or a device folder cannot be read when they are opened (another user's): a set-up
    mistake, which the plugin and the command report as a bad value of the option that named them."""


class DeviceSelectionError(ValueError):
    """A device list named a device that does not exist (or an ambiguous UUID prefix)."""


class Backend(Protocol):
    """What the checker needs from a device source."""

    kind: str
    """``nvml`` or ``simulated``."""

    def devices(self) -> tuple[DeviceInfo, ...]:
        """Every device on the machine (physical GPUs, or their MIG instances where MIG is on)."""
        ...

    def snapshot(self, device: DeviceInfo) -> DeviceSnapshot:
        """Read memory and processes of one device."""
        ...

    def readings(self, devices: Sequence[DeviceInfo]) -> tuple[DeviceSnapshot, ...]:
        """Read ``devices``, in order: what every check does, so its per-device work is in one loop. A
        reading equal to the device's last one is that same object (``LastReadings``)."""
        ...

    def cuda_users(self, pids: Iterable[int]) -> dict[int, frozenset[str]]:
        """Those of ``pids`` that have initialised CUDA, with the UUIDs of the devices they have open,
        whether the driver lists them there or not.

        The driver charges such a process a few MiB per device even before (or without) a context,
        and lists it under no process: 3 MiB per H200 after ``torch.cuda.is_available()`` (README).
        """
        ...

    def driver_version(self) -> str:
        """Driver version string, for headers and reports."""
        ...

    def close(self) -> None:
        """Release the backend."""
        ...


CLOCK_REASONS: tuple[tuple[int, str], ...] = (
    (0x4, "sw_power_cap"), (0x8, "hw_slowdown"), (0x20, "sw_thermal"), (0x40, "hw_thermal"),
    (0x80, "hw_power_brake"))
"""NVML's clock event reasons that slow a GPU down (bit, name): the names the reports use. Idle, application
clocks, sync boost and display clock are left out: they say nothing about a slowed-down test."""
COMPUTE_MODES = {0: "Default", 1: "Exclusive_Thread", 2: "Prohibited", 3: "Exclusive_Process"}
XID_EVENT = 0x8
"""``nvmlEventTypeXidCriticalError``."""


@runtime_checkable
class HealthSource(Protocol):
    """What the health watch (``health.py``) needs of a backend; both backends here have it.

    ``health`` and ``clock_reasons`` are the slow reads (figures: docs/benchmarks.md 7); ``drain_xids`` is
    the cheap one, for every check.
    """

    def health(self, device: DeviceInfo) -> DeviceHealth:
        """Row remapping, uncorrectable ECC count, compute mode, MIG mode, persistence of ``device``; raises
        ``DeviceLost``."""
        ...

    def clock_reasons(self, device: DeviceInfo) -> tuple[str, ...]:
        """The clock event reasons (``CLOCK_REASONS``' names) active on ``device`` now."""
        ...

    def watch_xids(self, devices: Sequence[DeviceInfo]) -> bool:
        """Start collecting Xid events of ``devices`` (once per session); False if the driver can't."""
        ...

    def drain_xids(self) -> list[tuple[str, int]]:
        """The Xid events since the last drain, as (device UUID, Xid code), without waiting."""
        ...


class NvmlOpening:
    """``import pynvml``, ``nvmlInit`` and the GPUs' handles, by default in a thread of their own.

    A checked session's start waits for NVML more than for anything else (docs/benchmarks.md 2), in C
    calls that let go of the GIL. Started before the session imports the rest of its code, they run
    meanwhile; ``NvmlBackend`` takes the result.
    """

    def __init__(self, *, thread: bool = True) -> None:
        self._opened: tuple[Any, list[Any]] | None = None
        self._error: Exception | None = None
        self._thread: threading.Thread | None = None
        if thread:
            self._thread = threading.Thread(target=self._open, name="gpuclean-nvml-open", daemon=True)
            self._thread.start()
        else:
            self._open()

    def _open(self) -> None:
        try:
            import pynvml
        except ImportError as exc:  # pragma: no cover - nvidia-ml-py is a dependency
            self._error = BackendUnavailable(f"pynvml is not importable: {exc}")
            return
        try:
            pynvml.nvmlInit()
            self._opened = pynvml, [pynvml.nvmlDeviceGetHandleByIndex(i)
                                    for i in range(pynvml.nvmlDeviceGetCount())]
        except pynvml.NVMLError as exc:
            self._error = BackendUnavailable(f"NVML init failed: {exc}")
        except Exception as exc:  # raised again in the session's thread, as it would have been there
            self._error = exc

    def result(self) -> tuple[Any, list[Any]]:
        """The pynvml module (initialised) and a handle per GPU; raises ``BackendUnavailable``."""
        if self._thread is not None:
            self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._opened is not None
        return self._opened


class LastReadings:
    """Each device's last reading: a reading equal to it is that object. The records of clean tests then
    share their readings instead of each keeping two per device (the session keeps every record for its
    report, and every full garbage collection, pytest's last ones included, walks them)."""

    __slots__ = ("_by_uuid",)

    def __init__(self) -> None:
        self._by_uuid: dict[str, DeviceSnapshot] = {}

    def same(self, reading: DeviceSnapshot) -> DeviceSnapshot:
        previous = self._by_uuid.get(reading.device.uuid)
        if previous is not None and previous == reading:
            return previous
        self._by_uuid[reading.device.uuid] = reading
        return reading


class NvmlBackend:
    """Real GPUs through NVML. ``nvmlInit`` is slow next to a device query, so it is done once per process."""

    kind = "nvml"

    def __init__(self, opening: NvmlOpening | None = None) -> None:
        self._nvml, handles = (opening or NvmlOpening(thread=False)).result()
        self._handles: dict[str, Any] = {}
        self._minors: dict[str, int | None] = {}
        self._physical: dict[str, Any] = {}
        """Per UUID, the handle of its physical GPU (a MIG instance's parent): remapping, ECC, persistence
        and events are the GPU's."""
        self._events: Any = None
        self._event_uuids: dict[int | None, list[str]] = {}
        """Address of a physical GPU's handle -> the checked UUIDs on it (an event names the GPU)."""
        self._devices = self._enumerate(handles)
        # v2 memory info appeared in driver 510; older drivers answer "function not found".
        self._memory_v2 = True
        # pynvml functions are not safe to interleave from several threads (shared ctypes state).
        self._lock = threading.Lock()
        self._last = LastReadings()

    def _enumerate(self, handles: list[Any]) -> tuple[DeviceInfo, ...]:
        nvml = self._nvml
        found: list[DeviceInfo] = []
        for index, handle in enumerate(handles):
            name = _text(nvml.nvmlDeviceGetName(handle))
            try:
                minor: int | None = int(nvml.nvmlDeviceGetMinorNumber(handle))  # N of /dev/nvidiaN
            except nvml.NVMLError:
                minor = None
            migs = self._mig_instances(handle)
            if not migs:
                uuid = _text(nvml.nvmlDeviceGetUUID(handle))
                self._handles[uuid] = handle
                self._physical[uuid] = handle
                self._minors[uuid] = minor
                found.append(DeviceInfo(index=index, uuid=uuid, name=name))
                continue
            for mig_index, mig_handle in migs:
                uuid = _text(nvml.nvmlDeviceGetUUID(mig_handle))
                self._handles[uuid] = mig_handle
                self._physical[uuid] = handle
                self._minors[uuid] = minor  # a MIG instance is used through its GPU's device file
                found.append(DeviceInfo(index=index, uuid=uuid, name=name, mig_index=mig_index))
        return tuple(found)

    def _mig_instances(self, handle: Any) -> list[tuple[int, Any]]:
        nvml = self._nvml
        try:
            current, _pending = nvml.nvmlDeviceGetMigMode(handle)
        except nvml.NVMLError:
            return []  # not MIG capable
        if current != getattr(nvml, "NVML_DEVICE_MIG_ENABLE", 1):
            return []
        instances: list[tuple[int, Any]] = []
        for mig_index in range(nvml.nvmlDeviceGetMaxMigDeviceCount(handle)):
            try:
                instances.append((mig_index, nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, mig_index)))
            except nvml.NVMLError:
                continue  # an unpopulated slot
        return instances

    def devices(self) -> tuple[DeviceInfo, ...]:
        return self._devices

    def snapshot(self, device: DeviceInfo) -> DeviceSnapshot:
        nvml = self._nvml
        handle = self._handles[device.uuid]
        with self._lock:
            try:
                memory = self._memory(handle)
                processes: dict[int, int | None] = {}
                # The clean path's shortcut: a listed process has a context on the device, and a context
                # holds memory (612 MiB for one with a 4-byte tensor on an H200), so with v2 "used" at 0
                # no process can be listed, and the two process queries can be skipped (docs/benchmarks.md).
                getters = () if self._memory_v2 and memory.used == 0 else (
                    nvml.nvmlDeviceGetComputeRunningProcesses, nvml.nvmlDeviceGetGraphicsRunningProcesses)
                for getter in getters:
                    for proc in getter(handle):
                        previous = processes.get(proc.pid)
                        used = proc.usedGpuMemory
                        # A process with a compute and a graphics context is listed twice.
                        processes[proc.pid] = used if previous is None else previous + (used or 0)
            except nvml.NVMLError_GpuIsLost:
                raise DeviceLost(device, "NVML: GPU is lost") from None
            except nvml.NVMLError as exc:
                raise DeviceError(f"NVML query of {device.label} ({device.uuid}) failed: {exc}") from exc
        return DeviceSnapshot(
            device=device,
            used_bytes=int(memory.used),
            total_bytes=int(memory.total),
            processes=tuple(GpuProcess(pid, used) for pid, used in sorted(processes.items())),
        )

    def readings(self, devices: Sequence[DeviceInfo]) -> tuple[DeviceSnapshot, ...]:
        same = self._last.same
        return tuple([same(self.snapshot(device)) for device in devices])

    def cuda_users(self, pids: Iterable[int]) -> dict[int, frozenset[str]]:
        users: dict[int, frozenset[str]] = {}
        for pid in pids:
            minors = procfs.cuda_device_minors(pid)
            if minors is not None:
                # A device whose minor number NVML did not tell counts as open.
                users[pid] = frozenset(uuid for uuid, minor in self._minors.items()
                                       if minor is None or minor in minors)
        return users

    def _memory(self, handle: Any) -> Any:
        nvml = self._nvml
        if self._memory_v2:
            try:
                # v1 counts ~600 MiB of driver-reserved memory as used on an idle H200; v2 does not.
                return nvml.nvmlDeviceGetMemoryInfo(handle, version=nvml.nvmlMemory_v2)
            except nvml.NVMLError_FunctionNotFound:
                self._memory_v2 = False
            except nvml.NVMLError_NotSupported:
                self._memory_v2 = False
        return nvml.nvmlDeviceGetMemoryInfo(handle)

    def driver_version(self) -> str:
        return _text(self._nvml.nvmlSystemGetDriverVersion())

    # ---- health (health.py): read when something points at it, except the Xid drain ----------------

    def _ask(self, device: DeviceInfo, function: Callable[..., Any], *args: Any) -> Any:
        """``function(*args)``, None where the device cannot tell (not supported, no permission)."""
        nvml = self._nvml
        try:
            return function(*args)
        except nvml.NVMLError_GpuIsLost:
            raise DeviceLost(device, "NVML: GPU is lost") from None
        except nvml.NVMLError:
            return None

    def health(self, device: DeviceInfo) -> DeviceHealth:
        nvml = self._nvml
        gpu = self._physical[device.uuid]
        with self._lock:
            rows = self._ask(device, nvml.nvmlDeviceGetRemappedRows, gpu)
            if rows is not None:
                _corrected, uncorrected, pending, failed = rows
                # NVML says whether remapping is pending, not how many rows wait: the rows remapped for
                # uncorrectable errors, at least one.
                remap_pending: int | None = max(1, int(uncorrected)) if pending else 0
                remap_failed: bool | None = bool(failed)
            else:  # before Ampere: page retirement
                retired = self._ask(device, nvml.nvmlDeviceGetRetiredPagesPendingStatus, gpu)
                remap_pending, remap_failed = (None if retired is None else int(bool(retired))), None
            ecc = self._ask(device, nvml.nvmlDeviceGetTotalEccErrors, gpu,
                            nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC)
            mode = self._ask(device, nvml.nvmlDeviceGetComputeMode, gpu)
            mig = self._ask(device, nvml.nvmlDeviceGetMigMode, gpu)
            persistence = self._ask(device, nvml.nvmlDeviceGetPersistenceMode, gpu)
        return DeviceHealth(
            remap_pending=remap_pending, remap_failed=remap_failed,
            ecc_uncorrected=None if ecc is None else int(ecc),
            compute_mode=None if mode is None else COMPUTE_MODES.get(int(mode), str(mode)),
            mig_mode=None if mig is None else ("on" if mig[0] else "off"),
            persistence=None if persistence is None else ("on" if persistence else "off"))

    def clock_reasons(self, device: DeviceInfo) -> tuple[str, ...]:
        nvml = self._nvml
        gpu = self._physical[device.uuid]
        # (ThrottleReasons: the name before driver 535)
        reader = (getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
                  or nvml.nvmlDeviceGetCurrentClocksThrottleReasons)
        with self._lock:
            mask = self._ask(device, reader, gpu)
        return () if mask is None else tuple(name for bit, name in CLOCK_REASONS if int(mask) & bit)

    def watch_xids(self, devices: Sequence[DeviceInfo]) -> bool:
        import ctypes  # (here, not at the top: pynvml has loaded it already; simulated devices never do)

        nvml = self._nvml
        with self._lock:
            if self._events is None:
                try:
                    self._events = nvml.nvmlEventSetCreate()
                except nvml.NVMLError:
                    return False
            for device in devices:
                gpu = self._physical[device.uuid]
                address = ctypes.cast(gpu, ctypes.c_void_p).value
                if address not in self._event_uuids:
                    try:
                        nvml.nvmlDeviceRegisterEvents(gpu, XID_EVENT, self._events)
                    except nvml.NVMLError:
                        continue  # not supported on this GPU (or no permission): its Xids go unseen
                    self._event_uuids[address] = []
                self._event_uuids[address].append(device.uuid)
        return bool(self._event_uuids)

    def drain_xids(self) -> list[tuple[str, int]]:
        if self._events is None:
            return []
        import ctypes  # (as in watch_xids)

        nvml = self._nvml
        found: list[tuple[str, int]] = []
        with self._lock:
            # A wait of 0 ms returns an event or "timeout" at once (its cost: docs/benchmarks.md 7).
            for _ in range(1000):  # a GPU flooding Xids must not hold the check forever
                try:
                    data = nvml.nvmlEventSetWait_v2(self._events, 0)
                except nvml.NVMLError:
                    break  # (timeout: nothing more)
                if data.eventType & XID_EVENT:
                    address = ctypes.cast(data.device, ctypes.c_void_p).value
                    found.extend((uuid, int(data.eventData)) for uuid in self._event_uuids.get(address, ()))
        return found

    def close(self) -> None:
        with contextlib.suppress(self._nvml.NVMLError):
            if self._events is not None:
                self._nvml.nvmlEventSetFree(self._events)
                self._events = None
        with contextlib.suppress(self._nvml.NVMLError):
            self._nvml.nvmlShutdown()


class SimulatedBackend:
    """Devices modelled as directories: ``DIR/<index>/<pid>`` holds the bytes ``pid`` has allocated.

    Faithful to the driver where it matters: memory counts only while its process lives and is not a
    zombie, and a file left by a dead process is not credited to a new process that reused its pid.
    Optional files: ``total`` (bytes), ``uuid``, ``name``, and ``context_overhead`` (bytes per process
    that count as used but are charged to no process, as the driver does for each CUDA context).
    ``DIR/<index>/cuda/<pid>`` marks a process that has initialised CUDA on the device without being
    listed (no context): it costs ``context_overhead`` too, charged to no process.

    Health (``health.py``; docs/ci.md lists them): ``DIR/xid`` (one event per line, ``<index> <code>``,
    appended: the lines added since ``watch_xids`` are the events; one file for all devices, so that the
    drain at every check costs one ``stat``), and in a device's folder ``remap_pending`` (rows),
    ``remap_failed``, ``ecc_uncorrected`` (count), ``compute_mode``, ``mig_mode``, ``persistence``,
    ``clocks_event_reasons`` (names, comma-separated), ``lost`` (the device is lost; its text says why),
    and for the CUDA probe ``probe_fails`` (its text is the error) and ``probe_hangs``.
    """

    kind = "simulated"

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        try:
            is_dir = S_ISDIR(os.stat(self.root).st_mode)
        except (FileNotFoundError, NotADirectoryError):
            is_dir = False
        except OSError as exc:  # a directory it may not search (another user's), a name too long
            raise SimulationError(f"simulated device directory {str(self.root)!r} cannot be read: "
                                  f"{exc.strerror or exc}") from None
        if not is_dir:
            raise BackendUnavailable(f"simulated device directory {str(self.root)!r} does not exist")
        self._idle: dict[int, DeviceSnapshot] = {}
        self._settled: dict[int, tuple[str, int, int, DeviceSnapshot]] = {}
        """Per device index, its folder, that folder's inode and ctime when it was last read empty and that
        ctime was settled, and the idle reading: while they stay the same the folder is still empty, and a
        ``stat`` does instead of a ``listdir`` (a third of the cost, on every check's every device). One
        lookup per device and reading in that case (its folder and its reading come with it)."""
        self._last = LastReadings()
        self._allocations = _Allocations()
        self._empty_since: dict[int, tuple[int, int, float]] = {}
        """Per device index: the folder's inode and ctime when it was first read empty with that ctime, and
        then (``time.monotonic``): settled once it stayed so for SETTLED_NS of this clock too."""
        self._last_batch: tuple[Sequence[DeviceInfo], list[tuple[str, int, int]],
                                tuple[DeviceSnapshot, ...]] | None = None
        """The devices of the last ``readings``, each one's folder, inode and settled ctime, and the readings,
        if all were settled and empty."""
        self._xid_path = str(self.root / "xid")
        self._xid_read: int | None = None
        """How many bytes of ``DIR/xid`` were read (None: not watching)."""
        self._xid_uuids: dict[int, list[str]] = {}
        """Device index -> the watched UUIDs with that index."""
        self._devices = self._enumerate()
        for device in self._devices:
            # A corrupt file, or a device folder this user may not read, is a set-up mistake: say so now,
            # not in the first test. A lost device is the session's finding, at its first check.
            try:
                self.snapshot(device)
            except DeviceLost:
                pass
            except SimulationError:
                raise
            except DeviceError as exc:
                raise SimulationError(str(exc)) from None

    def _enumerate(self) -> tuple[DeviceInfo, ...]:
        found: list[DeviceInfo] = []
        try:
            indices = sorted(int(p.name) for p in self.root.iterdir() if p.is_dir() and p.name.isdigit())
        except OSError as exc:  # listed only by its owner (mode 700, another user's home)
            raise SimulationError(f"simulated device directory {str(self.root)!r} cannot be read: "
                                  f"{exc.strerror or exc}") from None
        self._folders: dict[int, str] = {}
        for index in indices:
            folder = self.root / str(index)
            self._folders[index] = str(folder)
            uuid = _read_text(folder / "uuid") or simulated_uuid(self.root, index)
            name = _read_text(folder / "name") or SIM_NAME
            found.append(DeviceInfo(index=index, uuid=uuid, name=name))
        return tuple(found)

    def devices(self) -> tuple[DeviceInfo, ...]:
        return self._devices

    def readings(self, devices: Sequence[DeviceInfo]) -> tuple[DeviceSnapshot, ...]:
        # The clean path of every check: a settled empty folder is one stat, its reading the idle one. Asked
        # for the same devices as last time (a test's, from one check to the next) while every folder is
        # still settled and empty, the readings are the last ones, the very same tuple.
        last = self._last_batch
        if last is not None and last[0] is devices:
            try:
                for where, inode, ctime in last[1]:
                    seen = os.stat(where)
                    if seen.st_ino != inode or seen.st_ctime_ns != ctime:
                        break
                else:
                    return last[2]
            except OSError:
                pass  # (gone or unreadable: ``snapshot`` says which)
        settled = self._settled
        found: list[DeviceSnapshot] = []
        unchanged: list[tuple[str, int, int]] = []
        for device in devices:
            known = settled.get(device.index)
            if known is not None:
                try:
                    info = os.stat(known[0])
                except OSError:
                    info = None
                if info is not None and known[1] == info.st_ino and known[2] == info.st_ctime_ns:
                    found.append(known[3])
                    unchanged.append(known[:3])
                    continue
            found.append(self.snapshot(device))
        readings = tuple(found)
        self._last_batch = (devices, unchanged, readings) if len(unchanged) == len(found) else None
        return readings

    def snapshot(self, device: DeviceInfo) -> DeviceSnapshot:
        # A str path from _enumerate: this runs on every poll, and a Path per call is not free.
        where = self._folders.get(device.index) or str(self.root / str(device.index))
        try:
            info = os.stat(where)
            names = os.listdir(where)
        except FileNotFoundError:
            raise DeviceLost(device, f"vanished ({where} is gone)") from None
        except OSError as exc:
            raise DeviceError(f"simulated {device.label} ({where}) unreadable: {exc}") from exc
        if not names:
            # An idle device, the clean path's every check: its reading is always the same. Adding or
            # removing a file moves the folder's ctime, once that ctime is settled (procfs.SETTLED_NS).
            idle = self._idle.get(device.index)
            if idle is None:
                idle = self._idle[device.index] = DeviceSnapshot(device, 0, DEFAULT_SIM_TOTAL, ())
            # Settled: past the ctime's tick by the wall clock that stamps it, and unchanged for as long by a
            # clock no one can set (a wall clock stepped forward alone would call a fresh ctime settled).
            now = time.monotonic()
            seen = self._empty_since.get(device.index)
            if seen is None or seen[:2] != (info.st_ino, info.st_ctime_ns):
                self._empty_since[device.index] = (info.st_ino, info.st_ctime_ns, now)
            elif (now - seen[2]) * 1e9 > procfs.SETTLED_NS and (
                    time.time_ns() - info.st_ctime_ns > procfs.SETTLED_NS):
                self._settled[device.index] = (where, info.st_ino, info.st_ctime_ns, idle)
            return idle
        self._settled.pop(device.index, None)
        try:
            return self._last.same(self._read(device, Path(where), names))
        except SimulationError as exc:
            exc.device = device  # the file names the folder; a failed check's line names the device too
            raise

    def _read(self, device: DeviceInfo, folder: Path, names: list[str]) -> DeviceSnapshot:
        processes: list[GpuProcess] = []
        total = DEFAULT_SIM_TOTAL
        overhead = 0
        cuda_users: set[int] = set()
        for name in names:
            if not name.isdigit():
                if name == "cuda":
                    cuda_users = self._live_cuda_users(folder / name)
                elif name == "total":
                    total = _bytes_in(folder / name, _read_text(folder / name), DEFAULT_SIM_TOTAL)
                elif name == "context_overhead":
                    overhead = _bytes_in(folder / name, _read_text(folder / name), 0)
                elif name == "lost":
                    raise DeviceLost(device, _read_text(folder / name) or "simulated (its file 'lost')")
                continue
            pid = int(name)
            held, used = self._allocations.of(folder / name, pid)
            if held:
                processes.append(GpuProcess(pid, used))
        processes.sort(key=lambda p: p.pid)
        # Like the real driver: each context, and each process with CUDA initialised but no context,
        # may cost memory that no process is charged for.
        charged_to_none = overhead * (len(processes) + len(cuda_users - {p.pid for p in processes}))
        return DeviceSnapshot(
            device=device,
            used_bytes=sum(p.used_bytes or 0 for p in processes) + charged_to_none,
            total_bytes=total,
            processes=tuple(processes),
        )

    def cuda_users(self, pids: Iterable[int]) -> dict[int, frozenset[str]]:
        wanted = set(pids)
        users: dict[int, set[str]] = {}
        for device in self._devices:
            where = Path(self._folders.get(device.index) or self.root / str(device.index))
            listed: set[int] = set()
            with contextlib.suppress(OSError):
                listed = {int(n) for n in os.listdir(where) if n.isdigit()} & wanted
            try:
                on_device = self._live_cuda_users(where / "cuda") & wanted
                on_device |= {pid for pid in listed if self._allocations.of(where / str(pid), pid)[0]}
            except SimulationError as exc:
                exc.device = device
                raise
            for pid in on_device:
                users.setdefault(pid, set()).add(device.uuid)
        return {pid: frozenset(uuids) for pid, uuids in users.items()}

    def _live_cuda_users(self, folder: Path) -> set[int]:
        try:
            names = os.listdir(folder)
        except OSError:
            return set()
        return {int(n) for n in names if n.isdigit() and self._allocations.of(folder / n, int(n))[0]}

    def driver_version(self) -> str:
        return "simulated"

    # ---- health: files in the device's folder ---------------------------------------------------------

    def _folder(self, device: DeviceInfo) -> Path:
        return Path(self._folders.get(device.index) or self.root / str(device.index))

    def _health_file(self, device: DeviceInfo, name: str) -> str:
        folder = self._folder(device)
        if (folder / "lost").exists():
            raise DeviceLost(device, _read_text(folder / "lost") or "simulated (its file 'lost')")
        if not folder.is_dir():
            raise DeviceLost(device, f"vanished ({folder} is gone)")
        return _read_text(folder / name)

    def health(self, device: DeviceInfo) -> DeviceHealth:
        folder = self._folder(device)

        def count(name: str) -> int:
            return _bytes_in(folder / name, self._health_file(device, name), 0)

        def word(name: str, default: str, allowed: Iterable[str]) -> str:
            text = self._health_file(device, name) or default
            if text not in allowed:
                raise SimulationError(f"simulated device file {str(folder / name)!r} holds {text[:40]!r}, "
                                      f"not one of {', '.join(allowed)}")
            return text

        return DeviceHealth(
            remap_pending=count("remap_pending"), remap_failed=bool(count("remap_failed")),
            ecc_uncorrected=count("ecc_uncorrected"),
            compute_mode=word("compute_mode", "Default", COMPUTE_MODES.values()),
            mig_mode=word("mig_mode", "off", ("on", "off")),
            persistence=word("persistence", "on", ("on", "off")))

    def clock_reasons(self, device: DeviceInfo) -> tuple[str, ...]:
        where = self._folder(device) / "clocks_event_reasons"
        names = tuple(n.strip() for n in self._health_file(device, where.name).split(",") if n.strip())
        known = [name for _bit, name in CLOCK_REASONS]
        for name in names:
            if name not in known:
                raise SimulationError(f"simulated device file {str(where)!r} names {name!r}, not one of "
                                      f"{', '.join(known)}")
        return names

    def watch_xids(self, devices: Sequence[DeviceInfo]) -> bool:
        # Like an NVML event set: only what happens from now on.
        if self._xid_read is None:
            try:
                self._xid_read = os.stat(self._xid_path).st_size
            except OSError:
                self._xid_read = 0
        for device in devices:
            self._xid_uuids.setdefault(device.index, []).append(device.uuid)
        return True

    def drain_xids(self) -> list[tuple[str, int]]:
        done = self._xid_read
        if done is None:
            return []
        # One stat per check; the file is read only when it grew.
        try:
            size = os.stat(self._xid_path).st_size
        except OSError:
            return []
        if size == done:
            return []
        if size < done:  # rewritten: its lines are new
            done = 0
        with open(self._xid_path, "rb") as f:
            f.seek(done)
            chunk = f.read(size - done)
        complete = chunk.rfind(b"\n") + 1  # a line being written is read next time
        self._xid_read = done + complete
        found: list[tuple[str, int]] = []
        for line in chunk[:complete].decode(errors="replace").splitlines():
            words = line.split("#", 1)[0].split()
            if not words:
                continue
            if len(words) != 2 or not all(w.isdigit() for w in words):
                raise SimulationError(f"simulated device file {self._xid_path!r} holds the line "
                                      f"{line[:40]!r}, not '<device index> <Xid code>'")
            found.extend((uuid, int(words[1])) for uuid in self._xid_uuids.get(int(words[0]), ()))
        return found

    def close(self) -> None:
        pass


# A real holder writes its file after it starts; a pid reused by a newer process starts after the file was
# written. The slack covers clock-tick rounding of the start time and the file system's coarse clock; the
# error it allows (a dead holder's file credited to a process that reused its pid within it) makes a device
# dirty, never clean.
_STALE_SLACK_S = 1.0
_EMPTY_RETRIES = 5


class _Allocations:
    """Which files of the simulated devices are the allocations of live processes, as the driver would list
    them. A wrong "no" is the worst a reading can say (a clean verdict beside held memory), so each doubt
    lists the process:

    - A file's time is the wall clock's, a process's start the boot clock's; the two are compared through
      the earliest offset between them seen since this backend began, so a wall clock stepped forward later
      (a VM resumed, NTP) cannot make a live holder's file look older than it, and the verdict for a file
      (its inode and mtime) and a process (its pid and start) is kept once made.
    - A file being rewritten in place (a shell's ``echo N > file`` truncates first) is read again; if it is
      still empty, its process is listed with its amount unknown, as NVML lists a process it cannot size.
    """

    def __init__(self) -> None:
        self._offset = procfs.wall_minus_boot()
        self._fresh: dict[str, tuple[tuple[int, int, int, int], bool]] = {}

    def of(self, path: Path, pid: int) -> tuple[bool, int | None]:
        """(whether ``pid`` holds memory through ``path``, how much: None when the file cannot tell)."""
        stat = procfs.read_stat(pid)
        if stat is None or not procfs.live_state(pid, stat.state):
            return False, None
        where = str(path)
        try:
            info = os.stat(where)
        except OSError:
            return False, None  # the holder removed it while we looked
        key = (pid, stat.start_ticks, info.st_ino, info.st_mtime_ns)
        known = self._fresh.get(where)
        if known is None or known[0] != key:
            self._offset = min(self._offset, procfs.wall_minus_boot())
            started = self._offset + stat.start_ticks / procfs.CLOCK_TICKS
            known = self._fresh[where] = (key, started <= info.st_mtime_ns / 1e9 + _STALE_SLACK_S)
        if not known[1]:
            return False, None  # left by a dead process whose pid a newer one reuses
        for attempt in range(_EMPTY_RETRIES):
            try:
                content = Path(where).read_text().strip()
            except OSError:
                return False, None
            if content:
                return True, _bytes_in(path, content, 0)
            time.sleep(0.001 * (attempt + 1))
        return True, None


def _bytes_in(path: Path, content: str, default: int) -> int:
    """The byte count a simulated device file holds (``default`` if empty); SimulationError otherwise."""
    if not content:
        return default
    try:
        value = int(content)
    except ValueError:
        value = -1
    if value < 0:
        raise SimulationError(f"simulated device file {str(path)!r} holds {content[:40]!r}, not a number of "
                              "bytes (a whole number >= 0)")
    return value


def simulated_uuid(root: str | os.PathLike[str], index: int) -> str:
    """Stable UUID of simulated device ``index`` under ``root`` (used when no ``uuid`` file exists)."""
    real = os.path.realpath(root)
    return "GPU-" + str(uuid_mod.uuid5(uuid_mod.NAMESPACE_URL, f"gpuclean-simulated:{real}:{index}"))


def open_backend(simulate_dir: str | None, opening: NvmlOpening | None = None) -> Backend:
    """The simulated backend when a directory is given, else NVML (``opening``: NVML's start, begun
    earlier). Raises ``BackendUnavailable``."""
    if simulate_dir:
        return SimulatedBackend(simulate_dir)
    return NvmlBackend(opening)


class Selection(NamedTuple):
    """The devices to check, and where that choice came from (for headers and error messages). (A
    NamedTuple: see ``ownership.SessionRef``.)"""

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


def choose_devices(backend: Backend, spec: str | None, spec_source: str, *, option: str) -> Selection:
    """The devices to check: those ``spec`` lists (NVML indices or UUIDs), else those CUDA_VISIBLE_DEVICES
    shows, else all.

    The plugin and the ``gpuclean`` command both choose here. Raises ``DeviceSelectionError`` naming
    ``option`` and where the list came from (``spec_source``, or CUDA_VISIBLE_DEVICES).
    """
    available = backend.devices()
    if spec is not None:
        try:
            chosen = select_devices(available, spec, cuda_ordinals=False)
        except DeviceSelectionError as exc:
            raise DeviceSelectionError(f"{option}: {exc} ({spec_source})") from None
        return Selection(chosen, spec_source, len(available))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return Selection(available, "all devices", len(available))
    # Processes pinned to some GPUs through CUDA_VISIBLE_DEVICES check and reap only those; its tokens
    # are CUDA ordinals, which may not be NVML's order.
    from pytest_gpuclean.core.options.device_list import (
        parse_device_list,  # (only for a list: see select_devices)
    )

    ordinal_uuids = None
    if (any(t.isdigit() for t in parse_device_list(visible))
            and not cuda_order_matches_nvml(available) and backend.kind == "nvml"):
        ordinal_uuids = cuda_ordinal_uuids()
    try:
        chosen = select_devices(available, visible, cuda_ordinals=True, ordinal_uuids=ordinal_uuids)
    except DeviceSelectionError as exc:
        raise DeviceSelectionError(f"{option}: {exc} (from environment variable CUDA_VISIBLE_DEVICES="
                                   f"{visible!r}; pass {option} to choose devices explicitly)") from None
    return Selection(chosen, f"from CUDA_VISIBLE_DEVICES={visible!r}", len(available))


def select_devices(
    available: Sequence[DeviceInfo],
    spec: str,
    *,
    cuda_ordinals: bool,
    ordinal_uuids: Sequence[str] | None = None,
) -> tuple[DeviceInfo, ...]:
    """Map a device list to devices, by UUID.

    Tokens are indices, full UUIDs, or unique UUID prefixes (``GPU-...`` or ``MIG-...``). With
    ``cuda_ordinals``, indices are CUDA ordinals (as in CUDA_VISIBLE_DEVICES) and ``ordinal_uuids`` gives
    the UUID of each ordinal when CUDA's order differs from NVML's; otherwise they are NVML indices.
    """
    # Here, not at the top: a session that checks all devices (no list, no CUDA_VISIBLE_DEVICES) never
    # loads the list's syntax (a module costs a few tenths of a millisecond to import).
    from pytest_gpuclean.core.options.device_list import parse_device_list

    by_uuid = {d.uuid.lower(): d for d in available}
    chosen: list[DeviceInfo] = []
    named_by: list[str] = []
    for token in parse_device_list(spec):
        device: DeviceInfo | None
        if token.isdigit():
            number = int(token)
            if cuda_ordinals and ordinal_uuids is not None:
                device = by_uuid.get(ordinal_uuids[number].lower()) if number < len(ordinal_uuids) else None
            elif cuda_ordinals:
                device = available[number] if number < len(available) else None
            else:
                device = next((d for d in available if d.index == number and d.mig_index is None), None)
            if device is None:
                raise DeviceSelectionError(
                    f"device {token} does not exist ({len(available)} device(s) found)")
        else:
            matches = [d for u, d in by_uuid.items() if u.startswith(token.lower())]
            if not matches:
                raise DeviceSelectionError(f"no device has a UUID starting with {token!r}")
            if len(matches) > 1:
                raise DeviceSelectionError(f"UUID prefix {token!r} is ambiguous ({len(matches)} devices)")
            device = matches[0]
        if device in chosen:
            if not cuda_ordinals:
                # An explicit list means one check per device: a device named twice (an index and its
                # UUID) is a slip in the list, and guessing which one was meant would hide it.
                earlier = named_by[chosen.index(device)]
                raise DeviceSelectionError(f"{earlier!r} and {token!r} name the same device ({device.label}, "
                                           f"{device.uuid}); list each device once")
            continue  # CUDA_VISIBLE_DEVICES is the environment's, not ours to correct: one device
        chosen.append(device)
        named_by.append(token)
    return tuple(chosen)


def cuda_order_matches_nvml(available: Sequence[DeviceInfo]) -> bool:
    """True when CUDA ordinals are NVML indices: PCI order asked for, or all GPUs alike.

    CUDA's default order is "fastest first" with PCI bus order breaking ties; NVML enumerates in PCI
    order. On a machine of identical GPUs the two agree.
    """
    if os.environ.get("CUDA_DEVICE_ORDER") == "PCI_BUS_ID":
        return True
    return len({d.name for d in available}) <= 1 and all(d.mig_index is None for d in available)


_CUDA_ORDINALS_SCRIPT = r"""
import ctypes, sys
cuda = ctypes.CDLL("libcuda.so.1")
if cuda.cuInit(0) != 0:
    sys.exit(1)
count = ctypes.c_int()
cuda.cuDeviceGetCount(ctypes.byref(count))
for ordinal in range(count.value):
    dev = ctypes.c_int()
    cuda.cuDeviceGet(ctypes.byref(dev), ordinal)
    raw = (ctypes.c_ubyte * 16)()
    cuda.cuDeviceGetUuid(raw, dev)
    h = bytes(raw).hex()
    print(f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}")
"""


def cuda_ordinal_uuids() -> list[str] | None:
    """UUIDs of all GPUs in CUDA's own order, asked of the CUDA driver in a child process.

    A child, because initialising CUDA in the pytest process would break every later ``fork`` that
    uses CUDA (vLLM's workers die with "initialization error").
    """
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    try:
        out = subprocess.run([sys.executable, "-c", _CUDA_ORDINALS_SCRIPT], env=env, capture_output=True,
                             text=True, timeout=60, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return out.split()


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _read_text(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""

