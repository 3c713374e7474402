"""gpuclean's own hooks (``hookspecs.py``): an extension takes part in each checked test's check, in
the session's end and in the outputs without the per-test check or the outputs knowing of it (the Ray
cluster's checks are one: tests/test_ray.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import run_inner

EXTENSION = '''
import json, os


def log(*event):
    with open(os.environ["HOOK_LOG"], "a") as f:
        f.write(json.dumps(event) + "\\n")


class Extension:
    def pytest_gpuclean_session_start(self, session):
        log("session_start", type(session).__name__)

    def pytest_gpuclean_check_before(self, state, record):
        log("check_before", state.nodeid.split("::")[1])
        if state.nodeid.endswith("test_b_refused"):
            return "ext: not clean before the test"
        return None

    def pytest_gpuclean_check_after(self, state, record):
        log("check_after", state.nodeid.split("::")[1], record.before is not None)
        if state.nodeid.endswith("test_a_leaks"):
            return "ext: test_a_leaks left something on the extension"
        return None

    def pytest_gpuclean_checked(self, state, record, phase):
        log("checked", state.nodeid.split("::")[1], phase)

    def pytest_gpuclean_sweep(self, include_session, timeout):
        log("sweep", include_session)
        return []

    def pytest_gpuclean_session_finish(self, session):
        log("session_finish")


def pytest_configure(config):
    config.pluginmanager.register(Extension(), "gpuclean-test-extension")
'''

TESTS = '''
import pytest


@pytest.mark.needs_clean_gpus
def test_a_leaks():
    pass


@pytest.mark.needs_clean_gpus
def test_b_refused():
    pass


def test_c_unchecked():
    pass
'''


def test_an_extension_checks_each_checked_test_through_the_hooks(
        sim: Path, pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    pytester.makeconftest(EXTENSION)
    pytester.makepyfile(test_inner=TESTS)
    log = tmp_path / "hooks.jsonl"
    monkeypatch.setenv("HOOK_LOG", str(log))
    result = run_inner(pytester)
    # Its failure after the test fails the teardown; before it, the setup (the test does not run).
    result.assert_outcomes(passed=2, errors=2)
    result.stdout.fnmatch_lines(["*ERROR at teardown of test_a_leaks*", "*ext: test_a_leaks left something*",
                                 "*ERROR at setup of test_b_refused*", "*ext: not clean before the test*"])
    events = [tuple(json.loads(line)) for line in log.read_text().splitlines()]
    assert events == [
        ("session_start", "CheckedSession"),
        # Before this host's check; after it (clean), the extension may look at its census.
        ("check_before", "test_a_leaks"), ("checked", "test_a_leaks", "setup"),
        # After the last fixture, before this host's check; after it, the census again.
        ("check_after", "test_a_leaks", True), ("checked", "test_a_leaks", "teardown"),
        # A refused setup: this host is not checked, nor its teardown (the test never ran on clean GPUs).
        ("check_before", "test_b_refused"),
        # An unchecked test: no hook.
        ("sweep", False), ("session_finish",)]


# A third-party extension's report hooks: its parts of a test's summary line and of the JSON report.
REPORTING = '''
class Reporting:
    def pytest_gpuclean_summary_parts(self, record):
        return [f"acme saw {record.nodeid.split('::')[1]}"]

    def pytest_gpuclean_report_test(self, record):
        return {"acme": {"reaped": len(record.after.reaped) if record.after else None}}

    def pytest_gpuclean_report_session(self, config):
        return {"acme_session": {"rootdir": config.rootpath.name}}


class Silent:  # an extension with nothing to say of this session
    def pytest_gpuclean_summary_parts(self, record):
        return []

    def pytest_gpuclean_report_test(self, record):
        return None

    def pytest_gpuclean_report_session(self):
        return None


def pytest_configure(config):
    config.pluginmanager.register(Reporting(), "acme-reporting")
    config.pluginmanager.register(Silent(), "acme-silent")
'''

REPORTED = '''
import subprocess, sys
import pytest


@pytest.mark.needs_clean_gpus
def test_a_leaks():
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


@pytest.mark.needs_clean_gpus
def test_b_clean():
    pass
'''


def test_an_extension_adds_its_parts_to_the_summary_and_the_report(
        sim: Path, pytester: pytest.Pytester, tmp_path: Path) -> None:
    pytester.makeconftest(REPORTING)
    pytester.makepyfile(test_inner=REPORTED)
    report = tmp_path / "report.json"
    result = run_inner(pytester, "--gpuclean-grace=2", "--gpuclean-settle=0", f"--gpuclean-report={report}")
    result.assert_outcomes(passed=2, errors=1)
    # Its part comes after what gpuclean says of the test's own checks; a test without findings has no line.
    result.stdout.re_match_lines([r"test_inner.py::test_a_leaks: teardown: reaped 1 \(pid \d+ SIGTERM\)"
                                  r".*; acme saw test_a_leaks$"])
    assert "acme saw test_b_clean" not in result.stdout.str()
    document = json.loads(report.read_text())
    tests = {t["nodeid"].split("::")[1]: t for t in document["tests"]}
    # Each test's keys after its timings; the session's after xdist_workers; gpuclean's own keys as ever.
    assert tests["test_a_leaks"]["acme"] == {"reaped": 1} and tests["test_b_clean"]["acme"] == {"reaped": 0}
    assert list(tests["test_a_leaks"])[-2:] == ["timings", "acme"]
    assert list(document["session"])[-2:] == ["xdist_workers", "acme_session"]
    assert document["session"]["acme_session"] == {"rootdir": pytester.path.name}
    assert tests["test_a_leaks"]["outcome"] == "leaked" and document["summary"]["reaped"] == 1
