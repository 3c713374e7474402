"""The package's structure in figures, read from its source with ``ast`` (nothing is imported or run).

Modules, packages, lines, depth (folders below ``pytest_gpuclean/``), import arrows between the package's
modules (every import: at the top, in a function, under ``TYPE_CHECKING``), floors (the longest chain of
modules each importing the next), circles; depth (path components below the package: ``a/b/c.py`` is 3);
module names used twice; functions with 8 or more parameters, records with 8 or more fields;
names in ``__all__``; words of comment and docstring per line of code; pointers into docs/ and tests/;
and the path of a check's result: the modules that name ``CheckResult``, lowest floor first.

    python benchmarks/structure.py                      # this checkout
    python benchmarks/structure.py --tree 86ad68d       # a git revision (git archive)
    python benchmarks/structure.py --json out.json
"""

from __future__ import annotations

import argparse
import ast
import io
import json
import re
import subprocess
import sys
import tarfile
import tokenize
from collections import Counter
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
PACKAGE = "pytest_gpuclean"


_ROOT = [PACKAGE]


def sources(tree: str | None, path: str | None = None) -> dict[str, str]:
    """Module path (``pytest_gpuclean/x/y.py``) -> source, of the checkout, of a git revision, or of the
    package directory ``path`` (another project's, to compare)."""
    if path is not None:
        root = Path(path).resolve()
        _ROOT[0] = root.stem
        if root.is_file():
            return {root.name: root.read_text()}
        return {f"{root.name}/{p.relative_to(root)}": p.read_text() for p in sorted(root.rglob("*.py"))}
    if tree is None:
        return {str(p.relative_to(REPO)): p.read_text() for p in sorted((REPO / PACKAGE).rglob("*.py"))}
    data = subprocess.run(["git", "-C", str(REPO), "archive", tree, PACKAGE], check=True,
                          capture_output=True).stdout
    found: dict[str, str] = {}
    with tarfile.open(fileobj=io.BytesIO(data)) as archive:
        for member in archive.getmembers():
            if member.name.endswith(".py"):
                file = archive.extractfile(member)
                assert file is not None
                found[member.name] = file.read().decode()
    return dict(sorted(found.items()))


def module_name(path: str) -> str:
    name = path[:-3].replace("/", ".")
    return name[: -len(".__init__")] if name.endswith(".__init__") else name


def imports(name: str, tree: ast.AST, modules: set[str], is_package: bool) -> set[str]:
    """The package's modules that ``name`` imports (any import anywhere in it)."""
    found: set[str] = set()
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = name.split(".")
                parent = parts if is_package else parts[:-1]
                parent = parent[: len(parent) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name and target.startswith(_ROOT[0]):
                found.add(target)
    # An import of a.b.c also imports a and a.b (their __init__), which are faces: not drawn as arrows.
    return {t for t in found if not (t != name and modules_is_package(t, modules) and _empty_face(t))}


_FACES: set[str] = set()


def modules_is_package(name: str, modules: set[str]) -> bool:
    return any(m.startswith(name + ".") for m in modules)


def _empty_face(name: str) -> bool:
    return name in _FACES


def floors(graph: dict[str, set[str]]) -> tuple[dict[str, int], list[list[str]]]:
    """Each module's floor (1: imports nothing of the package) and the circles (strongly connected
    components of more than one module)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    circles: list[list[str]] = []
    counter = [0]
    sys.setrecursionlimit(10000)

    def connect(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in graph:
        if v not in index:
            connect(v)
    in_circle = {m for c in circles for m in c}
    floor: dict[str, int] = {}

    def height(v: str, seen: frozenset[str]) -> int:
        if v in floor:
            return floor[v]
        below = [height(w, seen | {v}) for w in graph[v]
                 if w not in seen and not (v in in_circle and w in in_circle)]
        floor[v] = 1 + max(below, default=0)
        return floor[v]

    for v in graph:
        height(v, frozenset())
    return floor, circles


def comment_words(source: str) -> tuple[int, int]:
    """(words in comments and docstrings, lines of code) of a module."""
    words = 0
    code_lines: set[int] = set()
    doc_lines: set[int] = set()
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if (body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                    and isinstance(body[0].value.value, str)):
                words += len(body[0].value.value.split())
                doc_lines.update(range(body[0].lineno, (body[0].end_lineno or body[0].lineno) + 1))
        # attribute docstrings: a bare string after an assignment
        if isinstance(node, (ast.Module, ast.ClassDef)):
            for first, second in zip(node.body, node.body[1:], strict=False):
                if (isinstance(first, (ast.Assign, ast.AnnAssign)) and isinstance(second, ast.Expr)
                        and isinstance(second.value, ast.Constant) and isinstance(second.value.value, str)):
                    words += len(second.value.value.split())
                    doc_lines.update(range(second.lineno, (second.end_lineno or second.lineno) + 1))
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            words += len(token.string.lstrip("#").split())
        elif token.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
                                tokenize.ENDMARKER) and token.start[0] not in doc_lines:
            code_lines.update(range(token.start[0], token.end[0] + 1))
    return words, len(code_lines - doc_lines)


def _functions(node: ast.AST, prefix: str) -> list[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    found: list[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]] = []
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found.append((f"{prefix}.{child.name}", child))
            found += _functions(child, f"{prefix}.{child.name}")
        elif isinstance(child, ast.ClassDef):
            found += _functions(child, f"{prefix}.{child.name}")
        else:
            found += _functions(child, prefix)
    return found


def measure(tree: str | None, path: str | None = None) -> dict[str, Any]:
    _FACES.clear()
    files = sources(tree, path)
    parsed = {module_name(p): (p, ast.parse(s), s) for p, s in files.items()}
    modules = set(parsed)
    for name, (path, node, _source) in parsed.items():
        defining = (ast.FunctionDef, ast.ClassDef, ast.Import, ast.ImportFrom)
        if path.endswith("__init__.py") and not any(isinstance(n, defining) for n in node.body):
            _FACES.add(name)
    graph = {name: imports(name, node, modules, path.endswith("__init__.py"))
             for name, (path, node, _s) in parsed.items()}
    floor, circles = floors(graph)
    up = [(a, b) for a, targets in graph.items() for b in targets if floor.get(b, 0) >= floor[a]
          and not any(a in c and b in c for c in circles)]
    lines = {name: len(s.splitlines()) for name, (_p, _n, s) in parsed.items()}
    packages = sorted(module_name(p) for p in files if p.endswith("__init__.py"))
    real = [m for m in modules if m not in _FACES]
    basenames = Counter(Path(parsed[m][0]).name for m in modules if not parsed[m][0].endswith("__init__.py"))
    long_params = []
    all_names = 0
    for name, (_path, node, _s) in parsed.items():
        for qualified, function in _functions(node, name):
            a = function.args
            count = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) + bool(a.vararg) + bool(a.kwarg)
            if a.args and a.args[0].arg in ("self", "cls"):
                count -= 1
            if count >= 8:
                long_params.append((qualified, count))
        for n in ast.walk(node):
            if (isinstance(n, ast.Assign) and isinstance(n.value, (ast.List, ast.Tuple))
                    and any(isinstance(t, ast.Name) and t.id == "__all__" for t in n.targets)):
                all_names += len(n.value.elts)
    wide_records = []
    for name, (_path, node, _s) in parsed.items():
        for n in ast.walk(node):
            if not isinstance(n, ast.ClassDef):
                continue
            slots = next((len(st.value.elts) for st in n.body if isinstance(st, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__slots__" for t in st.targets)
                and isinstance(st.value, (ast.Tuple, ast.List))), 0)
            record = any("dataclass" in ast.unparse(d) for d in n.decorator_list) or any(
                ast.unparse(b) in ("NamedTuple", "typing.NamedTuple") for b in n.bases)
            fields = sum(1 for st in n.body if isinstance(st, ast.AnnAssign)
                         and isinstance(st.target, ast.Name)
                         and "ClassVar" not in ast.unparse(st.annotation)) if record else slots
            if fields >= 8:
                wide_records.append((f"{name}.{n.name}", fields))
    words = code = 0
    for _name, (_p, _n, s) in parsed.items():
        w, c = comment_words(s)
        words += w
        code += c
    pointers = Counter()
    for _name, (_p, _n, s) in parsed.items():
        pointers["docs/"] += len(re.findall(r"docs/[\w./-]+", s))
        pointers["tests/"] += len(re.findall(r"tests/[\w./-]+", s))
    result_path = sorted((m for m, (_p, _n, s) in parsed.items() if re.search(r"\bCheckResult\b", s)),
                         key=lambda m: (floor[m], m))
    depth = max(p.count("/") for p in files) + (0 if _ROOT[0] == PACKAGE or "/" in next(iter(files)) else 1)
    return {
        "tree": tree or "WORKTREE",
        "modules": len(real),
        "modules_with_faces": len(modules),
        "packages": len(packages),
        "lines": sum(lines.values()),
        "max_depth": depth,
        "arrows": sum(len(t) for t in graph.values()),
        "floors": max(floor.values()),
        "circles": circles,
        "arrows_back_up": up,
        "largest_modules": sorted(((lines[m], m) for m in real), reverse=True)[:12],
        "modules_600_plus": sum(1 for m in real if lines[m] >= 600),
        "modules_550_599": sum(1 for m in real if 550 <= lines[m] < 600),
        "repeated_module_names": sorted(n for n, c in basenames.items() if c > 1),
        "named_like_package": sorted(m for m in real
                                     if "." in m and m.rsplit(".", 1)[1] == m.rsplit(".", 2)[-2]),
        "functions_8_plus_params": sorted(long_params, key=lambda x: -x[1]),
        "records_8_plus_fields": sorted(wide_records, key=lambda x: -x[1]),
        "all_names": all_names,
        "comment_words_per_code_line": round(words / max(code, 1), 2),
        "pointers": dict(pointers),
        "check_result_path": [(m, floor[m], lines[m]) for m in result_path],
        "package_list": packages,
        "module_list": sorted((m, lines[m], floor[m]) for m in real),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", help="a git revision (default: this checkout as it is)")
    parser.add_argument("--path", help="another package's directory (pluggy, xdist), for comparison")
    parser.add_argument("--json")
    parser.add_argument("--modules", action="store_true", help="list every module (lines, floor)")
    args = parser.parse_args()
    found = measure(args.tree, args.path)
    for key, value in found.items():
        if key in ("module_list",) and not args.modules:
            continue
        if isinstance(value, list) and value and isinstance(value[0], (list, tuple)):
            print(f"{key}:")
            for item in value:
                print("   ", " ".join(str(x) for x in item))
        else:
            print(f"{key}: {value}")
    if args.json:
        Path(args.json).write_text(json.dumps(found, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
