"""The import graph: one layer per folder, imports only point down, no package or module cycle.

Every ``import boosttune...`` in the source (at module level or inside a function, type-only ones
too) is an edge from the importing module's package to the imported one's. A package may import
its own modules and the packages of lower layers; packages of one layer never import each other.
A new package must be given a layer here, which is where the decision is made visible.

The same imports, module to module, must form no cycle either: a cycle hidden by a function-level
import still makes two modules that cannot be understood, tested or moved one without the other.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FOLDERS = {"boosttune": "boosttune", "serving": "boosttune.serving", "scheduler": "boosttune.scheduler",
           "data": "boosttune.data"}  # folder -> import name (pyproject)

LAYERS: list[tuple[str, ...]] = [
    ("boosttune.kernels", "boosttune.core", "boosttune.data"),  # tree attention; models, run dirs, files, prompts
    ("boosttune.serving",),  # the engine: trees, drafters, verification, caches; manifests and bundles
    ("boosttune.scheduler",),  # the learned scheduler at serve time: features, model, costs, policy
    ("boosttune",),  # config, assemble (the one engine assembly), bench
    # training the scheduler; the HTTP server; export (above boosttune: a bundle records its __version__)
    ("boosttune.scheduler.offline", "boosttune.http", "boosttune.export"),
    ("boosttune.train",),  # the boost-tuning pipeline (its last phase trains the scheduler)
    ("boosttune.cli",),  # the commands
]
LAYER = {package: i for i, packages in enumerate(LAYERS) for package in packages}
# The order inside the ``boosttune`` package's own layer: its top-level modules, lowest first.
BOOSTTUNE_MODULES: list[tuple[str, ...]] = [
    ("boosttune", "boosttune.config", "boosttune.llama_cpp", "boosttune.workload"),  # typed configs; the llama.cpp peer; request sets
    ("boosttune.report",),  # a run's summary (reads the run's config)
    ("boosttune.report_plot",),  # its figure
    ("boosttune.recost_cache",),  # the served forward's costs kept on disk, for assemble's recost
    ("boosttune.assemble",),  # the one engine assembly
    ("boosttune.bench",),  # benchmarks through assemble and the peers
]
# Packages that only group modules of their parent's layer (one phase of it): counted as the parent
# here, since they both use and serve its other modules; test_no_module_cycle still checks every module.
INNER = {"boosttune.train.teacher"}


def module_name(path: Path) -> str:
    rel = path.relative_to(REPO).with_suffix("")
    parts = [FOLDERS[rel.parts[0]], *rel.parts[1:]]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_of(module: str, packages: set[str]) -> str:
    """The deepest package that holds ``module`` (a package is its own)."""
    while module not in packages:
        module = module.rsplit(".", 1)[0]
    return module


def _source_files() -> list[Path]:
    return [p for folder in FOLDERS for p in (REPO / folder).rglob("*.py")]


def _imports() -> Iterator[tuple[str, ast.Import | ast.ImportFrom, str]]:
    """(importing module, import statement, where) for every import in the source."""
    for path in _source_files():
        module = module_name(path)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                assert node.level == 0, f"{path}: relative import; import boosttune... absolutely"
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                yield module, node, f"{path.relative_to(REPO)}:{node.lineno}"


def _ours(name: str) -> bool:
    return name == "boosttune" or name.startswith("boosttune.")


def import_edges() -> tuple[set[str], list[tuple[str, str, str]]]:
    """(packages, [(importing module, imported module, where)]) over the whole source."""
    packages = {module_name(p) for p in _source_files() if p.name == "__init__.py"} - INNER
    edges = []
    for module, node, where in _imports():
        if isinstance(node, ast.ImportFrom):
            names = [node.module] if node.module else []
            names += [f"{node.module}.{a.name}" for a in node.names]  # `from boosttune import assemble`
        else:
            names = [a.name for a in node.names]
        edges += [(module, name, where) for name in names if _ours(name)]
    return packages, edges


def module_edges() -> tuple[set[str], list[tuple[str, str, str]]]:
    """(modules, [(importing module, imported module, where)]): each import names the module it runs.

    ``from pkg import name`` is an edge to ``pkg.name`` where that is a module, else to ``pkg`` (its
    ``__init__``); ``import a.b`` is an edge to ``a.b``. A package's ``__init__`` that imports its own
    submodules is an edge down only, so it closes a cycle just when one of them imports it back.
    """
    modules = {module_name(p) for p in _source_files()}
    edges = []
    for module, node, where in _imports():
        if isinstance(node, ast.ImportFrom):
            if not (node.module and _ours(node.module)):
                continue
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                edges.append((module, sub if sub in modules else node.module, where))
        else:
            edges += [(module, a.name, where) for a in node.names if _ours(a.name)]
    return modules, [(a, b, where) for a, b, where in edges if a != b and b in modules]


def package_graph() -> dict[str, set[str]]:
    packages, edges = import_edges()
    graph: dict[str, set[str]] = {p: set() for p in packages}
    for src, dst, _ in edges:
        a, b = package_of(src, packages), package_of(dst, packages)
        if a != b:
            graph[a].add(b)
    return graph


def module_graph() -> dict[str, dict[str, str]]:
    """importing module -> {imported module: the first line that imports it}."""
    modules, edges = module_edges()
    graph: dict[str, dict[str, str]] = {m: {} for m in modules}
    for a, b, where in edges:
        graph[a].setdefault(b, where)
    return graph


def cycles_in(graph: dict[str, dict[str, str]]) -> list[list[tuple[str, str, str]]]:
    """One cycle, as its edges (importer, imported, where), per strongly connected set of modules."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components: list[list[str]] = []

    def connect(m: str) -> None:  # Tarjan's strongly connected components
        index[m] = low[m] = len(index)
        stack.append(m)
        for n in sorted(graph[m]):
            if n not in index:
                connect(n)
                low[m] = min(low[m], low[n])
            elif n in stack:
                low[m] = min(low[m], index[n])
        if low[m] == index[m]:
            component = []
            while not component or component[-1] != m:
                component.append(stack.pop())
            if len(component) > 1:
                components.append(sorted(component))

    for m in sorted(graph):
        if m not in index:
            connect(m)
    return [_cycle_through(graph, component) for component in components]


def _cycle_through(graph: dict[str, dict[str, str]], component: list[str]) -> list[tuple[str, str, str]]:
    """The shortest way from the component's first module back to itself (breadth first)."""
    start, inside = component[0], set(component)
    came_from: dict[str, str] = {}
    frontier = [start]
    while start not in came_from:  # a strongly connected component always has the way back
        reached = []
        for m in frontier:
            for n in sorted(graph[m]):
                if n in inside and n not in came_from:
                    came_from[n] = m
                    reached.append(n)
        frontier = reached
    path = [start]
    while len(path) == 1 or path[-1] != start:
        path.append(came_from[path[-1]])
    path.reverse()
    return [(a, b, graph[a][b]) for a, b in zip(path, path[1:], strict=False)]


def test_every_package_has_a_layer():
    packages, _ = import_edges()
    assert packages - set(LAYER) == set(), "give the new package a layer in LAYERS"
    assert set(LAYER) - packages == set(), "LAYERS names a package that does not exist"


def test_imports_only_point_down():
    packages, edges = import_edges()
    bad = []
    for src, dst, where in edges:
        a, b = package_of(src, packages), package_of(dst, packages)
        if a != b and LAYER[b] >= LAYER[a]:
            bad.append(f"{where}: {a} (layer {LAYER[a]}) imports {dst} ({b}, layer {LAYER[b]})")
    assert not bad, "imports that do not point to a lower layer:\n" + "\n".join(bad)


def test_no_package_cycle():
    graph = package_graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(p: str, path: list[str]) -> None:
        state[p] = 1
        for q in sorted(graph[p]):
            assert state.get(q) != 1, "package cycle: " + " -> ".join([*path, p, q])
            if q not in state:
                visit(q, [*path, p])
        state[p] = 2

    for p in sorted(graph):
        if p not in state:
            visit(p, [])


def test_serving_and_scheduler_never_import_training_or_the_cli():
    """The rule the layers exist for, spelled out: what serves a bundle does not need what trains one."""
    graph = package_graph()
    below = ("boosttune.serving", "boosttune.http", "boosttune.scheduler")
    for p in below:
        assert not graph[p] & {"boosttune.train", "boosttune.cli", "boosttune.scheduler.offline"}, p


def test_cycles_in_finds_a_package_that_its_module_imports_back():
    """The detector itself: an ``__init__`` importing its submodule is fine until the submodule imports it."""
    down = {"p": {"p.a": "p/__init__.py:1"}, "p.a": {"p.b": "p/a.py:1"}, "p.b": {}}
    assert cycles_in(down) == []
    back = {**down, "p.b": {"p": "p/b.py:3"}}
    assert cycles_in(back) == [[("p", "p.a", "p/__init__.py:1"), ("p.a", "p.b", "p/a.py:1"), ("p.b", "p", "p/b.py:3")]]


def test_no_module_cycle():
    cycles = cycles_in(module_graph())
    shown = ["\n".join(f"  {where}: {a} imports {b}" for a, b, where in cycle) for cycle in cycles]
    assert not cycles, "module cycles:\n" + "\n\n".join(shown)


def test_boosttune_modules_have_an_order_and_import_down():
    """Inside the ``boosttune`` layer too: every top-level module has a place, and imports point down."""
    modules, edges = module_edges()
    top = {m for m in modules if m == "boosttune" or (m.count(".") == 1 and m not in LAYER)}
    rank = {m: i for i, group in enumerate(BOOSTTUNE_MODULES) for m in group}
    assert top == set(rank), f"give each module of boosttune/ a place in BOOSTTUNE_MODULES: {sorted(top ^ set(rank))}"
    bad = [f"{where}: {a} imports {b}" for a, b, where in edges
           if a in rank and b in rank and a != "boosttune" and rank[b] >= rank[a] and b != "boosttune"]
    assert not bad, "imports inside the boosttune layer that do not point down:\n" + "\n".join(bad)
