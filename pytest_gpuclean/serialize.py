"""Dataclasses to plain JSON-able dicts and back: for xdist's workeroutput and the JSON report.

``from_dict`` rebuilds nested dataclasses, tuples and lists from the classes' own type hints, so a
field added to ``model`` round-trips without a change here.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from typing import TYPE_CHECKING, Any, TypeVar, Union, get_args, get_origin

from pytest_gpuclean.model import Reaped, TestRecord

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

T = TypeVar("T", bound="DataclassInstance")


def to_dict(obj: Any) -> dict[str, Any]:
    """A dataclass (tree) as dicts, lists and scalars."""
    plain: dict[str, Any] = _plain(dataclasses.asdict(obj))
    return plain


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


@functools.cache
def _hints(cls: Any) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _build(hint: Any, value: Any) -> Any:
    if value is None:
        return None
    origin = get_origin(hint)
    if origin is Union or origin is types.UnionType:
        inner = [a for a in get_args(hint) if a is not type(None)]
        return _build(inner[0], value) if len(inner) == 1 else value
    if dataclasses.is_dataclass(hint) and isinstance(hint, type):
        return from_dict(hint, value)
    if origin is tuple:
        args = get_args(hint)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_build(args[0], v) for v in value)
        return tuple(_build(a, v) for a, v in zip(args, value, strict=True))
    if origin is list:
        (item,) = get_args(hint)
        return [_build(item, v) for v in value]
    return value  # scalars, Literal words, Mapping of scalars


def from_dict(cls: type[T], data: Any) -> T:
    """Rebuild ``cls`` from ``to_dict`` output (sequences come back as tuples or lists as declared)."""
    hints = _hints(cls)
    kwargs = {f.name: _build(hints[f.name], data[f.name]) for f in dataclasses.fields(cls)
              if f.name in data}
    return cls(**kwargs)


def record_to_dict(record: TestRecord) -> dict[str, Any]:
    return to_dict(record)


def record_from_dict(data: dict[str, Any]) -> TestRecord:
    return from_dict(TestRecord, data)


def reaped_to_dict(reaped: Reaped) -> dict[str, Any]:
    return to_dict(reaped)


def reaped_from_dict(data: dict[str, Any]) -> Reaped:
    return from_dict(Reaped, data)
