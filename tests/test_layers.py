"""The import graph: one layer per folder, imports only point down, no package cycle.

Every ``import boosttune...`` in the source (at module level or inside a function, type-only ones
too) is an edge from the importing module's package to the imported one's. A package may import
its own modules and the packages of lower layers; packages of one layer never import each other.
A new package must be given a layer here, which is where the decision is made visible.
"""

from __future__ import annotations

import ast
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
    ("boosttune.scheduler.offline", "boosttune.serving.http", "boosttune.export"),
    ("boosttune.train",),  # the boost-tuning pipeline (its last phase trains the scheduler)
    ("boosttune.cli",),  # the commands
]
LAYER = {package: i for i, packages in enumerate(LAYERS) for package in packages}


def module_name(path: Path) -> str:
    rel = path.relative_to(REPO).with_suffix("")
    parts = [FOLDERS[rel.parts[0]], *rel.parts[1:]]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_of(module: str, packages: set[str]) -> str:
    """The deepest package that holds ``module`` (a package is its own)."""
    while module not in packages:
        module = module.rsplit(".", 1)[0]
    return module


def import_edges() -> tuple[set[str], list[tuple[str, str, str]]]:
    """(packages, [(importing module, imported module, where)]) over the whole source."""
    files = [p for folder in FOLDERS for p in (REPO / folder).rglob("*.py")]
    packages = {module_name(p) for p in files if p.name == "__init__.py"}
    edges = []
    for path in files:
        module = module_name(path)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                assert node.level == 0, f"{path}: relative import; import boosttune... absolutely"
                names = [node.module] if node.module else []
                names += [f"{node.module}.{a.name}" for a in node.names]  # `from boosttune import assemble`
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                if name == "boosttune" or name.startswith("boosttune."):
                    edges.append((module, name, f"{path.relative_to(REPO)}:{node.lineno}"))
    return packages, edges


def package_graph() -> dict[str, set[str]]:
    packages, edges = import_edges()
    graph: dict[str, set[str]] = {p: set() for p in packages}
    for src, dst, _ in edges:
        a, b = package_of(src, packages), package_of(dst, packages)
        if a != b:
            graph[a].add(b)
    return graph


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
    below = ("boosttune.serving", "boosttune.serving.http", "boosttune.scheduler")
    for p in below:
        assert not graph[p] & {"boosttune.train", "boosttune.cli", "boosttune.scheduler.offline"}, p
