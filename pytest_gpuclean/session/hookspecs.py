"""gpuclean's own hooks: how an extension (the Ray cluster's checks, ``ray/checks.py``) takes part in each
test's check and in the session's end without the per-test check knowing of it, as xdist keeps its
``newhooks.py``. Registered by the plugin's ``pytest_addhooks``; an extension is a plugin that implements
them, registered only when it is asked for (``--gpuclean-ray``).

A hook's ``session`` is the started session (``started.Started``); ``state`` and ``record`` the test's
state and record. What an extension finds goes into the record as ordinary records (``CheckResult``,
``Offender``, ``Reaped``: a finding off this host names its ``node``), so every output shows it.
A check hook returns the failure to report (its text), or None.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from pytest_gpuclean.model.records import Phase, Reaped, TestRecord
    from pytest_gpuclean.session.started import ItemState, Started


@pytest.hookspec
def pytest_gpuclean_session_start(session: Started) -> None:
    """The session's checking is set up (devices, locks, checker): set up what the extension checks.
    Raise ``pytest.UsageError`` for what cannot be (an option naming something unreachable)."""


@pytest.hookspec
def pytest_gpuclean_check_before(session: Started, state: ItemState, record: TestRecord) -> str | None:
    """A test's setup, before this host's check: the extension's check. A failure fails the setup (this
    host is then not checked)."""


@pytest.hookspec
def pytest_gpuclean_check_after(session: Started, state: ItemState, record: TestRecord) -> str | None:
    """A test's teardown, after its last fixture, before this host's check: the extension's check, so
    that what it knows how to end (a Ray actor, through Ray) is ended its way first. A failure fails the
    teardown, with this host's."""


@pytest.hookspec
def pytest_gpuclean_checked(session: Started, state: ItemState, record: TestRecord, phase: Phase
                            ) -> str | None:
    """After this host's check of ``phase`` (at setup, only a clean one): its census of the session's
    processes is ``session.checker.last_census``, where the extension may find something to check from
    now on (a Ray cluster the session started) and check it at once. A failure fails that phase."""


@pytest.hookspec
def pytest_gpuclean_sweep(session: Started, include_session: bool, timeout: float) -> list[Reaped]:
    """The session's final sweep (after the last test): what the extension ended of the session's tests'
    (and, with ``include_session``, its set-up's) leftovers."""
    raise NotImplementedError  # (a specification: the extensions implement it)


@pytest.hookspec
def pytest_gpuclean_session_finish(session: Started) -> None:
    """The session's very end (after every ``pytest_unconfigure``): the extension's last sweep, then it
    stops."""
