"""docs/mlx-lm.md against mlx-lm itself: every keyword of its
``generate_step``, ``make_sampler`` and ``stream_generate``, every flag of its ``generate``,
``chat`` and ``server`` commands and every request field its server reads
is listed there, either with the name that takes it here (which must exist)
or with the reason it is not taken.

mlx-lm's lists are read from mlx-lm: signatures by ``inspect``, the
``generate`` and ``chat`` parsers from their ``setup_arg_parser``, the
server's parser by running the statements of its ``main`` that build it (up
to ``parse_args``), and the request fields from the source of its
``APIHandler`` (every ``body.get("...")``, ``body["..."]`` and ``"..." in body``).
"""

import ast
import importlib
import inspect
import re
import textwrap
from pathlib import Path

import pytest
from mlx_lm.sample_utils import make_sampler
from mlx_lm.server import APIHandler

from dflash_mlx import chat, server
from dflash_mlx.server import DFlashAPIHandler

DOC = Path(__file__).resolve().parent.parent / "docs" / "mlx-lm.md"
NOT_TAKEN = "—"

mlx_lm_generate = importlib.import_module("mlx_lm.generate")
mlx_lm_chat = importlib.import_module("mlx_lm.chat")
mlx_lm_server = importlib.import_module("mlx_lm.server")
dflash_generate = importlib.import_module("dflash_mlx.generate")


def doc_tables() -> dict:
    """{section heading: [(mlx-lm name, name here or None, notes)]} of the page's tables."""
    tables, heading = {}, None
    for line in DOC.read_text().splitlines():
        if line.startswith("## "):
            heading = line[3:].strip()
        elif heading and line.startswith("| `"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            theirs, ours, notes = cells[0].strip("`"), cells[1], cells[2] if len(cells) > 2 else ""
            tables.setdefault(heading, []).append((theirs, None if ours == NOT_TAKEN else ours.strip("`"), notes))
    return tables


def section(start: str) -> list:
    """The rows of the one table whose heading starts with ``start``."""
    (rows,) = [rows for heading, rows in doc_tables().items() if heading.startswith(start)]
    return rows


def mlx_lm_server_parser():
    """mlx_lm.server's parser, built by the statements of its ``main`` before ``parse_args``."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(mlx_lm_server.main)))
    main = tree.body[0]
    end = next(i for i, st in enumerate(main.body) if "parse_args" in ast.unparse(st))
    main.body = main.body[:end] + [ast.Return(ast.Name("parser", ast.Load()))]
    namespace = dict(vars(mlx_lm_server))
    exec(compile(ast.fix_missing_locations(tree), mlx_lm_server.__file__, "exec"), namespace)
    return namespace["main"]()


def read_by_body(source: str) -> set:
    """The string keys a source reads from a request body (``body`` or ``self.body``)."""

    def is_body(node):
        return (isinstance(node, ast.Name) and node.id == "body") or (isinstance(node, ast.Attribute) and node.attr == "body")

    def text(node):
        return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None

    found = set()
    for node in ast.walk(ast.parse(textwrap.dedent(source))):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" \
                and is_body(node.func.value) and node.args:
            found.add(text(node.args[0]))
        elif isinstance(node, ast.Subscript) and is_body(node.value):
            found.add(text(node.slice))
        elif isinstance(node, ast.Compare) and isinstance(node.ops[0], (ast.In, ast.NotIn)) and is_body(node.comparators[0]):
            found.add(text(node.left))
    return found - {None}


def flags(parser) -> set:
    """A parser's long flags, as its usage line names them."""
    return set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", parser.format_usage())) - {"--help"}


def string_constants(obj) -> set:
    return {n.value for n in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(obj))))
            if isinstance(n, ast.Constant) and isinstance(n.value, str)}


def resolve(dotted: str):
    """The object a dotted name names (a module's function, a class's method)."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for part in parts[i:]:
            obj = getattr(obj, part)
        return obj
    raise ImportError(dotted)


def field_is_read(field: str, where: str) -> bool:
    """Whether the function ``where`` reads ``field``: ours, or mlx-lm's
    handler method that our handler inherits."""
    function = resolve(where)
    if where.startswith("mlx_lm."):
        owner = resolve(where.rsplit(".", 1)[0])
        if not (isinstance(owner, type) and issubclass(DFlashAPIHandler, owner)):
            return False
    return field in string_constants(function)


# Each surface: (heading, mlx-lm's items, whether an item of ours exists)
SURFACES = {
    "generate_step": ("Library: `generate_step`", lambda: set(inspect.signature(mlx_lm_generate.generate_step).parameters),
                      lambda name: name in inspect.signature(dflash_generate.generate_step).parameters),
    "make_sampler": ("Library: `make_sampler`", lambda: set(inspect.signature(make_sampler).parameters),
                     lambda name: name in inspect.signature(dflash_generate.generate_step).parameters),
    "stream_generate": ("Library: `stream_generate`", lambda: set(inspect.signature(mlx_lm_generate.stream_generate).parameters),
                        lambda name: name in inspect.signature(dflash_generate.stream_generate).parameters),
    "generate": ("`mlx-dflash generate`", lambda: flags(mlx_lm_generate.setup_arg_parser()),
                 lambda name: name in flags(dflash_generate.setup_arg_parser())),
    "chat": ("`mlx-dflash chat`", lambda: flags(mlx_lm_chat.setup_arg_parser()),
             lambda name: name in flags(chat.setup_arg_parser())),
    "server": ("`mlx-dflash server`", lambda: flags(mlx_lm_server_parser()),
               lambda name: name in flags(server.setup_arg_parser())),
}


@pytest.mark.parametrize("surface", SURFACES)
def test_every_mlx_lm_control_is_taken_or_has_its_reason(surface):
    heading, theirs, exists = SURFACES[surface]
    rows = section(heading)
    listed = [r[0] for r in rows]
    assert sorted(listed) == sorted(set(listed)), f"{heading}: listed twice"
    assert set(listed) == theirs(), f"{heading}: not listed {theirs() - set(listed)}, not mlx-lm's {set(listed) - theirs()}"
    missing = [f"{t} -> {o}" for t, o, _ in rows if o is not None and not exists(o)]
    assert not missing, f"{heading}: named here but not here: {missing}"
    assert all(notes for _, o, notes in rows if o is None), f"{heading}: a row without a name here needs its reason"


def test_every_request_field_of_mlx_lms_server_is_read_or_has_its_reason():
    theirs = read_by_body(inspect.getsource(APIHandler))
    rows = section("Server request fields")
    listed = [r[0] for r in rows]
    assert sorted(listed) == sorted(set(listed))
    assert set(listed) == theirs, f"not listed {theirs - set(listed)}, not mlx-lm's {set(listed) - theirs}"
    unread = [f"{t} -> {o}" for t, o, _ in rows if o is not None and not field_is_read(t, o)]
    assert not unread, f"named here but not read there: {unread}"
    assert all(notes for _, o, notes in rows if o is None)


def test_the_readers_find_what_they_look_for():
    """The extraction itself: known fields and flags are found, a stranger is not."""
    source = 'def f(self, body):\n    a = self.body.get("x", 1)\n    b = body["y"]\n    if "z" in body: pass\n    c = other.get("w")\n'
    assert read_by_body(source) == {"x", "y", "z"}
    assert {"messages", "logit_bias", "stream_options", "repetition_context_size"} <= read_by_body(inspect.getsource(APIHandler))
    assert {"--kv-bits", "--num-draft-tokens", "--chat-template-args"} <= flags(mlx_lm_server_parser())
    assert len(flags(mlx_lm_server_parser())) == 26 and "--help" not in flags(chat.setup_arg_parser())
    assert field_is_read("logit_bias", "dflash_mlx.server.logit_bias")
    assert not field_is_read("logit_bias", "dflash_mlx.server.chat_tokens")
    assert field_is_read("stream_options", "mlx_lm.server.APIHandler.do_POST")
    assert not field_is_read("stream_options", "mlx_lm.server.ResponseGenerator.generate")  # not our handler's
    assert re.search(r"\| `--kv-bits` \| `--kv-bits` \|", DOC.read_text())
