"""docs/architecture.md stays true to the code: every module, package, file and class it names exists."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "pytest_gpuclean"
PAGE = ROOT / "docs" / "architecture.md"

_SOURCES = {p: p.read_text() for p in PACKAGE.rglob("*.py")}
_BY_NAME: dict[str, list[Path]] = {}
for _path in _SOURCES:
    _BY_NAME.setdefault(_path.stem if _path.stem != "__init__" else _path.parent.name, []).append(_path)
_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _names(source: str) -> set[str]:
    """Every name ``source`` defines or imports, at any depth."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
    return names


_NAMES = {p: _names(s) for p, s in _SOURCES.items()}


def _defines(path: Path, name: str) -> bool:
    return name in _NAMES[path]


def _path_exists(text: str) -> bool:
    """A file or folder the page names: from the repository's root, the package's, or (a bare module name)
    anywhere in the package."""
    if (ROOT / text).exists() or (PACKAGE / text).exists():
        return True
    return "/" not in text and any(p.name == text for p in PACKAGE.rglob("*"))


def _dotted_exists(text: str) -> bool:
    """``pytest_gpuclean.a.b`` (a module, or a module's name), ``module.name`` or ``Class.name``."""
    parts = text.split(".")
    if parts[0] == "pytest_gpuclean":
        for cut in range(len(parts), 0, -1):
            base = PACKAGE.joinpath(*parts[1:cut])
            for path in (base.with_suffix(".py"), base / "__init__.py"):
                if path.is_file():
                    return all(_defines(path, name) for name in parts[cut:cut + 1])
        return False
    head, _, attr = text.partition(".")
    homes = [p for p in _SOURCES if p.stem == head] or [p for p in _SOURCES if _defines(p, head)]
    return bool(homes) and any(_defines(p, attr) for p in homes)


def _span_exists(span: str) -> bool:
    span = span.split("(")[0].strip()
    if re.fullmatch(r"[\w./-]+\.(py|json)|[\w/]+/", span):
        return _path_exists(span)
    if re.fullmatch(r"(?:[A-Za-z_]\w*\.)+[A-Za-z_]\w*", span) and not span.startswith(("config.", "item.")):
        return _dotted_exists(span)
    if re.fullmatch(r"[A-Z][a-z]\w*[A-Z]\w*", span):
        return any(_defines(p, span) for p in _SOURCES)
    return True  # (not a name of the code: an option, a command line, a value)


def missing(page: str) -> list[str]:
    """What ``page`` names that the code lacks: each code span that is a path (``x.py``, ``room/``), a
    dotted name, or a class name (capitalised); and each module of the drawing's rooms."""
    gone = [span for span in re.findall(r"`([^`\n]+)`", page) if not _span_exists(span)]
    for block in re.findall(r"```\n(.*?)```", page, re.DOTALL):
        for line in block.splitlines():
            for word in _WORD.findall(line.split("(")[0][17:]):
                if word not in _BY_NAME and not (PACKAGE / f"{word}.py").is_file():
                    gone.append(word)
    return gone


def test_every_module_the_architecture_page_names_exists() -> None:
    assert missing(PAGE.read_text()) == []


def test_every_room_of_the_package_is_on_the_page() -> None:
    page = PAGE.read_text()
    rooms = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file())
    assert [r for r in rooms if f"`{r}/`" not in page] == []


def test_the_check_bites() -> None:
    page = ("`_check/checker.py` `_check/verdict.py` `ghost/` `pytest_gpuclean._model.records.CheckResult` "
            "`pytest_gpuclean._model.records.Nothing` `decisions.sort_census` `decisions.sort_it` "
            "`TestGuard` `ItemChecks` `report_schema.json`\n```\n entry points      plugin   _gone\n```\n")
    assert missing(page) == ["_check/verdict.py", "ghost/", "pytest_gpuclean._model.records.Nothing",
                             "decisions.sort_it", "ItemChecks", "_gone"]
