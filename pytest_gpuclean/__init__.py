"""pytest-gpuclean: clean GPUs and no stray processes around every GPU test.

What users may import: the names below (``__all__``) and four modules: ``plugin`` (the ``pytest11`` entry
point; ``plugin.GpuCleanWarning`` is the warning class, for a warning filter), ``hookspecs`` (gpuclean's own
hooks, for an extension to implement), ``simulate`` (simulated devices: ``python -m
pytest_gpuclean.simulate``) and ``report.jsonreport`` (``load_schema`` and ``SCHEMA_PATH``: the JSON report's
schema). Everything else is the package's own: the modules and packages whose names start with ``_``, the
rest of ``report/`` and the Ray extension (``ray/``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pytest_gpuclean import _imports  # noqa: F401  (first: the package's modules load through it)
from pytest_gpuclean._version import __version__

if TYPE_CHECKING:
    from pytest_gpuclean._model.records import CleanGpus, DeviceState
    from pytest_gpuclean._session.names import GpuCleanWarning
    from pytest_gpuclean.report.jsonreport import load_schema

__all__ = ["CleanGpus", "DeviceState", "GpuCleanWarning", "__version__", "load_schema"]

_HOMES = {"CleanGpus": "pytest_gpuclean._model.records", "DeviceState": "pytest_gpuclean._model.records",
          "GpuCleanWarning": "pytest_gpuclean._session.names",
          "load_schema": "pytest_gpuclean.report.jsonreport"}


def __getattr__(name: str) -> Any:
    # On first use: importing the package (every pytest run of the environment does) loads none of them.
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(home), name)
