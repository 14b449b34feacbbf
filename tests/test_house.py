"""House rules checked on the package's sources and its tests'.

No module reads another module's underscore attributes: what one module
needs from another is public, so it can be found, documented and kept.
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "dflash_mlx"
TESTS = Path(__file__).resolve().parent


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def names_defined_in(tree: ast.AST) -> set:
    """Names this module gives a value: functions, classes, variables,
    attributes of ``self``/``cls``, and ``object.__setattr__(self, "_x", ...)``."""
    own = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            own.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            own.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and on_self(node):
            own.add(node.attr)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "__setattr__":
            if len(node.args) >= 2 and isinstance(node.args[1], ast.Constant):
                own.add(node.args[1].value)
    return own


def on_self(node: ast.Attribute) -> bool:
    return isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")


def foreign_private_reads(source: str) -> list:
    """(line, what) for each read of an underscore name this module does not define."""
    tree = ast.parse(source)
    own = names_defined_in(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            found += [(node.lineno, f"from {node.module} import {a.name}") for a in node.names if is_private(a.name)]
        elif isinstance(node, ast.Attribute) and is_private(node.attr) and not on_self(node):
            if node.attr not in own and isinstance(node.ctx, ast.Load):
                found.append((node.lineno, f"{ast.unparse(node.value)}.{node.attr}"))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr"):
            name = node.args[1] if len(node.args) > 1 else None
            if isinstance(name, ast.Constant) and isinstance(name.value, str) and is_private(name.value):
                if name.value not in own:
                    found.append((node.lineno, f"{node.func.id}(..., {name.value!r})"))
    return sorted(set(found))


@pytest.mark.parametrize("folder", [PACKAGE, TESTS], ids=["package", "tests"])
def test_no_module_reads_another_modules_underscore_attributes(folder):
    """Tests included: they check what the package offers, not its insides."""
    sources = sorted(folder.rglob("*.py"))
    assert len(sources) > 10  # the folder, not an empty glob
    violations = [
        f"{path.relative_to(folder.parent)}:{line}: {what}"
        for path in sources
        for line, what in foreign_private_reads(path.read_text())
    ]
    assert not violations, "reads of another module's private names:\n" + "\n".join(violations)


@pytest.mark.parametrize(
    "source, found",
    [
        ("import m\nm._helper()\n", [(2, "m._helper")]),
        ("from m import _helper\n", [(1, "from m import _helper")]),
        ("def f(draft):\n    return draft._target is None\n", [(2, "draft._target")]),
        ("def f(x):\n    return getattr(x, '_cache', None)\n", [(2, "getattr(..., '_cache')")]),
        ("def f(x):\n    return super()._setup(x)\n", [(2, "super()._setup")]),
    ],
)
def test_the_check_finds_foreign_private_reads(source, found):
    assert foreign_private_reads(source) == found


@pytest.mark.parametrize(
    "source",
    [
        "class A:\n    def __init__(self):\n        self._x = 1\n    def f(self, other):\n        return other._x\n",
        "_CACHE = {}\ndef f():\n    return _CACHE\n",
        "class A:\n    def f(self):\n        return self._y, type(self).__name__\n",
        "def _helper():\n    pass\nclass A:\n    run = staticmethod(_helper)\n",
        "from ._version import __version__\n",
    ],
)
def test_the_check_allows_a_modules_own_private_names(source):
    assert foreign_private_reads(source) == []


# ---------------------------------------------------------------------------
# Functions stay short enough to read in one screen.

MAX_FUNCTION_LINES = 80


def long_functions(source: str, limit: int = MAX_FUNCTION_LINES) -> list:
    """(name, lines) of every function or method longer than ``limit`` lines."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines = node.end_lineno - node.lineno + 1
            if lines > limit:
                found.append((node.name, lines))
    return found


def test_no_function_in_the_package_is_over_80_lines():
    offenders = {
        f"{path.relative_to(PACKAGE.parent)}: {name}": lines
        for path in sorted(PACKAGE.rglob("*.py"))
        for name, lines in long_functions(path.read_text())
    }
    assert not offenders, f"functions over {MAX_FUNCTION_LINES} lines: {offenders}"


def test_the_length_check_counts_lines():
    body = "\n".join(f"    x{i} = {i}" for i in range(80))
    assert long_functions(f"def f():\n{body}\n") == [("f", 81)]
    assert long_functions(f"def f():\n{body}\n", limit=81) == []
    assert long_functions("class A:\n    def g(self):\n" + "\n".join(f"        y{i} = 0" for i in range(3))) == []
