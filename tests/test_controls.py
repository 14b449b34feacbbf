"""mlx-lm's controls over the output: the values each takes, the processors
built as mlx-lm builds them, the command flags that spell them as mlx-lm
does, the chat template's variables and prefilled answers, LoRA adapters."""

import argparse
import importlib
import json

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm import load
from mlx_lm.sample_utils import make_logits_processors
from mlx_lm.tuner.utils import linear_to_lora_layers

import dflash_mlx
from dflash_mlx import chat, cli, controls
from dflash_mlx.errors import ArgumentError
from dflash_mlx.pair import load_pair
from dflash_mlx.server import request_controls
from dflash_mlx.targets import kv
from tiny import reference_tokens

mlx_lm_generate = importlib.import_module("mlx_lm.generate")


def test_kv_bits_and_group_sizes_are_what_mlx_quantizes():
    x = mx.random.normal((2, 128))
    for bits in kv.KV_BITS:
        for group in kv.KV_GROUP_SIZES:
            mx.quantize(x, group_size=group, bits=bits)
    for bits, group in ((7, 64), (16, 64), (4, 16)):
        with pytest.raises(ValueError):
            mx.quantize(x, group_size=group, bits=bits)
        with pytest.raises(ArgumentError, match="kv_bits" if bits != 4 else "kv_group_size"):
            controls.check_kv_cache(kv_bits=bits, kv_group_size=group)


@pytest.mark.parametrize("bad, says", [
    (dict(kv_bits=7), "kv_bits must be one of"),
    (dict(kv_group_size=48), "kv_group_size"),
    (dict(quantized_kv_start=-1), "quantized_kv_start"),
    (dict(max_kv_size=0), "max_kv_size"),
    (dict(kv_bits=4, max_kv_size=64), "kv_bits and max_kv_size cannot be used together"),
    (dict(xtc_probability=1.5), "xtc_probability"),
    (dict(xtc_threshold=0.6), r"xtc_threshold must be a finite number in \[0.0, 0.5\]"),
    (dict(min_tokens_to_keep=0), "min_tokens_to_keep"),
    (dict(xtc_special_tokens=[3, 99], vocab_size=50), "outside the vocabulary"),
    (dict(logits_processors=[1]), "callables"),
])
def test_check_controls_refuses_each_bad_value(bad, says):
    with pytest.raises(ArgumentError, match=says):
        controls.check_controls(**bad)
    controls.check_controls(vocab_size=50)  # mlx-lm's defaults pass


PENALTIES = [
    dict(repetition_penalty=1.3, repetition_context_size=5),
    dict(presence_penalty=0.7, presence_context_size=3),
    dict(frequency_penalty=-0.4, frequency_context_size=8),
    dict(logit_bias={3: 2.5, 7: -1.0}),
    dict(logit_bias={1: 4.0}, repetition_penalty=1.1, presence_penalty=0.2, frequency_penalty=0.3),
]


@pytest.mark.parametrize("kw", PENALTIES)
def test_penalty_processors_are_mlx_lms(kw):
    tokens = mx.array([1, 3, 3, 5, 7, 3, 2])
    logits = mx.random.normal((1, 12), key=mx.random.key(0))
    (ours,), theirs = controls.penalty_processors(12, **kw), make_logits_processors(**kw)
    before = logits.tolist()  # (mlx-lm's processors may write into the array they get)
    a, b = ours(tokens, logits), mx.array(before)
    for q in theirs:
        b = q(tokens, b)
    assert mx.array_equal(a, b) and a.tolist() != before


@pytest.mark.parametrize("bad, says", [
    (dict(repetition_context_size=-1), "repetition_context_size must be a positive integer"),
    (dict(presence_context_size=0), "presence_context_size"),
    (dict(frequency_context_size=-1), "frequency_context_size"),
    (dict(repetition_penalty=-0.5), r"repetition_penalty must be a finite number in \[0.0"),
    (dict(logit_bias={12: 1.0}), "token id 12 is outside the vocabulary"),
    (dict(logit_bias={-1: 1.0}), "not a non-negative integer"),
    (dict(logit_bias={2: float("nan")}), "finite"),
    (dict(presence_penalty=float("inf")), "finite"),
])
def test_penalty_processors_refuse_bad_values(bad, says):
    with pytest.raises(ArgumentError, match=says):
        controls.penalty_processors(12, **bad)


def test_control_keywords_hold_only_what_changes_something(qwen3_pair):
    tok = qwen3_pair.tokenizer
    assert controls.control_keywords(tok) == {}
    processors = make_logits_processors(repetition_penalty=1.2)
    got = controls.control_keywords(tok, processors, xtc_probability=0.5, xtc_threshold=0.2, kv_bits=4)
    assert got == dict(
        logits_processors=processors, xtc_probability=0.5, xtc_threshold=0.2,
        xtc_special_tokens=tok.encode("\n") + list(tok.eos_token_ids),  # as mlx_lm.generate and its server choose them
        kv_bits=4, kv_group_size=64, quantized_kv_start=5000,
    )
    assert controls.control_keywords(tok, max_kv_size=64) == {"max_kv_size": 64}
    assert controls.kv_keywords(got) == dict(kv_bits=4, kv_group_size=64, quantized_kv_start=5000)


def a_parser():
    p = cli.ArgumentParser(prog="x")
    for add in (cli.add_xtc_arguments, cli.add_kv_cache_arguments, cli.add_load_arguments, cli.add_template_arguments,
                cli.add_prompt_arguments):
        add(p)
    return p


# Each helper flag with values mlx_lm.generate's parser takes.
SAMPLES = {
    "--xtc-probability": ["0.25"], "--xtc-threshold": ["0.2"], "--min-tokens-to-keep": ["3"], "--kv-bits": ["4"],
    "--kv-group-size": ["32"], "--quantized-kv-start": ["0"], "--max-kv-size": ["256"], "--adapter-path": ["a"],
    "--trust-remote-code": [], "--extra-eos-token": ["<a>", "<b>"], "--prefill-response": ["Sure"],
    "--prompt-cache-file": ["c.safetensors"], "--use-default-chat-template": [],
}


@pytest.mark.parametrize("flag", SAMPLES)
def test_flags_mirror_mlx_lm_generates_names_types_and_defaults(flag):
    ours, theirs = a_parser(), mlx_lm_generate.setup_arg_parser()
    dest = flag[2:].replace("-", "_")
    assert ours.get_default(dest) == theirs.get_default(dest)
    got, want = ours.parse_args([flag, *SAMPLES[flag]]), theirs.parse_args([flag, *SAMPLES[flag]])
    assert getattr(got, dest) == getattr(want, dest) and type(getattr(got, dest)) is type(getattr(want, dest))


def test_chat_template_config_is_mlx_lms_json_parsed():
    """mlx_lm.generate keeps the text and parses it later; here the parser gives the object (or one error line)."""
    text = '{"enable_thinking": false}'
    assert a_parser().parse_args(["--chat-template-config", text]).chat_template_config == json.loads(
        mlx_lm_generate.setup_arg_parser().parse_args(["--chat-template-config", text]).chat_template_config)


@pytest.mark.parametrize("flag, value, says", [
    ("--kv-bits", "7", "kv_bits must be one of"),
    ("--kv-bits", "four", "expected an integer"),
    ("--kv-group-size", "48", "kv_group_size"),
    ("--quantized-kv-start", "-1", "at least 0"),
    ("--max-kv-size", "0", "at least 5"),
    ("--xtc-probability", "2", "xtc_probability"),
    ("--xtc-threshold", "0.9", "xtc_threshold"),
    ("--min-tokens-to-keep", "0", "min_tokens_to_keep"),
    ("--chat-template-config", "{not json", "not JSON"),
    ("--chat-template-config", "[1, 2]", "must be a JSON object"),
])
def test_bad_flag_values_are_one_error_line(capsys, flag, value, says):
    with pytest.raises(SystemExit) as stop:
        a_parser().parse_args([flag, value])
    err = capsys.readouterr().err
    assert stop.value.code == 1 and err.startswith(f"error: argument {flag}:") and says in err and err.count("\n") == 1


def test_generation_keywords_from_flags(qwen3_pair):
    tok = qwen3_pair.tokenizer
    assert cli.generation_keywords(a_parser().parse_args([]), tok) == {}
    args = a_parser().parse_args(["--kv-bits", "8", "--quantized-kv-start", "0", "--xtc-probability", "0.3", "--min-tokens-to-keep", "2"])
    assert cli.generation_keywords(args, tok) == dict(
        kv_bits=8, kv_group_size=64, quantized_kv_start=0, xtc_probability=0.3, xtc_threshold=0.1,
        xtc_special_tokens=controls.xtc_special_tokens(tok), min_tokens_to_keep=2,
    )
    assert cli.generation_keywords(argparse.Namespace(max_kv_size=32), tok) == {"max_kv_size": 32}  # a command's own subset


TEMPLATE = ("{{ greeting }}|{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


def test_template_config_reaches_the_template_and_prefill_continues_the_answer(qwen3_pair):
    tok = qwen3_pair.tokenizer
    saved, tok.chat_template = tok.chat_template, TEMPLATE
    try:
        config = cli.template_config('{"greeting": "hola"}')
        got = tok.decode(controls.template_prompt(tok, "hi", "be brief", config))
        assert got == "hola|<system>be brief<user>hi<assistant>"
        # mlx_lm.generate's rule: the prefill is the assistant's message, continued
        got = tok.decode(controls.template_prompt(tok, "hi", None, config, prefill_response="Sure"))
        assert got == "hola|<user>hi<assistant>Sure"
        assert tok.decode(chat.turn_prompt(tok, "hi", None, {"greeting": "hey"})) == "hey|<user>hi<assistant>"
    finally:
        tok.chat_template = saved


def test_extra_eos_tokens(qwen3_pair):
    tok = qwen3_pair.tokenizer
    before = set(tok.eos_token_ids)
    try:
        controls.add_extra_eos_tokens(tok, ["7"])
        assert tok.eos_token_ids == before | {7}
    finally:
        tok.eos_token_ids = before


def test_request_controls_build_mlx_lms_processors(qwen3_pair):
    tok = qwen3_pair.tokenizer
    body = {"logit_bias": {"3": 2, "9": -1.5}, "repetition_penalty": 1.2, "repetition_context_size": 4,
            "presence_penalty": 0.5, "frequency_penalty": 0.25, "xtc_probability": 0.5, "xtc_threshold": 0.2}
    got = request_controls(body, tok, 64)
    want = make_logits_processors({3: 2.0, 9: -1.5}, 1.2, 4, 0.5, 20, 0.25, 20)  # mlx-lm's server's call
    tokens, logits = mx.array([3, 3, 9, 1]), mx.random.normal((1, 64), key=mx.random.key(1))
    (ours,) = got.pop("logits_processors")
    a, b = ours(tokens, logits), mx.array(logits.tolist())
    for q in want:
        b = q(tokens, b)
    assert mx.array_equal(a, b)
    assert got == dict(xtc_probability=0.5, xtc_threshold=0.2, xtc_special_tokens=controls.xtc_special_tokens(tok))
    assert request_controls({"presence_penalty": 0, "xtc_threshold": 0.3, "logit_bias": {}}, tok, 64) == {}  # all off


@pytest.fixture(scope="module")
def adapter(qwen3_pair, tmp_path_factory):
    """A LoRA adapter for the tiny qwen3 target, in mlx_lm.lora's format, with weights that change its output."""
    root = tmp_path_factory.mktemp("adapter")
    model, _ = load(str(qwen3_pair.path))
    lora = {"rank": 4, "scale": 10.0, "dropout": 0.0}
    linear_to_lora_layers(model, 2, lora)
    weights = {k: mx.random.normal(v.shape, key=mx.random.key(i)) * 0.5
               for i, (k, v) in enumerate(tree_flatten(model.parameters())) if k.rsplit(".", 1)[-1] in ("lora_a", "lora_b")}
    mx.save_safetensors(str(root / "adapters.safetensors"), weights)
    (root / "adapter_config.json").write_text(json.dumps({"fine_tune_type": "lora", "num_layers": 2, "lora_parameters": lora}))
    return root


def test_adapter_path_decodes_as_mlx_lm_with_the_adapter(qwen3_pair, adapter, tmp_path):
    draft_dir = qwen3_pair.make_draft(tmp_path / "draft", block_size=4)
    model, tokenizer, draft, _ = load_pair(str(qwen3_pair.path), str(draft_dir), adapter_path=str(adapter))
    reference_model, _ = load(str(qwen3_pair.path), adapter_path=str(adapter))
    prompt = "def f(x):"
    want = reference_tokens(reference_model, tokenizer, prompt, 24)
    assert want != qwen3_pair.reference(prompt, 24)  # the adapter changes the output
    got = [t for r in dflash_mlx.stream_generate(model, draft, tokenizer, prompt, max_tokens=24) for t in r.tokens]
    assert got == want


def test_a_prompt_cache_file_of_mlx_lm_is_refused_with_a_clear_error(qwen3_pair, tmp_path):
    """mlx_lm.cache_prompt's files hold the target's cache alone; DFlash's
    drafter needs its own context, so such a file is refused by name."""
    from mlx_lm.models.cache import make_prompt_cache, save_prompt_cache

    cache = make_prompt_cache(qwen3_pair.model)
    qwen3_pair.model(mx.array([[1, 2, 3]]), cache=cache)
    path = str(tmp_path / "mlx_lm.safetensors")
    save_prompt_cache(path, cache, {"model": str(qwen3_pair.path), "tokenizer_config": "{}"})  # as mlx_lm.cache_prompt writes it
    draft = dflash_mlx.load_draft(qwen3_pair.make_draft(tmp_path / "d"), qwen3_pair.model)
    with pytest.raises(ArgumentError, match=r"mlx-lm's prompt cache \(mlx_lm.cache_prompt\).*save_prompt_cache"):
        dflash_mlx.load_prompt_cache(path, draft)
