"""Lossless block-wise generation: prefill, draft, verify, accept, roll back, stream.

    python -m dflash_mlx.generate --prompt "def fib(n):"
"""

import sys
import threading
import time
from collections import Counter
from contextlib import closing, contextmanager
from dataclasses import dataclass, replace
from typing import Callable, Generator, Iterable, List, Optional, Sequence, Tuple, Union

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generation_stream, wired_limit
from mlx_lm.tokenizer_utils import TokenizerWrapper

from . import cli
from .adaptive import BlockSizer
from .cache import PromptCache, bound_target, load_prompt_cache, prompt_cache_for
from .copy_source import CopyDrafts
from .calibration import calibrated, plan
from .controls import add_extra_eos_tokens, check_controls, positive_int, template_prompt, whole
from .decode import BatchResponse, Decoder, Request, Sizing, Stats
from .defaults import DEFAULT_MAX_TOKENS, DEFAULT_PREFILL_STEP_SIZE, MAX_BLOCK_SIZE
from .errors import ArgumentError
from .ops.threads import release_at_thread_exit
from .prefill import prefill
from .processors import Processors
from .sampling import ACCEPTANCE_RULES, AcceptanceRule, acceptance_rule
from .structured import constraint_for


@dataclass
class GenerationResponse:
    """One verify cycle's worth of output (the first one is the prefill token).

    Args:
        text: the new text segment.
        tokens: the tokens committed this cycle (eos excluded, as mlx-lm does).
        accepted: drafted tokens committed this cycle.
        committed: tokens committed this cycle (accepted + 1, fewer only when
            eos ends the generation inside the block; the "acceptance
            length" papers report).
        prompt_tokens, prompt_tps: prompt size and prefill speed.
        generation_tokens, generation_tps: totals so far.
        peak_memory: in GB.
        finish_reason: "stop" (eos), "length" (max_tokens) or None.
        block_size: tokens verified this cycle (1: plain decoding, no draft;
            0: the prefill's response; a tree's rows: the anchor and its
            nodes). Varies from cycle to cycle unless ``block_size`` was fixed.
        tree_size: nodes of the draft tree this cycle verified (0: a chain
            or plain decoding); ``committed`` is then the walked path's
            length plus the target's token after it.
        forced: of the tokens committed this cycle, those the
            ``response_format`` forced (the only token its grammar allowed:
            no drafting needed, see docs/structured.md).
        copied: of the ``accepted`` tokens, those copied from the context
            (:mod:`dflash_mlx.copy_source`); the rest came from the drafter.
    """

    text: str
    tokens: List[int]
    accepted: int
    committed: int
    prompt_tokens: int
    prompt_tps: float
    generation_tokens: int
    generation_tps: float
    peak_memory: float
    finish_reason: Optional[str] = None
    block_size: int = 0
    tree_size: int = 0
    forced: int = 0
    copied: int = 0


def cycle_lengths(responses: Sequence[GenerationResponse]) -> List[int]:
    """Tokens committed by each verify cycle of one generation, from its
    responses: the first response is the prefill's token, not a cycle."""
    return [r.committed for r in responses[1:]]


def mean_tokens_per_cycle(lengths: Sequence[int]) -> float:
    """Mean of :func:`cycle_lengths` (pooled over generations); 0 without cycles."""
    return sum(lengths) / max(1, len(lengths))


def encode_prompt(tokenizer: TokenizerWrapper, prompt) -> mx.array:
    """str, token list or mx.array -> 1-D token array (mlx-lm's rule for BOS)."""
    if isinstance(prompt, mx.array):
        return prompt.reshape(-1)
    if isinstance(prompt, str):
        add_special = tokenizer.bos_token is None or not prompt.startswith(tokenizer.bos_token)
        prompt = tokenizer.encode(prompt, add_special_tokens=add_special)
    return mx.array(prompt, dtype=mx.int32)


def max_block_size(draft, block_size: Optional[int], sizer: Optional[BlockSizer]) -> int:
    """The largest block a generation verifies: the fixed ``block_size``,
    the ``sizer``'s ``max_block`` or (adaptive) the drafter's trained size."""
    if sizer is not None and block_size is not None:
        raise ArgumentError("pass block_size or sizer, not both (a sizer's max_block is its largest block)")
    if block_size is not None:
        whole(block_size, "block_size")
    max_block = sizer.max_block if sizer is not None else draft.block_size if block_size is None else int(block_size)
    if not 1 <= max_block <= MAX_BLOCK_SIZE:
        raise ArgumentError(f"block_size must be from 1 to {MAX_BLOCK_SIZE}, got {max_block}")
    draft.check_block_size(max_block)
    return max_block


GENERATING: dict = {}  # id(drafter) -> (thread generating with it, generations open there)
GENERATING_LOCK = threading.Lock()


@contextmanager
def on_pair(draft, stream):
    """What every step of a generation runs in: this thread owns the pair, on
    ``stream``. A generation on a pair that another thread is generating
    with is refused: a pair's adapter, compiled functions and MLX stream are
    shared state; one thread may hold several generations (a conversation's
    turns), two threads may not run at once.
    """
    me = threading.get_ident()
    release_at_thread_exit()  # mlx-lm's compiled functions and mx.random run on this thread
    with GENERATING_LOCK:
        owner, depth = GENERATING.get(id(draft), (me, 0))
        if owner != me:
            raise ArgumentError(
                "this drafter and its target are generating in another thread: run one "
                "generation per pair at a time (wait for it, queue requests on one thread "
                "as mlx-dflash server does, or load a second pair for the second thread)"
            )
        GENERATING[id(draft)] = (me, depth + 1)
    try:
        with mx.stream(stream):
            yield
    finally:
        with GENERATING_LOCK:
            if depth:
                GENERATING[id(draft)] = (me, depth)
            else:
                del GENERATING[id(draft)]


def tree_plan(target, draft, tree_budget: Optional[int], sizer) -> Tuple[int, bool]:
    """``(nodes of the tree every drafting cycle verifies (0: none forced),
    whether the sizer may choose trees)``; a budget this generation cannot
    honour is refused before any work."""
    if tree_budget is not None:
        whole(tree_budget, "tree_budget")
        if tree_budget < 0:
            raise ArgumentError(f"tree_budget must be None (adaptive), 0 (chains only) or a node count, got {tree_budget}")
    able = not target.no_trees and hasattr(draft, "slot_head_logits")
    if tree_budget:
        if sizer is not None:
            raise ArgumentError("pass tree_budget or sizer, not both (a sizer makes every choice)")
        if target.no_trees:
            raise ArgumentError(target.no_trees)
        if not able:
            raise ArgumentError("this drafter gives no per-slot logits to build a tree from: use tree_budget=0")
    return tree_budget or 0, able and tree_budget is None and sizer is None


def checked_prompt(target, cache: PromptCache, prompt) -> List[int]:
    """``prompt`` as a token list, checked before any forward: not empty
    unless the cache has a pending token, every id in the target's vocabulary."""
    prompt = prompt.tolist() if isinstance(prompt, mx.array) else list(prompt)
    if not prompt and not cache.pending:
        raise ArgumentError("the prompt is empty")
    target.check_tokens(prompt)
    return prompt


def generate_step(
    prompt: Union[List[int], mx.array],
    model,
    draft,
    *,
    prompt_cache: Optional[PromptCache] = None,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    block_size: Optional[int] = None,
    sizer: Optional[BlockSizer] = None,
    tree_budget: Optional[int] = None,
    temperature: float = 0.0,
    top_p: float = 0.0,
    top_k: int = 0,
    min_p: float = 0.0,
    sampler: Optional[Callable[[mx.array], mx.array]] = None,
    acceptance: str = "speculative",
    eos_token_ids: Iterable[int] = (),
    logprobs: bool = False,
    prefill_step_size: int = DEFAULT_PREFILL_STEP_SIZE,
    prompt_progress_callback: Optional[Callable[[int, int], None]] = None,
    stream=generation_stream, draft_window: Optional[int] = None, draft_sink: Optional[int] = None,
    logits_processors: Optional[List[Callable[[mx.array, mx.array], mx.array]]] = None, min_tokens_to_keep: int = 1,
    xtc_probability: float = 0.0, xtc_threshold: float = 0.1, xtc_special_tokens: Optional[List[int]] = None,
    kv_bits: Optional[int] = None, kv_group_size: Optional[int] = None, quantized_kv_start: Optional[int] = None,
    max_kv_size: Optional[int] = None, all_tokens: Optional[List[int]] = None, response_format=None, tokenizer=None,
    copy_drafts: bool = True,
) -> Generator[Tuple[int, Optional[mx.array], bool, int, int, bool], None, None]:
    """Yield each committed token as ``(token, logprobs, from_draft, block,
    tree, copied)``, like mlx-lm's ``speculative_generate_step`` plus the rows its cycle verified
    (0 for the prefill's token), its draft tree's nodes and whether it was copied (``copy_drafts``).

    ``prompt`` holds only the tokens new to ``prompt_cache`` (it may be empty
    when the cache has a pending token; an id outside the target's
    vocabulary is refused before any forward). ``logprobs`` (the target's
    log-probabilities ``[V]`` at the token's position) is None unless asked
    for. Generation ends after ``max_tokens`` tokens or an eos (yielded, and
    kept in the cache as mlx-lm keeps it). Closing the generator at any
    token rolls back a cycle queued meanwhile: the cache is consistent after
    any token. Draft window: :func:`~dflash_mlx.cache.prompt_cache_for`.

    Greedy (``temperature == 0`` and no ``sampler``) output is token-identical
    to the target's own greedy decode. With ``temperature > 0`` every committed
    token is distributed exactly as mlx-lm's ``make_sampler`` samples the
    target, under either ``acceptance`` rule:

    - ``"speculative"`` (default): the drafter samples its block from its own
      processed distribution q; each draft token survives with probability
      min(1, p/q) against the target's processed p, the first rejected slot
      is resampled from max(0, p - q) (speculative sampling, see
      :mod:`dflash_mlx.sampling`).
    - ``"exact-match"``: the drafter proposes greedily, the target samples
      every slot, and a draft token survives only if it equals that sample
      (simpler, accepts less). A custom ``sampler`` (mlx-lm style, fed
      log-probabilities) yields no p, so it always uses exact match.

    By default each cycle verifies the length (up to the drafter's trained
    size; 1: plain decoding) or the draft tree (:mod:`dflash_mlx.tree`;
    ``tree_budget`` 0: none, ``n``: n nodes every cycle) that maximises expected
    tokens per second, as measured (:mod:`dflash_mlx.adaptive`; a ``sizer`` makes
    the choices instead): a seeded sampled run repeats only when they are fixed.
    mlx-lm's controls are exact through speculation: ``logits_processors``
    (:func:`row_controls`), ``min_tokens_to_keep``, XTC, the KV cache keywords;
    ``response_format`` (with ``tokenizer``; docs/structured.md) as mlx-lm's masked decode.
    """
    target = bound_target(model, draft)
    kv = dict(kv_bits=kv_bits, kv_group_size=kv_group_size, quantized_kv_start=quantized_kv_start, max_kv_size=max_kv_size)
    rule = controlled_rule(target, (temperature, top_p, top_k, min_p, sampler, acceptance), logits_processors, kv,
                           min_tokens_to_keep, xtc_probability, xtc_threshold, xtc_special_tokens)
    constraint = constraint_for(response_format, tokenizer)
    positive_int(max_tokens, "max_tokens")
    positive_int(prefill_step_size, "prefill_step_size")  # (a negative one fed no chunk: the prompt's body went unread)
    stop = stop_tokens(eos_token_ids, constraint)
    max_block, trees = max_block_size(draft, block_size, sizer), tree_plan(target, draft, tree_budget, sizer)
    cache = prompt_cache_for(model, draft, prompt_cache, draft_window, draft_sink, **kv)
    prompt = checked_prompt(target, cache, prompt)
    with generation(target, draft, cache, stream):
        controls = row_controls(logits_processors, constraint, prompt, all_tokens)
        request = Request(0, cache, rule, max_tokens, stop, logprobs, controls=controls, copies=CopyDrafts(cache) if copy_drafts else None)
        first = prefilled(target, request, prompt, prefill_step_size, prompt_progress_callback)
        yield from alone(target, draft, request, first, max_block, trees, block_size is not None, sizer)


def prefilled(target, request: Request, prompt: List[int], step: int, callback=None) -> BatchResponse:
    """The prefill's token, ``callback`` (a ``prompt_progress_callback``)
    called as mlx-lm's ``generate_step`` calls it: ``(0, n)`` before the
    prefill, ``(done, n)`` after each chunk and ``(n, n)`` once the token is
    chosen, ``n`` the prompt's tokens (a reused cache's pending token, which
    the chunks also run, not counted: mlx-lm ran it in the last turn)."""
    n, told = len(prompt), callback if callback is not None else (lambda done, total: None)
    told(0, n)
    logits = prefill(target, request.cache, prompt, step, lambda done, total: told(max(0, done - (total - n)), n))
    first = request.start(logits)
    told(n, n)
    return first


def controlled_rule(target, sampling: tuple, logits_processors, kv: dict, min_tokens_to_keep=1, xtc_probability=0.0,
                    xtc_threshold=0.1, xtc_special_tokens=None) -> AcceptanceRule:
    """A request's acceptance rule from ``sampling`` (acceptance_rule's
    arguments) and make_sampler's other keywords (those that change
    something), every control checked first: one error before any work."""
    check_controls(
        logits_processors=logits_processors, xtc_probability=xtc_probability, xtc_threshold=xtc_threshold,
        xtc_special_tokens=xtc_special_tokens, min_tokens_to_keep=min_tokens_to_keep, vocab_size=target.vocab_size, **kv,
    )
    more = {} if min_tokens_to_keep == 1 else dict(min_tokens_to_keep=min_tokens_to_keep)
    if xtc_probability > 0:
        more.update(xtc_probability=xtc_probability, xtc_threshold=xtc_threshold,
                    xtc_special_tokens=list(xtc_special_tokens) if xtc_special_tokens else None)
    return acceptance_rule(*sampling, **more)


def row_controls(logits_processors, constraint, prompt: List[int], all_tokens=None) -> list:
    """A request's controls (:attr:`~dflash_mlx.decode.Request.controls`):
    its logits processors, then its grammar's mask, applied last as a
    masking processor after mlx-lm's own would be. The processors' history
    starts with what mlx-lm's ``generate_step`` is given as its prompt:
    ``prompt`` (on a reused cache only the new turn's tokens: mlx-lm ran the
    last turn's tokens, its last one too, as it generated them), or, given
    ``all_tokens`` (the tokens before ``prompt``: mlx-lm's
    ``BatchGenerator.insert`` keyword, by which its server shows the
    processors a cached prefix), those first."""
    processors = [Processors(logits_processors, list(all_tokens or []) + list(prompt))] if logits_processors else []
    return processors + ([constraint] if constraint else [])


def stop_tokens(eos_token_ids, constraint) -> frozenset:
    """A request's stop tokens: its own (one id, as a Hugging Face
    generation config may give it, or any iterable of ids), and its
    grammar's (where a complete answer ends)."""
    own = [eos_token_ids] if isinstance(eos_token_ids, (int, np.integer)) else eos_token_ids
    return frozenset(int(t) for t in own) | frozenset(constraint.eos if constraint else ())


@contextmanager
def generation(target, draft, cache: PromptCache, stream):
    """What a generation runs in: the pair owned by this thread, its
    stream; however it ends (closed at any token, an error), a cycle it
    queued ahead is rolled back and the cache left at rest."""
    with on_pair(draft, stream):
        try:
            yield
        finally:
            if cache.target.undo is not None:  # interrupted inside a cycle
                target.rollback(cache.target, 0)
            cache.drop_unreadable()  # at rest, the cache holds only what a drafter may read
            mx.clear_cache()


def alone(target, draft, request: Request, first: BatchResponse, max_block: int, trees, fixed: bool, sizer):
    """A prefilled lone request's tokens, from its prefill's ``first``: the
    cycles' costs measured if they are not yet (after ``first`` goes out),
    then a decoder holding it alone, whose first cycle is queued before
    ``first`` goes out, then cycle after cycle to its end."""
    if first.finish_reason is not None or not calibrated(target, draft, max_block, trees[1]):
        yield from yielded(first)  # before the cycles' costs are measured, not after
        if first.finish_reason is not None:
            return
        first = None
    decoder = decoder_for(target, draft, request.cache, max_block, fixed, sizer, trees)
    decoder.join([request])
    decoder.queue()
    if first is not None:
        yield from yielded(first)
    while True:
        for response in decoder.step():
            yield from yielded(response)
            if response.finish_reason is not None:
                return


def decoder_for(target, draft, cache: PromptCache, max_block: int, fixed: bool, sizer, trees) -> Decoder:
    """A decoder sized by ``sizer``, else the pair's (what earlier generations
    learnt carries over) or a fixed one (:func:`~dflash_mlx.calibration.plan`;
    ``trees``: :func:`tree_plan`'s answer); the cycles' costs are measured on
    ``cache`` first if they are not yet."""
    sizer, settle = plan(target, draft, cache.target, cache.target_hidden, max_block, fixed, sizer, *trees)
    return Decoder(target, draft, max_block, settle, Sizing(sizer))


def yielded(response: BatchResponse):
    """A request's tokens from one cycle as :func:`generate_step` yields them."""
    for i, token in enumerate(response.tokens):
        lp = None if response.logprobs is None else response.logprobs[i]
        yield token, lp, response.from_draft[i], response.block, response.tree, response.copied[i]


def stream_generate(
    model,
    draft,
    tokenizer,
    prompt: Union[str, List[int], mx.array],
    *,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    prompt_cache: Optional[PromptCache] = None,
    stream=generation_stream,
    record=None,
    **kwargs,
) -> Generator[GenerationResponse, None, None]:
    """Generate from ``model`` with ``draft`` proposing blocks; yields per cycle.

    The text layer over :func:`generate_step` (which documents the sampling
    options in ``kwargs``): it detokenizes, stops at the tokenizer's eos
    ids, ends at ``max_tokens`` and keeps the statistics
    (:class:`~dflash_mlx.decode.Stats`). With ``prompt_cache``
    (:func:`dflash_mlx.make_prompt_cache`) ``prompt`` is only the new part
    of the conversation, as in mlx-lm. ``record``
    (a :class:`dflash_mlx.traffic.Recorder`) stores the conversation when
    the generation finishes, as training data for the drafter.
    ``copy_drafts`` (on by default): cycles may also verify what followed
    an earlier occurrence of the context's end (:mod:`dflash_mlx.copy_source`)
    where the request's acceptance of such copies says that is faster;
    exact as any draft (a copied token is a point-mass proposal).
    """
    if not isinstance(tokenizer, TokenizerWrapper):
        tokenizer = TokenizerWrapper(tokenizer)
    constraint = constraint_for(kwargs.pop("response_format", None), tokenizer)
    prompt = encode_prompt(tokenizer, prompt)
    context = (list(prompt_cache.tokens) if prompt_cache is not None else []) + prompt.tolist()
    eos = set(tokenizer.eos_token_ids)
    detok = tokenizer.detokenizer
    detok.reset()
    steps = generate_step(
        prompt, model, draft, prompt_cache=prompt_cache, max_tokens=max_tokens,
        eos_token_ids=eos, stream=stream, response_format=constraint, **kwargs,
    )
    with wired_limit(model, [stream]), closing(steps):
        tic = time.perf_counter()
        n_out, prompt_tps, answer, stats, seen = 0, None, [], Stats(), Stats()  # seen: the totals at the last response
        for token, _, from_draft, block, tree, was_copied in steps:
            if prompt_tps is None:
                prompt_tps = prompt.size / (time.perf_counter() - tic)
                tic = time.perf_counter()
            answer.append(token)
            stats.count(from_draft, block, tree, was_copied)
            finish = "stop" if token in eos else None
            n_out += 1  # (an eos counted too, as mlx-lm's stream_generate counts it)
            if finish is None:
                detok.add_token(token)
                finish = "length" if n_out == max_tokens else None
            if from_draft and finish is None:
                continue
            if finish:
                detok.finalize()
                if record is not None:  # before the last yield: a caller may stop at it
                    record.record(context, answer)
            stats.forced = constraint.forced_count if constraint else 0
            yield GenerationResponse(
                text=detok.last_segment,
                tokens=[t for t in answer[seen.tokens :] if t not in eos],
                accepted=stats.accepted - seen.accepted,
                committed=stats.tokens - seen.tokens,
                prompt_tokens=prompt.size,
                prompt_tps=prompt_tps,
                generation_tokens=n_out,
                generation_tps=n_out / max(time.perf_counter() - tic, 1e-9),
                peak_memory=mx.get_peak_memory() / 1e9,
                finish_reason=finish,
                block_size=block,
                tree_size=tree,
                forced=stats.forced - seen.forced,
                copied=stats.copied - seen.copied,
            )
            if finish:
                return
            seen = replace(stats)


def generate(model, draft, tokenizer, prompt, verbose: bool = False, **kwargs) -> str:
    """Whole-text convenience wrapper around :func:`stream_generate`."""
    text = ""
    for response in stream_generate(model, draft, tokenizer, prompt, **kwargs):
        if verbose:
            print(response.text, end="", flush=True)
        text += response.text
    if verbose:
        print()
    return text


def setup_arg_parser() -> cli.ArgumentParser:
    p = cli.ArgumentParser(description="Generate text with a target model and a DFlash drafter.")
    cli.add_pair_arguments(p)
    p.add_argument("--prompt", "-p", default=None, help="prompt text ('-' reads stdin; default: a bundled held-out prompt)")
    p.add_argument("--max-tokens", "-m", type=cli.positive_int, default=DEFAULT_MAX_TOKENS)
    cli.add_sampling_arguments(p)
    cli.add_xtc_arguments(p)
    p.add_argument("--seed", type=cli.seed, default=None, help="seed mx.random; a sampled run repeats exactly only with a fixed --block-size (the adaptive default follows measured speed)")
    p.add_argument(
        "--acceptance",
        choices=ACCEPTANCE_RULES,
        default="speculative",
        help="rule for drafted tokens at --temp > 0: rejection sampling or exact match (both lossless)",
    )
    cli.add_block_size_argument(p)
    cli.add_tree_budget_argument(p)
    cli.add_copy_drafts_argument(p)
    p.add_argument("--ignore-chat-template", action="store_true", help="feed the prompt as is")
    p.add_argument("--system-prompt", default=None)
    cli.add_template_arguments(p)
    cli.add_prompt_arguments(p)
    cli.add_kv_cache_arguments(p)
    cli.add_load_arguments(p)
    cli.add_prefill_step_size_argument(p)
    cli.add_draft_window_arguments(p)
    cli.add_structured_arguments(p)
    p.add_argument("--verbose", type=lambda s: s.lower() in ("1", "true", "yes"), default=True, help="stream text and print statistics")
    p.add_argument("--pipeline", action="store_true", help="split the target's layers across the processes mlx.launch started (see docs/pipeline.md)")
    return p


def build_prompt(tokenizer, prompt: str, system_prompt=None, use_chat_template=True, template_kwargs=None,
                 prefill_response=None, after_cache: bool = False):
    """The prompt as mlx_lm.generate builds it: the tokenizer's chat template
    applied when it has one (:func:`~dflash_mlx.controls.template_prompt`;
    tokens), else the text as is. ``after_cache``: only what follows a
    saved prompt cache's conversation (the template's text from the user's
    message on, as mlx_lm.generate cuts it)."""
    if not (use_chat_template and getattr(tokenizer, "chat_template", None)):
        return prompt
    if not after_cache:
        return template_prompt(tokenizer, prompt, system_prompt, template_kwargs, prefill_response)
    text = template_prompt(tokenizer, prompt, system_prompt, template_kwargs, prefill_response, tokenize=False)
    probe = template_prompt(tokenizer, "<query>", system_prompt, template_kwargs, prefill_response, tokenize=False)
    return tokenizer.encode(text[probe.index("<query>") :], add_special_tokens=False)


def load_for_main(args):
    """The pair, tokenizer and prompt cache (``--prompt-cache-file``; None) a command line asks for."""
    from .pair import load_pair

    if args.pipeline:
        from .pipeline import load_for_command

        if args.adapter_path is not None:
            raise ArgumentError("--adapter-path does not work with --pipeline yet: leave one of them out")
        model, tokenizer, draft = load_for_command(args.model, args.draft_model, seed=args.seed)
    else:
        model, tokenizer, draft, _ = load_pair(args.model, args.draft_model, args.adapter_path, args.trust_remote_code)
    add_extra_eos_tokens(tokenizer, args.extra_eos_token)
    if args.use_default_chat_template and getattr(tokenizer, "chat_template", None) is None:
        tokenizer.chat_template = tokenizer.default_chat_template
    cache = None if args.prompt_cache_file is None else load_prompt_cache(args.prompt_cache_file, draft)
    return model, tokenizer, draft, cache


def main(argv=None):
    from .blas import warn_if_reference
    from .pair import DEFAULT_TARGET, default_prompt

    args = setup_arg_parser().parse_args(argv)
    response_format = cli.response_format(args)  # (checked before loading)
    rank = mx.distributed.init().rank() if args.pipeline else 0
    model, tokenizer, draft, prompt_cache = load_for_main(args)
    controls = cli.generation_keywords(args, tokenizer)
    warn_if_reference()  # loaded: about to decode
    args.verbose = args.verbose and rank == 0  # only rank 0 prints
    if rank == 0 and str(args.model) == str(DEFAULT_TARGET):
        print(f"[bundled default pair: {DEFAULT_TARGET.parent}]", file=sys.stderr)
    prompt = args.prompt if args.prompt is not None else default_prompt(args.model)
    if prompt == "-":
        prompt = sys.stdin.read()
    prompt = build_prompt(
        tokenizer, prompt, args.system_prompt, not args.ignore_chat_template, args.chat_template_config,
        args.prefill_response, after_cache=prompt_cache is not None,
    )
    if args.verbose and isinstance(prompt, str):
        print(prompt, end="", flush=True)
    if args.seed is not None:
        mx.random.seed(args.seed)
    responses = []
    for r in stream_generate(
        model,
        draft,
        tokenizer,
        prompt,
        prompt_cache=prompt_cache,
        block_size=args.block_size,
        tree_budget=args.tree_budget,
        max_tokens=args.max_tokens,
        temperature=args.temp,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        acceptance=args.acceptance,
        prefill_step_size=args.prefill_step_size,
        draft_window=args.draft_window,
        draft_sink=args.draft_sink,
        response_format=response_format,
        copy_drafts=args.copy_drafts,
        **controls,
    ):
        if args.verbose:
            print(r.text, end="", flush=True)
        responses.append(r)
    if args.verbose and responses:
        print_statistics(responses)
    return 0


def print_statistics(responses: Sequence[GenerationResponse]) -> None:
    """What ``generate --verbose`` prints after the text."""
    last, cycles = responses[-1], cycle_lengths(responses)
    print("\n" + "=" * 10)
    print(f"Prompt: {last.prompt_tokens} tokens, {last.prompt_tps:.3f} tokens-per-sec")
    print(f"Generation: {last.generation_tokens} tokens, {last.generation_tps:.3f} tokens-per-sec")
    if cycles:
        print(f"Mean tokens per cycle: {mean_tokens_per_cycle(cycles):.2f} over {len(cycles)} cycles")
        copied = sum(r.copied for r in responses)
        print(f"Accepted drafted tokens: {sum(r.accepted for r in responses) - copied} from the drafter, {copied} copied from the context")
        sizes = Counter(r.block_size for r in responses[1:] if not r.tree_size)
        print("Block sizes (size:cycles): " + " ".join(f"{b}:{k}" for b, k in sorted(sizes.items())))
        trees = Counter(r.tree_size for r in responses[1:] if r.tree_size)
        if trees:
            print("Draft trees (nodes:cycles): " + " ".join(f"{n}:{k}" for n, k in sorted(trees.items())))
    forced = sum(r.forced for r in responses)
    if forced:
        print(f"Forced by the response format: {forced} tokens (no drafting needed)")
    print(f"Peak memory: {last.peak_memory:.3f} GB")


if __name__ == "__main__":
    sys.exit(cli.run(main))
