"""mlx-lm's controls over the output, checked and built once for every entry point.

The library keywords of :func:`~dflash_mlx.generate.generate_step` and
friends carry mlx-lm's names (``logits_processors``, ``xtc_probability``,
``xtc_threshold``, ``xtc_special_tokens``, ``min_tokens_to_keep``,
``kv_bits``, ``kv_group_size``, ``quantized_kv_start``, ``max_kv_size``).
This module holds what the commands and the server share about them: the
values each accepts (one :class:`ArgumentError` before any work, naming the
fix; the KV cache's settings as :mod:`dflash_mlx.targets.kv` checks them),
the processors built with mlx-lm's ``make_logits_processors`` (applied
through speculation by :mod:`dflash_mlx.processors`), the
XTC special tokens as mlx-lm's commands choose them, and the chat template
(``--chat-template-config``, ``--prefill-response``) as mlx_lm.generate
applies it.
"""

import json
import math
from typing import Callable, List, Optional, Sequence

import numpy as np

from .errors import ArgumentError
from .processors import PENALTIES, PROCESSOR_DEFAULTS, Penalties
from .targets.kv import DEFAULT_KV_GROUP_SIZE, DEFAULT_QUANTIZED_KV_START, KVSettings

# mlx-lm's own defaults (make_sampler, its commands).
DEFAULT_XTC_THRESHOLD = 0.1
DEFAULT_MIN_TOKENS_TO_KEEP = 1
XTC_MAX_THRESHOLD = 0.5  # mlx_lm.sample_utils.apply_xtc refuses a larger threshold
TOP_LOGPROBS_LIMIT = 11  # mlx-lm's server: top_logprobs at most 11


def token_id(value, vocab_size: Optional[int], what: str) -> None:
    """A token id: an int in the vocabulary ``[0, vocab_size)`` (any
    non-negative int when the size is unknown)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ArgumentError(f"{what}: token id {value!r} is not a non-negative integer; pass token ids from the tokenizer")
    if vocab_size is not None and value >= vocab_size:
        raise ArgumentError(f"{what}: token id {value} is outside the vocabulary (0..{vocab_size - 1}); pass ids below {vocab_size}")


def whole(value, what: str) -> None:
    """An int (not a bool): a count a float would be cut down unsaid, or fail on later."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ArgumentError(f"{what} must be a whole number, got {value!r}")


def positive_int(value, what: str, hint: str = "") -> None:
    """An int of 1 or more (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ArgumentError(f"{what} must be a positive integer, got {value!r}; pass 1 or more{hint}")


def finite(value, what: str, low: float = -math.inf, high: float = math.inf) -> None:
    """A finite real number in ``[low, high]``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not low <= value <= high:
        span = f" in [{low}, {high}]" if math.isfinite(low) or math.isfinite(high) else ""
        raise ArgumentError(f"{what} must be a finite number{span}, got {value!r}")


def check_kv_cache(kv_bits=None, kv_group_size=None, quantized_kv_start=None, max_kv_size=None) -> None:
    """Refuse KV-cache settings mlx-lm's caches cannot take (None each:
    mlx-lm's default), as :class:`~dflash_mlx.targets.kv.KVSettings` checks them."""
    KVSettings.of(kv_bits, kv_group_size, quantized_kv_start, max_kv_size)


def check_sampling(vocab_size: Optional[int] = None, xtc_probability=0.0, xtc_threshold=DEFAULT_XTC_THRESHOLD,
                   xtc_special_tokens=None, min_tokens_to_keep=DEFAULT_MIN_TOKENS_TO_KEEP) -> None:
    """Refuse XTC and min-p settings mlx-lm's ``make_sampler`` refuses (it
    only finds out at the first token): ``xtc_probability`` outside [0, 1],
    ``xtc_threshold`` outside [0, 0.5], special tokens outside the
    vocabulary, ``min_tokens_to_keep`` below 1."""
    finite(xtc_probability, "xtc_probability", 0.0, 1.0)
    finite(xtc_threshold, "xtc_threshold", 0.0, XTC_MAX_THRESHOLD)
    for token in xtc_special_tokens or ():
        token_id(token, vocab_size, "xtc_special_tokens")
    positive_int(min_tokens_to_keep, "min_tokens_to_keep")


def check_controls(*, logits_processors=None, xtc_probability=0.0, xtc_threshold=DEFAULT_XTC_THRESHOLD,
                   xtc_special_tokens=None, min_tokens_to_keep=DEFAULT_MIN_TOKENS_TO_KEEP, kv_bits=None,
                   kv_group_size=None, quantized_kv_start=None, max_kv_size=None,
                   vocab_size: Optional[int] = None) -> None:
    """Every control keyword of ``generate_step`` checked at once, before any
    forward (``vocab_size``: the target's, for the token ids)."""
    if logits_processors is not None and (
        isinstance(logits_processors, (str, bytes)) or not all(callable(p) for p in logits_processors)
    ):
        raise ArgumentError("logits_processors must be a list of callables (tokens, logits) -> logits")
    check_sampling(vocab_size, xtc_probability, xtc_threshold, xtc_special_tokens, min_tokens_to_keep)
    check_kv_cache(kv_bits, kv_group_size, quantized_kv_start, max_kv_size)


def check_processor_settings(vocab_size: Optional[int] = None, **settings) -> None:
    """Raise :class:`ArgumentError` for make_logits_processors' settings
    mlx-lm would refuse or misread: an unknown keyword, a logit bias whose
    ids are outside the vocabulary (``vocab_size``; None: not checked), a
    negative repetition penalty, a context size that is not a positive
    integer (mlx-lm reads 0 as the whole history and a negative one as all
    but the first tokens)."""
    unknown = sorted(set(settings) - set(PROCESSOR_DEFAULTS))
    if unknown:
        raise ArgumentError(f"unknown logits processor setting(s) {unknown}; the settings are {sorted(PROCESSOR_DEFAULTS)}")
    s = {**PROCESSOR_DEFAULTS, **settings}
    bias = s["logit_bias"]
    if bias is not None and not isinstance(bias, dict):
        raise ArgumentError(f"logit_bias must map token ids to numbers, got {type(bias).__name__}")
    for token, value in (bias or {}).items():
        token_id(token, vocab_size, "logit_bias")
        finite(value, f"logit_bias[{token}]")
    for kind in PENALTIES:
        penalty, context = s[f"{kind}_penalty"], s[f"{kind}_context_size"]
        if penalty is not None:
            finite(penalty, f"{kind}_penalty", low=0.0 if kind == "repetition" else -math.inf)
        default = PROCESSOR_DEFAULTS[f"{kind}_context_size"]
        positive_int(context, f"{kind}_context_size", f" tokens (mlx-lm's default is {default})")


def penalty_processors(vocab_size: Optional[int] = None, **settings) -> List[Callable]:
    """mlx-lm's ``make_logits_processors(**settings)``, its settings checked
    first (:func:`check_processor_settings`), as one
    :class:`~dflash_mlx.processors.Penalties` (a verify processes all its
    rows at once); an empty list when every setting is off."""
    check_processor_settings(vocab_size, **settings)
    penalties = Penalties(**settings)
    return [penalties] if penalties.made else []


def xtc_special_tokens(tokenizer) -> List[int]:
    """The tokens XTC never removes, as mlx-lm's commands and server choose them: newline and eos."""
    return tokenizer.encode("\n") + list(tokenizer.eos_token_ids)


def control_keywords(tokenizer, processors: Sequence[Callable] = (), xtc_probability=0.0, xtc_threshold=DEFAULT_XTC_THRESHOLD,
                     min_tokens_to_keep=DEFAULT_MIN_TOKENS_TO_KEEP, kv_bits=None, kv_group_size=DEFAULT_KV_GROUP_SIZE,
                     quantized_kv_start=DEFAULT_QUANTIZED_KV_START, max_kv_size=None) -> dict:
    """The keywords for ``generate_step`` / ``stream_generate`` / ``BatchGenerator.insert``:
    only the controls that change something (none: plain decoding's keywords)."""
    check_controls(logits_processors=list(processors), xtc_probability=xtc_probability, xtc_threshold=xtc_threshold,
                   min_tokens_to_keep=min_tokens_to_keep, kv_bits=kv_bits, kv_group_size=kv_group_size,
                   quantized_kv_start=quantized_kv_start, max_kv_size=max_kv_size)
    special = xtc_special_tokens(tokenizer) if xtc_probability > 0 else None
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


KV_KEYWORDS = ("kv_bits", "kv_group_size", "quantized_kv_start", "max_kv_size")


def kv_keywords(keywords: dict) -> dict:
    """The KV cache's part of :func:`control_keywords`' answer: what
    ``make_prompt_cache`` takes, for a caller that makes its caches itself."""
    return {k: v for k, v in keywords.items() if k in KV_KEYWORDS}


def template_config(text: Optional[str], flag: str = "--chat-template-config") -> dict:
    """``--chat-template-config`` (the server's ``--chat-template-args``, ``flag``): a JSON object of the template's extra variables."""
    if text is None:
        return {}
    try:
        config = json.loads(text)
    except ValueError as e:
        raise ArgumentError(f"{flag} is not JSON ({e}): pass an object, e.g. '{{\"enable_thinking\": false}}'") from None
    if not isinstance(config, dict):
        raise ArgumentError(f"{flag} must be a JSON object, not {type(config).__name__}")
    return config


def template_prompt(tokenizer, prompt: str, system_prompt=None, template_kwargs=None, prefill_response=None, tokenize: bool = True):
    """The tokens (or, not ``tokenize``, the text) of a user message templated
    as mlx_lm.generate templates it: the system prompt first,
    ``prefill_response`` as the start of the assistant's answer (the
    template continues it instead of opening a new turn), the template
    config's variables passed to the template."""
    messages = [{"role": "system", "content": system_prompt}] if system_prompt is not None else []
    messages.append({"role": "user", "content": prompt})
    if prefill_response is not None:
        messages.append({"role": "assistant", "content": prefill_response})
    return tokenizer.apply_chat_template(
        messages, tokenize=tokenize, continue_final_message=prefill_response is not None,
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

