"""The package's layers, held: data flows one way (readings -> snapshot -> verdict -> report), no import
circle comes back, and no import chain grows past six modules (docs/architecture.md draws them).

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
    ("pytest_gpuclean",),  # the version, nothing else
    ("pytest_gpuclean.model",),  # the records (one module), the decisions over them, text
    ("pytest_gpuclean.core", "pytest_gpuclean.report"),  # reading and checking; formatting and shipping
    ("pytest_gpuclean.session",),  # the pytest integration below the hooks, and gpuclean's own hook specs
    ("pytest_gpuclean.ray",),  # the Ray extension: a plugin of gpuclean's hooks, a cluster read and reaped,
    # its CLI commands
    ("pytest_gpuclean.plugin", "pytest_gpuclean.cli",
     "pytest_gpuclean.simulate"),  # the entry points: pytest's, the gpuclean command, the device simulator
    ("pytest_gpuclean.__main__",),  # python -m pytest_gpuclean: the gpuclean command
)

CHECK_FLOW: tuple[tuple[str, ...], ...] = (
    # Inside the core, the check's own order (bottom first; one row's modules independent, as in LAYERS):
    ("pytest_gpuclean.core.decide",),  # the decisions over plain data: no reading, no signal
    ("pytest_gpuclean.core.census", "pytest_gpuclean.core.reaping"),  # the processes read; the reap ladder
    ("pytest_gpuclean.core.checker",),  # one check: readings -> decisions -> reaping -> verdict
)


MAX_FLOORS = 6
"""The package's floors: modules on its longest import chain (each imports the next), at most this many. A
chain longer than the layers need is a module reaching over the ones beside it for a type or a helper
(move the helper down, or name what it needs as a protocol); the layers above stay cheap to read."""


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = (ROOT, *path.relative_to(PACKAGE).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """The package's modules that ``name`` imports, anywhere in its source."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
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
    """(row, layer) of ``module``: the longest layer name that contains it."""
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


def longest_chain(graph: dict[str, set[str]]) -> list[str]:
    """The longest import chain: modules, each importing the next (the first of the longest, by name)."""
    longest: dict[str, tuple[str, ...]] = {}
    none: tuple[str, ...] = ()

    def chain_from(module: str, path: frozenset[str]) -> tuple[str, ...]:
        if module in path:
            return none  # a circle: test_no_import_circle names it
        if module not in longest:
            below = [chain_from(target, path | {module}) for target in sorted(graph.get(module, ()))]
            longest[module] = (module, *max(below, key=len, default=none))
        return longest[module]

    chains = [chain_from(module, frozenset()) for module in sorted(graph)]
    tallest = max(chains, key=len, default=none)
    return list(tallest)


def test_every_module_is_on_a_layer() -> None:
    for module in MODULES:
        _layer(module)


def test_no_import_runs_up_a_layer() -> None:
    assert layer_violations(GRAPH) == []


def test_no_import_circle() -> None:
    assert circles(GRAPH) == []


def test_the_longest_import_chain_has_at_most_six_floors() -> None:
    chain = longest_chain(GRAPH)
    assert len(chain) <= MAX_FLOORS, f"{len(chain)} floors (at most {MAX_FLOORS}): {' -> '.join(chain)}"


def test_a_layer_package_imports_none_of_its_modules() -> None:
    # Importing ``pytest_gpuclean.core`` must not load the core: a session that checks nothing imports
    # three of its modules and no more (tests/test_cost.py).
    for row in LAYERS:
        for layer in row:
            if MODULES[layer].name == "__init__.py":
                assert GRAPH[layer] == set(), f"{layer}/__init__.py imports {sorted(GRAPH[layer])}"


def test_the_contract_catches_what_it_is_for() -> None:
    # The checks above, on an invented import of each kind (beside what the package has): one from the core
    # up into the pytest session, one sideways from the report into the core, a circle inside one layer.
    def added(module: str, target: str) -> dict[str, set[str]]:
        return {**GRAPH, module: GRAPH[module] | {target}}

    def new(graph: dict[str, set[str]]) -> set[str]:
        return set(layer_violations(graph)) - set(layer_violations(GRAPH))

    assert new(added("pytest_gpuclean.core.procfs", "pytest_gpuclean.session.names")) == {
        "pytest_gpuclean.core.procfs (pytest_gpuclean.core) imports pytest_gpuclean.session.names "
        "(pytest_gpuclean.session): a higher layer"}
    assert new(added("pytest_gpuclean.report.records", "pytest_gpuclean.core.checker")) == {
        "pytest_gpuclean.report.records (pytest_gpuclean.report) imports pytest_gpuclean.core.checker "
        "(pytest_gpuclean.core): an independent layer"}
    loop = circles(added("pytest_gpuclean.core.procfs", "pytest_gpuclean.core.checker"))
    assert any({"pytest_gpuclean.core.checker", "pytest_gpuclean.core.procfs"} <= set(c) for c in loop)
    # And a floor too many: the protocols of a started session naming the checker itself again.
    assert longest_chain({"a": {"b", "d"}, "b": {"c"}, "c": set(), "d": set()}) == ["a", "b", "c"]
    taller = longest_chain(added("pytest_gpuclean.session.started", "pytest_gpuclean.core.checker"))
    assert len(taller) > MAX_FLOORS
    started = taller.index("pytest_gpuclean.session.started")
    assert taller[started + 1] == "pytest_gpuclean.core.checker", taller


def test_imports_are_read_where_they_hide() -> None:
    # A function-level import (the plugin loads the Ray checks only with --gpuclean-ray) ...
    assert "pytest_gpuclean.ray.checks" in GRAPH["pytest_gpuclean.plugin"]
    # ... one under TYPE_CHECKING (the plugin names the records in annotations only) ...
    assert "pytest_gpuclean.model.records" in GRAPH["pytest_gpuclean.plugin"]
    # ... and ``from pkg import mod`` names the module, not its package.
    assert "pytest_gpuclean.core.devices" in GRAPH["pytest_gpuclean.session.session"]


def test_the_check_flows_one_way() -> None:
    row_of = {module: row for row, modules in enumerate(CHECK_FLOW) for module in modules}
    wrong = [f"{module} imports {target}" for module, row in row_of.items()
             for target in sorted(GRAPH[module]) if row_of.get(target, -1) >= row and target != module]
    assert wrong == []
    # The decisions need no reading: they import nothing of the core.
    core = [t for t in GRAPH["pytest_gpuclean.core.decide"] if t.startswith("pytest_gpuclean.core.")]
    assert core == []
