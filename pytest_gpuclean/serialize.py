"""Dataclasses to plain JSON-able dicts and back: for xdist's workeroutput and the JSON report."""

from __future__ import annotations

import dataclasses
from typing import Any

from pytest_gpuclean.model import (
    CheckResult,
    DeviceInfo,
    DeviceSnapshot,
    GpuProcess,
    Offender,
    Owner,
    ProcessInfo,
    Reaped,
    TestRecord,
)

# Fields holding nested dataclasses, per class: (field name, class, is a sequence).
_NESTED: dict[type, tuple[tuple[str, type, bool], ...]] = {
    DeviceSnapshot: (("device", DeviceInfo, False), ("processes", GpuProcess, True)),
    Offender: (("process", ProcessInfo, False), ("owner", Owner, False)),
    Reaped: (("process", ProcessInfo, False), ("owner", Owner, False)),
    CheckResult: (("devices", DeviceSnapshot, True), ("offenders", Offender, True), ("reaped", Reaped, True),
                  ("lingered", Offender, True), ("collected", Reaped, True)),
    TestRecord: (("before", CheckResult, False), ("after", CheckResult, False),
                 ("found_later", Reaped, True)),
}


def to_dict(obj: Any) -> Any:
    """A dataclass (tree) as dicts, lists and scalars."""
    return _plain(dataclasses.asdict(obj))


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def from_dict(cls: type, data: Any) -> Any:
    """Rebuild ``cls`` from ``to_dict`` output (sequences come back as tuples or lists as declared)."""
    if data is None:
        return None
    kwargs = dict(data)
    nested = {name: (inner, many) for name, inner, many in _NESTED.get(cls, ())}
    for f in dataclasses.fields(cls):
        if f.name not in kwargs:
            continue
        value = kwargs[f.name]
        if f.name in nested:
            inner, many = nested[f.name]
            value = [from_dict(inner, v) for v in value] if many else from_dict(inner, value)
        if isinstance(value, list) and "tuple" in str(f.type):
            value = tuple(tuple(v) if isinstance(v, list) else v for v in value)
        kwargs[f.name] = value
    return cls(**kwargs)


def record_to_dict(record: TestRecord) -> dict[str, Any]:
    data: dict[str, Any] = to_dict(record)
    return data


def record_from_dict(data: dict[str, Any]) -> TestRecord:
    record: TestRecord = from_dict(TestRecord, data)
    return record


def reaped_to_dict(reaped: Reaped) -> dict[str, Any]:
    data: dict[str, Any] = to_dict(reaped)
    return data


def reaped_from_dict(data: dict[str, Any]) -> Reaped:
    reaped: Reaped = from_dict(Reaped, data)
    return reaped
