"""pytest's configuration file, found from a directory upward as pytest finds it, read for one key. The
``gpuclean`` command reads no ini file (a runner hook runs outside any project); it looks here only to say,
when it cannot open NVML, that the project's pytest runs on the simulated devices the file names.
"""

from __future__ import annotations

import configparser
from pathlib import Path
from typing import Any

__all__ = [
    "ini_value",
]

_FILES = (("pytest.ini", "pytest"), (".pytest.ini", "pytest"), ("pyproject.toml", ""), ("tox.ini", "pytest"),
          ("setup.cfg", "tool:pytest"))
"""pytest's candidates in each directory, in its order, with the section that makes one its file (a
``pytest.ini`` is, whatever it holds)."""


def ini_value(start: Path, key: str) -> tuple[Path, str] | None:
    """The file pytest would take for its configuration from ``start`` (the first candidate that is one,
    ``start`` first, then its parents) and the value it gives ``key``; None if there is no such file, or it
    does not set ``key``. Unreadable files are passed over, as if absent."""
    for folder in (start, *start.parents):
        for name, section in _FILES:
            path = folder / name
            if not path.is_file():
                continue
            try:
                found = _read(path, section, key)
            except (OSError, ValueError, configparser.Error):
                continue
            if found is not None:
                return (path, found[1]) if found[1] is not None else None
    return None


def _read(path: Path, section: str, key: str) -> tuple[bool, str | None] | None:
    """(it is pytest's file, the value of ``key`` there); None if the file is not pytest's."""
    if path.suffix == ".toml":
        import importlib

        try:
            tomllib: Any = importlib.import_module("tomllib")
        except ImportError:  # Python 3.10: tomli, pytest's own dependency there
            tomllib = importlib.import_module("tomli")
        with open(path, "rb") as f:
            tool = tomllib.load(f).get("tool", {}).get("pytest")
        if not isinstance(tool, dict):
            return None
        table = tool.get("ini_options", tool)  # (pytest 9 reads [tool.pytest] itself too)
        value = table.get(key) if isinstance(table, dict) else None
        return True, value if isinstance(value, str) else None
    parser = configparser.ConfigParser(interpolation=None)
    parser.read(path, encoding="utf-8")
    if not parser.has_section(section):
        return (True, None) if path.name in ("pytest.ini", ".pytest.ini") else None
    value = parser.get(section, key, fallback=None)
    return True, value.strip() if value is not None else None
