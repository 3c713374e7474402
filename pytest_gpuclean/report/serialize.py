"""Records to plain JSON-able dicts and back: for xdist's workeroutput and the JSON report.

Driven only by the record classes (``model/records.py``'s ``Fields``): ``to_dict`` walks a record's fields
(``__slots__``), ``from_dict`` rebuilds each field from its type hint (``typing.get_type_hints``): nested
records, tuples and lists as declared. No class has code of its own here, so a field or a record added to
the model round-trips without a change (tests/test_report.py round-trips every record class).
"""

from __future__ import annotations

import functools
import types
from typing import Any, Final, TypeVar, Union, get_args, get_origin, get_type_hints

from pytest_gpuclean.model.records import Fields

__all__ = [
    "from_dict",
    "to_dict",
]

_T = TypeVar("_T")


def to_dict(obj: Fields) -> dict[str, Any]:
    """A record (tree) as dicts, lists and scalars."""
    plain: dict[str, Any] = _plain(obj)
    return plain


def _plain(value: Any) -> Any:
    if value is None or isinstance(value, (str, int, float)):
        return value
    if isinstance(value, Fields):
        return {name: _plain(getattr(value, name)) for name in value.__slots__}
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


@functools.cache
def _hints(cls: type[Fields]) -> dict[str, Any]:
    """Each field's type, ``Final`` taken off (resolved once per class, in its module's names)."""
    hints = get_type_hints(cls)
    return {name: get_args(hints[name])[0] if get_origin(hints[name]) is Final else hints[name]
            for name in cls.__slots__}


def _build(hint: Any, value: Any) -> Any:
    if value is None:
        return None
    origin = get_origin(hint)
    if origin is Union or origin is types.UnionType:
        inner = [a for a in get_args(hint) if a is not type(None)]
        return _build(inner[0], value) if len(inner) == 1 else value
    if isinstance(hint, type) and issubclass(hint, Fields):
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


def from_dict(cls: type[_T], data: Any) -> _T:  # (cls: a record class)
    """Rebuild ``cls`` from ``to_dict`` output (sequences come back as tuples or lists as declared)."""
    hints = _hints(cls)  # type: ignore[arg-type]  # (a Fields class; TypeVar keeps the caller's type)
    return cls(**{name: _build(hint, data[name]) for name, hint in hints.items() if name in data})
