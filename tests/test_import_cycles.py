"""The package's modules import each other without a circle.

Every import counts, those inside functions too: a circle that only closes
at call time still ties the modules' jobs together. Implicit imports of a
parent package (``dflash_mlx/__init__``) are not edges.
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "dflash_mlx"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(module: str, is_package: bool, node, modules) -> list:
    """The package's modules that ``node`` (an import statement in ``module``) loads."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = node.module or ""
    if node.level:
        anchor = module.split(".")[: len(module.split(".")) - (node.level - (1 if is_package else 0))]
        base = ".".join(anchor + ([node.module] if node.module else []))
    # `from pkg import name` loads pkg.name when that is a module, else pkg.
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]


def import_graph(sources: dict) -> dict:
    """{module: set of the package's modules it imports}, from ``{module: (source, is_package)}``."""
    graph = {}
    for module, (source, is_package) in sources.items():
        targets = set()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                targets.update(imported(module, is_package, node, sources))
        graph[module] = {t for t in targets if t in sources and t != module}
    return graph


def find_cycle(graph: dict):
    """One import circle as a list of modules (first repeated last), or None."""
    state = {}

    def visit(node, path):
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt, path + [nxt])
                if found:
                    return found
        state[node] = "done"
        return None

    for start in sorted(graph):
        if start not in state:
            found = visit(start, [start])
            if found:
                return found
    return None


def package_sources() -> dict:
    return {module_name(p): (p.read_text(), p.name == "__init__.py") for p in sorted(PACKAGE.rglob("*.py"))}


def test_the_package_has_no_import_cycle():
    sources = package_sources()
    graph = import_graph(sources)
    assert len(graph) > 20 and graph["dflash_mlx.convert"]  # the package, with its edges
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


@pytest.mark.parametrize(
    "sources, cycle",
    [
        # the circle the package had: cli -> pair -> convert -> cli (pair's import inside a function)
        (
            {
                "p.cli": ("from .pair import DEFAULT\n", False),
                "p.pair": ("def f():\n    from .convert import convert\n", False),
                "p.convert": ("from . import cli\n", False),
            },
            ["p.cli", "p.pair", "p.convert", "p.cli"],
        ),
        ({"p.a": ("import p.b\n", False), "p.b": ("from p import a\n", False), "p": ("", True)}, ["p.a", "p.b", "p.a"]),
        ({"p.t.x": ("from .. import y\n", False), "p.y": ("from .t import x\n", False), "p.t": ("", True)}, ["p.t.x", "p.y", "p.t.x"]),
        ({"p.a": ("from .b import f\n", False), "p.b": ("import os\n", False)}, None),
        ({"p.t": ("from . import x\n", True), "p.t.x": ("from . import helper\n", False)}, ["p.t", "p.t.x", "p.t"]),
    ],
)
def test_the_cycle_finder_sees_circles(sources, cycle):
    assert find_cycle(import_graph(sources)) == cycle
