"""Interactive chat with a target + DFlash drafter (mlx_lm.chat's manner).

    mlx-dflash chat --model Qwen/Qwen3.5-4B --draft-model z-lab/Qwen3.5-4B-DFlash

The conversation lives in one prompt cache: each turn prefills only the new
message, as mlx_lm.chat does. Type 'q' to quit, 'r' to reset the
conversation, 'h' for help (the bare letter, as mlx_lm.chat reads it: any
other line is a message). Targets without a chat template (the bundled
code model) continue the running text instead.
"""

import sys

import mlx.core as mx

from . import cli
from .adapt import add_learn_arguments
from .cache import make_prompt_cache
from .controls import add_extra_eos_tokens, kv_keywords, template_prompt
from .defaults import DEFAULT_MAX_TOKENS
from .generate import cycle_lengths, mean_tokens_per_cycle, stream_generate


HELP = "[q quits, r resets, h shows this]"


def setup_arg_parser() -> cli.ArgumentParser:
    p = cli.ArgumentParser(description="Chat with a target model, drafted by DFlash.")
    cli.add_pair_arguments(p)
    p.add_argument("--max-tokens", "-m", type=cli.positive_int, default=DEFAULT_MAX_TOKENS)
    cli.add_sampling_arguments(p)
    cli.add_xtc_arguments(p)
    cli.add_kv_cache_arguments(p)
    cli.add_load_arguments(p)
    cli.add_template_arguments(p)
    p.add_argument("--seed", type=cli.seed, default=0, help="PRNG seed")
    cli.add_block_size_argument(p)
    cli.add_tree_budget_argument(p)
    cli.add_copy_drafts_argument(p)
    p.add_argument("--system-prompt", default=None)
    cli.add_prefill_step_size_argument(p)
    cli.add_draft_window_arguments(p)
    p.add_argument("--pipeline", action="store_true", help="split the target's layers across the processes mlx.launch started (see docs/pipeline.md)")
    add_learn_arguments(p)
    return p


def turn_prompt(tokenizer, query: str, system_prompt=None, template_kwargs=None):
    """The new message alone, templated as mlx_lm.chat templates it (the
    earlier turns are in the cache; ``template_kwargs``: --chat-template-config);
    plain text plus a newline without a chat template."""
    if not getattr(tokenizer, "chat_template", None):
        return query + "\n"
    return template_prompt(tokenizer, query, system_prompt, template_kwargs)


def main(argv=None, input_fn=input):
    from .adapt import learning
    from .blas import warn_if_reference
    from .pair import load_pair

    args = setup_arg_parser().parse_args(argv)
    recorder = learning(args)[0]  # --learn
    if args.pipeline:
        from .pipeline import load_for_command, rank0_repl

        model, tokenizer, draft = load_for_command(args.model, args.draft_model, seed=args.seed)
        input_fn = rank0_repl(input_fn, mx.distributed.init())  # every rank gets rank 0's lines; only rank 0 prints
    else:
        model, tokenizer, draft, _ = load_pair(args.model, args.draft_model, args.adapter_path, args.trust_remote_code)
    add_extra_eos_tokens(tokenizer, args.extra_eos_token)
    controls = cli.generation_keywords(args, tokenizer)
    warn_if_reference()  # loaded: about to decode
    mx.random.seed(args.seed)
    templated = bool(getattr(tokenizer, "chat_template", None))
    print(HELP + ("" if templated else " [no chat template: text continuation]"))
    cache = make_prompt_cache(model, draft, args.draft_window, args.draft_sink, **kv_keywords(controls))
    while True:
        try:
            query = input_fn(">> ")
        except EOFError:
            break
        if query == "q":
            break
        if query == "h":
            print(HELP)
            continue
        if query == "r":
            cache = make_prompt_cache(model, draft, args.draft_window, args.draft_sink, **kv_keywords(controls))
            print("[conversation reset]")
            continue
        reused, responses = cache.offset, []
        for r in stream_generate(
            model, draft, tokenizer, turn_prompt(tokenizer, query, args.system_prompt, args.chat_template_config),
            prompt_cache=cache, block_size=args.block_size, tree_budget=args.tree_budget, max_tokens=args.max_tokens,
            temperature=args.temp, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
            prefill_step_size=args.prefill_step_size, record=recorder, copy_drafts=args.copy_drafts, **controls,
        ):
            print(r.text, end="", flush=True)
            responses.append(r)
        print(
            f"\n[{r.generation_tps:.1f} tok/s, {reused} prompt tokens reused, "
            f"{mean_tokens_per_cycle(cycle_lengths(responses)):.2f} tokens/cycle]"
        )
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
