"""Machine-readable outputs of a gpuclean session, for CI: the JSON report (``--gpuclean-report``), JUnit
``user_properties`` and, on GitHub Actions, ``::error`` annotations plus a job-summary table.

``OutputHooks`` reads the session's records (``records.py``); it never checks or reaps anything itself. Under
pytest-xdist the workers add JUnit properties to their own reports (xdist ships them to the
controller's junitxml) and the controller writes everything else from the records the workers sent. An
extension's parts of the report come through gpuclean's report hooks (``hookspecs.py``).

Every checked session registers these hooks, but one without a report, JUnit XML, GitHub or xdist makes
no output: the JSON shapes (``jsonreport.py``) and the records' shipping (``serialize.py``) are imported by
the functions that make one, when they first run, so that such a session never loads them (the lazy start:
tests/test_cost.py). Hence their function-level imports here.
"""

from __future__ import annotations

import contextlib
import html
import os
import socket
import time
from collections.abc import Callable, Generator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import pytest

from pytest_gpuclean._model.outcomes import FixtureLeak, TestRecord, has_findings
from pytest_gpuclean._model.records import Reaped
from pytest_gpuclean._session import store
from pytest_gpuclean.report import terminal

if TYPE_CHECKING:
    from pytest_gpuclean._session.checked import CheckedSession
    from pytest_gpuclean._settings import Settings
    from pytest_gpuclean.report import jsonreport

__all__ = [
    "PROPERTY_PREFIX",
    "RECORD_ATTRIBUTE",
    "REPORT_OPTION",
    "TITLE_GPU_FAULT",
    "TITLE_GPU_UNUSABLE",
    "TITLE_LEAK",
    "TITLE_LOCK_TIMEOUT",
    "TITLE_NOT_CLEAN",
    "TITLE_WITHOUT_LOCK",
    "OutputHooks",
    "PerTestOutputs",
    "annotation_lines",
    "annotation_message",
    "escape_data",
    "escape_property",
    "fixture_annotation_message",
    "junit_properties",
    "step_summary",
    "workflow_command",
]


TITLE_LEAK = "GPU leak"
TITLE_NOT_CLEAN = "GPU not clean"
TITLE_LOCK_TIMEOUT = "GPU lock timeout"
TITLE_WITHOUT_LOCK = "GPU used without its lock"
TITLE_GPU_FAULT = "GPU fault"
TITLE_GPU_UNUSABLE = "GPU not usable"
PROPERTY_PREFIX = "gpuclean_"
REPORT_OPTION = "--gpuclean-report"
RECORD_ATTRIBUTE = "gpuclean_record"
"""Attribute of an xdist worker's teardown report: the test's record, for the controller."""


# ---- GitHub workflow commands ------------------------------------------------------------------------

def escape_data(text: str) -> str:
    """Escape the message of a workflow command (GitHub's ``escapeData``)."""
    return text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def escape_property(text: str) -> str:
    """Escape a property value of a workflow command (GitHub's ``escapeProperty``)."""
    return escape_data(text).replace(":", "%3A").replace(",", "%2C")


def workflow_command(command: str, message: str, properties: Sequence[tuple[str, str]] = ()) -> str:
    """``::command key=value,...::message`` with both parts escaped."""
    props = ",".join(f"{key}={escape_property(value)}" for key, value in properties)
    return f"::{command}{' ' + props if props else ''}::{escape_data(message)}"


def _process_line(pid: int, cmdline: str, ended_by: str | None, release_s: float | None) -> str:
    # ("ended by" names a signal: a process that ended without one says how, "exited by itself".)
    what = (f"ended by {ended_by}" if ended_by in ("SIGTERM", "SIGKILL") else ended_by) if ended_by \
        else "NOT reaped, still running"
    release = (f", GPU memory released {release_s:.2f}s after the {ended_by}"
               if release_s is not None and ended_by else "")
    return f"pid {pid} {what}{release}: {terminal.one_line(cmdline)}"


def annotation_message(record: TestRecord) -> tuple[str, str] | None:
    """(title, message) of the annotation for a test with findings; None for a clean test."""
    found = _verdict_message(record)
    if not record.gpu_without_lock:
        return found
    # Found by another xdist worker: added to whatever else the test's own checks found.
    lines = [f"pid {u.process.pid} held {terminal.mib_list(u.mib_per_device)} while {u.seen_worker}'s "
             f"{u.seen_by} held the GPU lock: {terminal.one_line(u.process.cmdline)}"
             for u in record.gpu_without_lock]
    heading = "used a GPU whose lock another xdist worker's test held"
    if found is None:
        return TITLE_WITHOUT_LOCK, "\n".join([f"{record.nodeid} {heading}", *lines])
    return found[0], "\n".join([found[1], f"and {heading}:", *lines])


def _verdict_message(record: TestRecord) -> tuple[str, str] | None:
    from pytest_gpuclean.report import jsonreport  # (lazy: the module's docstring says why)

    if record.lock_timeout is not None:
        return TITLE_LOCK_TIMEOUT, f"{record.nodeid} never got its GPU locks: {record.lock_timeout}"
    if record.blocked_by and not has_findings(record):
        return None  # (skipped for a leak reported and left: its leaker's annotation says it)
    verdict = jsonreport.outcome(record)
    if verdict == "leaked":
        leaked = jsonreport.leaked_json(record)
        lines = [f"{record.nodeid} leaked {len(leaked)} process(es)"]
        lines.extend(_process_line(p["pid"], p["cmdline"], p["ended_by"], p["release_s"]) for p in leaked)
        return TITLE_LEAK, "\n".join(lines)
    health = [f.message for f in record.health if f.effect != "info"]
    if verdict == "gpu_fault":
        return TITLE_GPU_FAULT, "\n".join([f"{record.nodeid} caused a GPU fault", *health])
    checks_clean = all(c is None or c.clean for c in (record.before, record.after))
    if verdict == "not_clean" and checks_clean and health:
        return TITLE_GPU_UNUSABLE, "\n".join([f"GPU not usable around {record.nodeid} (gpuclean never resets "
                                              "a GPU)", *health])
    if verdict == "not_clean":
        lines = []
        for check in (record.before, record.after):
            if check is None or check.clean:
                continue
            when = "before" if check.phase == "setup" else "after"
            if check.error is not None:
                lines.append(f"could not check the GPUs {when} {record.nodeid}: {check.error}")
            else:
                same_as = check.outside.same_as if check.outside is not None else None
                lines.append(f"GPUs not clean {when} {record.nodeid} (waited {check.waited_s:.1f}s"
                             + (f"; the same outside state as at {same_as}: not waited for again)" if same_as
                                else ")"))
            for offender in check.offenders:
                proc = offender.process
                held = terminal.mib_list(offender.mib_per_device)
                who = (f"{offender.reason} pid {proc.pid} (user {proc.user}): "
                       f"{terminal.one_line(proc.cmdline)}"
                       if proc is not None else offender.detail)
                lines.append(who + (f" [{held}]" if held and proc is not None else ""))
        return TITLE_NOT_CLEAN, "\n".join(lines + health)
    return None


def fixture_annotation_message(leak: FixtureLeak) -> str:
    """The annotation of a fixture that leaked, shown at its definition."""
    from pytest_gpuclean.report import jsonreport  # (lazy: the module's docstring says why)

    leaked = jsonreport.fixture_leaked_json(leak)
    return "\n".join([f"{leak} leaked {len(leaked)} process(es), found at the teardown of {leak.reported_on}"]
                     + [_process_line(p["pid"], p["cmdline"], p["ended_by"], p["release_s"]) for p in leaked])


def annotation_lines(records: Sequence[TestRecord], session_reaped: Sequence[Reaped],
                     file_of: Any = None) -> list[str]:
    """``::error`` lines: one per test with findings (at the test), one per fixture that leaked (at the
    fixture's definition), one for leftovers reaped at session end.

    ``file_of`` maps a record's file (relative to rootdir) to the path GitHub expects (relative to
    the workspace); identity by default.
    """
    lines: list[str] = []

    def at(location: tuple[str, int], title: str) -> list[tuple[str, str]]:
        properties: list[tuple[str, str]] = []
        if location[0]:
            properties.append(("file", file_of(location[0]) if file_of else location[0]))
            if location[1]:
                properties.append(("line", str(location[1])))
        return [*properties, ("title", title)]

    for record in records:
        found = annotation_message(record)
        if found is not None:
            title, message = found
            lines.append(workflow_command("error", message, at(record.location, title)))
        for leak in record.fixture_leaks:  # at the fixture's definition, not at the test
            lines.append(workflow_command("error", fixture_annotation_message(leak),
                                          at(leak.location, TITLE_LEAK)))
    # Leftovers of a test are already in that test's annotation (its found_later).
    unowned = [r for r in session_reaped if r.owner is None or r.owner.kind != "test"]
    if unowned:
        message = "\n".join([f"gpuclean reaped {len(unowned)} leftover process(es) at session end"] + [
            _process_line(r.process.pid, f"({r.owner}) {r.process.cmdline}", r.how_ended, r.release_s)
            for r in unowned])
        lines.append(workflow_command("error", message, [("title", TITLE_LEAK)]))
    return lines


def _cell(text: str) -> str:
    return html.escape(text, quote=False).replace("|", "\\|").replace("\r", " ").replace("\n", " ")


def step_summary(records: Sequence[TestRecord], session_reaped: Sequence[Reaped]) -> str:
    """Markdown for ``$GITHUB_STEP_SUMMARY``: totals, then a row per test with findings."""
    from pytest_gpuclean.report import jsonreport  # (lazy: the module's docstring says why)

    totals = jsonreport.summary_json(records, session_reaped)
    timeouts = f", {totals['lock_timeouts']} gave up waiting for GPU locks" if totals["lock_timeouts"] else ""
    fixtures = f", {totals['fixture_leaks']} fixture(s) leaked" if totals["fixture_leaks"] else ""
    lines = [f"### gpuclean: {totals['checked']} checked test(s), {totals['leaked']} leaked{fixtures}, "
             f"{totals['not_clean']} met GPUs that were not clean, {totals['reaped']} process(es) reaped"
             f"{timeouts}" + (f", {totals['gpu_fault']} caused a GPU fault" if totals["gpu_fault"] else ""),
             ""]
    rows: list[str] = []
    for record in records:
        verdict = jsonreport.outcome(record)
        if record.lock_timeout is not None:
            rows.append("| " + " | ".join([
                f"`{_cell(record.nodeid)}`" if "`" not in record.nodeid else _cell(record.nodeid),
                "lock timeout", _cell(record.lock_timeout), "-", "-", "-"]) + " |")
            continue
        if verdict in ("clean", "unchecked") or (record.blocked_by and not has_findings(record)):
            continue
        leaked = jsonreport.leaked_json(record)
        processes = ", ".join(f"pid {p['pid']} {p['ended_by'] or 'NOT reaped'}" for p in leaked)
        if verdict == "gpu_fault" or (verdict == "not_clean" and record.health):
            processes = "; ".join(f.message for f in record.health if f.effect != "info")
        elif verdict == "not_clean":
            processes = ", ".join(
                [c.error for c in (record.before, record.after) if c is not None and c.error is not None]
                + [f"{o.reason} pid {o.process.pid}" if o.process else o.reason
                   for c in (record.before, record.after) if c is not None for o in c.offenders])
        releases = [p["release_s"] for p in leaked if p["release_s"] is not None]
        rows.append("| " + " | ".join([
            f"`{_cell(record.nodeid)}`" if "`" not in record.nodeid else _cell(record.nodeid),
            verdict.replace("_", " "),
            _cell(processes) or "-",
            f"{max(releases):.2f} s" if releases else "-",
            f"{record.before_s:.2f} s",
            f"{record.after_s:.2f} s",
        ]) + " |")
    for leak in (f for r in records for f in r.fixture_leaks):
        leaked = jsonreport.fixture_leaked_json(leak)
        releases = [p["release_s"] for p in leaked if p["release_s"] is not None]
        rows.append("| " + " | ".join([
            _cell(f"{leak} (at the teardown of {leak.reported_on})"), "fixture leaked",
            _cell(", ".join(f"pid {p['pid']} {p['ended_by'] or 'NOT reaped'}" for p in leaked)) or "-",
            f"{max(releases):.2f} s" if releases else "-", "-", "-"]) + " |")
    if rows:
        lines += ["| Test | Verdict | Processes | Driver release | Before check | After check |",
                  "|---|---|---|---|---|---|", *rows]
    else:
        lines.append("Every checked test found the GPUs clean and left them clean.")
    if session_reaped:
        lines += ["", "Reaped at session end: " + _cell(", ".join(
            f"pid {r.process.pid} ({r.owner}) {r.how_ended}" for r in session_reaped))]
    return "\n".join(lines) + "\n"


# ---- JUnit -------------------------------------------------------------------------------------------

def junit_properties(record: TestRecord) -> list[tuple[str, str]]:
    """``user_properties`` of a checked test, as known at the end of its teardown."""
    from pytest_gpuclean.report import jsonreport  # (lazy: the module's docstring says why)

    own = jsonreport.own_reaped(record)
    leaked = jsonreport.leaked_json(record)
    releases = [r.release_s for r in own if r.release_s is not None]
    props = [
        ("outcome", jsonreport.outcome(record)),
        ("leaked", str(len(leaked))),
        ("reaped_pids", ",".join(str(r.process.pid) for r in own)),
        ("release_s", f"{max(releases):.6f}" if releases else ""),
        ("before_s", f"{record.before_s:.6f}"),
        ("after_s", f"{record.after_s:.6f}"),
        ("lock_wait_s", f"{record.lock_wait_s:.6f}"),
        ("lock_timeout", record.lock_timeout or ""),
        ("device_error", "; ".join(c.error for c in (record.before, record.after)
                                   if c is not None and c.error is not None)),
        # A fixture that ended at this test's teardown and left processes: its finding, not this test's.
        ("fixture_leaks", "; ".join(f"{leak} leaked {len(jsonreport.fixture_leaked_json(leak))} process(es)"
                                    for leak in record.fixture_leaks)),
        # GPU health (health.py): what fails or stops, then the Xid codes seen, information included.
        ("health", "; ".join(f.message for f in record.health if f.effect != "info")),
        ("xids", ",".join(str(f.xid) for f in record.health if f.xid is not None)),
        ("outside_action", record.outside_action or ""),
    ]
    return [(PROPERTY_PREFIX + name, value) for name, value in props]


# ---- the hooks ---------------------------------------------------------------------------------------

def _report_path(value: str, source: str, base: Path) -> Path:
    # Checked at startup so that a typo fails in a second, not after an hour of GPU tests. Every way the
    # path can fail is the user's to fix: a directory that may not be searched (another user's home), a
    # name too long, a loop of links; each is one line naming the option, not an INTERNALERROR.
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
    # As --junitxml does: CI's documented command names a reports/ directory a fresh checkout lacks. Made
    # now, not when the report is written, so that a directory that cannot be made fails at start-up; and
    # one level at a time, so that a failure half-way removes what this made and leaves nothing behind.
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
    """The plugin that registers these hooks (``plugin._GpuCleanPlugin``, a layer above): its set-up, the
    session it started, and its final sweep."""

    config: pytest.Config
    settings: Settings
    controller: bool

    @property
    def session(self) -> CheckedSession | None: ...

    def sweep(self, session: pytest.Session) -> None: ...


class PerTestOutputs:
    """The outputs' hooks that run for every test report: registered only where they have work (JUnit
    properties, an xdist worker's or controller's records in flight)."""

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
                    test_report.user_properties.extend(junit_properties(record))
                if self.outputs.worker:
                    # xdist ships a report's attributes to the controller as each test is set up and ends:
                    # if the run is interrupted, the controller still knows what the finished tests found
                    # (the worker's session-end payload never comes), and that a test whose worker died
                    # while it ran was checked before it (its setup's record).
                    from pytest_gpuclean.report.serialize import to_dict  # (lazy: the module's docstring)

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
        # The properties are for junitxml alone: building them for every test of a run without it is waste.
        # xdist workers and forked children see the controller's options, so they know too.
        self.junit = bool(config.getoption("xmlpath", None))
        self.started = time.time()
        self._merged: store.RecordSet | None = None
        self._session: pytest.Session | None = None
        """Set once the outputs were written at the session's end."""
        self._extension_keys: jsonreport.JsonDict | None = None
        """The extensions' keys of the report's ``session`` object, as at the report's first write."""

    def per_test(self) -> bool:
        """Whether ``PerTestOutputs`` has work (an xdist controller is known to be one at its session's
        start)."""
        return self.junit or self.worker or self.plugin.controller

    def _session_json(self, exitstatus: int) -> jsonreport.JsonDict:
        from pytest_gpuclean.report import jsonreport  # (lazy: the module's docstring says why)

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
                         # (marked tests error with no GPU to check: --gpuclean-no-gpu=fail, chosen or CI's)
                         "require_gpu": started is not None and started.no_gpu[0] == "fail",
                         "probe": settings.probe,
                         "outside": settings.outside},
            "xdist_workers": len(self.records.worker_payloads) if plugin.controller else None,
            **self._session_keys(),
        }

    def _session_keys(self) -> jsonreport.JsonDict:
        # As at the first write: what an extension finds at the session's very end (its last sweep, after
        # pytest_unconfigure) it says itself, and a report written again for this host's does not take it in.
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
        # A wrapper, so this runs after every plain implementation, the checker's final sweep included;
        # and in ``finally``, so that a conftest's or another plugin's failing pytest_sessionfinish does
        # not cost the reports (the sweep then runs here first). trylast: inside the terminal reporter's
        # wrapper, which prints the summary (our annotations) when its own ends, whenever we were
        # registered (at the end of the collection, when the session starts checking).
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
            self._append_step_summary(session, step_summary(merged.records, merged.session_reaped))

    def _write_report(self, session: pytest.Session, merged: store.RecordSet) -> None:
        if self.report_path is None:
            return
        from pytest_gpuclean.report import jsonreport  # (lazy: the module's docstring says why)

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
        """The very last sweep (after every pytest_unconfigure) reaped ``late``, already in the session's
        ``session_reaped``: write the report again with them, whole and atomically as before (a reader
        sees the first report or this one), and tell GitHub. Only after the outputs were written once; an
        xdist worker's last sweep comes after it sent its findings, and is only printed."""
        session = self._session
        if self.worker or session is None:
            return
        self._merged = merged = self.records.merged()
        self._write_report(session, merged)
        if self.github:
            writer = session.config.pluginmanager.get_plugin("terminalreporter")
            for line in annotation_lines((), late, self._github_path):
                if writer is not None:
                    writer.write_line(line)
                else:
                    print(line)
            self._append_step_summary(session, "\nReaped after pytest_unconfigure (the session set-up's): "
                                      + _cell(", ".join(f"pid {r.process.pid} {r.how_ended}" for r in late))
                                      + "\n")

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
        for line in annotation_lines(self._merged.records, self._merged.session_reaped, self._github_path):
            terminalreporter.write_line(line)
