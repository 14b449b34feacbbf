"""Tiny chat targets that call tools and think, for the server's agent tests.

The Qwen-style one's tokenizer has Qwen markers (``<|im_start|>``,
``<think>``, ``<tool_call>``) and a chat template that mlx-lm reads as
thinking and JSON tool calling (its ``json_tools`` parser), so the server's
parsers are mlx-lm's own. The harmony one is a tiny gpt-oss whose tokenizer
and template speak gpt-oss's harmony format (channels ``analysis``,
``final``, ``commentary`` and ``to=functions.NAME`` calls). Each is
trained from seeded weights for a few seconds on a handful of
conversations, until its greedy answers are the scripted ones: a tool
call, an answer to the tool's result, and a reasoned answer. Nothing in the
generation path knows about the script.
"""

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import List

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten
from mlx_lm.server import process_message_content
from mlx_lm.tokenizer_utils import load as load_tokenizer
from mlx_lm.utils import load_model
from tiny import FULL, GPT_OSS, SLIDING

from dflash_mlx.random_pair import MASK, QWEN3, draft_config, make_draft, seeded_init

CHAT_TARGET = dict(QWEN3, num_hidden_layers=2)  # small: it trains in the test session's setup
EOS = "<|im_end|>"
MARKERS = ["<|im_start|>", "<think>", "</think>", "<tool_call>", "</tool_call>"]

# Qwen-style: tools listed in the system turn, calls as <tool_call>{json}</tool_call>,
# results as tool turns, earlier reasoning shown again as it was generated, and
# an empty think block when thinking is off.
TEMPLATE = """{%- if messages[0].role == 'system' or tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}
{% endif %}{% if tools %}Tools: {% for tool in tools %}{{ tool.function.name }} {% endfor %}
{% endif %}<|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'user' or (m.role == 'system' and not loop.first) %}<|im_start|>user
{{ m.content }}<|im_end|>
{% elif m.role == 'assistant' %}<|im_start|>assistant
{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}{{ m.content }}
{%- for tc in m.tool_calls or [] %}{% set tool_call = tc.function %}<tool_call>
{"name": "{{ tool_call.name }}", "arguments": {{ tool_call.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif m.role == 'tool' %}<|im_start|>tool
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% endif %}{% endif %}"""

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CALL = {"name": "get_weather", "arguments": {"city": "Paris"}}
ASK = [{"role": "user", "content": "Paris?"}]
CALLED = {"role": "assistant", "content": "", "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": CALL["name"], "arguments": json.dumps(CALL["arguments"])}}
]}
RESULT = {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}
THINK = [{"role": "user", "content": "2+3?"}]

# (messages, tools, the answer the target is trained to give greedily)
SCRIPT = [
    (ASK, [WEATHER_TOOL], "<tool_call>\n" + json.dumps(CALL) + "\n</tool_call>"),
    (ASK + [CALLED, RESULT], [WEATHER_TOOL], "Sunny."),
    (THINK, None, "<think>\nAdd.\n</think>\n\n5."),
]


@dataclass
class ChatFormat:
    """A chat target's format and the answers it is trained to give."""

    name: str
    target: dict  # its config
    eos: str
    markers: List[str]  # single tokens, decoded as text
    template: str
    script: list  # (messages, tools, answer)
    stops: List[str]  # special tokens that end an answer besides eos


def write_chat_tokenizer(path: Path, chat: "ChatFormat") -> int:
    """Byte-level BPE with no merges, plus the chat markers as single tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    vocab = {ch: i for i, ch in enumerate(sorted(ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([chat.eos, *chat.stops])
    tok.add_tokens(chat.markers)
    tok.add_special_tokens([MASK])  # last: the drafter's mask id is the vocabulary's last
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": chat.eos, "pad_token": chat.eos,
              "model_max_length": 4096, "chat_template": chat.template}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return tok.get_vocab_size()


def train(model, examples, max_steps: int, check_every: int = 10, seed: int = 0):
    """Fit ``model`` until it answers each (prompt, answer) pair greedily;
    returns the steps it took (an AssertionError if ``max_steps`` were not enough)."""
    mx.random.seed(seed)
    width = max(len(p) + len(a) for p, a in examples)
    rows, masks = [], []
    for p, a in examples:
        seq = p + a
        rows.append(seq + [0] * (width - len(seq)))
        masks.append([0] * (len(p) - 1) + [1] * len(a) + [0] * (width - len(seq)))
    x, mask = mx.array(rows), mx.array(masks, dtype=mx.float32)[:, : width - 1]

    def loss_fn(m):
        losses = nn.losses.cross_entropy(m(x[:, :-1]), x[:, 1:], reduction="none")
        return (losses * mask).sum() / mask.sum()

    opt = optim.Adam(learning_rate=5e-3)
    loss_and_grad = nn.value_and_grad(model, loss_fn)
    for step in range(1, max_steps + 1):
        _, grads = loss_and_grad(model)
        opt.update(model, grads)
        mx.eval(model.parameters(), opt.state)
        if step % check_every == 0 and greedy_answers_match(model, examples):
            return step
    raise AssertionError(f"the chat target did not learn its script in {max_steps} steps")


def greedy_answers_match(model, examples, margin: float = 2.0) -> bool:
    """Whether every answer token leads the next best by ``margin`` logits
    (far from a tie, so every exact decoder picks the same tokens)."""
    for p, a in examples:
        logits = model(mx.array([p + a]))[0, len(p) - 1 : -1]
        top2 = mx.sort(logits, axis=-1)[:, -2:]
        if mx.argmax(logits, axis=-1).tolist() != a or (top2[:, 1] - top2[:, 0]).min().item() < margin:
            return False
    return True


QWEN_CHAT = ChatFormat("chat", CHAT_TARGET, EOS, MARKERS, TEMPLATE, SCRIPT, [])

# gpt-oss's harmony format (github.com/openai/harmony), cut down: tools
# listed in a developer message, reasoning on the analysis channel, calls
# on the commentary channel to=functions.NAME, ending at <|call|>; the
# answer on the final channel, ending at <|return|>.
HARMONY_TEMPLATE = """{%- if tools %}<|start|>developer<|message|>namespace functions { {% for tool in tools %}{{ tool.function.name }} {% endfor %}}<|end|>{% endif %}
{%- for m in messages %}
{%- if m.role == 'user' or m.role == 'system' %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>
{%- elif m.role == 'assistant' %}
{%- if m.reasoning_content %}<|start|>assistant<|channel|>analysis<|message|>{{ m.reasoning_content }}<|end|>{% endif %}
{%- for tc in m.tool_calls or [] %}<|start|>assistant<|channel|>commentary to=functions.{{ tc.function.name }} <|constrain|>json<|message|>{{ tc.function.arguments | tojson }}<|call|>{% endfor %}
{%- if m.content %}<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>{% endif %}
{%- elif m.role == 'tool' %}<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>{{ m.content }}<|end|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|start|>assistant{% endif %}"""

HARMONY_CALL = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>' + json.dumps(CALL["arguments"])
HARMONY_CHAT = ChatFormat(
    "harmony",
    dict(GPT_OSS, num_hidden_layers=2, layer_types=[SLIDING, FULL]),
    "<|return|>",
    ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>"],
    HARMONY_TEMPLATE,
    [
        (ASK, [WEATHER_TOOL], "<|channel|>analysis<|message|>Weather.<|end|><|start|>assistant" + HARMONY_CALL + "<|call|>"),
        (ASK + [CALLED, RESULT], [WEATHER_TOOL], "<|channel|>final<|message|>Sunny.<|return|>"),
        (THINK, None, "<|channel|>analysis<|message|>Add.<|end|><|start|>assistant<|channel|>final<|message|>5.<|return|>"),
    ],
    ["<|call|>"],
)


def make_chat_target(root: Path, seed: int = 0, max_steps: int = 400, chat: ChatFormat = QWEN_CHAT) -> Path:
    """Write the trained chat target (float32, HF layout) under ``root``."""
    path = Path(root) / f"{chat.name}-target"
    vocab = write_chat_tokenizer(path, chat)
    tokenizer = load_tokenizer(path)
    stops = [tokenizer.convert_tokens_to_ids(t) for t in [chat.eos, *chat.stops]]
    cfg = dict(chat.target, vocab_size=vocab, eos_token_id=stops)
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    model, _ = load_model(path, strict=False)
    seeded_init(model, seed, scale=1.0)
    examples = []
    for messages, tools, answer in chat.script:
        messages = copy.deepcopy(messages)
        process_message_content(messages)  # as the server templates them: tool arguments parsed
        prompt = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True)
        ids = tokenizer.encode(answer, add_special_tokens=False)
        examples.append((prompt, ids if ids[-1] in stops else ids + [stops[0]]))
    train(model, examples, max_steps, seed=seed)
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())), metadata={"format": "mlx"})
    return path


def make_chat_draft(root: Path, target: Path, block_size: int = 4, chat: ChatFormat = QWEN_CHAT) -> Path:
    """A random drafter for the chat target (lossless whatever it proposes)."""
    vocab = json.loads((target / "config.json").read_text())["vocab_size"]
    return make_draft(Path(root) / f"{chat.name}-draft", draft_config(chat.target, vocab, block_size=block_size), seed=1)


def format_of(body, tokenizer):
    """The server's reading of a request's format (chat completions' fields), with the tokenizer's own call format."""
    from dflash_mlx.api.formats import request_format
    from dflash_mlx.api.harmony import text_format

    return request_format(body, tokenizer, text_format(tokenizer))
