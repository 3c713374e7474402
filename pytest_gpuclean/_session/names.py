"""The pytest integration's names: marker, fixture, plugin names, the warning class, the exported cookie. A
leaf: every pytest run imports it."""

from __future__ import annotations

from typing import NamedTuple

import pytest

MARKER = "needs_clean_gpus"
FIXTURE = "clean_gpus"
PLUGIN_NAME = "gpuclean-checker"
FORKING_PLUGINS = {"pytest_forked", "pytest_isolate.plugin"}
"""Modules of the plugins that run each test in a forked child."""
WORKER_OUTPUT_KEY = "gpuclean"
FORKED_REPORT_ATTR = "gpuclean_forked"
"""On a teardown report made in a forked child: that child's records."""


class GpuCleanWarning(pytest.PytestWarning):
    """A finding that does not fail the test it is issued at: torch memory the test kept alive in the pytest
    process. Issued at that test's own file and line, so that a filter (``-W
    error::pytest_gpuclean.plugin.GpuCleanWarning``) can make it that test's error. What gpuclean notices
    about the session or another test is a note, not a warning."""


class ExportedCookie(NamedTuple):
    """The session's cookie as exported: its id, the cookie it inherited, when, and what it replaced."""

    session_id: str
    inherited: str | None
    started_ticks: int
    previous: tuple[str | None, str | None]
    last_pid: int | None = None
    """The last pid allocated at export: within the export's own clock tick, only pids tell older
    processes from the session's (docs/ownership.md)."""
