"""mlx-lm's controls over the output, checked and built once for every entry point.

The library keywords of :func:`~dflash_mlx.generate.generate_step` and
friends carry mlx-lm's names (``logits_processors``, ``xtc_probability``,
``xtc_threshold``, ``xtc_special_tokens``, ``min_tokens_to_keep``,
``kv_bits``, ``kv_group_size``, ``quantized_kv_start``, ``max_kv_size``).
This module holds what the commands and the server share about them: the
values each accepts (one :class:`ArgumentError` before any work, naming the
fix), the processors built with mlx-lm's ``make_logits_processors``, the
XTC special tokens as mlx-lm's commands choose them, and the chat template
(``--chat-template-config``, ``--prefill-response``) as mlx_lm.generate
applies it.
"""

import json
import math
from typing import Callable, Dict, List, Optional, Sequence

from mlx_lm.sample_utils import make_logits_processors

from .errors import ArgumentError

# mlx-lm's QuantizedKVCache quantizes with mx.quantize (affine mode): these
# are the bits and group sizes it accepts.
KV_BITS = (1, 2, 3, 4, 5, 6, 8)
KV_GROUP_SIZES = (32, 64, 128)
# mlx-lm's own defaults (mlx_lm.generate.generate_step, make_sampler, its commands).
DEFAULT_KV_GROUP_SIZE = 64
DEFAULT_QUANTIZED_KV_START = 5000
DEFAULT_XTC_THRESHOLD = 0.1
DEFAULT_MIN_TOKENS_TO_KEEP = 1
DEFAULT_PENALTY_CONTEXT_SIZE = 20
XTC_MAX_THRESHOLD = 0.5  # mlx_lm.sample_utils.apply_xtc refuses a larger threshold
TOP_LOGPROBS_LIMIT = 11  # mlx-lm's server: top_logprobs at most 11


def check_kv_cache(kv_bits=None, kv_group_size=DEFAULT_KV_GROUP_SIZE, quantized_kv_start=DEFAULT_QUANTIZED_KV_START, max_kv_size=None) -> None:
    """Refuse KV-cache settings mlx-lm's caches cannot take."""
    if kv_bits is not None and kv_bits not in KV_BITS:
        raise ArgumentError(f"kv_bits must be one of {', '.join(map(str, KV_BITS))} (mlx's quantization), not {kv_bits}")
    if kv_group_size not in KV_GROUP_SIZES:
        raise ArgumentError(f"kv_group_size must be one of {', '.join(map(str, KV_GROUP_SIZES))}, not {kv_group_size}")
    if quantized_kv_start < 0:
        raise ArgumentError(f"quantized_kv_start must be at least 0, not {quantized_kv_start}")
    if max_kv_size is not None and max_kv_size < 1:
        raise ArgumentError(f"max_kv_size must be at least 1 (or None: no limit), not {max_kv_size}")


def check_ids(ids, vocab_size: Optional[int], what: str) -> None:
    """Refuse token ids outside ``[0, vocab_size)`` (any integer when the size is unknown)."""
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, int):
            raise ArgumentError(f"{what} must be token ids (integers), not {i!r}")
        if vocab_size is not None and not 0 <= i < vocab_size:
            raise ArgumentError(f"{what}: token id {i} is outside the vocabulary (0..{vocab_size - 1})")


def check_sampling(xtc_probability=0.0, xtc_threshold=DEFAULT_XTC_THRESHOLD, xtc_special_tokens=None,
                   min_tokens_to_keep=DEFAULT_MIN_TOKENS_TO_KEEP, vocab_size=None) -> None:
    """Refuse XTC and min-p settings mlx-lm's sampler cannot take."""
    if not 0 <= xtc_probability <= 1:
        raise ArgumentError(f"xtc_probability must be from 0 to 1, not {xtc_probability}")
    if not 0 <= xtc_threshold <= XTC_MAX_THRESHOLD:
        raise ArgumentError(f"xtc_threshold must be from 0 to {XTC_MAX_THRESHOLD}, not {xtc_threshold}")
    if min_tokens_to_keep < 1:
        raise ArgumentError(f"min_tokens_to_keep must be at least 1, not {min_tokens_to_keep}")
    check_ids(xtc_special_tokens or (), vocab_size, "xtc_special_tokens")


def check_controls(*, logits_processors=None, xtc_probability=0.0, xtc_threshold=DEFAULT_XTC_THRESHOLD,
                   xtc_special_tokens=None, min_tokens_to_keep=DEFAULT_MIN_TOKENS_TO_KEEP, kv_bits=None,
                   kv_group_size=DEFAULT_KV_GROUP_SIZE, quantized_kv_start=DEFAULT_QUANTIZED_KV_START,
                   max_kv_size=None, vocab_size: Optional[int] = None) -> None:
    """Every control keyword of ``generate_step`` checked at once, before any
    forward (``vocab_size``: the target's, for the token ids)."""
    if logits_processors is not None and not all(callable(p) for p in logits_processors):
        raise ArgumentError("logits_processors must be a list of callables (tokens, logits) -> logits")
    check_sampling(xtc_probability, xtc_threshold, xtc_special_tokens, min_tokens_to_keep, vocab_size)
    check_kv_cache(kv_bits, kv_group_size, quantized_kv_start, max_kv_size)


def penalty_processors(logit_bias: Optional[Dict[int, float]] = None, repetition_penalty=None,
                       repetition_context_size=DEFAULT_PENALTY_CONTEXT_SIZE, presence_penalty=None,
                       presence_context_size=DEFAULT_PENALTY_CONTEXT_SIZE, frequency_penalty=None,
                       frequency_context_size=DEFAULT_PENALTY_CONTEXT_SIZE, vocab_size: Optional[int] = None) -> List[Callable]:
    """mlx-lm's ``make_logits_processors``, its arguments checked first."""
    for name, size in (("repetition_context_size", repetition_context_size), ("presence_context_size", presence_context_size),
                       ("frequency_context_size", frequency_context_size)):
        if size < 0:
            raise ArgumentError(f"{name} must be at least 0, not {size}")
    for name, value in (("repetition_penalty", repetition_penalty), ("presence_penalty", presence_penalty),
                        ("frequency_penalty", frequency_penalty)):
        if value is not None and not math.isfinite(value):
            raise ArgumentError(f"{name} must be a finite number, not {value}")
    if repetition_penalty is not None and repetition_penalty < 0:
        raise ArgumentError(f"repetition_penalty must be at least 0, not {repetition_penalty}")
    bias = dict(logit_bias or {})
    check_ids(bias, vocab_size, "logit_bias")
    if not all(isinstance(v, (int, float)) and math.isfinite(v) for v in bias.values()):
        raise ArgumentError("logit_bias values must be finite numbers")
    return make_logits_processors(
        bias or None, repetition_penalty, repetition_context_size, presence_penalty, presence_context_size,
        frequency_penalty, frequency_context_size,
    )


def xtc_special_tokens(tokenizer) -> List[int]:
    """The tokens XTC never removes, as mlx-lm's commands and server choose them: newline and eos."""
    return tokenizer.encode("\n") + list(tokenizer.eos_token_ids)


def control_keywords(tokenizer, processors: Sequence[Callable] = (), xtc_probability=0.0, xtc_threshold=DEFAULT_XTC_THRESHOLD,
                     min_tokens_to_keep=DEFAULT_MIN_TOKENS_TO_KEEP, kv_bits=None, kv_group_size=DEFAULT_KV_GROUP_SIZE,
                     quantized_kv_start=DEFAULT_QUANTIZED_KV_START, max_kv_size=None) -> dict:
    """The keywords for ``generate_step`` / ``stream_generate`` / ``BatchGenerator.insert``:
    only the controls that change something (none: plain decoding's keywords)."""
    special = xtc_special_tokens(tokenizer) if xtc_probability > 0 else None
    check_controls(logits_processors=list(processors), xtc_probability=xtc_probability, xtc_threshold=xtc_threshold,
                   min_tokens_to_keep=min_tokens_to_keep, kv_bits=kv_bits, kv_group_size=kv_group_size,
                   quantized_kv_start=quantized_kv_start, max_kv_size=max_kv_size)
    out = {}
    if processors:
        out["logits_processors"] = list(processors)
    if xtc_probability > 0:
        out.update(xtc_probability=xtc_probability, xtc_threshold=xtc_threshold, xtc_special_tokens=special)
    if min_tokens_to_keep != DEFAULT_MIN_TOKENS_TO_KEEP:
        out["min_tokens_to_keep"] = min_tokens_to_keep
    if kv_bits is not None:
        out.update(kv_bits=kv_bits, kv_group_size=kv_group_size, quantized_kv_start=quantized_kv_start)
    if max_kv_size is not None:
        out["max_kv_size"] = max_kv_size
    return out


def template_config(text: Optional[str]) -> dict:
    """``--chat-template-config``: a JSON object of the template's extra variables."""
    if text is None:
        return {}
    try:
        config = json.loads(text)
    except ValueError as e:
        raise ArgumentError(f"--chat-template-config is not JSON ({e}): pass an object, e.g. '{{\"enable_thinking\": false}}'") from None
    if not isinstance(config, dict):
        raise ArgumentError(f"--chat-template-config must be a JSON object, not {type(config).__name__}")
    return config


def template_prompt(tokenizer, prompt: str, system_prompt=None, template_kwargs=None, prefill_response=None) -> List[int]:
    """The tokens of a user message templated as mlx_lm.generate templates it: the system
    prompt first, ``prefill_response`` as the start of the assistant's answer
    (the template continues it instead of opening a new turn), the template
    config's variables passed to the template."""
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages.append({"role": "user", "content": prompt})
    if prefill_response is not None:
        messages.append({"role": "assistant", "content": prefill_response})
    return tokenizer.apply_chat_template(
        messages, tokenize=True, continue_final_message=prefill_response is not None,
        add_generation_prompt=prefill_response is None, **(template_kwargs or {}),
    )


def add_extra_eos_tokens(tokenizer, tokens: Sequence[str]) -> None:
    """``--extra-eos-token``: more tokens that end a generation (mlx-lm's
    ``TokenizerWrapper.add_eos_token``; an unknown token is an error)."""
    for token in tokens:
        try:
            tokenizer.add_eos_token(token)
        except ValueError as e:
            raise ArgumentError(f"--extra-eos-token {token!r}: {e}") from None

