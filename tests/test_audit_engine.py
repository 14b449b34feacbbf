"""What an adversarial audit of the lone-request engine's less common paths
found: one regression test each. References: mlx-lm's own ``generate_step``
(its tokens, its progress calls), float32."""

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step as mlx_lm_generate_step
from test_state import assert_like_fresh_prefill
from tiny import prompt_of

import dflash_mlx
from dflash_mlx.errors import ArgumentError


@pytest.fixture(scope="module")
def pair_and_draft(qwen3_pair, tmp_path_factory):
    pair = qwen3_pair
    return pair, dflash_mlx.load_draft(pair.make_draft(tmp_path_factory.mktemp("audit_engine") / "d", block_size=4), pair.model)


def mlx_lm_tokens(model, prompt, n, **kw):
    return [t for (t, _), _ in zip(mlx_lm_generate_step(mx.array(prompt), model, max_tokens=n, **kw), range(n))]


@pytest.mark.parametrize("length, step", [(1, 1), (2, 1), (5, 2), (7, 3), (9, 512)])
def test_prompt_progress_is_reported_as_mlx_lm_reports_it(pair_and_draft, length, step):
    """mlx-lm calls the callback with (0, n) first and (n, n) once the first
    token is out (a progress bar's 100%); ours stopped at (n - 1, n), and a
    one-token prompt was never reported at all."""
    pair, draft = pair_and_draft
    prompt, want, got = prompt_of(length), [], []
    mlx_lm_tokens(pair.model, prompt, 2, prefill_step_size=step, prompt_progress_callback=lambda *a: want.append(a))
    steps = dflash_mlx.generate_step(prompt, pair.model, draft, max_tokens=2, prefill_step_size=step,
                                     prompt_progress_callback=lambda *a: got.append(a))
    next(steps)
    steps.close()
    assert got == want
    assert want[0] == (0, length) and want[-1] == (length, length)  # (the case)


class Raised(Exception):
    pass


def raising_at(n):
    calls = [0]

    def fire():
        calls[0] += 1
        if calls[0] == n:
            raise Raised

    return fire


@pytest.mark.parametrize("where", ["logits_processor", "sampler"])
@pytest.mark.parametrize("at", [3, 5])
def test_a_raise_in_a_plain_step_run_ahead_leaves_the_cache_usable(pair_and_draft, where, at):
    """Plain steps run ahead of the host's read: the target keeps the last
    step, then queues the next one on its lazy token. A logits processor or
    sampler raising while that next step was queued left the target having
    run a token the prompt cache still held as pending: the next turn ran
    it twice and left mlx-lm's continuation."""
    pair, draft = pair_and_draft
    fire = raising_at(at)
    if where == "sampler":
        shaped = dict(sampler=lambda lp: (fire(), mx.argmax(lp, axis=-1))[1])
    else:
        shaped = dict(logits_processors=[lambda tokens, logits: (fire(), logits)[1]])
    cache, prompt, got = dflash_mlx.make_prompt_cache(pair.model, draft), prompt_of(6), []
    with pytest.raises(Raised):
        for t, *_ in dflash_mlx.generate_step(prompt, pair.model, draft, prompt_cache=cache, max_tokens=30, block_size=1, **shaped):
            got.append(t)
    greedy = mlx_lm_tokens(pair.model, prompt, 30)
    assert got == greedy[: len(got)] and cache.tokens == (prompt + greedy)[: len(cache.tokens)]
    assert_like_fresh_prefill(cache, pair.model, draft)
    turn, held = [4, 8], list(cache.tokens)
    again = [t for t, *_ in dflash_mlx.generate_step(turn, pair.model, draft, prompt_cache=cache, max_tokens=12)]
    assert again == mlx_lm_tokens(pair.model, held + turn, 12)


@pytest.mark.parametrize("bad", [dict(prefill_step_size=-2), dict(prefill_step_size=0), dict(prefill_step_size=2.5),
                                 dict(max_tokens=2.5), dict(block_size=3.5), dict(tree_budget=2.5)])
def test_counts_that_are_not_whole_positive_numbers_are_refused_before_any_work(pair_and_draft, bad):
    """A negative prefill_step_size fed no chunk: the prompt's body was
    never read and the answer silently left mlx-lm's; 0 was range()'s
    ValueError; a fractional block_size was cut down unsaid; a fractional
    max_tokens or tree_budget failed after the prefill."""
    pair, draft = pair_and_draft
    cache = dflash_mlx.make_prompt_cache(pair.model, draft)
    with pytest.raises(ArgumentError, match=next(iter(bad))):
        next(dflash_mlx.generate_step(prompt_of(9), pair.model, draft, prompt_cache=cache, **{"max_tokens": 5, **bad}))
    assert cache.tokens == []


@pytest.mark.parametrize("bad", [dict(block_size=3.5), dict(tree_budget=2.5)])
def test_a_batch_refuses_fractional_blocks_and_tree_budgets_too(pair_and_draft, bad):
    """The checks live where both loops size their blocks (max_block_size,
    tree_plan): a BatchGenerator cut block_size=3.5 down to 3 unsaid."""
    pair, draft = pair_and_draft
    with pytest.raises(ArgumentError, match=f"{next(iter(bad))} must be a whole number"):
        dflash_mlx.BatchGenerator(pair.model, draft, completion_batch_size=1, **bad)


def test_one_eos_id_given_as_an_int_stops_the_generation(pair_and_draft):
    """A Hugging Face generation config's eos_token_id is often one int: it
    was a TypeError after the prefill."""
    pair, draft = pair_and_draft
    greedy = mlx_lm_tokens(pair.model, prompt_of(9), 12)
    eos = greedy[4]
    got = [t for t, *_ in dflash_mlx.generate_step(prompt_of(9), pair.model, draft, max_tokens=12, eos_token_ids=eos)]
    assert got == greedy[: greedy.index(eos) + 1]


@pytest.mark.parametrize("temperature", [-1.0, float("nan"), float("inf")])
def test_a_temperature_that_is_not_a_finite_non_negative_number_is_refused(pair_and_draft, temperature):
    """The CLI refused these; the library decoded a negative temperature
    greedily unsaid and sampled junk ids (the vocabulary's padding) at nan."""
    pair, draft = pair_and_draft
    with pytest.raises(ArgumentError, match="temperature must be a finite number"):
        next(dflash_mlx.generate_step(prompt_of(5), pair.model, draft, max_tokens=4, temperature=temperature))
    with pytest.raises(ArgumentError, match="temperature must be a finite number"):
        dflash_mlx.BatchGenerator(pair.model, draft).insert([prompt_of(5)], 4, temperature=temperature)
