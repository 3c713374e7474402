"""The device backends as the package holds them: the ``Backend`` and ``HealthSource`` protocols, the
choice of devices to check, and opening the backend the settings name."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from pytest_gpuclean._model.records import DeviceHealth, DeviceInfo, DeviceSnapshot, Selection
from pytest_gpuclean._reading.devices import DeviceSelectionError
from pytest_gpuclean._settings import parse_device_list

if TYPE_CHECKING:
    from pytest_gpuclean._reading.nvml import NvmlOpening


class Backend(Protocol):
    """What the checker needs from a device source."""

    kind: str
    """``nvml`` or ``simulated``."""
    notices: list[str]
    """Lines about what a reading could not trust (a simulated device file another user planted), once
    each; whoever reports them takes them."""

    def devices(self) -> tuple[DeviceInfo, ...]:
        """Physical GPUs, or their MIG instances where MIG is on."""
        ...

    def snapshot(self, device: DeviceInfo) -> DeviceSnapshot:
        ...

    def readings(self, devices: Sequence[DeviceInfo]) -> tuple[DeviceSnapshot, ...]:
        """Read ``devices`` in one loop. A reading equal to the device's last one is that same object."""
        ...

    def cuda_users(self, pids: Iterable[int]) -> dict[int, frozenset[str]]:
        """Those of ``pids`` with CUDA initialised, and the UUIDs of the devices they have open: the driver
        charges such a process a few MiB per device even without a context, listed under no process."""
        ...

    def driver_version(self) -> str:
        """For headers and reports."""
        ...

    def close(self) -> None:
        ...


@runtime_checkable
class HealthSource(Protocol):
    """What the health watch needs of a backend. ``health`` and ``clock_reasons`` are the slow reads;
    ``drain_xids`` the cheap one, for every check."""

    def health(self, device: DeviceInfo) -> DeviceHealth:
        """Row remapping, uncorrectable ECC count, compute mode, MIG mode, persistence; raises
        ``DeviceLost``."""
        ...

    def clock_reasons(self, device: DeviceInfo) -> tuple[str, ...]:
        """The clock event reasons (``devices.CLOCK_REASONS``' names) active on ``device`` now."""
        ...

    def watch_xids(self, devices: Sequence[DeviceInfo]) -> bool:
        """Start collecting Xid events of ``devices`` (once per session); False if the driver can't."""
        ...

    def drain_xids(self) -> list[tuple[str, int]]:
        """The Xid events since the last drain, as (device UUID, Xid code), without waiting."""
        ...


def choose_devices(backend: Backend, spec: str | None, spec_source: str, *, option: str) -> Selection:
    """The devices to check: those ``spec`` lists, else those CUDA_VISIBLE_DEVICES shows, else all."""
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
    # Processes pinned to some GPUs by CUDA_VISIBLE_DEVICES check only those; its tokens are CUDA ordinals.
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
    """Map a device list (indices, UUIDs, unique UUID prefixes) to devices. With ``cuda_ordinals`` indices
    are CUDA ordinals, mapped by ``ordinal_uuids`` where CUDA's order differs from NVML's."""
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
                # One check per device: a device named twice is a slip, and guessing which was meant would
                # hide it.
                earlier = named_by[chosen.index(device)]
                raise DeviceSelectionError(f"{earlier!r} and {token!r} name the same device ({device.label}, "
                                           f"{device.uuid}); list each device once")
            continue  # CUDA_VISIBLE_DEVICES is the environment's, not ours to correct: one device
        chosen.append(device)
        named_by.append(token)
    return tuple(chosen)


def cuda_order_matches_nvml(available: Sequence[DeviceInfo]) -> bool:
    """True when CUDA ordinals are NVML indices: PCI order asked for, or all GPUs alike (CUDA's default
    order is fastest first)."""
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
    """UUIDs in CUDA's order, asked in a child process: CUDA initialised in the pytest process breaks every
    later CUDA-using ``fork`` (vLLM's workers die with "initialization error")."""
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    try:
        out = subprocess.run([sys.executable, "-c", _CUDA_ORDINALS_SCRIPT], env=env, capture_output=True,
                             text=True, timeout=60, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return out.split()


def open_backend(simulate_dir: str | None, opening: NvmlOpening | None = None) -> Backend:
    """The simulated backend when a directory is given, else NVML (``opening``: NVML's start, begun
    earlier). Raises ``BackendUnavailable``."""
    # Imported when opened: a CPU CI session never loads the NVML module.
    if simulate_dir:
        from pytest_gpuclean._reading.simulated import SimulatedBackend
        return SimulatedBackend(simulate_dir)
    from pytest_gpuclean._reading.nvml import NvmlBackend
    return NvmlBackend(opening)
