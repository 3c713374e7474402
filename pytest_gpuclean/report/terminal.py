"""Pure formatting of gpuclean's findings: the same records feed text, JSON and JUnit output."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

from pytest_gpuclean._model.outcomes import has_findings, noticed, outcome, reaped_count
from pytest_gpuclean._model.records import (
    MIB,
    CheckResult,
    DeviceSnapshot,
    FixtureLeak,
    HealthFinding,
    Offender,
    Phase,
    ProcessInfo,
    Reaped,
    TestRecord,
)
from pytest_gpuclean.report.text import CMDLINE_CHARS as CMDLINE_CHARS  # re-exported: checker.py uses it
from pytest_gpuclean.report.text import mib_list as mib_list
from pytest_gpuclean.report.text import one_line as one_line

LEAK_PREFIX = "gpuclean: test leaked"
NOT_CLEAN_PREFIX = "gpuclean: GPUs not clean"
UNREADABLE_PREFIX = "gpuclean: could not check the GPUs"
SUMMARY_TITLE = "gpuclean"


def mib(num_bytes: int | float) -> str:
    return f"{num_bytes / MIB:.0f}"


def device_line(snap: DeviceSnapshot, holders: str = "") -> str:
    """``GPU 0 NVIDIA H200 (GPU-...): 0/143771 MiB used``, plus who holds it."""
    line = (f"{snap.device.label} {snap.device.name} ({snap.device.uuid}): "
            f"{mib(snap.used_bytes)}/{mib(snap.total_bytes)} MiB used")
    if snap.processes:
        procs = ", ".join(f"pid {p.pid}" + (f" {mib(p.used_bytes)} MiB" if p.used_bytes is not None else "")
                          for p in snap.processes)
        line += f", processes: {procs}"
    return line + (f", {holders}" if holders else "")


def _held(pairs: Sequence[tuple[str, float]]) -> str:
    return mib_list(pairs) or "no GPU memory"


def offender_lines(offender: Offender) -> list[str]:
    proc = offender.process
    if proc is None:
        return [f"  {offender.reason}: {offender.detail}"]
    owner = f", spawned by {offender.owner}" if offender.owner else ""
    return [
        f"  {offender.reason} pid {proc.pid} (user {proc.user}, {proc.state}, found as {offender.found_by}"
        f"{owner}): {_held(offender.mib_per_device)}"
        + (f"; {offender.detail}" if offender.detail else ""),
        f"      cmd: {one_line(proc.cmdline)}",
    ]


_HOW = {"already exited": "had already exited", "reaped zombie": "had exited (a zombie: collected)",
        "exited by itself": "exited by itself", "pid reused": "was gone, its pid reused (left alone)"}
"""How a process that no signal of ours ended reads in a sentence ("ended by" names a signal)."""


def reaped_lines(reaped: Reaped) -> list[str]:
    proc = reaped.process
    timing = f" after {reaped.exit_s:.2f}s" if reaped.exit_s is not None else ""
    signalled = reaped.ended_by in ("SIGTERM", "SIGKILL")
    if signalled:
        how, since = f"ended by {reaped.ended_by}", f"the {reaped.ended_by}"
    elif reaped.ended_by == "survived":
        how, since = f"survived SIGKILL ({reaped.survived_as})", "the SIGKILL"
    else:
        how, since = _HOW.get(reaped.ended_by, reaped.ended_by), "it ended"
    release = (f"; the driver released it {reaped.release_s:.2f}s after {since}"
               if reaped.release_s is not None else "")
    owner = f", spawned by {reaped.owner}" if reaped.owner else ""
    return [
        f"  pid {proc.pid} {how}{timing} (found as {reaped.found_by}{owner}): "
        f"held {_held(reaped.mib_per_device)}{release}",
        f"      cmd: {one_line(proc.cmdline)}",
    ]


def check_report(result: CheckResult, heading: str, *, more_notes: Sequence[str] = (),
                 devices: Sequence[DeviceSnapshot] | None = None) -> str:
    """The long text of a failed or leaking check, shown as the test's setup/teardown error; an extension
    passes its own ``more_notes`` and ``devices``."""
    lines = [heading]
    if result.reaped:
        lines.append(f"reaped {len(result.reaped)} process(es):")
        for reaped in result.reaped:
            lines.extend(reaped_lines(reaped))
    if result.lingered:
        lines.append("outlived the test, then ended by themselves:")
        for offender in result.lingered:
            lines.extend(offender_lines(offender))
    if result.offenders and result.error is not None:
        lines.append("still there, not reaped:")  # (no reading, no wait: the check ended at the error)
        for offender in result.offenders:
            lines.extend(offender_lines(offender))
    elif result.offenders:
        lines.append(f"still dirty after {result.waited_s:.2f}s:")
        for offender in result.offenders:
            lines.extend(offender_lines(offender))
    elif result.clean_after_s is not None and result.reaped:
        lines.append(f"GPUs and processes clean again {result.clean_after_s:.2f}s after the check started")
    lines.extend(f"note: {n}" for n in (*result.notes, *more_notes))
    if devices is None:
        devices = result.devices
    if devices and result.error is None:  # (after an error, some devices only: its line says it)
        lines.append(f"devices (tolerance {result.tolerance_mib} MiB):")
        lines.extend("  " + device_line(s) for s in devices)
    return "\n".join(lines)


class DryRunTarget(NamedTuple):
    """A process on ``reap --dry-run``'s list (``report.dry_run_lines``), on this host or a Ray node."""

    where: str
    """'' on this host, ``node ab12cd34: `` on a Ray cluster."""
    info: ProcessInfo
    how: str
    """How it was found, or how it will end."""
    mib: tuple[tuple[str, float], ...]
    """(device label, MiB) of each device the driver lists it on."""


def dry_run_lines(prog: str, targets: Sequence[DryRunTarget]) -> list[str]:
    """``reap --dry-run``'s list, on this host or an extension's nodes."""
    lines = [f"{prog} reap: --dry-run: would end {len(targets)} process(es):"]
    for t in targets:
        lines.append(f"  {t.where}pid {t.info.pid} (user {t.info.user}, {t.how}): held "
                     f"{mib_list(t.mib) or 'no GPU memory'}")
        lines.append(f"      cmd: {one_line(t.info.cmdline, CMDLINE_CHARS)}")
    return lines


def leak_heading(reaped: Sequence[Reaped], leaked: Sequence[Offender], reap_enabled: bool) -> str:
    """``gpuclean: test leaked N process(es) (reaped)``; ``leaked`` are the ones not reaped.

    Zombies are counted apart: they hold no memory, and a double fork's middle parent becomes one once our
    subreaper adopts it.
    """
    return f"{LEAK_PREFIX} {_leak_count(reaped, leaked, reap_enabled)}"


def fixture_leak_heading(leak: FixtureLeak, reap_enabled: bool) -> str:
    """``gpuclean: fixture engine (session-scoped, conftest.py:12) leaked N process(es) (reaped), found at
    the teardown of test_2.py::test_d``: the fixture's finding, reported where pytest tore it down."""
    count = _leak_count(leak.reaped, (*leak.leaked, *leak.lingered), reap_enabled)
    return f"gpuclean: {leak} leaked {count}, found at the teardown of {leak.reported_on}"


def _leak_count(reaped: Sequence[Reaped], leaked: Sequence[Offender], reap_enabled: bool) -> str:
    if not reap_enabled:
        state = "reaping is off: reported only"
    elif leaked:
        state = "NOT all reaped"
    else:
        state = "reaped"
    zombies = sum(1 for r in reaped if r.ended_by == "reaped zombie")
    live = len(reaped) - zombies + len(leaked)
    extra = f" and {zombies} exited child(ren) nobody waited for" if zombies and live else ""
    count = f"{live} process(es){extra}" if live else f"{zombies} exited child(ren) nobody waited for"
    return f"{count} ({state})"


def not_clean_heading(phase: str, result: CheckResult, timeout: float) -> str:
    when = "before the test" if phase == "setup" else "after the test"
    outside = result.outside
    if outside is not None and outside.same_as is not None:
        again = "; ".join(f"{label}: still the same {value:.0f} MiB held from outside as at {outside.same_as}"
                          for label, value in outside.devices)
        return f"{NOT_CLEAN_PREFIX} {when}: {again}; not waiting again"
    return f"{NOT_CLEAN_PREFIX} {when} (waited {result.waited_s:.1f}s of a {timeout:g}s timeout)"


def unreadable_heading(result: CheckResult) -> str:
    """``gpuclean: could not check the GPUs after the test: GPU 0 (GPU-...): <cause>``: one line, the
    device and the cause (what was reaped all the same is listed below it)."""
    when = "before the test" if result.phase == "setup" else "after the test"
    return f"{UNREADABLE_PREFIX} {when}: {result.error}"


def outside_line(phase: str, result: CheckResult, timeout: float) -> str:
    """A check that found the GPUs dirty only from outside, in one line (a skip's reason, a warning)."""
    when = "before the test" if phase == "setup" else "after the test"
    outside = result.outside
    waited = (f"the same as at {outside.same_as}: not waiting again"
              if outside is not None and outside.same_as is not None
              else f"waited {result.waited_s:.1f}s of a {timeout:g}s timeout")
    return f"gpuclean: {outside_cause(result)} {when}, {waited}"


def outside_cause(result: CheckResult) -> str:
    """``GPU 0 dirty from outside the session (GPU 0 719 MiB; held by no process we can see)``: one line."""
    outside = result.outside
    if outside is None:
        return "GPUs not clean"
    who = [f"{o.reason} pid {o.process.pid}" if o.process is not None
           else "held by " + o.detail.rpartition("held by ")[2]
           for o in result.offenders if o.reason in ("foreign", "memory")]
    return (f"{', '.join(label for label, _ in outside.devices)} dirty from outside the session "
            f"({mib_list(outside.devices)}; {', '.join(who)})")


def summary_lines(records: Sequence[TestRecord], session_reaped: Sequence[Reaped], notes: Sequence[str],
                  more_parts: Callable[[TestRecord], Sequence[str]] | None = None) -> list[str]:
    """The terminal summary: a line per test with findings, one per test whose checks noticed something,
    then totals. ``more_parts``: an extension's parts of a test's line."""
    lines: list[str] = []
    dirty: list[TestRecord] = []
    for record in records:
        if has_findings(record):
            dirty.append(record)
            lines.append(f"{record.nodeid}: " + "; ".join(_record_parts(record, more_parts)))
        elif noticed(record):
            # A test that never got its GPU locks did not run: counted apart in the totals.
            label = "" if record.lock_timeout is not None else "noticed, not a finding: "
            lines.append(f"{record.nodeid}: {label}" + "; ".join(_record_parts(record, more_parts)))
    for record in records:
        for leak in record.fixture_leaks:
            lines.append(f"{leak}, found at the teardown of {leak.reported_on}: " + fixture_part(leak))
    if session_reaped:
        lines.append(f"session end: reaped {len(session_reaped)} leftover process(es): "
                     + ", ".join(f"pid {r.process.pid} ({r.owner}) {r.how_ended}" for r in session_reaped))
    lines.extend(notes)
    lines.append(totals_line(records, session_reaped, dirty))
    return lines


def _record_parts(record: TestRecord, more_parts: Callable[[TestRecord], Sequence[str]] | None) -> list[str]:
    parts: list[str] = []
    for check in (record.before, record.after):
        if check is None:
            continue
        if check.error is not None:
            parts.append(f"{check.phase}: could not read the devices: {check.error}")
        if check.reaped:
            releases = [r.release_s for r in check.reaped if r.release_s is not None]
            parts.append(f"{check.phase}: reaped {len(check.reaped)} "
                         f"({', '.join(f'pid {r.process.pid} {r.how_ended}' for r in check.reaped)})"
                         + (f", driver release {max(releases):.2f}s" if releases else "")
                         + (f", clean after {check.clean_after_s:.2f}s"
                            if check.clean_after_s is not None else ""))
        if check.offenders:
            parts.append(f"{check.phase}: not clean ({', '.join(short(o) for o in check.offenders)})")
    if collected := [r for c in (record.before, record.after) if c for r in c.collected]:
        parts.append(f"collected {len(collected)} process(es) that exited by themselves ("
                     + ", ".join(f"pid {r.process.pid} spawned by {r.owner}" for r in collected) + ")")
    if record.after is not None and record.after.lingered:
        lingered = record.after.lingered
        parts.append(f"{len(lingered)} process(es) outlived the test and ended by themselves "
                     f"({', '.join(short(o) for o in lingered)})")
    if record.found_later:
        parts.append(f"leaked {len(record.found_later)} process(es) found by a later check "
                     f"({', '.join(f'pid {r.process.pid} {r.how_ended}' for r in record.found_later)})")
    if record.in_process_mib:
        parts.append("torch memory grew in-process: " + _held(record.in_process_mib))
    if record.lock_timeout is not None:
        parts.append(f"never got its GPU locks: {record.lock_timeout}")
    if record.gpu_without_lock:
        parts.append("used a GPU whose lock another xdist worker's test held: " + ", ".join(
            f"pid {u.process.pid} {_held(u.mib_per_device)} while {u.seen_worker or 'a worker'}'s "
            f"{u.seen_by} held it" for u in record.gpu_without_lock))
    if record.blocked_by:
        parts.append(f"not run: its GPUs held what {' and '.join(record.blocked_by)} leaked, left there "
                     "(reaping is off)")
    if record.outside_action is not None:
        again = any(c is not None and c.outside is not None and c.outside.same_as is not None
                    for c in (record.before, record.after))
        parts.append(f"GPUs dirty from outside the session: {record.outside_action}"
                     + (" (not waited for again)" if again else ""))
    if more_parts is not None:
        parts.extend(more_parts(record))
    parts.extend(health_parts(record))
    return parts


def set_up_reaped_line(late: Sequence[Reaped]) -> str:
    """What the very last sweep (after every pytest_unconfigure) reaped of the session set-up."""
    return (f"gpuclean: reaped {len(late)} process(es) of the session set-up (conftest, plugins) still alive "
            "after pytest_unconfigure: "
            + ", ".join(f"pid {r.process.pid} {r.how_ended} ({one_line(r.process.cmdline, 60)})"
                        for r in late))


def fixture_part(leak: FixtureLeak) -> str:
    """``leaked 2 process(es) (pid 6886 SIGTERM, pid 6887 SIGTERM)``."""
    ended = [f"pid {r.process.pid} {r.how_ended}" for r in leak.reaped]
    ended += [f"pid {o.process.pid} NOT reaped" for o in leak.leaked if o.process is not None]
    ended += [f"pid {o.process.pid} exited by itself" for o in leak.lingered if o.process is not None]
    return f"leaked {len(ended)} process(es) ({', '.join(ended)})"


def health_parts(record: TestRecord) -> list[str]:
    """The GPU health part of a test's summary line; information-only findings are for the JSON report."""
    return [f"{f.message} (before the test)" if f.phase == "setup" else f.message
            for f in record.health if f.effect != "info"]


def totals_line(records: Sequence[TestRecord], session_reaped: Sequence[Reaped],
                dirty: Sequence[TestRecord] | None = None) -> str:
    """``3 checked test(s), 1 with findings, 2 process(es) reaped``.

    ``with findings`` counts every test at fault (``has_findings``), as the JSON report's ``with_findings``
    does; an unchecked test that leaked is counted there and named apart. ``dirty``: the records with
    findings, if the caller has them already.
    """
    checked = unchecked_leakers = timeouts = fixtures = unreadable = without_lock = 0
    for r in records:
        before, after = r.before, r.after
        if before is not None:
            checked += 1
        elif outcome(r) == "leaked":
            unchecked_leakers += 1
        if r.lock_timeout is not None:
            timeouts += 1
        if r.fixture_leaks:
            fixtures += len(r.fixture_leaks)
        if (before is not None and before.error is not None) or (
                after is not None and after.error is not None):
            unreadable += 1
        if r.gpu_without_lock:
            without_lock += 1
    with_findings = len(dirty) if dirty is not None else sum(1 for r in records if has_findings(r))
    parts = [f"{checked} checked test(s)", f"{with_findings} with findings"]
    if fixtures:
        parts.append(f"{fixtures} fixture(s) that leaked processes")
    if unchecked_leakers:
        parts.append(f"{unchecked_leakers} unchecked test(s) that leaked processes")
    parts.append(f"{reaped_count(records, session_reaped)} process(es) reaped")
    if timeouts:
        parts.append(f"{timeouts} gave up waiting for GPU locks")
    if unreadable:
        parts.append(f"{unreadable} could not read a device")
    if without_lock:
        parts.append(f"{without_lock} used a GPU another xdist worker held the lock of")
    return ", ".join(parts)


def short(offender: Offender) -> str:
    """``leaked pid 4242``, or what the finding says when it is no process (memory, unreachable)."""
    if offender.process is None:
        return offender.detail
    return f"{offender.reason} pid {offender.process.pid}"


# ---- a GPU's health, as a test's failure ----------------------------------------------------------------

HEALTH_PREFIX = "gpuclean: GPU"


def failure_text(findings: Sequence[HealthFinding], phase: Phase) -> str | None:
    """The failure text of a test's health findings (None if nothing fails): one heading, a line each."""
    failing = [f for f in findings if f.effect != "info"]
    if not failing:
        return None
    effects = {f.effect for f in failing}
    if "lost" in effects:
        heading = f"{HEALTH_PREFIX} lost: the session's remaining tests are stopped"
    elif phase == "setup":
        heading = f"{HEALTH_PREFIX} not usable before the test (gpuclean never resets a GPU)"
    elif "unusable" in effects:
        heading = f"{HEALTH_PREFIX} not usable after the test (gpuclean never resets a GPU)"
    else:
        heading = f"{HEALTH_PREFIX} fault during the test"
    return "\n".join([heading, *(f"  {f.message}" for f in failing)])


def stop_line(cause: str) -> str:
    """The one line that stops the session (``session.shouldstop``) when a GPU is lost, whoever found it:
    a check that could not read it, or the health watch."""
    return (f"gpuclean: {cause}; stopping the session's tests instead of letting each wait its timeout "
            "(every later check would fail)")


def stop_reason(item: HealthFinding) -> str:
    """``stop_line`` for a health finding of effect ``lost``."""
    return stop_line(item.message)
