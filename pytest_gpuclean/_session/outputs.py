"""The hooks that write what CI reads of a session: the JSON report, JUnit ``user_properties`` and, on
GitHub Actions, annotations and a job summary. Under xdist the workers add the JUnit properties and send
their records; the controller writes the rest. ``report/`` is imported only by an output that needs it."""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Callable, Generator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import pytest

from pytest_gpuclean._model.records import Reaped, TestRecord
from pytest_gpuclean._session import store

if TYPE_CHECKING:
    from pytest_gpuclean._session.checked import CheckedSession
    from pytest_gpuclean._settings import Settings
    from pytest_gpuclean.report import jsonreport


REPORT_OPTION = "--gpuclean-report"
RECORD_ATTRIBUTE = "gpuclean_record"
"""Attribute of an xdist worker's teardown report: the test's record, for the controller."""


# ---- the hooks ---------------------------------------------------------------------------------------

def _report_path(value: str, source: str, base: Path) -> Path:
    # Checked at startup, so a typo fails in a second, not after an hour of GPU tests; every failure is
    # the user's to fix, so a usage error, not an INTERNALERROR.
    try:
        path = (base / Path(value).expanduser()).absolute()
    except RuntimeError as exc:  # ~name of no such user, or no home directory to expand ~ to
        raise pytest.UsageError(f"{REPORT_OPTION}: cannot use {value!r}: {exc} ({source})") from None
    try:
        if path.is_dir():
            raise pytest.UsageError(f"{REPORT_OPTION}: {value!r} is a directory; give a file path ({source})")
        if not path.parent.is_dir():
            _make_report_dir(path.parent, source)
    except OSError as exc:
        raise pytest.UsageError(f"{REPORT_OPTION}: cannot use {str(path)!r}: {exc.strerror or exc} "
                                f"({source})") from None
    if not os.access(path.parent, os.W_OK | os.X_OK):
        raise pytest.UsageError(
            f"{REPORT_OPTION}: directory {str(path.parent)!r} is not writable ({source})")
    return path


def _make_report_dir(directory: Path, source: str) -> None:
    # As --junitxml does. Made now, so a failure shows at start-up; one level at a time, so a failure
    # half-way removes what this made.
    missing: list[Path] = []
    for candidate in (directory, *directory.parents):
        if candidate.is_dir():
            break
        if candidate.exists() or candidate.is_symlink():
            raise pytest.UsageError(f"{REPORT_OPTION}: cannot create directory {str(directory)!r}: "
                                    f"{str(candidate)!r} is not a directory ({source})")
        missing.append(candidate)
    made: list[Path] = []
    try:
        for folder in reversed(missing):
            try:
                folder.mkdir()
            except FileExistsError:
                if not folder.is_dir():
                    raise
                continue  # made by someone else meanwhile: theirs, not ours to remove
            made.append(folder)
    except OSError as exc:
        for folder in reversed(made):
            with contextlib.suppress(OSError):
                folder.rmdir()
        raise pytest.UsageError(f"{REPORT_OPTION}: cannot create directory {str(directory)!r}: "
                                f"{exc.strerror or exc} ({source})") from None


class _Plugin(Protocol):
    """What these hooks need of ``plugin._GpuCleanPlugin``, a layer above."""

    config: pytest.Config
    settings: Settings
    controller: bool

    @property
    def session(self) -> CheckedSession | None: ...

    def sweep(self, session: pytest.Session) -> None: ...


class PerTestOutputs:
    """The outputs' hooks that run for every test report: registered only where they have work."""

    def __init__(self, outputs: OutputHooks) -> None:
        self.outputs = outputs

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo[None]
                                  ) -> Generator[None, pytest.TestReport, pytest.TestReport]:
        test_report = yield
        when = call.when
        if when == "teardown" or (when == "setup" and self.outputs.worker):
            record = item.stash.get(store.TEST, None)
            if record is not None:
                if self.outputs.junit and when == "teardown":
                    # On the report, not the item: junitxml and xdist take them from the teardown terminal.
                    from pytest_gpuclean.report.ci import junit_properties

                    test_report.user_properties.extend(junit_properties(record))
                if self.outputs.worker:
                    # Streamed with the report, so an interrupted run's controller still knows what the
                    # finished tests found, though the worker's payload never comes.
                    from pytest_gpuclean.report.serialize import to_dict

                    setattr(test_report, RECORD_ATTRIBUTE, to_dict(record))
        return test_report

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        record = getattr(report, RECORD_ATTRIBUTE, None)
        if record is not None and not self.outputs.worker and report.when in ("setup", "teardown"):
            self.outputs.records.stream(report.nodeid, record)


class OutputHooks:
    """Turns the session's records into the JSON report, JUnit properties and GitHub output."""

    def __init__(self, plugin: _Plugin) -> None:
        self.plugin = plugin
        config = plugin.config
        self.records = store.of(config)
        self.worker = hasattr(config, "workerinput")
        self.report_path: Path | None = None
        if plugin.settings.report and not self.worker:
            source = plugin.settings.sources.get("report", "from the command line")
            self.report_path = _report_path(plugin.settings.report, source, config.invocation_params.dir)
        self.github = os.environ.get("GITHUB_ACTIONS") == "true" and not self.worker
        # For junitxml alone; xdist workers and forked children see the controller's options too.
        self.junit = bool(config.getoption("xmlpath", None))
        self.started = time.time()
        self._merged: store.RecordSet | None = None
        self._session: pytest.Session | None = None
        """Set once the outputs were written at the session's end."""
        self._extension_keys: jsonreport.JsonDict | None = None
        """The extensions' keys of the report's ``session`` object, as at the report's first write."""

    def per_test(self) -> bool:
        """Whether ``PerTestOutputs`` has work (known for an xdist controller only at its start)."""
        return self.junit or self.worker or self.plugin.controller

    def _session_json(self, exitstatus: int) -> jsonreport.JsonDict:
        from pytest_gpuclean.report import jsonreport

        plugin = self.plugin
        started = plugin.session
        backend = started.backend if started is not None else None
        settings = plugin.settings
        ended = time.time()
        return {
            "start": jsonreport.iso_time(self.started),
            "end": jsonreport.iso_time(ended),
            "duration_s": round(max(0.0, ended - self.started), 6),
            "exitstatus": int(exitstatus),
            "host": socket.gethostname(),
            "backend": backend.kind if backend is not None else None,
            "driver": backend.driver_version() if backend is not None else None,
            "unavailable": started.unavailable if started is not None else None,
            "devices": [jsonreport.device_json(d) for d in (started.devices if started is not None else ())],
            "settings": {"all": settings.all, "tolerance_mib": settings.tolerance_mib,
                         "timeout": settings.timeout, "scope": settings.scope, "reap": settings.reap,
                         "grace": settings.grace, "lock": settings.lock,
                         # marked tests error with no GPU to check (--gpuclean-no-gpu=fail)
                         "require_gpu": started is not None and started.no_gpu[0] == "fail",
                         "probe": settings.probe,
                         "outside": settings.outside},
            "xdist_workers": len(self.records.worker_payloads) if plugin.controller else None,
            **self._session_keys(),
        }

    def _session_keys(self) -> jsonreport.JsonDict:
        # As at the first write: an extension reports its own last sweep itself.
        if self._extension_keys is None:
            self._extension_keys = {}
            for keys in self.plugin.config.hook.pytest_gpuclean_report_session(config=self.plugin.config):
                self._extension_keys.update(keys or {})
        return self._extension_keys

    def _test_keys(self) -> Callable[[TestRecord], jsonreport.JsonDict] | None:
        """The extensions' keys of each test's object (None where no extension has any)."""
        hook = self.plugin.config.hook.pytest_gpuclean_report_test
        if not hook.get_hookimpls():
            return None

        def keys(record: TestRecord) -> jsonreport.JsonDict:
            found: jsonreport.JsonDict = {}
            for part in hook(record=record):
                found.update(part or {})
            return found

        return keys

    @pytest.hookimpl(wrapper=True, trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> Generator[None, None, None]:
        # A wrapper, to run after every plain implementation (the final sweep included); in ``finally``, so
        # another's failing pytest_sessionfinish does not cost the reports. trylast: inside the terminal
        # reporter's wrapper, which prints the summary when its own ends.
        try:
            yield
        finally:
            self.plugin.sweep(session)
            if not self.worker:
                self._write(session)

    def _write(self, session: pytest.Session) -> None:
        self._session = session
        self._merged = merged = self.records.merged()
        self._write_report(session, merged)
        if self.github and (merged.records or merged.session_reaped):
            from pytest_gpuclean.report.ci import step_summary

            self._append_step_summary(session, step_summary(merged.records, merged.session_reaped))

    def _write_report(self, session: pytest.Session, merged: store.RecordSet) -> None:
        if self.report_path is None:
            return
        from pytest_gpuclean.report import jsonreport

        document = jsonreport.report_document(
            records=merged.records, session_reaped=merged.session_reaped, notes=merged.notes,
            session=self._session_json(session.exitstatus), test_keys=self._test_keys())
        try:
            jsonreport.write_atomic(self.report_path, document)
        except OSError as exc:
            self._complain(session, f"gpuclean: could not write the report {self.report_path}: {exc}")

    def _append_step_summary(self, session: pytest.Session, text: str) -> None:
        summary_file = os.environ.get("GITHUB_STEP_SUMMARY")
        if not summary_file:
            return
        try:
            with open(summary_file, "a", encoding="utf-8") as f:
                f.write(text)
        except OSError as exc:
            self._complain(session, f"gpuclean: could not append to GITHUB_STEP_SUMMARY "
                                    f"{summary_file}: {exc}")

    def add_late(self, late: Sequence[Reaped]) -> None:
        """The very last sweep (after every pytest_unconfigure) reaped ``late``: write the report again,
        atomically, and tell GitHub. Only once the outputs were written; an xdist worker's last sweep is
        only printed, as its findings are sent already."""
        session = self._session
        if self.worker or session is None:
            return
        self._merged = merged = self.records.merged()
        self._write_report(session, merged)
        if self.github:
            from pytest_gpuclean.report import ci

            writer = session.config.pluginmanager.get_plugin("terminalreporter")
            for line in ci.annotation_lines((), late, self._github_path):
                if writer is not None:
                    writer.write_line(line)
                else:
                    print(line)
            self._append_step_summary(session, ci.late_step_summary(late))

    def _complain(self, session: pytest.Session, message: str) -> None:
        # The tests ran, but CI would miss the output it relies on: fail the run, loudly.
        writer = session.config.pluginmanager.get_plugin("terminalreporter")
        if writer is not None:
            writer.write_line(message, red=True)
        else:
            print(message)
        if session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.INTERNAL_ERROR

    def _github_path(self, file: str) -> str:
        # GitHub resolves annotation paths against the workspace; rootdir may be a subdirectory.
        workspace = os.environ.get("GITHUB_WORKSPACE")
        full = self.plugin.config.rootpath / file
        if workspace:
            try:
                return full.resolve().relative_to(Path(workspace).resolve()).as_posix()
            except ValueError:
                pass
        return file

    @pytest.hookimpl(trylast=True)
    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if not self.github or self._merged is None:
            return
        from pytest_gpuclean.report.ci import annotation_lines

        for line in annotation_lines(self._merged.records, self._merged.session_reaped, self._github_path):
            terminalreporter.write_line(line)
