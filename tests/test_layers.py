"""The package's layers, held: data flows one way (readings -> check -> verdict -> report), nothing imports a
layer above its own, and no import circle comes back (docs/architecture.md draws the layers).

Read from the source with ``ast``, so every import counts: the module-level ones, those inside a function
(a lazy import is still a dependency: it only moves the cost) and those under ``if TYPE_CHECKING:`` (a
type-only import still sends a reader of the one module to the other, and is how a circle hides).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "pytest_gpuclean"
ROOT = "pytest_gpuclean"

LAYERS: tuple[tuple[str, ...], ...] = (
    # (bottom first; the layers of one row are independent: neither may import the other)
    ("pytest_gpuclean._version", "pytest_gpuclean._imports"),  # the version; the package's import finder
    ("pytest_gpuclean._model",),  # the records, and the decisions over a test's record
    ("pytest_gpuclean._settings", "pytest_gpuclean.report"),  # the options; formatting (text, JSON, CI)
    ("pytest_gpuclean._reading",),  # what the machine says: /proc, psutil, NVML, simulated devices
    ("pytest_gpuclean._ownership", "pytest_gpuclean._locks"),  # whose a process is; the GPU locks
    ("pytest_gpuclean._check",),  # a check: observe -> decide -> act; the reaping; GPU health
    ("pytest_gpuclean._session",),  # the pytest integration below the hooks
    ("pytest_gpuclean.ray",),  # the Ray extension: a plugin of gpuclean's hooks, its commands
    ("pytest_gpuclean.hookspecs",),  # gpuclean's own hooks (the session's types in their annotations)
    ("pytest_gpuclean.plugin", "pytest_gpuclean._cli",
     "pytest_gpuclean.simulate"),  # the entry points: pytest's, the gpuclean command, the device simulator
    ("pytest_gpuclean.__main__", "pytest_gpuclean"),  # python -m pytest_gpuclean; the public names
)

DECISIONS = ("pytest_gpuclean._check.decisions", "pytest_gpuclean._check.gate",
             "pytest_gpuclean._check.reap_plan")
"""What a check decides, over plain data: they read nothing and signal nothing, so at run time they import
nothing of the package but the model, the formatting and one another (they may name the census's entries in
annotations); tests/test_checker_decisions.py tables them with hand-built records."""


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = (ROOT, *path.relative_to(PACKAGE).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _imports(name: str, path: Path, *, typing: bool = True) -> set[str]:
    """The package's modules that ``name`` imports, anywhere in its source (without ``typing``: but those
    under ``if TYPE_CHECKING:``, which name types only)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets: set[str] = set()
    tree = ast.parse(path.read_text(), str(path))
    hidden = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If) and not typing
              and ast.unparse(block.test) == "TYPE_CHECKING" for n in ast.walk(block)}
    for node in ast.walk(tree):
        if id(node) in hidden:
            continue
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            # ``from pkg import mod`` imports the module ``pkg.mod``; ``from mod import name``, ``mod``.
            targets.update(f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names)
    return {t for t in targets if t == ROOT or t.startswith(ROOT + ".")}


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _layer(module: str) -> tuple[int, str]:
    """(row, layer) of ``module``: the longest layer name of ``LAYERS`` that contains it."""
    best: tuple[int, str] | None = None
    for row, layers in enumerate(LAYERS):
        for layer in layers:
            inside = module == layer or module.startswith(layer + ".")
            if inside and (best is None or len(layer) > len(best[1])):
                best = (row, layer)
    assert best is not None, f"{module} is on no layer: place it in tests/test_layers.py's LAYERS"
    return best


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    """Each import that runs up a layer, or sideways into an independent one."""
    wrong = []
    for module, targets in sorted(graph.items()):
        row, layer = _layer(module)
        for target in sorted(targets):
            target_row, target_layer = _layer(target)
            if target_layer != layer and target_row >= row:
                wrong.append(f"{module} ({layer}) imports {target} ({target_layer}): "
                             + ("a higher layer" if target_row > row else "an independent layer"))
    return wrong


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected components of more than one module (or one that imports itself)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's; the package's import chains are short, recursion is fine
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or node in graph.get(node, ()):
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_every_module_is_on_a_layer() -> None:
    for module in MODULES:
        _layer(module)


def test_no_import_runs_up_a_layer() -> None:
    assert layer_violations(GRAPH) == []


def test_no_import_circle() -> None:
    assert circles(GRAPH) == []


def test_a_package_imports_none_of_its_modules() -> None:
    # Importing ``pytest_gpuclean._check`` must not load the check: a session that checks nothing imports a
    # handful of modules and no more (tests/test_cost.py).
    for name, path in MODULES.items():
        if path.name == "__init__.py" and name != ROOT:
            assert GRAPH[name] == set(), f"{name}/__init__.py imports {sorted(GRAPH[name])}"


def _runtime_reach(graph: dict[str, set[str]]) -> list[str]:
    allowed = ("pytest_gpuclean._model", "pytest_gpuclean.report", *DECISIONS)
    return [f"{module} imports {target}" for module in DECISIONS for target in sorted(graph[module])
            if not any(target == a or target.startswith(a + ".") for a in allowed)]


RUNTIME = {name: _imports(name, MODULES[name], typing=False) for name in DECISIONS}


def test_the_decisions_read_nothing() -> None:
    assert _runtime_reach(RUNTIME) == []


def test_the_contract_catches_what_it_is_for() -> None:
    # The checks above, on an invented import of each kind (beside what the package has): one from the reading
    # up into the pytest session, one sideways from the formatting into the options, a circle inside a layer,
    # and a decision that reads /proc.
    def added(module: str, target: str) -> dict[str, set[str]]:
        return {**GRAPH, module: GRAPH[module] | {target}}

    def new(graph: dict[str, set[str]]) -> set[str]:
        return set(layer_violations(graph)) - set(layer_violations(GRAPH))

    procfs, checker = "pytest_gpuclean._reading.procfs", "pytest_gpuclean._check.checker"
    assert new(added(procfs, "pytest_gpuclean._session.names")) == {
        f"{procfs} (pytest_gpuclean._reading) imports pytest_gpuclean._session.names "
        "(pytest_gpuclean._session): a higher layer"}
    assert new(added("pytest_gpuclean.report.terminal", "pytest_gpuclean._settings")) == {
        "pytest_gpuclean.report.terminal (pytest_gpuclean.report) imports pytest_gpuclean._settings "
        "(pytest_gpuclean._settings): an independent layer"}
    loop = circles(added(procfs, checker))
    assert any({checker, procfs} <= set(c) for c in loop)
    decisions = DECISIONS[0]
    assert _runtime_reach({**RUNTIME, decisions: RUNTIME[decisions] | {procfs}}) == [
        f"{decisions} imports {procfs}"]
    assert "pytest_gpuclean._ownership.census" in GRAPH[decisions]  # (an annotation's: not at run time)


def test_imports_are_read_where_they_hide() -> None:
    # A function-level import (the plugin loads the Ray extension only with --gpuclean-ray) ...
    assert "pytest_gpuclean.ray.hooks" in GRAPH["pytest_gpuclean.plugin"]
    # ... one under TYPE_CHECKING (the plugin names the records in annotations only) ...
    assert "pytest_gpuclean._model.records" in GRAPH["pytest_gpuclean.plugin"]
    # ... and ``from pkg import mod`` names the module, not its package.
    assert "pytest_gpuclean._reading.devices" in GRAPH["pytest_gpuclean._session.checked"]
