"""The plugin inside suites written elsewhere (issue 13): process-per-test runners and helpers.

Each case runs an inner session under ``-p gpuclean --gpuclean-all`` over simulated devices, with the
helper as its users have it: pytest-forked, pytest-xdist, PyTorch's ``MultiProcessTestCase``, vLLM's
fork/spawn-per-test decorators and a server started in a fixture, and the common pytest plugins. A
clean suite must pass exactly as without gpuclean (no finding, no killed runner); a leak must be
reaped, blamed on its test and reported once.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import run_inner

from pytest_gpuclean.report import LEAK_PREFIX

PYTEST_VERSION = tuple(int(part) for part in pytest.__version__.split(".")[:2])


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


# pytest 9.2 puts a ``_id`` (a NodeId object) on every test report; pytest-forked (1.6.0 and 1.7.5)
# marshals the report's attributes and fails on it, so on 9.2 every forked test fails, gpuclean or not.
needs_forked = pytest.mark.skipif(
    not _installed("pytest_forked") or PYTEST_VERSION >= (9, 2),
    reason="needs pytest-forked on pytest < 9.2 (pytest-forked 1.7.5 cannot serialise pytest 9.2's "
           "reports: every forked test fails with or without gpuclean); CI runs these in .venv-pytest8")


# ---- pytest-forked ---------------------------------------------------------------------------------

@needs_forked
@pytest.mark.parametrize("reap", ["on", "off"])
def test_forked_child_is_never_a_suspect(inner: Callable[[str], Path], pytester: pytest.Pytester,
                                         reap: str) -> None:
    # The forked child runs gpuclean's hooks with the checker the session built before forking: the
    # running process and the parent pytest must be "us", not a leak (it was SIGTERMed, or with
    # reaping off reported as leaked after the timeout).
    inner('''
@pytest.mark.needs_clean_gpus
def test_marked():
    pass

def test_unmarked():
    assert os.getpid() > 0
''')
    result = run_inner(pytester, "--forked", "--gpuclean-all", f"--gpuclean-reap={reap}",
                       "--gpuclean-timeout=3")
    result.assert_outcomes(passed=2)
    assert "CRASHED" not in result.stdout.str()
    assert LEAK_PREFIX not in result.stdout.str()
