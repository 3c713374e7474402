"""What users may import resolves: the names of ``pytest_gpuclean`` (its ``__all__``) and the public modules'
names that the README and docs/ tell users to use (docs/architecture.md, "The public surface"). Importing the
package loads none of them: every pytest run of an environment with the plugin imports it."""

from __future__ import annotations

import subprocess
import sys

import pytest

import pytest_gpuclean
from pytest_gpuclean import hookspecs, plugin, simulate
from pytest_gpuclean.report import jsonreport


def test_every_public_name_resolves() -> None:
    assert sorted(pytest_gpuclean.__all__) == ["CleanGpus", "DeviceState", "GpuCleanWarning", "__version__",
                                              "load_schema"]
    for name in pytest_gpuclean.__all__:
        assert getattr(pytest_gpuclean, name) is not None
    # The same objects wherever users were told to find them (README: -W error::...plugin.GpuCleanWarning).
    assert pytest_gpuclean.GpuCleanWarning is plugin.GpuCleanWarning
    assert issubclass(plugin.GpuCleanWarning, pytest.PytestWarning)
    assert pytest_gpuclean.load_schema is jsonreport.load_schema
    assert jsonreport.load_schema()["properties"]["schema_version"]
    assert jsonreport.SCHEMA_PATH.name == "report_schema.json"
    gpus = pytest_gpuclean.CleanGpus((pytest_gpuclean.DeviceState(0, "GPU-a", "H200", 0, 80),))
    assert gpus.uuids == ("GPU-a",) and gpus.devices[0].index == 0
    assert [n for n in dir(hookspecs) if n.startswith("pytest_gpuclean_")]
    assert callable(simulate.main)


def test_a_name_that_is_not_public_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="has no attribute 'Checker'"):
        pytest_gpuclean.Checker  # noqa: B018


def test_importing_the_package_loads_none_of_the_public_names_modules() -> None:
    code = ("import sys, pytest_gpuclean; "
            "print(sorted(m for m in sys.modules if m.startswith('pytest_gpuclean')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          check=True)
    assert done.stdout.split() == ["['pytest_gpuclean',", "'pytest_gpuclean._imports',",
                                   "'pytest_gpuclean._version']"]
