"""The simulated devices' directory layout, written by ``pytest_gpuclean.simulate`` and read by
``simulated.py`` and the probe; it imports nothing (a holder, ``simulate hold``, loads only this).

``DIR/<index>/`` is a device: ``<pid>`` holds the bytes that process allocated, ``cuda/<pid>`` marks a
process with CUDA initialised there without a context, other files are optional. ``DIR/xid`` holds every
device's Xid events."""

from __future__ import annotations

import os


def device_indices(root: str | os.PathLike[str]) -> list[int]:
    """The devices ``root`` holds: its folders named by an index, in order. Raises ``OSError`` if
    unlistable."""
    with os.scandir(root) as entries:
        return sorted(int(e.name) for e in entries if e.name.isdigit() and e.is_dir())


def no_device(root: str) -> str:
    """Why ``root`` holding no device is refused: a directory of no simulated devices (a typo, ``.``) must
    not read as a machine without GPUs."""
    return (f"{root!r} holds no simulated device (DIR/<index>/); make them with 'python -m "
            "pytest_gpuclean.simulate init DIR'")


DEFAULT_TOTAL = 80 * 1024**3
"""Capacity in bytes where a folder has no ``TOTAL`` file: an 80 GB GPU's."""

TOTAL = "total"
"""Bytes."""
UUID = "uuid"
NAME = "name"
CONTEXT_OVERHEAD = "context_overhead"
"""Bytes per process counted as used but charged to no process, as the driver does per CUDA context (and
per process with CUDA initialised but no context)."""
CUDA = "cuda"
"""Processes that initialised CUDA on the device without being listed."""

XID = "xid"
"""In ``DIR``: one line per event (``xid_line``), appended; one file for all devices, so the drain at every
check costs one ``stat``."""


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
