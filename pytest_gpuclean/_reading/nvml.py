"""Real GPUs through NVML: the only module that imports pynvml, and only when it opens NVML, so a session
that never reads a GPU never loads it."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from pytest_gpuclean._imports import import_cached
from pytest_gpuclean._model.records import DeviceHealth, DeviceInfo, DeviceSnapshot, GpuProcess
from pytest_gpuclean._reading import procfs
from pytest_gpuclean._reading.devices import (
    CLOCK_REASONS,
    COMPUTE_MODES,
    BackendUnavailable,
    DeviceError,
    DeviceLost,
    LastReadings,
)

XID_EVENT = 0x8
"""``nvmlEventTypeXidCriticalError``."""


class NvmlOpening:
    """``import pynvml``, ``nvmlInit`` and the handles, by default in a thread: they dominate a session's
    start, in C calls that release the GIL, so they run while the session imports the rest."""

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
            # through the plugin's bytecode cache: compiling pynvml costs several times nvmlInit
            pynvml = import_cached("pynvml")
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


class NvmlBackend:
    """Real GPUs through NVML; ``nvmlInit`` is slow next to a query, so once per process."""

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
        self._last: LastReadings[DeviceSnapshot] = LastReadings()
        self.notices: list[str] = []
        """(The driver is trusted: nothing for ``Backend.notices``.)"""

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
                # A listed process has a context, which holds memory, so with v2 "used" at 0 the process
                # queries are skipped.
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
                # v1 counts the driver's reserved memory as used on an idle GPU; v2 does not.
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
            # (a wait of 0 ms returns an event or "timeout" at once)
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


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value
