"""Lossless block-wise generation: prefill, draft, verify, accept, roll back, stream.

    python -m dflash_mlx.generate --prompt "def fib(n):"
"""

import argparse
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, Generator, List, Optional, Tuple, Union

import mlx.core as mx
from mlx_lm.generate import generation_stream, wired_limit
from mlx_lm.sample_utils import make_sampler
from mlx_lm.tokenizer_utils import TokenizerWrapper

from .sampling import ACCEPTANCE_RULES, processed_probs, speculative_accept


@dataclass
class GenerationResponse:
    """One verify cycle's worth of output (the first one is the prefill token).

    Args:
        text: the new text segment.
        tokens: the tokens committed this cycle (eos excluded, as mlx-lm does).
        accepted: drafted tokens the target accepted this cycle.
        committed: tokens this cycle committed before any eos / length cut
            (accepted + 1; the "acceptance length" papers report).
        prompt_tokens, prompt_tps: prompt size and prefill speed.
        generation_tokens, generation_tps: totals so far.
        peak_memory: in GB.
        finish_reason: "stop" (eos), "length" (max_tokens) or None.
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


@dataclass
class PhaseTimer:
    """Wall time per phase, for the benchmark. Timing forces a sync per phase."""

    seconds: Dict[str, float] = field(
        default_factory=lambda: {"prefill": 0.0, "draft": 0.0, "verify": 0.0, "rollback": 0.0, "host": 0.0}
    )
    cycles: int = 0
    _t: float = 0.0

    def start(self):
        self._t = time.perf_counter()

    def lap(self, phase: str, *arrays):
        if arrays:
            mx.eval(*arrays)
        now = time.perf_counter()
        self.seconds[phase] += now - self._t
        self._t = now


def encode_prompt(tokenizer: TokenizerWrapper, prompt) -> mx.array:
    """str, token list or mx.array -> 1-D token array (mlx-lm's rule for BOS)."""
    if isinstance(prompt, mx.array):
        return prompt.reshape(-1)
    if isinstance(prompt, str):
        add_special = tokenizer.bos_token is None or not prompt.startswith(tokenizer.bos_token)
        prompt = tokenizer.encode(prompt, add_special_tokens=add_special)
    return mx.array(prompt)


@mx.compile  # a handful of tiny ops, fused: one task instead of seven per cycle
def accept_greedy(draft_tokens: mx.array, target_tokens: mx.array) -> Tuple[mx.array, mx.array]:
    """Longest prefix where the draft equals the target's choice, and the
    target's own token at the first mismatch (or after the last slot).

    ``[..., n]`` and ``[..., n + 1]`` in, ``(accepted, next_token)`` out, on
    the device like :func:`speculative_accept`, so the loop reads the whole
    outcome in one host sync.
    """
    n = draft_tokens.shape[-1]
    same = (draft_tokens == target_tokens[..., :n]).astype(mx.int32)
    accepted = mx.cumprod(same, axis=-1).sum(axis=-1)
    return accepted, mx.take_along_axis(target_tokens, accepted[..., None], axis=-1)[..., 0]


def prefill(target, prompt: mx.array, cache, step: int):
    """Run the prompt through the target; return last logits and all taps.

    Mirrors mlx-lm's generate_step: all but the last token in chunks of
    ``step``, then the last token alone.
    """
    taps = []
    tokens = prompt[None]
    n = tokens.shape[1]
    start = 0
    while n - start > 1:
        end = min(start + step, n - 1)
        _, t = target.forward(tokens[:, start:end], cache, last_logits_only=True, record=False)
        mx.eval(t, [c.state for c in cache])
        taps.append(t)
        start = end
    logits, t = target.forward(tokens[:, start:], cache, last_logits_only=True, record=False)
    taps.append(t)
    return logits[:, -1], mx.concatenate(taps, axis=1)


def stream_generate(
    model,
    draft,
    tokenizer,
    prompt: Union[str, List[int], mx.array],
    *,
    block_size: Optional[int] = None,
    max_tokens: int = 256,
    temperature: float = 0.0,
    top_p: float = 0.0,
    top_k: int = 0,
    min_p: float = 0.0,
    sampler: Optional[Callable[[mx.array], mx.array]] = None,
    acceptance: str = "speculative",
    prefill_step_size: int = 2048,
    timer: Optional[PhaseTimer] = None,
) -> Generator[GenerationResponse, None, None]:
    """Generate from ``model`` with ``draft`` proposing blocks; yields per cycle.

    Greedy (``temperature == 0`` and no ``sampler``) output is token-identical
    to the target's own greedy decode. With ``temperature > 0`` every committed
    token is distributed exactly as mlx-lm's ``make_sampler(temperature,
    top_p, min_p, top_k=top_k)`` samples the target, under either
    ``acceptance`` rule:

    - ``"speculative"`` (default): the drafter samples its block from its own
      processed distribution q; each draft token survives with probability
      min(1, p/q) against the target's processed p, the first rejected slot
      is resampled from max(0, p - q) (reference section 6).
    - ``"exact-match"``: the drafter proposes greedily, the target samples
      every slot, and a draft token survives only if it equals that sample.
      Simpler, accepts less; kept for comparison.

    A custom ``sampler`` (mlx-lm style, fed log-probabilities; it overrides
    ``temperature`` and the truncation arguments) only yields tokens, not the
    p that rejection sampling needs, so it always uses exact match. Seed
    ``mx.random`` to reproduce a sampled run. ``block_size`` defaults to the
    drafter's trained size; 1 is plain target decoding.
    """
    if acceptance not in ACCEPTANCE_RULES:
        raise ValueError(f"acceptance must be one of {ACCEPTANCE_RULES}, not {acceptance!r}")
    if not isinstance(tokenizer, TokenizerWrapper):
        tokenizer = TokenizerWrapper(tokenizer)
    if max_tokens < 1:
        raise ValueError("max_tokens must be at least 1")
    block_size = draft.block_size if block_size is None else int(block_size)
    if block_size < 1:
        raise ValueError("block_size must be at least 1")
    draft.check_block_size(block_size)
    if draft._target is None or draft._target.model is not model:
        draft.bind(model)
    target = draft.target
    speculative = sampler is None and temperature > 0 and acceptance == "speculative"
    sampling = dict(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p)
    if sampler is None and temperature > 0:
        sampler = make_sampler(temperature, top_p=top_p, min_p=min_p, top_k=top_k)

    def choose(logits):  # target's token(s) for logits [..., V]
        if sampler is None:
            return mx.argmax(logits, axis=-1)
        return sampler(logits - mx.logsumexp(logits, axis=-1, keepdims=True))

    def accept(logits, proposal, q):
        """Accepted count, the token after them and the proposal, read in one sync."""
        if q is None:
            accepted, token = accept_greedy(proposal, choose(logits))
        else:
            accepted, token = speculative_accept(proposal, processed_probs(logits, **sampling), q)
        outcome = mx.concatenate([accepted[None], token[None], proposal]).astype(mx.int32)
        accepted, token, *proposed = outcome.tolist()
        return accepted, token, proposed

    prompt = encode_prompt(tokenizer, prompt)
    if prompt.size == 0:
        raise ValueError("the prompt is empty")
    eos = set(tokenizer.eos_token_ids)
    detok = tokenizer.detokenizer
    detok.reset()

    # On a GPU the host builds the next graph while the device computes. On
    # the CPU backend that overlap takes cores from the compute threads (on
    # two cores, 1 ms of host work during the draft cost 3 ms), so there each
    # phase runs to completion before the host goes on: 3% faster a cycle.
    settle = mx.async_eval if mx.default_device() == mx.gpu else mx.eval

    with wired_limit(model, [generation_stream]):
        cache = target.make_cache()
        draft_cache = draft.make_cache()
        tic = time.perf_counter()
        if timer:
            timer.start()
        logits, context = prefill(target, prompt, cache, prefill_step_size)
        anchor = choose(logits).item()
        if timer:
            timer.lap("prefill")
        prompt_tps = prompt.size / (time.perf_counter() - tic)
        tic = time.perf_counter()
        n_out = 0

        def respond(new_tokens, accepted, committed):
            nonlocal n_out
            finish = None
            out = []
            for t in new_tokens:
                if t in eos:
                    finish = "stop"
                    break
                out.append(t)
                detok.add_token(t)
                n_out += 1
                if n_out == max_tokens:
                    finish = "length"
                    break
            if finish:
                detok.finalize()
            return GenerationResponse(
                text=detok.last_segment,
                tokens=out,
                accepted=accepted,
                committed=committed,
                prompt_tokens=prompt.size,
                prompt_tps=prompt_tps,
                generation_tokens=n_out,
                generation_tps=n_out / max(time.perf_counter() - tic, 1e-9),
                peak_memory=mx.get_peak_memory() / 1e9,
                finish_reason=finish,
            )

        def start_draft(length):
            """Draft the next ``length``-slot block (done, or queued on a GPU,
            when this returns). None when the next cycle verifies the anchor
            alone."""
            if length < 2:
                return None
            block = mx.array([[anchor] + [draft.mask_token_id] * (length - 1)])
            q = None  # the drafter's distribution, when rejection sampling
            if speculative:
                drafted, q = draft.propose_with_probs(block, context, draft_cache, **sampling)
                q = q[0]
            else:
                drafted = draft.propose(block, context, draft_cache)
            settle(drafted)
            if timer:
                timer.lap("draft", drafted)
            return drafted, q

        response = respond([anchor], 0, 1)
        if timer:
            timer.start()
        # Never verify more slots than tokens we may still emit.
        drafting = start_draft(min(block_size, max_tokens - n_out))
        yield response
        while response.finish_reason is None:
            if timer:
                timer.start()
            if drafting is None:
                q, verify_in = None, mx.array([[anchor]])
            else:
                drafted, q = drafting
                verify_in = mx.concatenate([mx.array([[anchor]]), drafted.astype(mx.int32)], axis=1)
            logits, taps = target.forward(verify_in, cache)
            accepted, bonus, proposed = accept(logits[0], verify_in[0, 1:], q)
            if timer:
                timer.lap("verify", taps, [c.state for c in cache])
            new_tokens = proposed[:accepted] + [bonus]
            anchor, context = bonus, taps[:, : accepted + 1]
            # The next block needs only the accepted taps: draft it now.
            remaining = max_tokens - n_out - len(new_tokens)
            ends = remaining < 1 or any(t in eos for t in new_tokens)
            drafting = None if ends else start_draft(min(block_size, remaining))
            target.rollback(cache, accepted + 1)
            restored = [c.state for c in cache]
            settle(restored, context)
            if timer:
                timer.lap("rollback", restored)
                timer.cycles += 1
            response = respond(new_tokens, accepted, accepted + 1)
            if timer:
                timer.lap("host")
            yield response
        mx.clear_cache()


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


def setup_arg_parser() -> argparse.ArgumentParser:
    from .pair import DEFAULT_TARGET

    p = argparse.ArgumentParser(description="Generate text with a target model and a DFlash drafter.")
    p.add_argument("--model", default=str(DEFAULT_TARGET), help="target: local path or Hugging Face id (default: the bundled pair)")
    p.add_argument("--draft-model", default=None, help="DFlash/DFlash2 drafter: local path or Hugging Face id (default: the bundled pair's when --model is the default)")
    p.add_argument("--prompt", "-p", default=None, help="prompt text ('-' reads stdin; default: a bundled held-out prompt)")
    p.add_argument("--max-tokens", "-m", type=int, default=256)
    p.add_argument("--temp", type=float, default=0.0, help="sampling temperature (0 = greedy)")
    p.add_argument("--top-p", type=float, default=0.0, help="nucleus sampling threshold (0 = off)")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens (0 = off)")
    p.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min-p x the top probability (0 = off)")
    p.add_argument("--seed", type=int, default=None, help="seed mx.random for a reproducible sampled run")
    p.add_argument(
        "--acceptance",
        choices=ACCEPTANCE_RULES,
        default="speculative",
        help="rule for drafted tokens at --temp > 0: rejection sampling or exact match (both lossless)",
    )
    p.add_argument("--block-size", type=int, default=None, help="verify width (default: the drafter's trained block size; 1 = plain decoding)")
    p.add_argument("--ignore-chat-template", action="store_true", help="feed the prompt as is")
    p.add_argument("--system-prompt", default=None)
    p.add_argument("--prefill-step-size", type=int, default=2048)
    p.add_argument("--verbose", type=lambda s: s.lower() in ("1", "true", "yes"), default=True, help="stream text and print statistics")
    p.add_argument("--pipeline", action="store_true", help="split the target's layers across the processes mlx.launch started (see the README)")
    return p


def build_prompt(tokenizer, prompt: str, system_prompt=None, use_chat_template=True):
    """Apply the tokenizer's chat template when it has one (mlx_lm.generate's rule)."""
    if use_chat_template and getattr(tokenizer, "chat_template", None):
        messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
        messages.append({"role": "user", "content": prompt})
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return prompt


def main(argv=None):
    from .pair import DEFAULT_TARGET, default_prompt, load_pair

    args = setup_arg_parser().parse_args(argv)
    rank = mx.distributed.init().rank() if args.pipeline else 0
    try:
        if args.pipeline:
            from .pipeline import load_pipelined_pair

            model, tokenizer, draft = load_pipelined_pair(args.model, args.draft_model, seed=args.seed)
        else:
            model, tokenizer, draft, _ = load_pair(args.model, args.draft_model)
    except (ValueError, FileNotFoundError) as e:
        if rank == 0:  # with --pipeline every rank has the same message
            print(f"error: {e}", file=sys.stderr)
        return 1
    args.verbose = args.verbose and rank == 0  # only rank 0 prints
    if rank == 0 and str(args.model) == str(DEFAULT_TARGET):
        print(f"[bundled default pair: {DEFAULT_TARGET.parent}]", file=sys.stderr)
    prompt = args.prompt if args.prompt is not None else default_prompt()
    if prompt == "-":
        prompt = sys.stdin.read()
    prompt = build_prompt(tokenizer, prompt, args.system_prompt, not args.ignore_chat_template)
    if args.verbose and isinstance(prompt, str):
        print(prompt, end="", flush=True)
    if args.seed is not None:
        mx.random.seed(args.seed)
    cycles, committed = 0, 0
    last = None
    for last in stream_generate(
        model,
        draft,
        tokenizer,
        prompt,
        block_size=args.block_size,
        max_tokens=args.max_tokens,
        temperature=args.temp,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        acceptance=args.acceptance,
        prefill_step_size=args.prefill_step_size,
    ):
        if args.verbose:
            print(last.text, end="", flush=True)
        cycles += 1
        committed += last.committed
    if args.verbose and last is not None:
        print("\n" + "=" * 10)
        print(f"Prompt: {last.prompt_tokens} tokens, {last.prompt_tps:.3f} tokens-per-sec")
        print(f"Generation: {last.generation_tokens} tokens, {last.generation_tps:.3f} tokens-per-sec")
        # The first response is the prefill's token, not a verify cycle.
        if cycles > 1:
            print(f"Mean tokens per cycle: {(committed - 1) / (cycles - 1):.2f} over {cycles - 1} cycles")
        print(f"Peak memory: {last.peak_memory:.3f} GB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
