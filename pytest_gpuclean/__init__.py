"""pytest-gpuclean: clean GPUs and no stray processes around every GPU test."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from importlib.machinery import ModuleSpec, PathFinder
from types import ModuleType

__all__ = [
    "__version__",
]

__version__ = "0.1.0"


class _PlainImports:
    """Imports this package's modules the standard way, in front of pytest's assertion rewriting.

    pytest rewrites the asserts of every module of a distribution with a ``pytest11`` entry point (ours
    among them) as it is imported, and keeps the rewritten code in a ``.pyc`` of its own only where it may
    write bytecode: under ``PYTHONDONTWRITEBYTECODE=1`` (the GPU image sets it) or a read-only
    ``site-packages``, every pytest run parsed, rewrote and compiled the ~10k lines a checked session
    imports (most of its fixed cost: docs/benchmarks.md, section 9). The package's asserts only state
    invariants, which need no rewritten messages; imported the standard way, its ordinary (installed)
    bytecode is used.
    """

    @staticmethod
    def find_spec(name: str, path: Sequence[str] | None = None,
                  target: ModuleType | None = None) -> ModuleSpec | None:
        if not name.startswith(__name__ + "."):
            return None
        return PathFinder.find_spec(name, path, target)


if not any(type(f).__name__ == _PlainImports.__name__ for f in sys.meta_path):  # once: (re)imports
    sys.meta_path.insert(0, _PlainImports())
