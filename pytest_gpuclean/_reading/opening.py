"""Opening the device backend the settings name: the simulated devices' reader when a directory is given,
else NVML. The one module that imports both backends (``devices.py``, which both import, cannot import them
back: an import circle). ``session/opening.py`` words its errors for pytest.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pytest_gpuclean._reading.backends import Backend
    from pytest_gpuclean._reading.nvml import NvmlOpening
__all__ = [
    "open_backend",
]



def open_backend(simulate_dir: str | None, opening: NvmlOpening | None = None) -> Backend:
    """The simulated backend when a directory is given, else NVML (``opening``: NVML's start, begun
    earlier). Raises ``BackendUnavailable``."""
    # Each backend is imported here, when it is opened, to keep the lazy start: a session reads one kind of
    # device, and a CPU CI session never loads the NVML module (nor a GPU session the simulated one).
    if simulate_dir:
        from pytest_gpuclean._reading.simulated import SimulatedBackend
        return SimulatedBackend(simulate_dir)
    from pytest_gpuclean._reading.nvml import NvmlBackend
    return NvmlBackend(opening)
