"""gpuclean's own hooks: how an extension (such as ``ray/hooks.py``) takes part in each test's check, the
session's end and the outputs, without those knowing of it.

An extension puts what it finds into the record as ordinary records (``CheckResult``, ``Offender``,
``Reaped``, naming their ``node``), so every decision and output treats it as this host's. A check hook
returns the failure to report, or None."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from pytest_gpuclean._model.records import Phase, Reaped, TestRecord
    from pytest_gpuclean._session.checked import CheckedSession
    from pytest_gpuclean._session.guard import TestState


# ---- the checks ---------------------------------------------------------------------------------------


@pytest.hookspec
def pytest_gpuclean_session_start(session: CheckedSession) -> None:
    """The session's checking is set up (devices, locks, checker): set up what the extension checks.
    Raise ``pytest.UsageError`` for what cannot be (an option naming something unreachable)."""


@pytest.hookspec
def pytest_gpuclean_check_before(session: CheckedSession, state: TestState, record: TestRecord) -> str | None:
    """A test's setup, before this host's check: the extension's check. A failure fails the setup (this
    host is then not checked)."""


@pytest.hookspec
def pytest_gpuclean_check_after(session: CheckedSession, state: TestState, record: TestRecord) -> str | None:
    """A test's teardown, after its last fixture, before this host's check: the extension's check, so that
    what it knows how to end (a Ray actor, through Ray) is ended its way first. A failure fails the
    teardown, with this host's."""


@pytest.hookspec
def pytest_gpuclean_checked(session: CheckedSession, state: TestState, record: TestRecord, phase: Phase
                            ) -> str | None:
    """After this host's check of ``phase`` (at setup, only a clean one): its census of the session's
    processes is ``session.checker.last_census``, where the extension may find something to check from now
    on (a Ray cluster the session started) and check it at once. A failure fails that phase."""


@pytest.hookspec
def pytest_gpuclean_sweep(session: CheckedSession, include_session: bool, timeout: float) -> list[Reaped]:
    """The session's final sweep (after the last test): what the extension ended of the session's tests'
    (and, with ``include_session``, its set-up's) leftovers."""
    raise NotImplementedError


@pytest.hookspec
def pytest_gpuclean_session_finish(session: CheckedSession) -> None:
    """The session's very end (after every ``pytest_unconfigure``): the extension's last sweep, then it
    stops."""


# ---- the outputs: the extension's parts of what it put in the records -----------------------------------


@pytest.hookspec
def pytest_gpuclean_summary_parts(record: TestRecord) -> list[str]:
    """The extension's parts of ``record``'s line in the terminal summary (a test with findings, or whose
    checks noticed something), after this host's and before the GPU health's; [] for nothing. Also for a
    record an xdist worker sent: a function of the record alone."""
    raise NotImplementedError


@pytest.hookspec
def pytest_gpuclean_report_test(record: TestRecord) -> dict[str, Any] | None:
    """The extension's keys in ``record``'s object of the JSON report (``tests``), after ``timings``;
    None (or {}) for a test it has nothing of, so that such a report keeps its shape. A function of the
    record alone, as ``pytest_gpuclean_summary_parts``."""


@pytest.hookspec
def pytest_gpuclean_report_session(config: pytest.Config) -> dict[str, Any] | None:
    """The extension's keys in the JSON report's ``session`` object, after ``xdist_workers``; None (or {})
    for none. Asked once, when the report is first written: the report written again for the session's
    very last sweep (after ``pytest_unconfigure``) keeps them as they were."""
