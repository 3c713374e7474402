"""Machine-readable outputs of a gpuclean session, for CI: the JSON report (``--gpuclean-report``), JUnit
``user_properties`` and, on GitHub Actions, ``::error`` annotations plus a job-summary table.

``OutputHooks`` reads the session's records (``records.py``); it never checks or reaps anything itself. Under
pytest-xdist the workers add JUnit properties to their own reports (xdist ships them to the
controller's junitxml) and the controller writes everything else from the records the workers sent.
"""

from __future__ import annotations

import html
import os
import socket
import time
from collections.abc import Generator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import pytest

from pytest_gpuclean import records, report
from pytest_gpuclean.model import DeviceInfo, TestRecord

if TYPE_CHECKING:
    from pytest_gpuclean import jsonreport
    from pytest_gpuclean.devices import Backend
    from pytest_gpuclean.findings import Reaped
    from pytest_gpuclean.settings import Settings

TITLE_LEAK = "GPU leak"
TITLE_NOT_CLEAN = "GPU not clean"
TITLE_LOCK_TIMEOUT = "GPU lock timeout"
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
    what = f"ended by {ended_by}" if ended_by else "NOT reaped, still running"
    release = (f", GPU memory released {release_s:.2f}s after the {ended_by}"
               if release_s is not None and ended_by else "")
    return f"pid {pid} {what}{release}: {report.one_line(cmdline)}"


def annotation_message(record: TestRecord) -> tuple[str, str] | None:
    """(title, message) of the annotation for a test with findings; None for a clean test."""
    from pytest_gpuclean import jsonreport  # (loaded when an output is made)

    if record.lock_timeout is not None:
        return TITLE_LOCK_TIMEOUT, f"{record.nodeid} never got its GPU locks: {record.lock_timeout}"
    verdict = jsonreport.outcome(record)
    if verdict == "leaked":
        leaked = jsonreport.leaked_json(record)
        lines = [f"{record.nodeid} leaked {len(leaked)} process(es)"]
        lines.extend(_process_line(p["pid"], p["cmdline"], p["ended_by"], p["release_s"]) for p in leaked)
        return TITLE_LEAK, "\n".join(lines)
    if verdict == "not_clean":
        lines = []
        for check in (record.before, record.after):
            if check is None or check.clean:
                continue
            when = "before" if check.phase == "setup" else "after"
            same_as = check.outside.same_as if check.outside is not None else None
            lines.append(f"GPUs not clean {when} {record.nodeid} (waited {check.waited_s:.1f}s"
                         + (f"; the same outside state as at {same_as}: not waited for again)" if same_as
                            else ")"))
            for offender in check.offenders:
                proc = offender.process
                held = report.mib_list(offender.mib_per_device)
                who = (f"{offender.reason} pid {proc.pid} (user {proc.user}): {report.one_line(proc.cmdline)}"
                       if proc is not None else offender.detail)
                lines.append(who + (f" [{held}]" if held and proc is not None else ""))
        return TITLE_NOT_CLEAN, "\n".join(lines)
    return None


def annotation_lines(records: Sequence[TestRecord], session_reaped: Sequence[Reaped],
                     file_of: Any = None) -> list[str]:
    """``::error`` lines: one per test with findings, one for leftovers reaped at session end.

    ``file_of`` maps a record's file (relative to rootdir) to the path GitHub expects (relative to
    the workspace); identity by default.
    """
    lines: list[str] = []
    for record in records:
        found = annotation_message(record)
        if found is None:
            continue
        title, message = found
        properties: list[tuple[str, str]] = []
        if record.location[0]:
            path = file_of(record.location[0]) if file_of else record.location[0]
            properties.append(("file", path))
            if record.location[1]:
                properties.append(("line", str(record.location[1])))
        properties.append(("title", title))
        lines.append(workflow_command("error", message, properties))
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
    from pytest_gpuclean import jsonreport  # (loaded when an output is made)

    totals = jsonreport.summary_json(records, session_reaped)
    timeouts = f", {totals['lock_timeouts']} gave up waiting for GPU locks" if totals["lock_timeouts"] else ""
    lines = [f"### gpuclean: {totals['checked']} checked test(s), {totals['leaked']} leaked, "
             f"{totals['not_clean']} met GPUs that were not clean, {totals['reaped']} process(es) reaped"
             f"{timeouts}", ""]
    rows: list[str] = []
    for record in records:
        verdict = jsonreport.outcome(record)
        if record.lock_timeout is not None:
            rows.append("| " + " | ".join([
                f"`{_cell(record.nodeid)}`" if "`" not in record.nodeid else _cell(record.nodeid),
                "lock timeout", _cell(record.lock_timeout), "-", "-", "-"]) + " |")
            continue
        if verdict in ("clean", "unchecked"):
            continue
        leaked = jsonreport.leaked_json(record)
        processes = ", ".join(f"pid {p['pid']} {p['ended_by'] or 'NOT reaped'}" for p in leaked)
        if verdict == "not_clean":
            processes = ", ".join(
                f"{o.reason} pid {o.process.pid}" if o.process else o.reason
                for c in (record.before, record.after) if c is not None for o in c.offenders)
        releases = [p["release_s"] for p in leaked if p["release_s"] is not None]
        rows.append("| " + " | ".join([
            f"`{_cell(record.nodeid)}`" if "`" not in record.nodeid else _cell(record.nodeid),
            verdict.replace("_", " "),
            _cell(processes) or "-",
            f"{max(releases):.2f} s" if releases else "-",
            f"{record.before_s:.2f} s",
            f"{record.after_s:.2f} s",
        ]) + " |")
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
    from pytest_gpuclean import jsonreport  # (loaded when an output is made)

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
        ("outside_action", record.outside_action or ""),
    ]
    return [(PROPERTY_PREFIX + name, value) for name, value in props]


# ---- the hooks ---------------------------------------------------------------------------------------

def _ray_session_json(started: StartedSession | None, found: records.SessionRecords) -> jsonreport.JsonDict:
    from pytest_gpuclean import jsonreport  # (loaded when an output is made)

    # Only with --gpuclean-ray: a report without a cluster keeps exactly its old shape.
    if started is None or started.cluster is None or not started.cluster.address:
        return {}  # (with auto: no cluster found)
    cluster = started.cluster
    return {"ray": jsonreport.ray_json(cluster.address, cluster.version, found.cluster_sweeps)}


def _report_path(value: str, source: str, base: Path) -> Path:
    # Checked at startup so that a typo fails in a second, not after an hour of GPU tests.
    path = (base / Path(value).expanduser()).absolute()
    if path.is_dir():
        raise pytest.UsageError(f"{REPORT_OPTION}: {value!r} is a directory; give a file path ({source})")
    if not path.parent.is_dir():
        raise pytest.UsageError(
            f"{REPORT_OPTION}: directory {str(path.parent)!r} does not exist ({source})")
    if not os.access(path.parent, os.W_OK | os.X_OK):
        raise pytest.UsageError(
            f"{REPORT_OPTION}: directory {str(path.parent)!r} is not writable ({source})")
    return path


class StartedSession(Protocol):
    """What the outputs need of a session that started checking: its set-up."""

    backend: Backend | None
    devices: tuple[DeviceInfo, ...]
    unavailable: str | None
    cluster: Any
    """The Ray cluster's checks (``cluster_checks.ClusterChecks``) with ``--gpuclean-ray``, else None."""


class CheckingSession(Protocol):
    """What the outputs need of the plugin that checks the session: its set-up and its final sweep."""

    config: pytest.Config
    settings: Settings
    controller: bool

    @property
    def session(self) -> StartedSession | None: ...

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
        if call.when == "teardown":
            record = item.stash.get(records.TEST, None)
            if record is not None:
                if self.outputs.junit:
                    # On the report, not the item: junitxml and xdist take them from the teardown report.
                    test_report.user_properties.extend(junit_properties(record))
                if self.outputs.worker:
                    # xdist ships a report's attributes to the controller as each test ends: if the run is
                    # interrupted, the controller still knows what the finished tests found (the worker's
                    # session-end payload never comes).
                    from pytest_gpuclean.serialize import record_to_dict

                    setattr(test_report, RECORD_ATTRIBUTE, record_to_dict(record))
        return test_report

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        record = getattr(report, RECORD_ATTRIBUTE, None)
        if record is not None and not self.outputs.worker and report.when == "teardown":
            self.outputs.found.stream(report.nodeid, record)


class OutputHooks:
    """Turns the session's records into the JSON report, JUnit properties and GitHub output."""

    def __init__(self, plugin: CheckingSession) -> None:
        self.plugin = plugin
        config = plugin.config
        self.found = records.of(config)
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
        self._merged: records.Merged | None = None

    def per_test(self) -> bool:
        """Whether ``PerTestOutputs`` has work (an xdist controller is known to be one at its session's
        start)."""
        return self.junit or self.worker or self.plugin.controller

    def _session_json(self, exitstatus: int) -> jsonreport.JsonDict:
        from pytest_gpuclean import jsonreport  # (loaded when an output is made)

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
                         "grace": settings.grace, "lock": settings.lock, "require_gpu": settings.require_gpu,
                         "outside": settings.outside},
            "xdist_workers": len(self.found.worker_payloads) if plugin.controller else None,
            **_ray_session_json(started, self.found),
        }

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
        self._merged = merged = self.found.merged()
        if self.report_path is not None:
            from pytest_gpuclean import jsonreport  # (loaded when an output is made)

            document = jsonreport.report_document(
                records=merged.records, session_reaped=merged.session_reaped, notes=merged.notes,
                session=self._session_json(session.exitstatus))
            try:
                jsonreport.write_atomic(self.report_path, document)
            except OSError as exc:
                self._complain(session, f"gpuclean: could not write the report {self.report_path}: {exc}")
        summary_file = os.environ.get("GITHUB_STEP_SUMMARY")
        if self.github and summary_file and (merged.records or merged.session_reaped):
            try:
                with open(summary_file, "a", encoding="utf-8") as f:
                    f.write(step_summary(merged.records, merged.session_reaped))
            except OSError as exc:
                self._complain(session, f"gpuclean: could not append to GITHUB_STEP_SUMMARY "
                                        f"{summary_file}: {exc}")

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
