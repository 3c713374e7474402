"""One record style, held: every record of the package is a ``Fields`` class (``model/records.py``), or a
``Fields`` subclass declared where it is used. Read from the source with ``ast``, the other styles are
counted per module: ``@dataclass`` classes, ``NamedTuple`` subclasses and ``namedtuple(...)`` calls,
hand-slotted classes (``__slots__`` without ``Fields``; an exception or a ``Protocol`` is no record),
records passed as ``dict[str, object]`` in annotations, and anonymous tuples of four fields or more in a
function's signature (``tuple[a, b, c, d]``: the reader must count to know what ``[2]`` is).

``python tests/test_record_style.py [PACKAGE_DIR]`` prints the table (of another checkout's package too).
"""

from __future__ import annotations

import ast
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "pytest_gpuclean"

KINDS = ("dataclass", "NamedTuple", "namedtuple()", "slotted", "dict[str, object]", "tuple[4+]")

Offender = tuple[str, str, str]
"""(module path under the package, kind, what: a class, or ``function(argument)``/``function->``)."""

ALLOWED: dict[Offender, str] = {
    # What stays as it is, and why. (Not counted at all: ``Fields`` itself, the style; ``Protocol`` classes
    # and exceptions, which are no records; ``.ci/stages.py``, outside the package.)
    ("core/options/settings.py", "NamedTuple", "Option"):
        "every pytest run of an environment with the plugin imports settings.py, and a session that checks "
        "nothing imports no model (tests/test_cost.py); Fields lives in model/records.py, and Fields in a "
        "module of its own below it would be a seventh floor (tests/test_layers.py)",
    ("core/options/settings.py", "slotted", "TestSettings"):
        "declared beside for_marker in settings.py, which every pytest run imports: as Option",
    ("session/names.py", "NamedTuple", "ExportedCookie"):
        "made in every pytest run, before the first conftest is imported: as settings.Option",
    ("core/reading/procfs.py", "NamedTuple", "ProcStat"):
        "every pytest run imports procfs.py (the cookie's checks), which imports nothing of the package: a "
        "Fields record there would load the model in a session that checks nothing (as Option)",
    ("core/reading/devices.py", "slotted", "LastReadings"):
        "no record: a backend's cache of each device's last reading, mutable, never compared or sent",
    ("core/reading/processes.py", "slotted", "Handle"):
        "no record: it owns a pidfd (closed with it) and is compared by identity",
    ("core/ownership/census.py", "slotted", "Found"):
        "a census entry holds its process's pinned Handle (a pidfd) and is marked as a check goes; the "
        "decisions see it through model/records.py's CensusEntry protocol",
    ("session/started.py", "slotted", "ItemState"):
        "no record: one test's mutable state between its setup and teardown hooks, never compared or sent",
    ("session/torch_growth.py", "slotted", "TorchGrowth"):
        "no record: the session's running totals of torch cache growth, mutable, inside one module",
}

PENDING: set[Offender] = set()
"""What is still to convert (none since issue 39: a new record comes as a Fields record, or in ALLOWED with
its reason)."""


def _is_fields(base: ast.expr, fields: set[str]) -> bool:
    return isinstance(base, (ast.Name, ast.Attribute)) and _name(base) in fields


def _name(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Call):
        return _name(node.func)
    if isinstance(node, ast.Subscript):
        return _name(node.value)
    return ""


_NOT_RECORDS = ("Protocol", "Exception", "BaseException", "Warning", "Error")
"""Bases (by the end of their name) of classes that are no record: a protocol is a type only; an exception
carries its message (and ``pytest.PytestWarning`` subclasses)."""


def _annotation(node: ast.expr | None) -> ast.expr | None:
    """``node``, or the expression a string annotation holds."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        try:
            return ast.parse(node.value, mode="eval").body
        except SyntaxError:
            return None
    return node


def _dict_str_object(node: ast.expr) -> bool:
    for sub in ast.walk(node):
        if isinstance(sub, ast.Subscript) and _name(sub.value) in ("dict", "Dict") \
                and isinstance(sub.slice, ast.Tuple) and len(sub.slice.elts) == 2 \
                and [_name(e) for e in sub.slice.elts] == ["str", "object"]:
            return True
    return False


def _long_tuple(node: ast.expr) -> bool:
    for sub in ast.walk(node):
        if isinstance(sub, ast.Subscript) and _name(sub.value) in ("tuple", "Tuple") \
                and isinstance(sub.slice, ast.Tuple) and len(sub.slice.elts) >= 4 \
                and not any(isinstance(e, ast.Constant) and e.value is Ellipsis for e in sub.slice.elts):
            return True
    return False


def _fields_classes(trees: dict[str, ast.Module]) -> set[str]:
    """The names of ``Fields`` and its subclasses anywhere in the package (by name, to a fixed point)."""
    fields = {"Fields"}
    classes = [node for tree in trees.values() for node in ast.walk(tree) if isinstance(node, ast.ClassDef)]
    grown = True
    while grown:
        grown = False
        for node in classes:
            if node.name not in fields and any(_is_fields(b, fields) for b in node.bases):
                fields.add(node.name)
                grown = True
    return fields


def _walk(node: ast.AST, prefix: str = "") -> Iterator[tuple[str, ast.AST]]:
    """Every node under ``node`` with the qualified name of the class or function it is in."""
    for child in ast.iter_child_nodes(node):
        yield prefix, child
        if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            yield from _walk(child, f"{prefix}{child.name}.")
        else:
            yield from _walk(child, prefix)


def offenders_in(module: str, tree: ast.Module, fields: set[str]) -> Iterator[Offender]:
    for scope, node in _walk(tree):
        if isinstance(node, ast.ClassDef):
            what = scope + node.name
            bases = [_name(b) for b in node.bases]
            if any(_name(d) == "dataclass" for d in node.decorator_list):
                yield module, "dataclass", what
            if "NamedTuple" in bases:
                yield module, "NamedTuple", what
            slotted = any(isinstance(s, (ast.Assign, ast.AnnAssign)) and "__slots__" in
                          [_name(t) for t in (s.targets if isinstance(s, ast.Assign) else [s.target])]
                          for s in node.body)
            if slotted and node.name not in fields and not any(
                    b.endswith(_NOT_RECORDS) for b in bases):
                yield module, "slotted", what
        elif isinstance(node, ast.Call) and _name(node.func) == "namedtuple":
            yield module, "namedtuple()", scope.rstrip(".") or "<module>"
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args
            named = [(a.arg, a.annotation) for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)]
            named += [(a.arg, a.annotation) for a in (args.vararg, args.kwarg) if a is not None]
            named.append(("->", node.returns))
            for arg, raw in named:
                annotation = _annotation(raw)
                if annotation is None:
                    continue
                what = f"{scope}{node.name}" + ("->" if arg == "->" else f"({arg})")
                if _dict_str_object(annotation):
                    yield module, "dict[str, object]", what
                if _long_tuple(annotation):
                    yield module, "tuple[4+]", what
        elif isinstance(node, ast.AnnAssign):
            annotation = _annotation(node.annotation)
            if annotation is not None and _dict_str_object(annotation):
                yield module, "dict[str, object]", f"{scope}{ast.unparse(node.target)}"


def offenders(package: Path = PACKAGE) -> list[Offender]:
    trees = {path.relative_to(package).as_posix(): ast.parse(path.read_text(), str(path))
             for path in sorted(package.rglob("*.py"))}
    fields = _fields_classes(trees)
    return sorted({o for module, tree in trees.items() for o in offenders_in(module, tree, fields)})


def table(found: list[Offender]) -> str:
    """Per module, how many of each kind; then the total."""
    counts: dict[str, Counter[str]] = {}
    for module, kind, _ in found:
        counts.setdefault(module, Counter())[kind] += 1
    width = max([len(m) for m in counts] + [len("total")])
    lines = [f"{'module':<{width}}  " + "  ".join(KINDS)]
    for module, count in sorted(counts.items()):
        lines.append(f"{module:<{width}}  " + "  ".join(f"{count[k] or '':>{len(k)}}" for k in KINDS))
    total = Counter(kind for _, kind, _ in found)
    lines.append(f"{'total':<{width}}  " + "  ".join(f"{total[k]:>{len(k)}}" for k in KINDS)
                 + f"  ({len(found)})")
    return "\n".join(lines)


def test_one_record_style() -> None:
    found = offenders()
    print(table(found))
    new = [o for o in found if o not in ALLOWED and o not in PENDING]
    assert not new, ("records in another style than Fields (model/records.py): make them Fields records, "
                     "or allow one in ALLOWED with its reason:\n" + "\n".join(map(str, new)))


def test_every_allowed_one_is_still_there() -> None:
    # A record converted since is taken off the list, so that the list says what is left and why.
    found = set(offenders())
    assert [o for o in ALLOWED if o not in found] == []
    assert not set(ALLOWED) & PENDING


def test_the_count_catches_what_it_is_for(tmp_path: Path) -> None:
    source = '''
import collections, dataclasses
from typing import NamedTuple, Protocol
from pytest_gpuclean.model.records import Fields

@dataclasses.dataclass(frozen=True)
class A:
    x: int

class B(NamedTuple):
    x: int

C = collections.namedtuple("C", "x y")

class D:
    __slots__ = ("x",)

class E(Fields):
    __slots__ = ("x",)

class F(E):
    __slots__ = ("x", "y")

class G(Protocol):
    __slots__ = ()

class H(ValueError):
    __slots__ = ("x",)

def f(a: dict[str, object], b: tuple[int, int, int], c: tuple[int, ...]) -> tuple[int, str, int, str]:
    d: dict[str, object] = {}
    return 1, "", 1, ""

def g(a: "tuple[int, int, int, int]") -> list[dict[str, dict[str, object]]]:
    return []
'''
    (tmp_path / "m.py").write_text(source)
    assert offenders(tmp_path) == [
        ("m.py", "NamedTuple", "B"),
        ("m.py", "dataclass", "A"),
        ("m.py", "dict[str, object]", "f(a)"),
        ("m.py", "dict[str, object]", "f.d"),
        ("m.py", "dict[str, object]", "g->"),
        ("m.py", "namedtuple()", "<module>"),
        ("m.py", "slotted", "D"),
        ("m.py", "tuple[4+]", "f->"),
        ("m.py", "tuple[4+]", "g(a)"),
    ]


if __name__ == "__main__":
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else PACKAGE
    listed = offenders(root)
    print(table(listed))
    for offender in listed:
        print("  ", *offender)
