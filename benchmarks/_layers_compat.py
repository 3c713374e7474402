"""Lets a benchmark written for the layered package (issue 29) run against a tree from before it.

Before/after pairs (``ab_trees.py``, ``call_counts.py``) import the checking code by its new names
(``pytest_gpuclean._check.checker``); a tree exported from before the layers has the same modules flat
(``pytest_gpuclean.checker``). Imported before ``pytest_gpuclean``'s modules, this maps each new name to
the old module when the tree has no ``pytest_gpuclean/core``, and does nothing otherwise.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types
from collections.abc import Sequence

OLD_NAMES = {
    **{f"core.{m}": m for m in ("procfs", "pools", "signals", "cookie", "outside", "probe", "devices",
                                "settings", "locks", "health", "processes", "ownership", "checker")},
    "model.readings": "model", "model.results": "model", "model.findings": "findings",
    "model.ray_model": "ray_model", "model.text": "report", "model.records": "model",
    "model.decisions": "model", "model.outcomes": "model",
    **{f"report.{m}": m for m in ("report", "jsonreport", "records", "serialize")},
    "ray.cluster": "cluster", "ray.cli_ray": "cli_ray",
    "session.names": "plugin", "session.session": "session", "session.testcheck": "testcheck",
    "session.cluster_checks": "cluster_checks", "session.outputs": "outputs",
}
LAYERS = ("core", "model", "report", "ray", "session")


class _OldTree(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: types.ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        name = fullname.removeprefix("pytest_gpuclean.")
        if name == fullname or (name not in OLD_NAMES and name not in LAYERS):
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=name in LAYERS)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        name = spec.name.removeprefix("pytest_gpuclean.")
        if name in LAYERS:
            # The old tree may have a flat module of the layer's name (model.py, report.py, session.py): that
            # module, made a package of the mapped names; else an empty one.
            parent = sys.modules["pytest_gpuclean"]
            found = importlib.machinery.PathFinder.find_spec(spec.name, parent.__path__)
            if found is None or found.loader is None:
                module = types.ModuleType(spec.name)
            else:
                module = importlib.util.module_from_spec(found)
                sys.modules[spec.name] = module
                found.loader.exec_module(module)
            module.__path__ = []
            return module
        return importlib.import_module(f"pytest_gpuclean.{OLD_NAMES[name]}")

    def exec_module(self, module: types.ModuleType) -> None:
        pass  # the old module ran when it was imported


def _flat_tree() -> bool:
    # By the folder, not by find_spec("pytest_gpuclean.core"): an editable install of the layered checkout
    # would answer for the old tree's missing subpackage from its own folder.
    spec = importlib.util.find_spec("pytest_gpuclean")
    return bool(spec and spec.origin) and not os.path.isdir(os.path.join(os.path.dirname(spec.origin or ""),
                                                                         "core"))


if _flat_tree():
    sys.meta_path.insert(0, _OldTree())
