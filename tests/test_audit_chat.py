"""Audit of ``mlx-dflash chat`` against mlx_lm.chat's loop: each turn's text
is what mlx-lm's own loop answers on the same target (greedy, float32)."""

import contextlib
import io
import json
import re

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.generate import stream_generate
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.tokenizer_utils import load as load_tokenizer
from mlx_lm.utils import load, load_model
from tiny_chat import QWEN_CHAT, make_chat_draft, write_chat_tokenizer

from dflash_mlx import chat
from dflash_mlx.random_pair import seeded_init


@pytest.fixture(scope="module")
def templated_pair(tmp_path_factory):
    """(target dir, drafter dir): a seeded, untrained target with the Qwen-style chat template."""
    root = tmp_path_factory.mktemp("chat")
    path = root / "chat-target"
    vocab = write_chat_tokenizer(path, QWEN_CHAT)
    eos = load_tokenizer(path).convert_tokens_to_ids(QWEN_CHAT.eos)
    (path / "config.json").write_text(json.dumps(dict(QWEN_CHAT.target, vocab_size=vocab, eos_token_id=[eos])))
    model, _ = load_model(path, strict=False)
    seeded_init(model, 0, scale=1.0)
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())), metadata={"format": "mlx"})
    return path, make_chat_draft(root, path)


def ours(pair, lines, *flags):
    """The text of each generated turn of ``mlx-dflash chat`` fed ``lines``."""
    feed = iter(lines)

    def read(_prompt):
        line = next(feed, None)
        if line is None:
            raise EOFError
        return line

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        chat.main(["--model", str(pair[0]), "--draft-model", str(pair[1]), *flags], input_fn=read)
    text = out.getvalue().replace(chat.HELP + "\n", "")  # the banner, and 'h''s answer
    return re.split(r"\n\[[^\]]*tokens/cycle\]\n", text)[:-1]


def theirs(pair, lines, max_tokens, system=None):
    """mlx_lm.chat's loop (its commands q, r and h; every other line a query)."""
    model, tokenizer = load(str(pair[0]))
    cache, texts = make_prompt_cache(model), []
    for query in lines:
        if query == "q":
            break
        if query in ("r", "h"):
            cache = make_prompt_cache(model) if query == "r" else cache
            continue
        messages = ([{"role": "system", "content": system}] if system is not None else []) + [{"role": "user", "content": query}]
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        texts.append("".join(r.text for r in stream_generate(model, tokenizer, prompt, max_tokens=max_tokens, prompt_cache=cache)))
    return texts


def test_an_empty_system_prompt_is_templated_as_mlx_lm_templates_it(templated_pair):
    """--system-prompt "" is a system message to mlx-lm (``is not None``); it was dropped."""
    lines = ["hi", "more"]
    assert ours(templated_pair, lines, "-m", "12", "--system-prompt", "") == theirs(templated_pair, lines, 12, system="")


def test_only_the_bare_commands_are_commands(templated_pair):
    """mlx_lm.chat quits on "q" alone (" q" is a query) and answers "h" with help, not a turn."""
    lines = [" q", "h", "hi", "q"]
    assert ours(templated_pair, lines, "-m", "8") == theirs(templated_pair, lines, 8)


def test_a_strict_tools_bad_schema_is_named_as_the_tools_beside_a_good_response_format(templated_pair):
    """The 400 names the field at fault: a strict tool's broken schema is
    ``tools`` even when a (valid) ``response_format`` rides along."""
    from dflash_mlx.api.formats import request_format
    from dflash_mlx.api.harmony import text_format
    from dflash_mlx.errors import RequestError

    tokenizer = load_tokenizer(templated_pair[0])
    good = {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object"}}}
    broken = {"type": "function", "function": {"name": "f", "strict": True, "parameters": {"$ref": "#/nowhere"}}}
    with pytest.raises(RequestError) as e:
        request_format({"tools": [broken], "response_format": good}, tokenizer, text_format(tokenizer))
    assert e.value.param == "tools" and e.value.status == 400
    with pytest.raises(RequestError) as e:
        request_format({"tools": [dict(broken, function=dict(broken["function"], parameters={"type": "object"}))],
                        "response_format": {**good, "json_schema": {"name": "a", "schema": {"type": "strin"}}}}, tokenizer, text_format(tokenizer))
    assert e.value.param == "response_format"
