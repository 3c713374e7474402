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
    # (session/hookspecs.py: beside the session modules that call them, below ray/ and plugin.py)
    ("pytest_gpuclean.ray",),  # the Ray extension: a plugin of gpuclean's hooks, a cluster read and reaped,
    # its CLI commands
    ("pytest_gpuclean.plugin", "pytest_gpuclean.cli",
     "pytest_gpuclean.simulate"),  # the entry points: pytest's, the gpuclean command, the device simulator
    ("pytest_gpuclean.__main__",),  # python -m pytest_gpuclean: the gpuclean command
)

STAGES: tuple[tuple[str, ...], ...] = (
    # Inside the core, a check's stages (bottom first; one row's stages independent, as in LAYERS). A
    # check observes (reading, ownership), decides (pure functions over what was read) and then acts.
    ("pytest_gpuclean.core.options",  # the settings and a device list's syntax
     "pytest_gpuclean.core.deciding"),  # decisions over plain data: no reading, no signal, no core import
    ("pytest_gpuclean.core.reading",),  # /proc, psutil, the GPUs (NVML or simulated), their health
    ("pytest_gpuclean.core.ownership",  # whose a process is: the cookie, ownership windows, the census
     "pytest_gpuclean.core.acting",  # signals, the reap ladder, pools: what changes the machine
     "pytest_gpuclean.core.locks"),  # cross-process GPU locks
    ("pytest_gpuclean.core.checking",),  # one check: observe -> decide -> act; what lasts between checks
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


def _layer(module: str, rows: tuple[tuple[str, ...], ...] = LAYERS) -> tuple[int, str]:
    """(row, layer) of ``module``: the longest layer name of ``rows`` that contains it."""
    best: tuple[int, str] | None = None
    for row, layers in enumerate(rows):
        for layer in layers:
            inside = module == layer or module.startswith(layer + ".")
            if inside and (best is None or len(layer) > len(best[1])):
                best = (row, layer)
    assert best is not None, f"{module} is on no layer: place it in tests/test_layers.py's {_name(rows)}"
    return best


def _name(rows: tuple[tuple[str, ...], ...]) -> str:
    return "LAYERS" if rows is LAYERS else "STAGES"


def _in_core(module: str) -> bool:
    return module.startswith("pytest_gpuclean.core.")


def layer_violations(graph: dict[str, set[str]],
                     rows: tuple[tuple[str, ...], ...] = LAYERS) -> list[str]:
    """Each import that runs up a layer (of ``rows``: the package's, or the core's stages), or sideways into
    an independent one."""
    wrong = []
    stages = rows is not LAYERS
    for module, targets in sorted(graph.items()):
        if stages and not _in_core(module):
            continue
        row, layer = _layer(module, rows)
        for target in sorted(targets):
            if stages and not _in_core(target):
                continue
            target_row, target_layer = _layer(target, rows)
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

    assert new(added("pytest_gpuclean.core.reading.procfs", "pytest_gpuclean.session.names")) == {
        "pytest_gpuclean.core.reading.procfs (pytest_gpuclean.core) imports pytest_gpuclean.session.names "
        "(pytest_gpuclean.session): a higher layer"}
    checker, procfs = "pytest_gpuclean.core.checking.checker", "pytest_gpuclean.core.reading.procfs"
    assert new(added("pytest_gpuclean.report.records", checker)) == {
        f"pytest_gpuclean.report.records (pytest_gpuclean.report) imports {checker} "
        "(pytest_gpuclean.core): an independent layer"}
    loop = circles(added(procfs, checker))
    assert any({checker, procfs} <= set(c) for c in loop)
    # And a floor too many: the protocols of a started session naming the checker itself again.
    assert longest_chain({"a": {"b", "d"}, "b": {"c"}, "c": set(), "d": set()}) == ["a", "b", "c"]
    taller = longest_chain(added("pytest_gpuclean.session.started", "pytest_gpuclean.core.checking.checker"))
    assert len(taller) > MAX_FLOORS
    started = taller.index("pytest_gpuclean.session.started")
    assert taller[started + 1] == "pytest_gpuclean.core.checking.checker", taller


def test_imports_are_read_where_they_hide() -> None:
    # A function-level import (the plugin loads the Ray checks only with --gpuclean-ray) ...
    assert "pytest_gpuclean.ray.checks" in GRAPH["pytest_gpuclean.plugin"]
    # ... one under TYPE_CHECKING (the plugin names the records in annotations only) ...
    assert "pytest_gpuclean.model.records" in GRAPH["pytest_gpuclean.plugin"]
    # ... and ``from pkg import mod`` names the module, not its package.
    assert "pytest_gpuclean.core.reading.devices" in GRAPH["pytest_gpuclean.session.session"]


def test_the_hook_specs_are_within_reach_of_who_calls_and_implements_them() -> None:
    # gpuclean's own hook specs: the session's modules call them (config.hook), the Ray extension implements
    # them, plugin.py adds them. Each may import the specs (for their names, their documentation) without
    # an import up a layer: they sit on the lowest layer of the three.
    specs = "pytest_gpuclean.session.hookspecs"
    assert specs in GRAPH["pytest_gpuclean.plugin"]
    row = _layer(specs)[0]
    for user in ("pytest_gpuclean.session.session", "pytest_gpuclean.session.testcheck",
                 "pytest_gpuclean.session.outputs", "pytest_gpuclean.ray.checks", "pytest_gpuclean.plugin"):
        assert _layer(user)[0] >= row, user
    users = ("pytest_gpuclean.session.testcheck", "pytest_gpuclean.session.outputs",
             "pytest_gpuclean.ray.checks")
    assert not layer_violations({**GRAPH, **{user: GRAPH[user] | {specs} for user in users}})


def test_every_core_module_is_in_a_stage() -> None:
    # The core's own package holds only the stages: a module straight under core/ is on no stage.
    for module in MODULES:
        if _in_core(module):
            _layer(module, STAGES)


def test_the_check_flows_one_way_through_the_stages() -> None:
    assert layer_violations(GRAPH, STAGES) == []
    # The decisions need no reading: they import nothing of the core but one another (``gpuclean reap``'s
    # planner asks the signal gate).
    core = [t for m in MODULES if m.startswith("pytest_gpuclean.core.deciding")
            for t in GRAPH[m] if _in_core(t) and not t.startswith("pytest_gpuclean.core.deciding")]
    assert core == []


def test_the_stages_catch_what_they_are_for() -> None:
    def new(module: str, target: str) -> set[str]:
        graph = {**GRAPH, module: GRAPH[module] | {target}}
        return set(layer_violations(graph, STAGES)) - set(layer_violations(GRAPH, STAGES))

    # Reading reaching up into the check; a decision reading /proc; acting and ownership beside each other.
    assert new("pytest_gpuclean.core.reading.procfs", "pytest_gpuclean.core.checking.checker") == {
        "pytest_gpuclean.core.reading.procfs (pytest_gpuclean.core.reading) imports "
        "pytest_gpuclean.core.checking.checker (pytest_gpuclean.core.checking): a higher layer"}
    assert new("pytest_gpuclean.core.deciding.decide", "pytest_gpuclean.core.reading.procfs") == {
        "pytest_gpuclean.core.deciding.decide (pytest_gpuclean.core.deciding) imports "
        "pytest_gpuclean.core.reading.procfs (pytest_gpuclean.core.reading): a higher layer"}
    assert len(new("pytest_gpuclean.core.acting.reaping", "pytest_gpuclean.core.ownership.census")) == 1
