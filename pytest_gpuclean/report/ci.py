"""What CI reads of a session, worded: GitHub's ``::error`` annotations and job-summary table, and the JUnit
``user_properties`` of each test. Pure functions over the records (``_session/outputs.py`` hands them on).
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from typing import Any

from pytest_gpuclean._model.outcomes import has_findings
from pytest_gpuclean._model.records import FixtureLeak, Reaped, TestRecord
from pytest_gpuclean.report import jsonreport, terminal

TITLE_LEAK = "GPU leak"
TITLE_NOT_CLEAN = "GPU not clean"
TITLE_LOCK_TIMEOUT = "GPU lock timeout"
TITLE_WITHOUT_LOCK = "GPU used without its lock"
TITLE_GPU_FAULT = "GPU fault"
TITLE_GPU_UNUSABLE = "GPU not usable"
PROPERTY_PREFIX = "gpuclean_"


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
    if record.lock_timeout is not None:
        return TITLE_LOCK_TIMEOUT, f"{record.nodeid} never got its GPU locks: {record.lock_timeout}"
    if record.blocked_by and not has_findings(record):
        return None  # skipped for a leak left unreaped: its leaker's annotation says it
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
    leaked = jsonreport.fixture_leaked_json(leak)
    return "\n".join([f"{leak} leaked {len(leaked)} process(es), found at the teardown of {leak.reported_on}"]
                     + [_process_line(p["pid"], p["cmdline"], p["ended_by"], p["release_s"]) for p in leaked])


def annotation_lines(records: Sequence[TestRecord], session_reaped: Sequence[Reaped],
                     file_of: Any = None) -> list[str]:
    """``::error`` lines: one per test with findings, one per leaking fixture (at its definition), one for
    leftovers reaped at session end. ``file_of`` maps a rootdir-relative file to GitHub's workspace path."""
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


def late_step_summary(late: Sequence[Reaped]) -> str:
    """The job summary's line for what the very last sweep (after every ``pytest_unconfigure``) reaped."""
    return ("\nReaped after pytest_unconfigure (the session set-up's): "
            + _cell(", ".join(f"pid {r.process.pid} {r.how_ended}" for r in late)) + "\n")


# ---- JUnit -------------------------------------------------------------------------------------------

def junit_properties(record: TestRecord) -> list[tuple[str, str]]:
    """``user_properties`` of a checked test, as known at the end of its teardown."""
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
        # What fails or stops, then every Xid code seen, information included.
        ("health", "; ".join(f.message for f in record.health if f.effect != "info")),
        ("xids", ",".join(str(f.xid) for f in record.health if f.xid is not None)),
        ("outside_action", record.outside_action or ""),
    ]
    return [(PROPERTY_PREFIX + name, value) for name, value in props]
