"""Inner sessions whose first test leaves an engine behind, and what gpuclean must then have done: reaped it,
blamed that test, and let the next test of the same session pass (test_abandoned_engine.py,
test_server_crash.py)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from example_suite.reaping import gone
from example_suite.runtime import VllmRuntime
from example_suite.subprocesses import REPO_ROOT, run_inner_session

# An inner test file that leaves an engine behind (test_abandoned_engine.py, test_server_crash.py): this
# prelude, the file's own first test (which writes ``{"engine": [{"pid", "cmdline", ...}], ...}`` to
# PIDS_FILE), then INNER_NEXT_TEST.
INNER_PRELUDE = """
import json
import os
import signal
import sys
from pathlib import Path

import psutil
import pytest

sys.path.insert(0, {repo!r})
PIDS_FILE = Path({pids_file!r})
"""

INNER_NEXT_TEST = """

@pytest.mark.needs_clean_gpus
def test_next_test_passes():
    # Still the same session: only the plugin can have ended them by now.
    engine = json.loads(PIDS_FILE.read_text())["engine"]
    alive = [p for p in engine if psutil.pid_exists(p["pid"])
             and psutil.Process(p["pid"]).status() != psutil.STATUS_ZOMBIE]
    assert not alive, alive
"""


@dataclass(frozen=True)
class InnerSession:
    """An inner session whose first test left an engine behind: its result, output and PIDS_FILE."""

    result: pytest.RunResult
    output: str
    pids_file: Path

    def recorded(self) -> dict[str, Any]:
        """What the first inner test wrote to PIDS_FILE (fails the test, with the output, if nothing)."""
        import json

        assert self.pids_file.exists(), self.output[-6000:]
        return dict(json.loads(self.pids_file.read_text()))


def leaving_tp(runtime: VllmRuntime) -> int:
    """TP size of the engine an inner test leaves behind: 2 (orphaned workers too) unless only one GPU."""
    return 1 if runtime.device == "cuda" and runtime.gpus < 2 else 2


def run_leaving_session(pytester: pytest.Pytester, first_test: str, **fields: Any) -> InnerSession:
    """Run INNER_PRELUDE + ``first_test`` (formatted with ``fields``) + INNER_NEXT_TEST under gpuclean."""
    pids_file = pytester.path / "engine-pids.json"
    prelude = INNER_PRELUDE.format(repo=str(REPO_ROOT), pids_file=str(pids_file))
    pytester.makepyfile(test_inner=prelude + first_test.format(**fields) + INNER_NEXT_TEST)
    result = run_inner_session(pytester)
    return InnerSession(result, result.stdout.str() + "\n" + result.stderr.str(), pids_file)


def assert_engine_reaped_and_blamed(
    session: InnerSession, test_name: str, engine: list[dict[str, Any]]
) -> None:
    """:func:`assert_leak_reaped_and_blamed`, and every process of ``engine`` gone by now."""
    assert_leak_reaped_and_blamed(session.result, test_name, engine)
    # Nothing of the engine is left running now (pids are not reused that fast).
    deadline = time.monotonic() + 10
    while not all(gone(p["pid"]) for p in engine) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert all(gone(p["pid"]) for p in engine), (engine, session.output[-3000:])


def report_section(output: str, title: str) -> str:
    """The body of one ``___ TITLE ___`` block of pytest's report, e.g. "ERROR at teardown of test_x"."""
    import re

    match = re.search(rf"_+ {re.escape(title)} _+\n(.*?)(?=\n_{{3,}} |\n={{3,}} )", output, re.S)
    assert match, f"no {title!r} section in:\n{output}"
    return match.group(1)


def assert_leak_reaped_and_blamed(
    result: pytest.RunResult, test_name: str, processes: list[dict[str, Any]]
) -> None:
    """The inner ``test_name`` passed its body, errored at teardown naming every one of ``processes``
    (``{"pid", "cmdline"}``) as leaked, and the inner ``test_next_test_passes`` passed."""
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines(
        [f"*test_inner.py::{test_name} PASSED*", f"*test_inner.py::{test_name} ERROR*"]
    )
    result.stdout.fnmatch_lines(["*test_inner.py::test_next_test_passes PASSED*"])
    report = report_section(result.stdout.str(), f"ERROR at teardown of {test_name}")
    assert "leaked" in report, report
    for process in processes:  # the report names each process with its command line
        cmdline = " ".join(process["cmdline"].split())  # setproctitle pads the title with spaces
        assert f"pid {process['pid']} " in report and cmdline[:60] in report, (process, report)


def remove_engine_debris(pids: set[int], directories: Sequence[str]) -> None:
    """After a test killed or abandoned an engine: remove what its processes could not clean up themselves.

    ``directories`` (a server's private directory, an extractor's staging directory) and, on CPU, the
    OpenMP registrations ``/dev/shm/__KMP_REGISTERED_LIB_<pid>_*`` of exactly ``pids``; only once none of
    ``pids`` runs any more.
    """
    import shutil

    from example_suite.runtime import openmp_registrations

    if not all(gone(pid) for pid in pids):
        return
    for directory in directories:
        shutil.rmtree(directory, ignore_errors=True)
    for entry in openmp_registrations(pids):
        entry.unlink(missing_ok=True)
