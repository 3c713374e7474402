"""The package's own imports: past pytest's assertion rewriting, and through a bytecode cache of its own where
Python writes none. Imported first, by the package's ``__init__``, so that every later module of the package
loads through it."""

from __future__ import annotations

import binascii
import contextlib
import importlib.util
import marshal
import os
import sys
from collections.abc import Sequence
from importlib.machinery import ModuleSpec, PathFinder, SourceFileLoader
from types import CodeType, ModuleType

_PACKAGE = __name__.rpartition(".")[0]
_CACHE_ENV = "GPUCLEAN_BYTECODE_CACHE"
"""``off`` turns the bytecode cache off; a path puts it there (default: ``$XDG_CACHE_HOME/pytest-gpuclean``,
``~/.cache/pytest-gpuclean`` without it)."""


class _CachedBytecode(SourceFileLoader):
    """A source module's loader that keeps its bytecode in the plugin's own cache where Python writes none.

    With ``PYTHONDONTWRITEBYTECODE=1`` (GPU images set it, and often ship packages without bytecode),
    every process compiles each module it imports from source: pynvml's 5,000-line module alone cost
    57-82 ms of CPU per pytest run on an H100 image, 6x its ``nvmlInit``. The plugin keeps the bytecode of
    what it imports itself in a directory of the user's own (``_cache_dir``), checked against the
    source's modification time and size as Python's own ``.pyc`` files are.
    """

    def __init__(self, fullname: str, path: str, cache_dir: str) -> None:
        super().__init__(fullname, path)
        self.cache_dir = cache_dir

    def get_code(self, fullname: str) -> CodeType | None:
        source = self.path
        try:
            st = os.stat(source)
        except OSError:
            return super().get_code(fullname)
        # (the header of Python's own timestamp-checked .pyc files: magic, flags, source mtime and size)
        header = (importlib.util.MAGIC_NUMBER + bytes(4)
                  + (int(st.st_mtime) & 0xFFFFFFFF).to_bytes(4, "little")
                  + (st.st_size & 0xFFFFFFFF).to_bytes(4, "little"))
        encoded = os.fsencode(source)
        name = f"{binascii.crc32(encoded):08x}-{len(encoded)}-{os.path.basename(source)}c"
        cached = os.path.join(self.cache_dir, name)
        try:
            with open(cached, "rb") as f:
                data = f.read()
            if data[:16] == header:
                code = marshal.loads(data[16:])
                if isinstance(code, CodeType):
                    return code
        except (OSError, EOFError, ValueError, TypeError):
            pass
        code = super().get_code(fullname)  # compiled from source (Python writes nothing under the flag)
        if code is not None:
            temporary = f"{cached}.{os.getpid()}.tmp"
            try:
                with open(temporary, "wb") as f:
                    f.write(header + marshal.dumps(code))
                os.replace(temporary, cached)
            except OSError:
                with contextlib.suppress(OSError):
                    os.unlink(temporary)
        return code


_NO_CACHE = ""
_cache: list[str] = []
"""The cache directory once looked for: ``_NO_CACHE`` where there is none."""


def _cache_dir() -> str | None:
    """The bytecode cache's directory, made if missing: the user's own and writable by nobody else, or
    None (bytecode written by Python, the cache turned off, or no such directory to be had)."""
    if not sys.dont_write_bytecode:
        return None
    if not _cache:
        _cache.append(_find_cache_dir() or _NO_CACHE)
    return _cache[0] or None


def _find_cache_dir() -> str | None:
    setting = os.environ.get(_CACHE_ENV, "")
    if setting.lower() == "off":
        return None
    base = setting or os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"),
                                   "pytest-gpuclean")
    path = os.path.join(base, "bytecode", sys.implementation.cache_tag or "none")
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        st = os.stat(path)
    except OSError:
        return None
    # Bytecode is code: another user's directory, or one others may write, could serve anything.
    if st.st_uid != os.getuid() or st.st_mode & 0o022:
        return None
    return path


def _cached_spec(spec: ModuleSpec | None) -> ModuleSpec | None:
    if spec is not None and type(spec.loader) is SourceFileLoader and isinstance(spec.origin, str):
        cache = _cache_dir()
        # (Python's own bytecode, where there is some, is used as Python would)
        if cache is not None and not os.path.exists(importlib.util.cache_from_source(spec.origin)):
            spec.loader = _CachedBytecode(spec.name, spec.origin, cache)
    return spec


_importing: set[str] = set()
"""Modules being imported by ``import_cached`` right now (``_PlainImports`` answers for them)."""


def import_cached(name: str) -> ModuleType:
    """``import name`` for the plugin's own use, through the bytecode cache where Python writes none
    (``_CachedBytecode``); a module already imported is what it is. Only this very import goes through the
    cache: ``_PlainImports`` answers for ``name`` while it runs, and finds nothing of it otherwise."""
    module = sys.modules.get(name)
    if module is not None:
        return module
    if _cache_dir() is None:
        return importlib.import_module(name)
    _importing.add(name)
    try:
        return importlib.import_module(name)
    finally:
        _importing.discard(name)


class _PlainImports:
    """Imports this package's modules the standard way, in front of pytest's assertion rewriting.

    pytest rewrites the asserts of every module of a distribution with a ``pytest11`` entry point (ours
    among them) as it is imported, and keeps the rewritten code in a ``.pyc`` of its own only where it may
    write bytecode: under ``PYTHONDONTWRITEBYTECODE=1`` or a read-only ``site-packages``, every pytest run
    parsed, rewrote and compiled the ~10k lines a checked session imports. The package's asserts only
    state invariants, which need no rewritten messages; imported the standard way, its ordinary
    (installed) bytecode is used, or the plugin's own cache (``_CachedBytecode``) where there is none.
    """

    @staticmethod
    def find_spec(name: str, path: Sequence[str] | None = None,
                  target: ModuleType | None = None) -> ModuleSpec | None:
        if not name.startswith(_PACKAGE + ".") and name not in _importing:
            return None
        return _cached_spec(PathFinder.find_spec(name, path, target))


if not any(type(f).__name__ == _PlainImports.__name__ for f in sys.meta_path):  # once: (re)imports
    sys.meta_path.insert(0, _PlainImports())
