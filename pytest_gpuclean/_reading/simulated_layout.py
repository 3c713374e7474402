"""The simulated devices' directory layout, shared by ``simulate``, ``simulated.py`` and the probe; it
imports nothing (``simulate hold`` loads only this). ``DIR/<index>/<pid>`` holds the bytes a process
allocated; ``DIR/xid`` holds every device's Xid events."""

from __future__ import annotations

import os


def device_indices(root: str | os.PathLike[str]) -> list[int]:
    """The devices ``root`` holds: its folders named by an index, in order. Raises ``OSError`` if
    unlistable."""
    with os.scandir(root) as entries:
        return sorted(int(e.name) for e in entries if e.name.isdigit() and e.is_dir())


def no_device(root: str) -> str:
    """Why ``root`` holding no device is refused: a wrong directory (a typo, ``.``) must not read as no
    GPUs."""
    return (f"{root!r} holds no simulated device (DIR/<index>/); make them with 'python -m "
            "pytest_gpuclean.simulate init DIR'")


DEFAULT_TOTAL = 80 * 1024**3
"""Capacity in bytes where a folder has no ``TOTAL`` file: an 80 GB GPU's."""

TOTAL = "total"
"""Bytes."""
UUID = "uuid"
NAME = "name"
CONTEXT_OVERHEAD = "context_overhead"
"""Bytes per process the driver counts as used but charges to no process (per context, or CUDA without
one)."""
CUDA = "cuda"
"""Processes that initialised CUDA on the device without being listed."""

XID = "xid"
"""One line per event, appended, for all devices: the drain at every check costs one ``stat``."""


def xid_line(index: int, code: int) -> str:
    """The line of ``XID`` that is an event of Xid ``code`` on device ``index``."""
    return f"{index} {code}\n"


XID_LINE = "<device index> <Xid code>"
"""``xid_line``'s form, for the message about a line that is not."""

# The health files: what NVML would report of the device.
REMAP_PENDING = "remap_pending"
"""Rows waiting for a reset to be remapped."""
REMAP_FAILED = "remap_failed"
ECC_UNCORRECTED = "ecc_uncorrected"
"""A count."""
COMPUTE_MODE = "compute_mode"
MIG_MODE = "mig_mode"
PERSISTENCE = "persistence"
CLOCKS_EVENT_REASONS = "clocks_event_reasons"
"""Names, comma-separated."""
LOST = "lost"
"""The device is lost; its text says why."""
PROBE_FAILS = "probe_fails"
"""The CUDA probe fails on the device; its text is the error."""
PROBE_HANGS = "probe_hangs"
"""The CUDA probe never answers on the device."""
HEALTH_FILES = (REMAP_PENDING, REMAP_FAILED, ECC_UNCORRECTED, COMPUTE_MODE, MIG_MODE, PERSISTENCE,
                CLOCKS_EVENT_REASONS, LOST, PROBE_FAILS, PROBE_HANGS)
