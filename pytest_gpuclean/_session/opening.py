"""The devices a session checks, opened and chosen as its options say; the reading's errors become
``pytest.UsageError`` lines that name the option and where its value came from."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from pytest_gpuclean import _settings as settings
from pytest_gpuclean._reading import backends, devices
from pytest_gpuclean._reading.backends import open_backend

if TYPE_CHECKING:
    from pytest_gpuclean._model.records import Selection
    from pytest_gpuclean._reading.backends import Backend
    from pytest_gpuclean._reading.nvml import NvmlOpening


def open_devices(resolved: settings.Settings, opening: NvmlOpening | None = None) -> Backend:
    """The backend ``--gpuclean-simulate`` names (``opening``: NVML's start, begun earlier)."""
    try:
        return open_backend(resolved.simulate, opening)
    except devices.SimulationError as exc:
        raise pytest.UsageError(resolved.refused("simulate", exc)) from None


def select_devices(backend: Backend, resolved: settings.Settings) -> Selection:
    """The devices ``--gpuclean-devices`` (or ``CUDA_VISIBLE_DEVICES``) names of ``backend``'s."""
    try:
        return backends.choose_devices(backend, resolved.devices, resolved.sources.get("devices", ""),
                                       option=settings.option("devices").cli)
    except devices.DeviceSelectionError as exc:
        raise pytest.UsageError(str(exc)) from None
