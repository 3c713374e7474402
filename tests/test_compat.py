"""The plugin inside suites written elsewhere (issue 13): process-per-test runners and helpers.

Each case runs an inner session under ``-p gpuclean --gpuclean-all`` over simulated devices, with the
helper as its users have it: pytest-forked, pytest-xdist, PyTorch's ``MultiProcessTestCase``, vLLM's
fork/spawn-per-test decorators and a server started in a fixture, and the common pytest plugins. A
clean suite must pass exactly as without gpuclean (no finding, no killed runner); a leak must be
reaped, blamed on its test and reported once.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import alive, read_pids, run_inner, wait_dead

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


def summary_of(result: pytest.RunResult) -> list[str]:
    """The lines of gpuclean's terminal summary section."""
    lines = result.outlines
    starts = [i for i, line in enumerate(lines) if line.startswith("=") and " gpuclean " in line]
    if not starts:
        return []
    section: list[str] = []
    for line in lines[starts[0] + 1:]:
        if line.startswith("="):
            break
        section.append(line)
    return section


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
    assert summary_of(result)[-1].startswith("2 checked test(s), 0 with findings")


@needs_forked
def test_forked_leak_is_reaped_in_the_child_and_reported_once(inner: Callable[[str], Path],
                                                              pytester: pytest.Pytester) -> None:
    pidfile = inner('''
def test_leaks():
    hold(mib=100)
    wait_holders(1)

def test_leaks_a_daemon():
    hold("--daemonize", mib=50)
    wait_holders(2)

def test_after():
    pass
''')
    result = run_inner(pytester, "--forked", "--gpuclean-all", "--gpuclean-report=report.json",
                       "--junitxml=junit.xml")
    result.assert_outcomes(passed=3, errors=2)
    leaked = read_pids(pidfile, expected=2)
    assert wait_dead(leaked, timeout=5) == []
    out = result.stdout.str()
    assert out.count(LEAK_PREFIX) == 2
    summary = summary_of(result)
    assert summary[-1] == "3 checked test(s), 2 with findings, 2 process(es) reaped"
    for name in ("test_leaks", "test_leaks_a_daemon"):
        assert sum(1 for line in summary if line.startswith(f"test_inner.py::{name}:")) == 1
    report = json.loads((pytester.path / "report.json").read_text())
    records = {t["nodeid"]: t for t in report["tests"]}
    assert len(report["tests"]) == 3 == len(records)
    assert [p["pid"] for p in records["test_inner.py::test_leaks"]["leaked"]] == leaked[:1]
    daemon = records["test_inner.py::test_leaks_a_daemon"]["leaked"]
    assert leaked[1] in [p["pid"] for p in daemon]
    assert all(p["owner"]["name"] == "test_inner.py::test_leaks_a_daemon" for p in daemon)
    assert records["test_inner.py::test_after"]["outcome"] == "clean"
    assert report["session_reaped"] == []
    junit = (pytester.path / "junit.xml").read_text()
    assert 'name="gpuclean_outcome" value="leaked"' in junit


@needs_forked
def test_forked_unchecked_leak_is_blamed_on_its_own_test(inner: Callable[[str], Path],
                                                         pytester: pytest.Pytester) -> None:
    # Each forked child starts from the session's state as it was before the fork: an unchecked
    # test's escapee, found by the next checked test's cookie scan in another child, still names the
    # test that spawned it, not the test that found it.
    pidfile = inner('''
def test_a_unchecked_leaks_a_daemon():
    hold("--daemonize", mib=50)
    wait_holders(1)

@pytest.mark.needs_clean_gpus
def test_b_checked():
    pass
''')
    result = run_inner(pytester, "--forked", "--gpuclean-report=report.json")
    leaked = read_pids(pidfile)
    assert wait_dead(leaked, timeout=5) == []
    result.assert_outcomes(passed=2)
    report = json.loads((pytester.path / "report.json").read_text())
    records = {t["nodeid"]: t for t in report["tests"]}
    later = records["test_inner.py::test_a_unchecked_leaks_a_daemon"]["found_later"]
    assert [r["process"]["pid"] for r in later] == leaked
    assert records["test_inner.py::test_b_checked"]["leaked"] == []
    assert alive(leaked[0]) is False
