"""Every module of the package says what it offers: an ``__all__`` of the names that other modules, the tests
or users take from it, each one there, and nothing else public (a name used only inside its module starts
with ``_``). What users may import is docs/architecture.md's "The public API"."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest
from test_layers import MODULES  # (the package's modules by name, as the layers test reads them)

PENDING_ALL: set[str] = set()
"""Modules whose ``__all__`` is still to come (none: a new module comes with its own)."""

DECLARED = sorted(set(MODULES) - PENDING_ALL)


def _defined(path: Path) -> set[str]:
    """The names a module defines at its top level (not those it imports)."""
    names: set[str] = set()
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


@pytest.mark.parametrize("name", DECLARED)
def test_a_module_exports_what_it_declares(name: str) -> None:
    module = importlib.import_module(name)
    exported = getattr(module, "__all__", None)
    assert isinstance(exported, list), f"{name} has no __all__"
    assert len(exported) == len(set(exported)), f"{name}.__all__ names one twice"
    assert [n for n in exported if n.startswith("_") and not n.startswith("__")] == []
    assert [n for n in exported if not hasattr(module, n)] == [], f"{name}.__all__ names what it lacks"
    star: dict[str, object] = {}
    exec(f"from {name} import *", star)
    assert set(star) - {"__builtins__"} == set(exported)
    # Public on purpose: what the module defines is in __all__, or private.
    public = {n for n in _defined(MODULES[name]) if not n.startswith("_")}
    assert sorted(public - set(exported)) == [], f"{name}: export these in __all__ or make them private"


def _declares_all(path: Path) -> bool:
    for node in ast.parse(path.read_text(), str(path)).body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] \
            if isinstance(node, ast.AnnAssign) else []
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
            return True
    return False


def test_every_module_declares_its_names_or_is_pending() -> None:
    # A new module comes with its __all__; a pending one that has one now is taken off PENDING_ALL.
    assert sorted(PENDING_ALL - set(MODULES)) == []
    with_all = {name for name, path in MODULES.items() if _declares_all(path)}
    assert sorted(set(DECLARED) - with_all) == []
    assert sorted(PENDING_ALL & with_all) == []
