"""What the ``gpuclean`` command prints, as text and JSON, from what ``_cli.py`` read: pure functions."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, NamedTuple, TextIO

from pytest_gpuclean._model.records import (
    MIB,
    CheckResult,
    DeviceHealth,
    DeviceInfo,
    DeviceSnapshot,
    FoundBy,
    ProcessInfo,
    Reaped,
)
from pytest_gpuclean._version import __version__
from pytest_gpuclean.report import jsonreport, terminal

PROG = "gpuclean"
CMDLINE_WIDTH = 200


class Selection(NamedTuple):
    """The devices a command works on, as its output names them."""

    kind: str
    """The backend's kind: ``nvml`` or ``simulated``."""
    driver: str
    source: str
    """Where the device list came from."""
    chosen: int
    total: int
    """How many devices the backend has, chosen or not."""


def header(selection: Selection) -> str:
    return (f"{selection.kind} devices, driver {selection.driver}; "
            f"{selection.chosen} of {selection.total} device(s) ({selection.source})")


def cmd(cmdline: str) -> str:
    # One line per process: a ``python -c "<script>"`` command line carries newlines.
    return terminal.one_line(cmdline, CMDLINE_WIDTH)


def mib_text(num_bytes: int | None) -> str:
    return "?" if num_bytes is None else f"{num_bytes / MIB:.0f}"


def print_json(document: dict[str, Any], out: TextIO) -> None:
    json.dump(document, out, indent=2)
    out.write("\n")


# ---- health ------------------------------------------------------------------------------------------

class Health(NamedTuple):
    """One device's health as a command shows it."""

    device: DeviceInfo
    reading: DeviceHealth | None
    """None: the device is lost (``lost``), or its backend has no health reads."""
    problems: tuple[str, ...]
    lost: str | None = None


def health_lines(read: Sequence[Health]) -> list[str]:
    """One line per device: ``ok`` with its settings, or what makes it unusable."""
    lines: list[str] = []
    for item in read:
        label = f"{item.device.label:<10} health:"
        if item.lost is not None:
            lines.append(f"{label} LOST: {item.lost}")
            continue
        reading = item.reading
        assert reading is not None
        settings_text = ", ".join(f"{name} {value}" for name, value in (
            ("compute mode", reading.compute_mode), ("persistence", reading.persistence),
            ("MIG", reading.mig_mode)) if value is not None)
        if item.problems:
            lines.append(f"{label} NOT USABLE: {'; '.join(item.problems)} ({settings_text})")
        else:
            lines.append(f"{label} ok ({settings_text})")
    return lines


def health_json(read: Sequence[Health]) -> list[dict[str, Any]]:
    """The ``health`` list of ``status --json`` and ``check --json``."""
    return [{"device": item.device.label, "uuid": item.device.uuid, "usable": not item.problems,
             "problems": list(item.problems), "lost": item.lost is not None,
             **({} if item.reading is None else {
                 "remap_pending": item.reading.remap_pending, "remap_failed": item.reading.remap_failed,
                 "ecc_uncorrected": item.reading.ecc_uncorrected, "compute_mode": item.reading.compute_mode,
                 "mig_mode": item.reading.mig_mode, "persistence": item.reading.persistence})}
            for item in read]


# ---- status ------------------------------------------------------------------------------------------

def status_lines(snaps: Sequence[DeviceSnapshot], described: dict[int, ProcessInfo | None]) -> list[str]:
    """The compact per-GPU table of ``gpuclean status``."""
    lines: list[str] = []
    for snap in snaps:
        device = snap.device
        busy = f"{len(snap.processes)} process(es)" if snap.processes else "no processes"
        lines.append(f"{device.label:<10} {device.name}  {device.uuid}  "
                     f"{mib_text(snap.used_bytes)} / {mib_text(snap.total_bytes)} MiB used  {busy}")
        if not snap.processes:
            continue
        lines.append(f"    {'PID':>8}  {'USER':<12} {'MiB':>8}  COMMAND")
        for proc in snap.processes:
            info = described.get(proc.pid)
            user = info.user if info else "?"
            command = cmd(info.cmdline) if info else "(not visible here: exited, or another PID namespace)"
            lines.append(f"    {proc.pid:>8}  {user:<12} {mib_text(proc.used_bytes):>8}  {command}")
    return lines


def status_text(selection: Selection, snaps: Sequence[DeviceSnapshot],
                described: dict[int, ProcessInfo | None], read: Sequence[Health]) -> list[str]:
    """``gpuclean status``: the header, the table and each device's health."""
    return [f"{PROG} status: {header(selection)}", *(status_lines(snaps, described) or ["(no devices)"]),
            *health_lines(read)]


def status_json(selection: Selection, snaps: Sequence[DeviceSnapshot],
                described: dict[int, ProcessInfo | None]) -> dict[str, Any]:
    # ``check --json`` extends this document with the verdict: one shape for a CI script to read.
    return {"gpuclean_version": __version__, "backend": selection.kind,
            "driver": selection.driver, "device_source": selection.source,
            "devices": [jsonreport.snapshot_json(s, described) for s in snaps]}


# ---- check -------------------------------------------------------------------------------------------

class Debris(NamedTuple):
    """A process that a gpuclean session which died left behind: what ``reap --dead-sessions`` ends."""

    info: ProcessInfo
    left_by: str
    """The dead session, in words."""
    owner: str | None
    """Who spawned it, where known."""


def unusable_lines(unusable: Sequence[Health]) -> list[str]:
    """``gpuclean check``'s answer when a GPU needs a reset or is lost."""
    return [f"{PROG} check: NOT USABLE: {len(unusable)} GPU(s) need a reset or are lost; take "
            "this runner out of service (gpuclean never resets a GPU):",
            *(f"  {item.device.label} ({item.device.uuid}): {'; '.join(item.problems)}" for item in unusable)]


def unusable_json(kind: str, source: str, read: Sequence[Health]) -> dict[str, Any]:
    """``gpuclean check --json`` when a GPU needs a reset or is lost: no devices read, the verdict."""
    return {"gpuclean_version": __version__, "backend": kind, "device_source": source, "clean": False,
            "usable": False, "health": health_json(read)}


def processes_note(result: CheckResult) -> str | None:
    """Why a check with a tolerance still fails: a process on a device fails it, whatever it holds."""
    listed = [o for o in result.offenders if o.process is not None]
    if not listed or not result.tolerance_mib:
        return None
    labels = sorted({label for o in listed for label, _ in o.mib_per_device})
    where = f" on {', '.join(labels)}" if labels else ""
    count = "1 process" if len(listed) == 1 else f"{len(listed)} processes"
    return f"{count}{where}; processes fail the check whatever the tolerance"


def check_lines(result: CheckResult, wait: float, my_uid: int) -> list[str]:
    """Why ``gpuclean check`` found the devices clean or not."""
    lines: list[str] = []
    if result.clean:
        waited = f", after {result.waited_s:.1f}s" if wait else ""
        lines.append(f"{PROG} check: clean ({len(result.devices)} device(s), tolerance "
                     f"{result.tolerance_mib} MiB{waited})")
    else:
        waited = f" after waiting {result.waited_s:.1f}s" if wait else ""
        lines.append(f"{PROG} check: NOT clean{waited} (tolerance {result.tolerance_mib} MiB):")
        note = processes_note(result)
        if note:
            lines.append(f"  {note}")
        for offender in result.offenders:
            proc = offender.process
            if proc is None:
                lines.append(f"  {offender.detail}")
                continue
            lines.append(f"  pid {proc.pid} (user {proc.user}, {proc.state}) is on "
                         f"{terminal.mib_list(offender.mib_per_device) or 'the devices'}: "
                         f"{cmd(proc.cmdline)}")
        mine = [o.process.pid for o in result.offenders if o.process is not None and o.process.uid == my_uid]
        if mine:
            lines.append(f"  `{PROG} reap` would end the processes of this user: pid(s) "
                         + ", ".join(map(str, mine)))
    lines.extend("  " + terminal.device_line(s) for s in result.devices)
    return lines


def check_json(selection: Selection, result: CheckResult, described: dict[int, ProcessInfo | None],
               debris: Sequence[Debris], read: Sequence[Health]) -> dict[str, Any]:
    """``gpuclean check --json``: the ``status --json`` document as last read, plus the verdict, what
    ``reap --dead-sessions`` would end and each device's health."""
    note = processes_note(result)
    return {**status_json(selection, result.devices, described),
            "clean": result.clean, "tolerance_mib": result.tolerance_mib,
            "waited_s": round(result.waited_s, 6),
            "offenders": [jsonreport.offender_json(o) for o in result.offenders],
            "notes": [*([note] if note else []), *result.notes],
            "dead_session_debris": [{"pid": d.info.pid, "user": d.info.user, "cmdline": d.info.cmdline,
                                     "left_by": d.left_by, "owner": d.owner} for d in debris],
            "usable": True, "health": health_json(read)}


def debris_lines(debris: Sequence[Debris]) -> list[str]:
    """What ``reap --dead-sessions`` would end: processes left by gpuclean sessions that died."""
    lines: list[str] = []
    for d in debris:
        owner = f", spawned by {d.owner}" if d.owner else ""
        lines.append(f"  pid {d.info.pid} ({cmd(d.info.cmdline)}): left by {d.left_by}{owner}")
    if lines:
        lines.insert(0, f"{PROG} check: `{PROG} reap --dead-sessions` would end {len(lines)} process(es) "
                        "that dead pytest sessions left behind:")
    return lines


# ---- reap --------------------------------------------------------------------------------------------

class ReapTarget(NamedTuple):
    """A process ``reap`` sets out to end."""

    info: ProcessInfo
    found_by: FoundBy
    """``gpu`` (listed on a device), ``cookie`` (carries the ``--cookie`` value) or ``dead session``."""
    mib: tuple[tuple[str, float], ...]


class Unreadable(NamedTuple):
    """A device ``reap`` could not read: what it holds, and whose, is unknown."""

    device: DeviceInfo
    lost: bool
    """The device is lost (not only its reads failing)."""
    why: str


def dead_session_note(debris: Debris) -> str:
    """Why ``reap --dead-sessions`` ends a process: the session that left it."""
    return (f"pid {debris.info.pid}: left by {debris.left_by}"
            + (f", spawned by {debris.owner}" if debris.owner else ""))


def reap_opening_lines(selection: Selection, cookie: str | None, left_alone: Sequence[str],
                       notes: Sequence[str]) -> list[str]:
    """``gpuclean reap``'s first lines: the devices, what it leaves alone and the dead sessions' debris."""
    return [f"{PROG} reap: {header(selection)}" + (f"; cookie {cookie!r}" if cookie else ""),
            *(f"  left alone: {line}" for line in left_alone), *(f"  dead session: {line}" for line in notes)]


def reap_ended_lines(reaped: Sequence[Reaped], grace: float, released_s: float | None) -> list[str]:
    """How each process ``reap`` set out to end ended, and when the driver let go of their memory."""
    lines = [f"{PROG} reap: ended {len(reaped)} process(es) (SIGTERM, SIGKILL after {grace:g}s):"]
    for item in reaped:
        lines.extend(terminal.reaped_lines(item))
    if released_s is not None:
        lines.append(f"{PROG} reap: the driver released their GPU memory {released_s:.2f}s after the first "
                     "signal")
    return lines


def unreadable_lines(unreadable: Sequence[Unreadable], cookie: str | None, exit_status: int) -> list[str]:
    """Which devices ``reap`` could not read, and what that means for what ran on them."""
    if not unreadable:
        return []
    lines = [f"{PROG} reap: could not read {u.device.label} ({u.device.uuid}): {u.why}" for u in unreadable]
    labels = ", ".join(u.device.label for u in unreadable)
    if cookie is not None:
        reach = f"a process on {labels} was ended only if it carries the cookie {cookie!r}"
    else:
        reach = f"no process on {labels} could be found (--cookie finds the job's wherever they run)"
    lines.append(f"{PROG} reap: {reach}; a GPU that cannot be read is no GPU for the next job: exit "
                 f"{exit_status}, take this runner out of service (gpuclean never resets a GPU)")
    return lines


class ReapRun(NamedTuple):
    """What one ``gpuclean reap`` set out to end and what became of it: its JSON document's own part."""

    cookie: str | None
    dry_run: bool
    targets: dict[int, ReapTarget]
    left_alone: Sequence[str]
    notes: Sequence[str]
    unreadable: Sequence[Unreadable] = ()
    reaped: Sequence[Reaped] = ()
    released_s: float | None = None


def reap_json(selection: Selection, snaps: Sequence[DeviceSnapshot], described: dict[int, ProcessInfo | None],
              health: Sequence[Health], run: ReapRun) -> dict[str, Any]:
    """``gpuclean reap --json``: the ``status --json`` document as last read, the targets (with
    ``--dry-run``, what it would end), how each ended, what it left alone and why, and unreadable devices."""
    return {**status_json(selection, snaps, described), "health": health_json(health),
            "unreadable": [{"device": u.device.label, "uuid": u.device.uuid, "lost": u.lost, "error": u.why}
                           for u in run.unreadable],
            "cookie": run.cookie, "dry_run": run.dry_run,
            "targets": [{"process": jsonreport.process_json(t.info), "found_by": t.found_by,
                         "mib_per_device": jsonreport.mib_pairs_json(t.mib)}
                        for _pid, t in sorted(run.targets.items())],
            "reaped": [jsonreport.reaped_json(r) for r in run.reaped],
            "survived": [r.process.pid for r in run.reaped if r.ended_by == "survived"],
            "release_s": None if run.released_s is None else round(run.released_s, 6),
            "left_alone": list(run.left_alone), "notes": list(run.notes)}
