"""The JSON shapes gpuclean publishes (schema version 1), built from the records of ``_model/records.py``.

Pure functions, no pytest: the ``--gpuclean-report`` file and ``gpuclean status --json`` share the
device and process shapes. ``report_schema.json`` next to this module is the contract; the
documentation is docs/report-schema.md. The internal records may change; these shapes only change
with ``SCHEMA_VERSION``.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

from pytest_gpuclean._model.outcomes import OwnLeaks, has_findings, own_leaks, reaped_count
from pytest_gpuclean._model.outcomes import outcome as results_outcome
from pytest_gpuclean._model.records import (
    MIB,
    CheckResult,
    DeviceInfo,
    DeviceSnapshot,
    FixtureLeak,
    HealthFinding,
    Offender,
    Owner,
    ProcessInfo,
    Reaped,
    SiblingUse,
    TestRecord,
)

SCHEMA_VERSION = 1
SCHEMA_PATH = Path(__file__).with_name("report_schema.json")

JsonDict = dict[str, Any]


def _mib(num_bytes: int | float) -> float:
    return round(num_bytes / MIB, 3)


def seconds(value: float | None) -> float | None:
    """A duration as the report writes it."""
    # Microseconds are plenty for anything gpuclean times, and keep the file readable.
    return None if value is None else round(value, 6)


def device_json(device: DeviceInfo) -> JsonDict:
    """A device's identity."""
    return {"index": device.index, "mig_index": device.mig_index, "uuid": device.uuid, "name": device.name,
            "label": device.label}


def process_json(info: ProcessInfo) -> JsonDict:
    """A process as the user sees it; ``(pid, start_ticks)`` identifies it."""
    return {"pid": info.pid, "start_ticks": info.start_ticks, "ppid": info.ppid, "uid": info.uid,
            "user": info.user, "cmdline": info.cmdline, "state": info.state}


def owner_json(owner: Owner | None) -> JsonDict | None:
    """Who spawned a process (a test, a fixture, the session), or None if unknown."""
    return None if owner is None else {"kind": owner.kind, "name": owner.name}


def mib_pairs_json(pairs: Sequence[tuple[str, float]]) -> list[JsonDict]:
    """``(device label, MiB)`` pairs as objects."""
    return [{"device": label, "mib": round(value, 3)} for label, value in pairs]


def snapshot_json(snap: DeviceSnapshot, described: Mapping[int, ProcessInfo | None] | None = None
                  ) -> JsonDict:
    """One reading of a device; with ``described``, each process also gets its user and command line."""
    entries: list[JsonDict] = []
    for proc in snap.processes:
        entry: JsonDict = {"pid": proc.pid, "used_bytes": proc.used_bytes,
                           "used_mib": None if proc.used_bytes is None else _mib(proc.used_bytes)}
        if described is not None:
            info = described.get(proc.pid)
            # None: exited since the reading, or in another PID namespace (the driver lists host pids).
            entry.update({"uid": info.uid if info else None, "user": info.user if info else None,
                          "cmdline": info.cmdline if info else None, "state": info.state if info else None})
        entries.append(entry)
    return {**device_json(snap.device), "used_bytes": snap.used_bytes, "total_bytes": snap.total_bytes,
            "used_mib": _mib(snap.used_bytes), "total_mib": _mib(snap.total_bytes), "processes": entries}


def offender_json(offender: Offender) -> JsonDict:
    """Something that made a check fail."""
    return {"reason": offender.reason, "found_by": offender.found_by, "detail": offender.detail,
            "process": None if offender.process is None else process_json(offender.process),
            "owner": owner_json(offender.owner), "mib_per_device": mib_pairs_json(offender.mib_per_device)}


def reaped_json(reaped: Reaped) -> JsonDict:
    """A process gpuclean ended, how, and how long the driver took to release its memory."""
    return {"process": process_json(reaped.process), "owner": owner_json(reaped.owner),
            "found_by": reaped.found_by, "ended_by": reaped.how_ended, "exit_s": seconds(reaped.exit_s),
            "release_s": seconds(reaped.release_s), "mib_per_device": mib_pairs_json(reaped.mib_per_device)}


def check_json(check: CheckResult) -> JsonDict:
    """One check (before or after a test)."""
    return {"phase": check.phase, "clean": check.clean, "waited_s": seconds(check.waited_s),
            "clean_after_s": seconds(check.clean_after_s), "tolerance_mib": check.tolerance_mib,
            "devices": [snapshot_json(s) for s in check.devices],
            "offenders": [offender_json(o) for o in check.offenders],
            "reaped": [reaped_json(r) for r in check.reaped],
            "lingered": [offender_json(o) for o in check.lingered], "notes": list(check.notes),
            "self_mib": mib_pairs_json(check.self_mib), "error": check.error,
            "outside": outside_json(check)}


def outside_json(check: CheckResult) -> JsonDict | None:
    """What a check found that cannot be the session's, and whether it waited for it; None if nothing."""
    outside = check.outside
    if outside is None:
        return None
    return {"devices": mib_pairs_json(outside.devices), "only": outside.only, "same_as": outside.same_as,
            "waited": outside.same_as is None}


def own_reaped(record: TestRecord) -> list[Reaped]:
    """Processes the after-check reaped that this test leaked (an earlier test's are charged to it)."""
    return own_leaks(record).reaped


def _reaped_leak_json(reaped: Reaped, found: str) -> JsonDict:
    return {"pid": reaped.process.pid, "user": reaped.process.user, "cmdline": reaped.process.cmdline,
            "owner": owner_json(reaped.owner), "found": found, "ended_by": reaped.how_ended,
            "release_s": seconds(reaped.release_s),
            **({} if reaped.node is None else {"node_id": reaped.node, "via": reaped.via or "ladder"})}


def _offender_leak_json(offender: Offender, ended_by: str | None) -> JsonDict | None:
    proc = offender.process
    if offender.reason != "leaked" or proc is None:
        return None
    return {"pid": proc.pid, "user": proc.user, "cmdline": proc.cmdline, "owner": owner_json(offender.owner),
            "found": "teardown", "ended_by": ended_by, "release_s": None,
            **({} if offender.node is None else {"node_id": offender.node, "via": None})}


def leaked_json(record: TestRecord) -> list[JsonDict]:
    """Every process this test left behind: reaped after it, found by a later check, or not reapable."""
    leaks = own_leaks(record)
    leaked: list[JsonDict] = [*(_reaped_leak_json(r, "teardown") for r in leaks.reaped),
                              *(_reaped_leak_json(r, "later") for r in leaks.later)]
    leaked.extend(e for o, ended_by in leaks.offenders if (e := _offender_leak_json(o, ended_by)) is not None)
    leaked.extend(_cluster_leaked_json(leaks))
    return leaked


def fixture_leaked_json(leak: FixtureLeak) -> list[JsonDict]:
    """Every process a fixture left behind, in the shape of a test's ``leaked``."""
    entries = [_reaped_leak_json(r, "teardown") for r in leak.reaped]
    for offenders, ended_by in ((leak.leaked, None), (leak.lingered, "exited by itself")):
        entries.extend(e for o in offenders if (e := _offender_leak_json(o, ended_by)) is not None)
    return entries


def fixture_json(leak: FixtureLeak) -> JsonDict:
    """A fixture wider than a test that left processes behind, found at the teardown of ``reported_on``."""
    return {"name": leak.name, "scope": leak.scope, "file": leak.location[0], "line": leak.location[1],
            "reported_on": leak.reported_on, "leaked": fixture_leaked_json(leak),
            "reaped": [reaped_json(r) for r in leak.reaped]}


def _cluster_leaked_json(leaks: OwnLeaks) -> list[JsonDict]:
    """What a test left where an extension's check after it found it (``cluster_after``): ended, or
    still there."""
    return [*(_reaped_leak_json(r, "teardown") for r in leaks.cluster_reaped),
            *(e for o in leaks.cluster_left if (e := _offender_leak_json(o, None)) is not None)]


def outcome(record: TestRecord) -> str:
    """The test's outcome (``outcomes.outcome``, which every output uses)."""
    return results_outcome(record)


def health_json(found: HealthFinding) -> JsonDict:
    """One GPU health finding."""
    return {"kind": found.kind, "effect": found.effect, "device": found.device, "uuid": found.uuid,
            "phase": found.phase, "xid": found.xid, "message": found.message}


def record_json(record: TestRecord, more_keys: Callable[[TestRecord], JsonDict] | None = None) -> JsonDict:
    """Everything gpuclean saw around one test; ``more_keys``: an extension's keys of it
    (``hookspecs.pytest_gpuclean_report_test``), after ``timings``."""
    return {
        "nodeid": record.nodeid,
        "file": record.location[0],
        "line": record.location[1],
        "outcome": outcome(record),
        "findings": has_findings(record),
        "devices": list(record.devices),
        "before": None if record.before is None else check_json(record.before),
        "after": None if record.after is None else check_json(record.after),
        "leaked": leaked_json(record),
        "found_later": [reaped_json(r) for r in record.found_later],
        "in_process_mib": mib_pairs_json(record.in_process_mib),
        "lock_timeout": record.lock_timeout,
        "health": [health_json(f) for f in record.health],
        "outside_action": record.outside_action,
        "blocked_by": list(record.blocked_by),
        "timings": {"lock_wait_s": seconds(record.lock_wait_s), "before_s": seconds(record.before_s),
                    "after_s": seconds(record.after_s)},
        **(more_keys(record) if more_keys is not None else {}),
        # Only when another xdist worker found one: a report without it keeps its shape.
        **({"gpu_without_lock": [sibling_use_json(u) for u in record.gpu_without_lock]}
           if record.gpu_without_lock else {}),
    }


def sibling_use_json(use: SiblingUse) -> JsonDict:
    """A process of this test that another xdist worker found on a GPU whose lock that worker's test held."""
    return {"process": process_json(use.process), "owner": owner_json(use.owner), "worker": use.worker,
            "mib_per_device": mib_pairs_json(use.mib_per_device),
            "lock_held_by": {"nodeid": use.seen_by, "worker": use.seen_worker, "phase": use.phase}}


def summary_json(records: Sequence[TestRecord], session_reaped: Sequence[Reaped]) -> JsonDict:
    """Counts over the whole session."""
    outcomes = [outcome(r) for r in records]
    without_lock = sum(1 for r in records if r.gpu_without_lock)
    return {"tests": len(records), "checked": sum(1 for r in records if r.before is not None),
            "with_findings": sum(1 for r in records if has_findings(r)),
            "clean": outcomes.count("clean"), "leaked": outcomes.count("leaked"),
            "not_clean": outcomes.count("not_clean"), "gpu_fault": outcomes.count("gpu_fault"),
            "reaped": reaped_count(records, session_reaped),
            "lock_timeouts": sum(1 for r in records if r.lock_timeout is not None),
            "fixture_leaks": sum(len(r.fixture_leaks) for r in records),
            "device_errors": sum(1 for r in records if any(
                c is not None and c.error is not None for c in (r.before, r.after))),
            "dirty_from_outside": sum(1 for r in records if r.outside_action is not None),
            **({"gpu_without_lock": without_lock} if without_lock else {})}


def versions() -> dict[str, str | None]:
    """Versions of gpuclean and what it runs on, for reading a report months later."""
    import platform

    found: dict[str, str | None] = {"python": platform.python_version()}
    for key, dist in (("pytest_gpuclean", "pytest-gpuclean"), ("pytest", "pytest"),
                      ("pytest_xdist", "pytest-xdist"), ("nvidia_ml_py", "nvidia-ml-py"),
                      ("psutil", "psutil")):
        try:
            found[key] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            found[key] = None
    return found


def iso_time(timestamp: float) -> str:
    """A wall-clock timestamp as ISO 8601 in UTC."""
    return datetime.fromtimestamp(timestamp, tz=timezone.utc).isoformat(timespec="milliseconds")


def report_document(*, records: Sequence[TestRecord], session_reaped: Sequence[Reaped],
                    notes: Sequence[str], session: JsonDict,
                    test_keys: Callable[[TestRecord], JsonDict] | None = None) -> JsonDict:
    """The whole ``--gpuclean-report`` document; the caller, who knows pytest, builds ``session`` and
    ``test_keys``."""
    return {
        "schema_version": SCHEMA_VERSION,
        "versions": versions(),
        "session": session,
        "summary": summary_json(records, session_reaped),
        "tests": [record_json(r, test_keys) for r in records],
        "fixtures": [fixture_json(f) for r in records for f in r.fixture_leaks],
        "session_reaped": [reaped_json(r) for r in session_reaped],
        "notes": list(notes),
    }


def write_atomic(path: str | os.PathLike[str], document: Any) -> None:
    """Write ``document`` as JSON to ``path`` so a reader sees the old file or the whole new one."""
    target = Path(path)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(document, f, indent=2)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        # mkstemp creates 0600; a report is meant to be read by CI tooling running as other users.
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def load_schema() -> JsonDict:
    """The JSON Schema of the report (for validating a report, e.g. in a CI step)."""
    schema: JsonDict = json.loads(SCHEMA_PATH.read_text(encoding="utf-8"))
    return schema
