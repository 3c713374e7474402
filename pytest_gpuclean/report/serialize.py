"""Records to plain JSON-able dicts and back: for xdist's workeroutput and the JSON report.

A record is one of ``model``'s ``Fields`` classes or a dataclass (``findings``).
``from_dict`` rebuilds nested records, tuples and lists from the classes' own annotations, so a field
added to a record round-trips without a change here. A field's hint is resolved only when a value
needs building: a record's findings name ``findings``' classes, which a clean record never loads.
"""

from __future__ import annotations

import builtins
import dataclasses
import functools
import sys
import types
from typing import TYPE_CHECKING, Any, Final, TypeVar, Union, get_args, get_origin

from pytest_gpuclean.model.readings import Fields
from pytest_gpuclean.model.results import TestRecord

if TYPE_CHECKING:
    from pytest_gpuclean.model.findings import Reaped

T = TypeVar("T")


def to_dict(obj: Any) -> dict[str, Any]:
    """A record (tree) as dicts, lists and scalars."""
    plain: dict[str, Any] = _plain(obj)
    return plain


def _names(cls: Any) -> tuple[str, ...]:
    """A record class's fields, in order."""
    if issubclass(cls, Fields):
        names: tuple[str, ...] = cls.__slots__
        return names
    return tuple(f.name for f in dataclasses.fields(cls))


def _is_record(value: Any) -> bool:
    return isinstance(value, type) and (issubclass(value, Fields) or dataclasses.is_dataclass(value))


def _plain(value: Any) -> Any:
    if value is None or isinstance(value, (str, int, float)):
        return value
    if _is_record(type(value)):
        return {name: _plain(getattr(value, name)) for name in _names(type(value))}
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


class _Names(dict[str, Any]):
    """A module's names, plus those of ``findings``, loaded on first use (``model`` imports them for
    typing only)."""

    def __missing__(self, name: str) -> Any:
        if hasattr(builtins, name):
            raise KeyError(name)  # eval looks in here first: builtins are not a reason to load the others
        from pytest_gpuclean.model import findings

        try:
            return getattr(findings, name)
        except AttributeError:
            raise KeyError(name) from None


@functools.cache
def _hint(cls: Any, name: str) -> Any:
    if issubclass(cls, Fields):
        annotation = cls.__annotations__[name]
    else:
        annotation = next(f.type for f in dataclasses.fields(cls) if f.name == name)
    if isinstance(annotation, str):
        # What typing.get_type_hints does for one annotation, without resolving the class's other fields.
        annotation = eval(annotation, _Names(vars(sys.modules[cls.__module__])))
    return get_args(annotation)[0] if get_origin(annotation) is Final else annotation


def _build(hint: Any, value: Any) -> Any:
    if value is None:
        return None
    origin = get_origin(hint)
    if origin is Union or origin is types.UnionType:
        inner = [a for a in get_args(hint) if a is not type(None)]
        return _build(inner[0], value) if len(inner) == 1 else value
    if _is_record(hint):
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


def from_dict(cls: type[T], data: Any) -> T:  # (cls: a record class)
    """Rebuild ``cls`` from ``to_dict`` output (sequences come back as tuples or lists as declared)."""
    record: Any = cls
    kwargs = {name: None if data[name] is None else _build(_hint(record, name), data[name])
              for name in _names(cls) if name in data}
    return cls(**kwargs)


def record_to_dict(record: TestRecord) -> dict[str, Any]:
    return to_dict(record)


def record_from_dict(data: dict[str, Any]) -> TestRecord:
    return from_dict(TestRecord, data)


def reaped_to_dict(reaped: Reaped) -> dict[str, Any]:
    return to_dict(reaped)


def reaped_from_dict(data: dict[str, Any]) -> Reaped:
    from pytest_gpuclean.model.findings import Reaped  # (as model: loaded at the first finding)

    return from_dict(Reaped, data)
