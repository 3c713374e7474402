"""The package's own imports: past pytest's assertion rewriting, and through a bytecode cache of its own where
Python writes none. The package's ``__init__`` imports it first, so every later module loads through it."""

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
    """A loader that keeps bytecode in the plugin's own cache, checked by source mtime and size as ``.pyc``.

    GPU images often set ``PYTHONDONTWRITEBYTECODE=1`` and ship no bytecode: compiling pynvml alone then
    costs 57-82 ms of CPU per pytest run, 6x its ``nvmlInit``.
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
        # The header of a timestamp-checked .pyc: magic, flags, source mtime and size.
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
        code = super().get_code(fullname)
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
"""Empty until looked for; then the directory, or ``_NO_CACHE``."""


def _cache_dir() -> str | None:
    """The cache directory, made if missing; None where Python writes bytecode, or none is to be had."""
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
        # Python's own bytecode, where there is some, wins.
        if cache is not None and not os.path.exists(importlib.util.cache_from_source(spec.origin)):
            spec.loader = _CachedBytecode(spec.name, spec.origin, cache)
    return spec


_importing: set[str] = set()
"""Modules ``import_cached`` is importing now: ``_PlainImports`` answers for them."""


def import_cached(name: str) -> ModuleType:
    """``import name`` through the bytecode cache, for a third-party module the plugin uses. Only this very
    import goes through the cache; elsewhere the module is imported the ordinary way."""
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

    pytest rewrites a ``pytest11`` plugin's asserts and caches the result only where it may write bytecode;
    elsewhere every run recompiled the ~10k lines a checked session imports. Our asserts only state
    invariants, so they need no rewritten messages.
    """

    @staticmethod
    def find_spec(name: str, path: Sequence[str] | None = None,
                  target: ModuleType | None = None) -> ModuleSpec | None:
        if not name.startswith(_PACKAGE + ".") and name not in _importing:
            return None
        return _cached_spec(PathFinder.find_spec(name, path, target))


if not any(type(f).__name__ == _PlainImports.__name__ for f in sys.meta_path):  # once, even if reimported
    sys.meta_path.insert(0, _PlainImports())
