"""gpt-oss's harmony format, for the server's split of an answer into
reasoning, text and tool calls.

A harmony answer is a run of messages, each opened by a header that names
its channel: ``analysis`` (the reasoning), ``final`` (the answer) or
``commentary`` (a preamble, or a tool call addressed ``to=functions.NAME``,
its JSON arguments ending at ``<|call|>``); ``<|end|>`` closes a message
and ``<|start|>assistant`` opens the next (OpenAI's harmony format,
github.com/openai/harmony). mlx-lm splits answers with a
``TextStateMachine`` driven by the tokenizer's response format (one per
``mlx_lm.chat_templates`` module) and has none for harmony in 0.32:
:func:`text_format` gives a harmony tokenizer's, in the terms of mlx-lm's
``TokenizerWrapper``, for mlx-lm's own ``make_text_state_machine``, tool
call formatter and handlers.
"""

import json
import re

# Tokens only a harmony vocabulary has, all of them.
HARMONY_TOKENS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|call|>")
TOOL_CALL_START = " to=functions."

# state -> [(text that moves on, next state)], as mlx-lm's response formats
# give them; "header" is between messages, where nothing is shown.
TRANSITIONS = {
    "header": [
        ("<|channel|>analysis<|message|>", "reasoning"),
        ("<|channel|>final<|message|>", "normal"),
        ("<|channel|>commentary<|message|>", "normal"),
        (TOOL_CALL_START, "tool"),  # after the channel, or in the role part of the header
        ("<|start|>assistant", "header"),
    ],
    "reasoning": [("<|end|>", "header")],
    "normal": [("<|end|>", "header"), ("<|start|>assistant", "header")],
    "tool": [("<|call|>", "normal")],
}


def parse_tool_call(text: str, tools=None) -> dict:
    """A harmony tool call from its text after ``to=functions.``: the
    function's name, the rest of the header (``<|constrain|>json``), then
    the JSON arguments after ``<|message|>``. A ValueError if it is not one."""
    name = re.match(r"[^\s<]+", text)
    _, found, arguments = text.partition("<|message|>")
    if name is None or not found:
        raise ValueError(f"not a harmony tool call: {text!r}")
    return {"name": name.group(0), "arguments": json.loads(arguments)}


class HarmonyFormat:
    """A harmony tokenizer's answer handling, named as mlx-lm's
    ``TokenizerWrapper`` names its own."""

    has_thinking = False  # no think markers: the reasoning is a channel
    has_tool_calling = True
    tool_call_start = TOOL_CALL_START
    tool_call_end = None  # the transitions end a call
    structural_markers = ()
    response_transitions = TRANSITIONS
    response_initial_state = "header"  # the prompt ends with <|start|>assistant
    tool_parser = staticmethod(parse_tool_call)


def text_format(tokenizer):
    """How to split ``tokenizer``'s answers: harmony's for a harmony
    vocabulary that mlx-lm has no response format for, else the tokenizer's
    own (mlx-lm's)."""
    vocab = tokenizer.get_vocab()
    if tokenizer.response_transitions or not all(t in vocab for t in HARMONY_TOKENS):
        return tokenizer
    return HarmonyFormat
