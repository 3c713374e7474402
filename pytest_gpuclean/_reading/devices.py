"""What both device backends share: the errors, ``LastReadings`` and NVML's words. Both give the same
``DeviceSnapshot``s, so CPU CI runs the same code as a GPU runner."""

from __future__ import annotations

from typing import Generic, Protocol, TypeVar


class Device(Protocol):
    """What an error or a reading names of its device: a ``records.DeviceInfo`` (a protocol: this module
    imports nothing of the package)."""

    @property
    def label(self) -> str: ...
    @property
    def uuid(self) -> str: ...


class DeviceError(Exception):
    """The driver (or the simulated directory) could not be read."""

    device: Device | None = None
    """Where the message does not name it (a simulated device's file)."""

    def describe(self) -> str:
        """The message, naming the device first: the one line of a check that could not read it."""
        return str(self) if self.device is None else f"{self.device.label} ({self.device.uuid}): {self}"


class BackendUnavailable(DeviceError):
    """No usable device backend: no NVML library, no driver, or no such simulate directory."""


class DeviceLost(DeviceError):
    """A device is gone (NVML's GPU_IS_LOST, or a simulated ``lost`` file): no later reading can succeed."""

    device: Device  # (always known: the device that is gone)

    def __init__(self, device: Device, reason: str) -> None:
        super().__init__(f"{device.label} ({device.uuid}) is lost: {reason}")
        self.device = device
        self.reason = reason

    def describe(self) -> str:
        return str(self)  # names the device already


class SimulationError(DeviceError):
    """A simulated device file no driver would write, or unreadable devices: a bad value of the option that
    named them."""


class DeviceSelectionError(ValueError):
    """A device list named a device that does not exist (or an ambiguous UUID prefix)."""


CLOCK_REASONS: tuple[tuple[int, str], ...] = (
    (0x4, "sw_power_cap"), (0x8, "hw_slowdown"), (0x20, "sw_thermal"), (0x40, "hw_thermal"),
    (0x80, "hw_power_brake"))
"""NVML's clock event reasons that slow a GPU (bit, report name); the others say nothing about a slow test."""
COMPUTE_MODES = {0: "Default", 1: "Exclusive_Thread", 2: "Prohibited", 3: "Exclusive_Process"}


class _Reading(Protocol):
    """A reading of a device: a ``records.DeviceSnapshot``."""

    @property
    def device(self) -> Device: ...


_R = TypeVar("_R", bound=_Reading)


class LastReadings(Generic[_R]):
    """Each device's last reading: an equal reading is that object, so clean tests' records share readings
    (the session keeps every record, and each full garbage collection walks them)."""

    __slots__ = ("_by_uuid",)

    def __init__(self) -> None:
        self._by_uuid: dict[str, _R] = {}

    def same(self, reading: _R) -> _R:
        previous = self._by_uuid.get(reading.device.uuid)
        if previous is not None and previous == reading:
            return previous
        self._by_uuid[reading.device.uuid] = reading
        return reading

