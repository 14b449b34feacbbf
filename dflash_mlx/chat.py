"""Interactive chat with a target + DFlash drafter (mlx_lm.chat's manner).

    mlx-dflash chat --model Qwen/Qwen3.5-4B --draft-model z-lab/Qwen3.5-4B-DFlash

The conversation lives in one prompt cache: each turn prefills only the new
message, as mlx_lm.chat does. Type 'q' to quit, 'r' to reset the
conversation. Targets without a chat template (the bundled code model)
continue the running text instead.
"""

import argparse
import sys

import mlx.core as mx

from .cache import make_prompt_cache
from .generate import stream_generate


def setup_arg_parser():
    from .pair import DEFAULT_TARGET

    p = argparse.ArgumentParser(description="Chat with a target model, drafted by DFlash.")
    p.add_argument("--model", default=str(DEFAULT_TARGET))
    p.add_argument("--draft-model", default=None)
    p.add_argument("--max-tokens", "-m", type=int, default=512)
    p.add_argument("--temp", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0, help="PRNG seed")
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--system-prompt", default=None)
    p.add_argument("--prefill-step-size", type=int, default=2048)
    p.add_argument("--pipeline", action="store_true", help="split the target's layers across the processes mlx.launch started (see the README)")
    return p


def turn_prompt(tokenizer, query: str, system_prompt=None):
    """The new message alone, templated as mlx_lm.chat templates it (the
    earlier turns are in the cache); plain text plus a newline without a
    chat template."""
    if not getattr(tokenizer, "chat_template", None):
        return query + "\n"
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages.append({"role": "user", "content": query})
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True)


def main(argv=None, input_fn=input):
    from .pair import load_pair

    args = setup_arg_parser().parse_args(argv)
    group = mx.distributed.init() if args.pipeline else None
    try:
        if group is not None:
            from .pipeline import load_pipelined_pair, rank0_repl

            model, tokenizer, draft = load_pipelined_pair(args.model, args.draft_model, seed=args.seed)
            input_fn = rank0_repl(input_fn, group)  # every rank gets rank 0's lines; only rank 0 prints
        else:
            model, tokenizer, draft, _ = load_pair(args.model, args.draft_model)
    except (ValueError, FileNotFoundError) as e:
        if group is None or group.rank() == 0:  # with --pipeline every rank has the same message
            print(f"error: {e}", file=sys.stderr)
        return 1
    mx.random.seed(args.seed)
    templated = bool(getattr(tokenizer, "chat_template", None))
    print("[q quits, r resets]" + ("" if templated else " [no chat template: text continuation]"))
    cache = make_prompt_cache(model, draft)
    while True:
        try:
            query = input_fn(">> ")
        except EOFError:
            break
        if query.strip() == "q":
            break
        if query.strip() == "r":
            cache = make_prompt_cache(model, draft)
            print("[conversation reset]")
            continue
        reused, cycles, committed = cache.offset, 0, 0
        for r in stream_generate(
            model, draft, tokenizer, turn_prompt(tokenizer, query, args.system_prompt),
            prompt_cache=cache, block_size=args.block_size, max_tokens=args.max_tokens,
            temperature=args.temp, top_p=args.top_p, prefill_step_size=args.prefill_step_size,
        ):
            print(r.text, end="", flush=True)
            cycles += 1
            committed += r.committed
        # The first response is the prefill's token, not a verify cycle.
        print(
            f"\n[{r.generation_tps:.1f} tok/s, {reused} prompt tokens reused, "
            f"{(committed - 1) / max(1, cycles - 1):.2f} tokens/cycle]"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
