"""Records to plain JSON-able dicts and back: for xdist's workeroutput and a forked child's records.

``to_dict`` walks a record's fields, ``from_dict`` rebuilds each field from its type hint
(``typing.get_type_hints``): nested records, tuples and lists as declared. No class has code of its own
here, so a field or a record added to the model round-trips without a change.
"""

from __future__ import annotations

import dataclasses
import functools
import types
from typing import Any, TypeVar, Union, get_args, get_origin, get_type_hints

_T = TypeVar("_T")


def to_dict(obj: Any) -> dict[str, Any]:
    """A record (tree) as dicts, lists and scalars."""
    plain: dict[str, Any] = _plain(obj)
    return plain


def _plain(value: Any) -> Any:
    if value is None or isinstance(value, (str, int, float)):
        return value
    names = _names(type(value))
    if names:
        return {name: _plain(getattr(value, name)) for name in names}
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _names(cls: type) -> tuple[str, ...]:
    """A record class's fields, in order (a NamedTuple's or a dataclass's); () for any other class."""
    names = _NAMES.get(cls)
    if names is None:
        fields = getattr(cls, "_fields", None)
        if isinstance(fields, tuple) and issubclass(cls, tuple):
            names = fields
        else:
            names = tuple(f.name for f in dataclasses.fields(cls)) if dataclasses.is_dataclass(cls) else ()
        _NAMES[cls] = names
    return names


_NAMES: dict[type, tuple[str, ...]] = {}


@functools.cache
def _hints(cls: Any) -> dict[str, Any]:
    """Each field's type (resolved once per class, in its module's names)."""
    hints = get_type_hints(cls)
    return {name: hints[name] for name in _names(cls)}


def _build(hint: Any, value: Any) -> Any:
    if value is None:
        return None
    origin = get_origin(hint)
    if origin is Union or origin is types.UnionType:
        inner = [a for a in get_args(hint) if a is not type(None)]
        return _build(inner[0], value) if len(inner) == 1 else value
    if isinstance(hint, type) and _names(hint):
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
    hints = _hints(cls)  # type: ignore[arg-type]  # (a class is hashable; mypy's functools.cache typing)
    return cls(**{name: _build(hint, data[name]) for name, hint in hints.items() if name in data})
