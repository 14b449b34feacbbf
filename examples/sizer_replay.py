"""Replay the block sizer on a real generation's acceptance, free of the
machine's noise: how good its choices are, apart from how fast the machine
happened to be while it made them.

    python examples/sizer_replay.py                    # bundled pair, `import os`, 2,048 tokens
    python examples/sizer_replay.py --prompt-index 1   # a held-out prompt instead
    python examples/sizer_replay.py --slow 1.8         # with slow spells of the machine
    python examples/sizer_replay.py --bench 24         # the bench's prompts in turn, 128 tokens each
    python examples/sizer_replay.py --model smollm2 --bench 8 --max-tokens 256   # a named pair's held-out requests

The bundled pair by default, or a named pair (``--model smollm2``) on its
held-out requests; the costs are measured by ``plain_step.py``'s scripted
sizer on that pair.

First the greedy generation (mlx-lm's), and at every position of it how many
tokens of a whole drafted block the target accepts there: the drafter runs
at every position on the target's own tap states, as the loop's drafting
cycle would. The costs are the loop's own, measured here on the bundled
pair (``plain_step.switching``: a scripted sizer alternating runs of
drafting cycles and plain steps): a plain step, a whole block's drafting
cycle, and a switch (what a run of each costs beyond as many steady cycles:
the plain step before a drafting cycle looks nearly free and the one after
it dear, BENCHMARKS.md "The switch priced apart"); a shorter block saves
what the verify's rows cost (:func:`time_forwards`). Each cycle's seconds
are jittered (log-normal, ``--noise``) and, with ``--slow``, multiplied in
spells of a few hundred cycles.

Then the loop's choices are replayed, cycle by cycle, for the default
:class:`BlockSizer` (adaptive), the fixed trained block and plain decoding,
each over ``--seeds`` seeds of the jitter: seconds per token against plain
decoding's, the drafting cycles and the spells of them. With ``--bench N``
one sizer goes through the first N bench prompts in turn, as the bench's
own loop does (what it learnt on one prompt carries over to the next), and
the worst prompt's time is reported too.
"""

import argparse
import math

import mlx.core as mx
import numpy as np
from never_slower import WALK_PROMPT
from plain_step import switching

import dflash_mlx
from dflash_mlx.adaptive import BlockSizer, CycleCosts
from dflash_mlx.benchmark import run_autoregressive, time_forwards
from dflash_mlx.cache import bound_target
from dflash_mlx.defaults import DEFAULT_TARGET
from dflash_mlx.generate import encode_prompt
from dflash_mlx.prefill import prefill
from dflash_mlx.sampling import accept_greedy
from dflash_mlx.models.dflash import masked_block
from dflash_mlx.pair import benchmark_prompts, load_pair


def accepted_everywhere(model, draft, prompt_ids, tokens, block: int):
    """For each position ``p`` of the greedy ``tokens``, how many drafted
    tokens after ``tokens[p]`` (a whole block, ``block - 1`` slots) the
    target would accept."""
    target = bound_target(model, draft)
    cache = dflash_mlx.make_prompt_cache(model, draft)
    assert mx.argmax(prefill(target, cache, prompt_ids, 2048), axis=-1).item() == tokens[0]
    out = []
    for p in range(len(tokens) - 1):
        drafted = draft.propose(masked_block(draft, tokens[p], block), cache.target_hidden, cache.draft, slots=block - 1)
        cache.target_hidden = None  # taken into the drafter's context
        future = tokens[p + 1 : p + block]  # shorter than the block near the end
        # The target's token after the last slot is not read here: -1 stands in for it.
        accepted, _ = accept_greedy(drafted[:, : len(future)], mx.array([future + [-1]]))
        out.append(accepted.item())
        _, hidden = target.forward(mx.array([[tokens[p]]]), cache.target, record=False)
        cache.add_hidden(hidden)
    return out


def replay(sizer, accepted, cost, switch: float, rng, noise: float, slow: float):
    """Decode ``len(accepted)`` tokens with ``sizer``'s choices; returns
    (seconds per token, drafting cycles, spells of them). Like the loop, a
    plain step's successor is chosen before the step is read."""
    n, seconds, drafting, spells, after_drafting, slowed = 0, 0.0, 0, 0, False, False
    total = len(accepted)
    sizer.begin()
    choice = sizer.choose(total)
    while n < total:
        if rng.random() < 1 / 300:  # a slow spell starts or ends
            slowed = not slowed
        factor = math.exp(noise * rng.standard_normal()) * (slow if slowed else 1.0)
        if choice == 1:
            following = sizer.choose(max(1, total - n - 1))
            spent = cost(1)
            if following != 1:  # its timing holds little: the next forward is a drafting cycle's
                spent *= 0.15
            if after_drafting:
                spent = 2 * cost(1) + switch - 0.15 * cost(1)
            sizer.observe(1, 0, spent * factor)
            n += 1
        else:
            taken = min(accepted[n], choice - 1)
            spent = cost(choice)
            drafting, spells = drafting + 1, spells + (not after_drafting)
            sizer.observe(choice, taken, spent * factor)
            n += taken + 1
            following = sizer.choose(max(1, total - n))
        seconds += spent * factor
        after_drafting, choice = choice != 1, following
    return seconds / n, drafting, spells


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a named pair, such as smollm2 (default: the bundled pair)")
    p.add_argument("--prompt-index", type=int, default=None,
                   help="a held-out prompt of the pair (default: the bundled pair's `import os`, a named pair's first)")
    p.add_argument("--bench", type=int, default=0, help="replay the first N bench prompts in turn instead")
    p.add_argument("--max-tokens", type=int, default=None, help="new tokens (default: 2,048; 128 with --bench)")
    p.add_argument("--costs-ms", type=float, nargs=4, default=None, metavar=("PLAIN", "DRAFT", "ROW", "SWITCH"),
                   help="the loop's costs instead of measuring them, as the first run prints them: a plain step, a "
                        "whole block's drafting cycle, what each row fewer saves, a switch (to compare sizers at equal costs)")
    p.add_argument("--noise", type=float, default=0.1, help="log-normal jitter of each cycle's seconds")
    p.add_argument("--slow", type=float, default=1.0, help="how much slower the machine runs in its slow spells")
    p.add_argument("--seeds", type=int, default=8)
    p.add_argument("--per-prompt", action="store_true", help="with --bench: each prompt's figures too")
    args = p.parse_args(argv)
    pair = args.model or DEFAULT_TARGET
    model, tokenizer, draft, _ = load_pair(pair)
    held_out = benchmark_prompts(pair, tokenizer)
    if args.bench:
        prompts = held_out[: args.bench]
    elif args.prompt_index is None and args.model is None:
        prompts = [WALK_PROMPT]
    else:
        prompts = [held_out[args.prompt_index or 0]]
    max_tokens = args.max_tokens or (128 if args.bench else 2048)
    block = draft.block_size
    generations = []  # per prompt, the tokens a drafted block commits at each position, less one
    for prompt in prompts:
        tokens = run_autoregressive(model, tokenizer, prompt, max_tokens)["tokens"]
        ids = encode_prompt(tokenizer, prompt)
        generations.append(accepted_everywhere(model, draft, ids.tolist(), tokens, block))
    if args.costs_ms:
        plain, full, row, switch = args.costs_ms
    else:
        loop = switching(repeats=2, max_tokens=600, run=8, model_path=pair)
        forwards = time_forwards(model, draft, encode_prompt(tokenizer, prompts[0]), block)
        plain, full = loop["plain_steady_ms"], loop["draft_steady_ms"]
        row = (forwards[f"target_{block}"] - forwards["target_1"]) / (block - 1)
        switch = loop["plain_run_extra_ms"] + loop["draft_run_extra_ms"]

    def cost(b):  # seconds of a cycle verifying b rows
        return (plain if b == 1 else full - row * (block - b)) / 1e3

    table = {b: cost(b) for b in (1, 2, block)}
    everywhere = [a for accepted in generations for a in accepted]
    print(f"{len(prompts)} prompt(s), {len(everywhere)} tokens; a drafted block at every position commits "
          f"{np.mean(everywhere) + 1:.2f} tokens on average")
    print(f"the loop's costs (ms): plain step {plain:.2f}, drafting cycle of {block} {full:.2f} "
          f"(each row fewer {row:.2f} less), switch {switch:.2f}")
    policies = {
        "plain decoding": lambda: BlockSizer(1, None),
        f"fixed block {block}": lambda: BlockSizer(block, CycleCosts(dict(table)), fixed=True),
        "adaptive": lambda: BlockSizer(block, CycleCosts(dict(table))),
    }
    results = {}  # per policy and prompt, the means over seeds of (seconds a token, drafting cycles, spells)
    for name, make in policies.items():
        runs = []
        for seed in range(args.seeds):
            sizer, rng = make(), np.random.default_rng(seed)
            runs.append([replay(sizer, accepted, cost, switch / 1e3, rng, args.noise, args.slow) for accepted in generations])
        results[name] = np.mean(np.array(runs), axis=0)
    weights = np.array([len(accepted) for accepted in generations], float)
    base = results["plain decoding"][:, 0]
    for name, by_prompt in results.items():
        ratio = by_prompt[:, 0] / base
        worst = f" (worst prompt {ratio.max():.3f})" if len(prompts) > 1 else ""
        print(f"{name:16s} {np.average(ratio, weights=weights):.3f} of plain decoding's time a token{worst}, "
              f"{by_prompt[:, 1].sum():.0f} drafting cycles in {by_prompt[:, 2].sum():.0f} spells")
        if args.per_prompt and len(prompts) > 1:
            print("  by prompt (time a token / drafting cycles): "
                  + " ".join(f"{i}:{r:.2f}/{d:.0f}" for i, (r, d) in enumerate(zip(ratio, by_prompt[:, 1]))))
    if args.per_prompt and len(prompts) > 1:
        print("  by prompt, tokens a drafted block commits on average: "
              + " ".join(f"{i}:{np.mean(accepted) + 1:.1f}" for i, accepted in enumerate(generations)))


if __name__ == "__main__":
    main()
