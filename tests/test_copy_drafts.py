"""Copy drafts in the decode loop: spans copied from the context verified in
place of the drafter's block or after it, exact (greedy token for token
against mlx-lm, sampled in distribution), batched rows each on their own
acceptance, the switch that turns them off, and the per-source counts."""

import importlib
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest
import tiny
from tiny import PROMPT, REAL_TOKENS, TRUNCATED, generated_tokens, pit_check, prompt_of, reference_tokens, small_pair

import dflash_mlx
from dflash_mlx.adaptive import BlockSizer, CycleCosts
from dflash_mlx import copy_source
from dflash_mlx.batch import BatchGenerator
from dflash_mlx.copy_source import CopyDrafts
from dflash_mlx.decode import Decoder, Request, Sizing
from dflash_mlx.sampling import accept_greedy, accept_point_mass, accept_rows, acceptance_rule, processed_probs


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A 16-token target: its answers repeat, so copies are accepted."""
    return small_pair(tmp_path_factory.mktemp("small"), tiny.QWEN3)


@pytest.fixture
def spans(monkeypatch):
    """Counts the copied spans the target reached (each verified and observed)."""
    seen = []
    real = CopyDrafts.observe

    def observe(self, klass, proposed, accepted):
        seen.append((proposed, accepted))
        real(self, klass, proposed, accepted)

    monkeypatch.setattr(CopyDrafts, "observe", observe)
    return seen


@pytest.fixture
def eager(monkeypatch):
    """Copies proposed wherever the index has one, until they are seen to fail
    (on random targets they mostly are: the check is that they stay exact)."""
    monkeypatch.setattr(copy_source, "COPY_PRIORS", (0.99,) * len(copy_source.MATCH_CLASSES))


def repeating_prompt(pair, n=20):
    """A prompt whose end occurred earlier, followed by the target's own answer to it."""
    head = prompt_of(n)
    return head + pair.reference(head, 40) + head


def copies_possible(prompt, tokens) -> bool:
    """Whether a copy could be proposed: after some committed token (the
    last few left out, no room to verify one) the last two occurred before."""
    seq, seen = list(prompt) + list(tokens), set()
    for j in range(1, len(seq) - 3):
        if j >= len(prompt) and (seq[j - 1], seq[j]) in seen:
            return True
        seen.add((seq[j - 1], seq[j]))
    return False


def counts_add_up(responses, tokens):
    """Every cycle commits its accepted tokens and the target's one (the
    last may stop short), the copied ones among the accepted; together the
    tokens out (and an eos)."""
    for r in responses[1:-1]:
        assert r.committed == r.accepted + 1
    assert all(0 <= r.copied <= r.accepted for r in responses)
    assert sum(r.committed for r in responses) == len(tokens) + (responses[-1].finish_reason == "stop")


def test_each_kind_of_target_is_lossless_with_copies(loop_family_pair, tmp_path, spans, eager):
    """Each kind of target (tiny.LOOP_FAMILIES), a prompt built to repeat:
    adaptive (chains, trees, copies) and a fixed block against mlx-lm's
    greedy decode; copies were verified."""
    pair = loop_family_pair
    prompt = repeating_prompt(pair)
    ref = pair.reference(prompt, 48)
    draft = dflash_mlx.load_draft(pair.make_draft(tmp_path / "d"), pair.model)
    for kw in (dict(), dict(block_size=8)):
        got, responses = pair.dflash(draft, prompt, max_tokens=48, **kw)
        assert got == ref, kw
        counts_add_up(responses, got)
    assert spans or not copies_possible(prompt, ref)  # (random targets seldom repeat: the small one below does)


def test_accepted_copies_are_lossless_and_counted(small, spans):
    """Greedy answers that repeat: copies accepted, alone and after the
    drafter's block, adaptive, fixed and with trees; every run mlx-lm's."""
    ref = reference_tokens(small.model, small.tokenizer, PROMPT, 64)
    copied = 0
    for kw in (dict(), dict(block_size=4), dict(tree_budget=3)):
        got, responses = tiny.dflash_tokens(small.model, small.draft, small.tokenizer, PROMPT, max_tokens=64, **kw)
        assert got == ref, kw
        counts_add_up(responses, got)
        copied += sum(r.copied for r in responses)
    assert copied > 0 and any(a for _, a in spans)


def test_the_switch_turns_copies_off(small, spans):
    ref = reference_tokens(small.model, small.tokenizer, PROMPT, 40)
    got, responses = tiny.dflash_tokens(small.model, small.draft, small.tokenizer, PROMPT, max_tokens=40, copy_drafts=False)
    assert got == ref
    assert not spans and sum(r.copied for r in responses) == 0
    gen = BatchGenerator(small.model, small.draft, copy_drafts=False)
    gen.insert([PROMPT], 40)
    out = []
    while gen.busy:
        out += gen.next()
    assert [t for r in out for t in r.tokens] == ref and not spans


def test_cli_flags():
    for name in ("generate", "chat", "benchmark", "server"):  # (the package exports a function named generate)
        parser = importlib.import_module(f"dflash_mlx.{name}").setup_arg_parser()
        assert parser.parse_args([]).copy_drafts is True
        assert parser.parse_args(["--no-copy-drafts"]).copy_drafts is False


def test_dflash2_drafter_with_copies(qwen3_pair, tmp_path, spans, eager):
    pair = qwen3_pair
    draft = dflash_mlx.load_draft(tiny.make_draft(tmp_path / "d2", pair.dflash2_config(), seed=3), pair.model)
    prompt = repeating_prompt(pair)
    ref = pair.reference(prompt, 40)
    for kw in (dict(), dict(block_size=8), dict(temperature=0.0, draft_window=8, draft_sink=2)):
        assert pair.dflash(draft, prompt, max_tokens=40, **kw)[0] == ref, kw
    assert spans


@pytest.mark.parametrize("acceptance", ["speculative", "exact-match"])
@pytest.mark.parametrize("setting", [dict(temperature=1.0), TRUNCATED], ids=["plain", "truncated"])
def test_sampled_copies_follow_the_target(small, setting, acceptance):
    """Seeded sampled runs with copied tokens accepted (point masses): a
    randomised PIT of every token under the target's processed p."""
    runs, copied = [], 0
    for seed in range(8):
        tokens, responses = generated_tokens(small.model, small.draft, small.tokenizer, seed, REAL_TOKENS, block_size=4, acceptance=acceptance, **setting)
        runs.append(tokens)
        copied += sum(r.copied for r in responses)
    assert copied > 10
    ks, bound, outside = pit_check(small.model, runs, setting, np.random.default_rng(0))
    assert outside == 0 and ks < bound


def test_a_broken_point_mass_rule_is_caught(small, monkeypatch):
    """Copied tokens kept whatever the target's p: the same check fails."""
    import dflash_mlx.sampling as sampling

    real = sampling.speculative_accept

    def keep_copies(draft_tokens, p, q, key=None):
        if q.shape[-2] == 0:  # all copied: keep them all, then the bonus
            n = draft_tokens.shape[-1]
            return mx.array(n), sampling.sample(p[n], key)
        return real(draft_tokens, p, q, key)

    monkeypatch.setattr(sampling, "speculative_accept", keep_copies)
    setting = dict(temperature=1.0)
    runs = [generated_tokens(small.model, small.draft, small.tokenizer, seed, REAL_TOKENS, block_size=4, **setting)[0] for seed in range(16)]
    ks, bound, _ = pit_check(small.model, runs, setting, np.random.default_rng(0))
    assert ks > bound


def test_batched_rows_mixing_copies_each_equal_their_lone_run(small, qwen3_pair, tmp_path, spans, eager):
    """Rows that copy beside rows that do not (the switch per request), in
    one batch, adaptive and fixed: each is its lone run, token for token."""
    draft = dflash_mlx.load_draft(qwen3_pair.make_draft(tmp_path / "d"), qwen3_pair.model)
    for pair, model, prompts in ((small, small.model, [PROMPT, [2, 9, 4], PROMPT]), (qwen3_pair, qwen3_pair.model, None)):
        d = small.draft if pair is small else draft
        prompts = prompts or [repeating_prompt(qwen3_pair), prompt_of(9), repeating_prompt(qwen3_pair, 12)]
        refs = [reference_tokens(model, pair.tokenizer, p, 40) for p in prompts]
        for block_size in (None, 4):
            gen = BatchGenerator(model, d, block_size=block_size)
            uids = gen.insert(prompts, 40, copy_drafts=[True, True, False])
            got = {u: [] for u in uids}
            batches = []
            while gen.busy:
                for r in gen.next():
                    got[r.uid] += r.tokens
                    batches.append(r.batch)
                    assert sum(r.copied) <= sum(r.from_draft)
                    assert r.uid != uids[2] or not any(r.copied)
            assert [got[u] for u in uids] == refs, (pair is small, block_size)
            assert max(batches) == 3
    assert spans


def test_batch_generate_counts_copies(small):
    result = dflash_mlx.batch_generate(small.model, small.draft, small.tokenizer, [PROMPT, PROMPT], max_tokens=40, block_size=4)
    off = dflash_mlx.batch_generate(small.model, small.draft, small.tokenizer, [PROMPT], max_tokens=40, block_size=4, copy_drafts=False)
    assert result.tokens[0] == result.tokens[1] == off.tokens[0]
    assert all(0 < s["copied"] <= s["accepted"] for s in result.stats)
    assert off.stats[0]["copied"] == 0


def test_accept_rows_caps_padded_rows():
    """A row's proposal shorter than the batch's block: its acceptance stops
    at its own length, greedy rows as accept_greedy on the row cut short,
    a sampled row's copied tokens as accept_point_mass."""
    mx.random.seed(0)
    V, n = 12, 5
    logits = mx.random.normal((3, n + 1, V)) * 3
    target = mx.argmax(logits, axis=-1)
    proposal = target[:, :n].astype(mx.int32)  # every slot the target's choice
    greedy, sampled = acceptance_rule(0, 0, 0, 0, None, "speculative"), acceptance_rule(1.0, 0, 0, 0, None, "speculative")
    lengths = [2, 5, 3]
    out = accept_rows([greedy, greedy, sampled], logits, proposal, [None] * 3, [None, None, mx.random.key(3)], lengths)
    for b in (0, 1):
        acc, tok = accept_greedy(proposal[b, : lengths[b]], target[b, : lengths[b] + 1])
        assert out[b, :2].tolist() == [acc.item(), tok.item()] == [lengths[b], target[b, lengths[b]].item()]
    p = processed_probs(logits[2, :4], temperature=1.0)
    acc, tok = accept_point_mass(proposal[2, :3], p, mx.random.key(3))
    assert out[2, :2].tolist() == [acc.item(), tok.item()]


def pricing_row(tokens):
    """A request whose context ends with a repeat of its start, its copy source on."""
    cache = SimpleNamespace(tokens=list(tokens), copy_index=None)
    r = Request(0, cache, acceptance_rule(0, 0, 0, 0, None, "speculative"), 200, frozenset())
    r.copies = CopyDrafts(cache)
    return r


def test_copies_are_priced_and_stop_where_they_fail():
    """A cycle of copies alone where they pay (no draft, the verify's rows
    priced by the drafting line's slope), longer as they are accepted, and
    none once a request's copies keep failing: it decodes as it would
    without them."""
    text = list(range(100, 160))
    sizing = Sizing(BlockSizer(8, CycleCosts({1: 1.0, 2: 1.6, 8: 2.2}, follow=False)))
    r = pricing_row(text + text[:10])
    choice, plans, drafting = sizing.copies([r], 1)
    assert choice > 1 and not drafting and plans[0][0] == text[10 : 10 + choice - 1]
    klass = plans[0][1]
    for _ in range(30):
        r.copies.observe(klass, 32, 32)
    long, plans, _ = sizing.copies([r], 1)
    assert long > choice and plans[0][0] == text[10 : 10 + long - 1]
    for _ in range(60):
        r.copies.observe(klass, 32, 0)
    assert sizing.copies([r], 1) == (1, [None], True)
    assert sizing.copies([r], 4) == (4, [None], True)


def test_a_joining_request_starts_from_the_copies_the_pair_has_seen():
    """A request's copies start from the pair's copy acceptance, which every
    request's copy cycles feed: after requests whose answers did not repeat
    their context, a new one does not try copies on the prior's hope; the
    first request starts from the priors."""
    text = list(range(100, 160))
    sizing = Sizing(BlockSizer(8, CycleCosts({1: 1.0, 2: 1.6, 8: 2.2}, follow=False)))
    first, second = pricing_row(text + text[:10]), pricing_row(text + text[:10])
    sizing.copies_joined([first])
    choice, plans, _ = sizing.copies([first], 1)
    assert choice > 1 and plans[0] is not None  # the priors: worth a try
    for _ in range(60):
        first.copies.observe(plans[0][1], choice - 1, 0)
    sizing.copies_joined([second])
    assert sizing.copies([second], 1) == (1, [None], True)
    assert sizing.copies([pricing_row(text + text[:10])], 1)[0] > 1  # (not joined: its own priors)


def test_a_closed_batch_weighs_its_rows_tokens_by_its_trailing_edge():
    """Where no request waits to join, a batch runs until its last row ends:
    what a cycle is worth is how far its rows' trailing edge advances (a row
    ahead of the others counts for nothing more), so a copy only one of two
    level rows verifies is worth no more than a plain step and is not
    chosen, while the same batch with requests waiting (a row that ends
    gives its place) takes it; a row behind the other counts in full."""
    text, other = list(range(100, 160)), list(range(200, 260))
    sizing = Sizing(BlockSizer(8, CycleCosts({1: 1.0, 2: 1.6, 8: 2.2}, follow=False)))
    level = [pricing_row(text + text[:10]), pricing_row(other)]
    sizing.rows_joined(level)
    assert sizing.worth(level, [3.0, 1.0]) == 4.0
    assert sizing.copies(level, 1)[0] > 1  # open: a copy for one row pays
    sizing.closed = True
    assert sizing.worth(level, [3.0, 1.0]) == 2.0 and sizing.worth(level, [3.0, 2.0]) == 4.0
    assert sizing.copies(level, 1) == (1, [None, None], True)
    behind = [pricing_row(text + text[:10]), pricing_row(other)]
    behind[1].n = 20  # the other row is 20 tokens ahead
    sizing.rows_joined(behind)
    assert sizing.worth(behind, [3.0, 1.0]) == 6.0
    assert sizing.copies(behind, 1)[0] > 1
    assert sizing.expected(level)[0].expected_as_seen[0] == 1.0  # a plain step moves the edge one token


def test_a_rows_resyncing_copy_holds_back_a_lone_rows_plain_step_not_a_batchs():
    """A lone row whose copy broke off lately reads its plain step before
    the next is queued (the read may take the copy up); in a batch some row
    is nearly always resyncing, and waiting would cost every row the
    overlap: the next plain step is queued on the lazy tokens."""

    class Probe(Decoder):  # the queue, without a target
        def keep(self, cycle, kept):
            pass

        def launch(self, rows, choice, anchors=None, queued_ahead=False):
            return SimpleNamespace(rows=rows, choice=choice, queued_ahead=queued_ahead)

    def row(resyncing):
        r = Request(0, SimpleNamespace(), acceptance_rule(0, 0, 0, 0, None, "speculative"), 200, frozenset())
        r.copies = SimpleNamespace(resyncing=resyncing)
        return r

    decoder = Probe(None, None, 1, mx.eval, Sizing(BlockSizer(1, None)))  # every cycle a plain step
    step = lambda rows: SimpleNamespace(block=1, rows=rows, outcome=mx.zeros((len(rows), 2), mx.int32))  # noqa: E731
    assert decoder.plain_ahead(step([row(True)])) is None
    assert decoder.plain_ahead(step([row(False)])).queued_ahead
    assert decoder.plain_ahead(step([row(True), row(False)])).queued_ahead


def test_copy_cycles_are_priced_by_their_own_cycles_once_measured():
    """Before any, a cycle of copies costs a chain's verify without the
    draft; after some, what they took (here dearer per row than the table's
    slope), but never more than a drafting chain as long: the same verify
    and a draft besides (a copy line read dear in a slow spell would
    otherwise shut copies out)."""
    costs = CycleCosts({1: 1.0, 2: 1.6, 8: 2.2})  # C(b) = 1.5 + 0.1 (b - 1)
    assert costs.verify(9) == pytest.approx(1.0 + 0.1 * 8)
    for n in (3, 9, 17, 33) * 8:
        costs.observe(n, 1.0 + 0.15 * (n - 1), copies=True)
    assert costs.verify(5) == pytest.approx(1.0 + 0.15 * 4, rel=0.05)
    assert costs.verify(21) == pytest.approx(1.5 + 0.1 * 20)  # capped at the chain's
    assert costs.upto(8)[-1] == pytest.approx(2.2)  # the drafting line as it was
    batch = CycleCosts({1: 1.0, 2: 1.6, 8: 2.2})  # two rows: their own line, the same way
    line, drafting = batch.verify(9, rows=2), batch.cost(9, rows=2)
    for _ in range(9):
        batch.observe(9, 1.2 * line, rows=2, copies=True)
    assert batch.verify(9, rows=2) == pytest.approx(min(1.2 * line, drafting), rel=0.05) and batch.cost(9, rows=2) == drafting


def test_a_long_match_is_verified_long_from_its_first_cycle():
    """A match of 8 tokens or more is a copy under way: before the request
    has shown anything, its first cycle verifies a longer span than a
    match of 2 tokens gets (one that recurs by chance more often): its
    class's prior is higher (copy_source.COPY_PRIORS)."""
    text = list(range(100, 160))
    lengths = []
    for repeated in (2, 10):
        sizing = Sizing(BlockSizer(8, CycleCosts({1: 1.0, 2: 1.6, 8: 2.2}, follow=False)))
        choice, plans, drafting = sizing.copies([pricing_row(text + text[:repeated])], 1)
        assert not drafting and plans[0][0] == text[repeated : repeated + choice - 1]
        lengths.append(choice)
    assert lengths[1] > lengths[0] > 1


def grammar_for(tokenizer, pattern):
    from dflash_mlx.structured import constraint_from_response_format

    return constraint_from_response_format({"type": "regex", "pattern": pattern}, tokenizer)


def test_copies_under_a_grammar_start_with_its_forced_tokens_and_stop_where_it_refuses(small):
    """Held to a grammar, a copied span is the tokens the grammar forces,
    then what followed them in the context, cut before the first token the
    grammar refuses (llguidance's own matcher takes exactly that much); a
    drafted block is continued the same way, and a span with nothing
    copied after the forced tokens is none."""
    from llguidance import LLMatcher

    from dflash_mlx.structured import bridge

    enc = lambda text: small.tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    pattern = "xy[abc]+!"
    context = enc("say xyabcabcq! then ") + enc("x")
    grammar = grammar_for(small.tokenizer, pattern)
    grammar.commit(enc("x"))
    cache = SimpleNamespace(tokens=context, copy_index=None)
    copies = CopyDrafts(cache)
    copies.hold_to(grammar)
    span, _ = copies.propose(31)
    reference = LLMatcher(bridge(small.tokenizer), LLMatcher.grammar_from_regex(pattern))
    reference.consume_tokens(enc("x"))
    copied = enc("yabcabcq! then ")
    assert grammar.forced(5) == enc("y")
    assert span == copied[: reference.try_consume_tokens(copied)] == enc("yabcabc")
    assert copies.propose(31, after=enc("ya"))[0] == enc("bcabc")
    grammar.commit(enc("yabcabc"))
    cache.tokens = context + enc("yabcabc")
    assert copies.propose(31)[0] == []  # ("q" next in the context: refused)
    copies.hold_to(None)
    assert copies.propose(3)[0] == enc("q! ")


def test_copies_held_to_a_grammar_are_exact(small, spans, eager, monkeypatch):
    """A repeating context whose copies the grammar cuts (it refuses ")",
    id 8, which the context has): lone (adaptive, fixed) and batched beside
    a free row, every row mlx-lm's masked greedy decode, copies accepted,
    spans cut, and no span proposed past a refused token."""
    from mlx_lm.generate import generate_step

    from dflash_mlx.structured import Constraint

    free = reference_tokens(small.model, small.tokenizer, PROMPT, 64)
    prompt, form = PROMPT + free[:40] + PROMPT, {"type": "regex", "pattern": "[!-(*-0]*"}
    assert 8 in free[:40]
    c = grammar_for(small.tokenizer, form["pattern"])
    want = [t for t, _ in generate_step(mx.array(prompt), small.model, max_tokens=48, logits_processors=[c.processor()])]
    cuts, proposed = [], []
    takes, propose = Constraint.takes, CopyDrafts.propose
    monkeypatch.setattr(Constraint, "takes", lambda self, tokens: cuts.append(takes(self, tokens) < len(tokens)) or takes(self, tokens))
    monkeypatch.setattr(CopyDrafts, "propose", lambda self, *a, **k: proposed.append(propose(self, *a, **k)[0]) or propose(self, *a, **k))
    for kw in (dict(), dict(block_size=4)):
        got, responses = tiny.dflash_tokens(small.model, small.draft, small.tokenizer, prompt, max_tokens=48, response_format=form, **kw)
        assert got == want, kw
        assert sum(r.copied for r in responses) > 0, kw
    other = [2, 9, 6, 14, 3]
    gen = BatchGenerator(small.model, small.draft, tokenizer=small.tokenizer, block_size=4)
    uids = gen.insert([prompt, other], 48, response_format=[form, None], copy_drafts=[True, False])
    got = {u: [] for u in uids}
    while gen.busy:
        for r in gen.next():
            got[r.uid] += r.tokens
    assert [got[u] for u in uids] == [want, reference_tokens(small.model, small.tokenizer, other, 48)]
    assert any(cuts) and not any(8 in p for p in proposed) and spans
