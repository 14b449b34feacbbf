"""The cheaper build's levers: a draft vocabulary (drafting stays exact,
greedy and sampled), the approximate target of the data stages, and the
trainer's options (slots, answer anchors, layers from the target)."""

import json

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
import numpy as np
import pytest
from mlx_lm import batch_generate, load
from mlx_lm.models.cache import make_prompt_cache
from tiny import PROMPT, TRUNCATED, V, pit_check, sampled_runs

import dflash_mlx
import tiny
from dflash_mlx import cli
from dflash_mlx import train as T
from dflash_mlx.loading import DraftLoadError
from dflash_mlx.targets.approximate import ApproxAttention, approximate

FEW = [0, 2, 3, 5, 8, 11]  # a draft vocabulary of 6 of the 16 ids


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    """A tiny target with a 16-token vocabulary and a random drafter that
    scores only the ids FEW."""
    from types import SimpleNamespace

    root = tmp_path_factory.mktemp("draft_vocab")
    model, tokenizer = load(str(tiny.make_target(root / "target", tiny.QWEN3, seed=3, vocab_size=V)))
    cfg = tiny.draft_config(tiny.QWEN3, V, block_size=4)
    cfg["dflash_config"]["draft_vocab"] = FEW
    draft = dflash_mlx.load_draft(str(tiny.make_draft(root / "draft", cfg, seed=1)), model)
    return SimpleNamespace(model=model, tokenizer=tokenizer, draft=draft, root=root, cfg=cfg)


def test_draft_vocab_scores_only_its_ids(small_vocab):
    draft = small_vocab.draft
    hidden = mx.random.normal((2, 3, draft.config.hidden_size), key=mx.random.key(0))
    full = draft.target.lm_head(hidden)
    sub = draft.head_logits(hidden)
    assert sub.shape == (2, 3, len(FEW))
    np.testing.assert_allclose(sub, full[..., FEW], atol=1e-5)
    logits = np.array(draft.compute_logits(hidden))
    outside = [i for i in range(V) if i not in FEW]
    assert np.isneginf(logits[..., outside]).all()
    np.testing.assert_allclose(logits[..., FEW], full[..., FEW], atol=1e-5)


def test_draft_vocab_greedy_is_lossless(small_vocab):
    # token ids, not text: the tokenizer's ids reach past this model's V-row embedding
    got, _ = tiny.dflash_tokens(small_vocab.model, small_vocab.draft, small_vocab.tokenizer, PROMPT, [], max_tokens=40)
    assert got == tiny.reference_tokens(small_vocab.model, small_vocab.tokenizer, PROMPT, 40, [])
    tokens = small_vocab.draft.propose(
        mx.array([[1, 4, 4, 4]]), mx.zeros((1, 2, small_vocab.draft.config.fc_input_size)),
        small_vocab.draft.make_cache(),
    )
    assert set(np.array(tokens).ravel().tolist()) <= set(FEW)


def test_draft_vocab_proposals_and_tree_candidates_match_the_full_logits(small_vocab):
    """Ranked over the draft vocabulary and mapped to target ids, greedy
    proposals (of any number of slots) and a tree's candidates are what the
    target-vocabulary logits (-inf outside it) give."""
    from dflash_mlx.tree import candidates

    draft = small_vocab.draft
    block = mx.array([[1, 4, 4, 4]])
    for seed in range(4):
        context = mx.random.normal((1, 3, draft.config.fc_input_size), key=mx.random.key(seed))
        full = draft.slot_logits(block, context, draft.make_cache())
        want = np.array(mx.argmax(full, axis=-1))
        assert np.array(draft.propose(block, context, draft.make_cache())).tolist() == want.tolist()
        for slots in (1, 2):
            got = draft.propose(block, context, draft.make_cache(), slots=slots)
            assert np.array(got).tolist() == want[:, :slots].tolist()
        head = draft.slot_head_logits(block, context, draft.make_cache(), slots=2)
        ids, logprobs = candidates(head[0], 3, draft.vocab_ids)
        exact = np.array(full[0, :2] - mx.logsumexp(full[0, :2], axis=-1, keepdims=True))
        assert ids.shape == (2, 3) and set(ids.ravel().tolist()) <= set(FEW)
        np.testing.assert_array_equal(ids, np.argsort(-exact, axis=-1, kind="stable")[:, :3])
        np.testing.assert_allclose(logprobs, np.take_along_axis(exact, ids, axis=-1), atol=1e-4)


def test_draft_vocab_sampling_samples_the_target(small_vocab):
    """q is zero outside the draft vocabulary and the committed tokens are
    distributed as the target's (the PIT / DKW check of test_sampling)."""
    draft = small_vocab.draft
    _, q = draft.propose_with_probs(
        mx.array([[1, 4, 4, 4]]), mx.zeros((1, 2, draft.config.fc_input_size)), draft.make_cache(), **TRUNCATED
    )
    q = np.array(q)
    np.testing.assert_allclose(q.sum(-1), 1.0, atol=1e-5)
    assert (q[..., [i for i in range(V) if i not in FEW]] == 0).all()
    tokens, accepted = sampled_runs(small_vocab, draft, 5, TRUNCATED, block_size=4)
    ks, bound, outside = pit_check(small_vocab.model, tokens, TRUNCATED, np.random.default_rng(0))
    assert outside == 0 and ks < bound
    assert max(accepted) >= 1  # drafts from the draft vocabulary were accepted
    assert any(t not in FEW for run in tokens for t in run)  # the target still emits every id


@pytest.mark.parametrize("bad", [[3, 2], [0, 16], []])
def test_bad_draft_vocab_is_one_error(small_vocab, tmp_path, bad):
    cfg = json.loads(json.dumps(small_vocab.cfg))
    cfg["dflash_config"]["draft_vocab"] = bad
    path = tiny.make_draft(tmp_path / "d", dict(small_vocab.cfg), seed=1)
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DraftLoadError, match="draft_vocab"):
        dflash_mlx.load_draft(str(path))


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_approximate_target_follows_the_exact_one(make_pair, family):
    """Taps to training precision and the same batched greedy answers
    (a tiny target has no near ties), cache and padding masks included."""
    pair = make_pair(family)
    exact, tokenizer = load(str(pair.path))
    approx = approximate(load(str(pair.path))[0])
    tokens = mx.array(np.random.default_rng(0).integers(0, 256, (2, 24)), dtype=mx.int32)
    a, b = (T.target_pass(dflash_mlx.targets.adapter_for(m), tokens, [0, 1]) for m in (exact, approx))
    np.testing.assert_allclose(np.array(b[0]), np.array(a[0]), atol=2e-3, rtol=1e-3)
    prompts = [tokenizer.encode(p) for p in ("def f(", "import numpy as np\nx = ", "class")]
    kw = dict(max_tokens=12, return_token_ids=True, completion_batch_size=3, prefill_batch_size=3)
    assert batch_generate(approx, tokenizer, prompts, **kw).token_ids == batch_generate(exact, tokenizer, prompts, **kw).token_ids
    assert set(dict(tree_flatten(approx.parameters()))) == set(dict(tree_flatten(exact.parameters())))
    assert all(isinstance(layer.self_attn, ApproxAttention) for layer in approx.model.layers)


@pytest.mark.parametrize("L, S, chunk", [(24, 24, 5), (16, 40, 4), (8, 8, 8)])
def test_causal_chunks_are_causal_attention(L, S, chunk):
    """Query blocks (a last one short, keys before the queries from a cache)
    give mlx-lm's causal attention to the approximate exp's precision."""
    from dflash_mlx.targets.approximate import causal_chunks

    q, k, v = (mx.random.normal((2, h, n, 8), key=mx.random.key(i)) for i, (h, n) in enumerate(((6, L), (3, S), (3, S))))
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=1.0, mask="causal")
    got = causal_chunks(q.reshape(2, 3, 2, L, 8), k, v, chunk).reshape(2, 6, L, 8)  # query head h reads KV head h // 2
    np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-4)


def test_chunked_prefill_follows_the_exact_target(make_pair):
    """A prompt in two pieces through the cache (the second one's queries
    after cached keys), in query blocks of 4: the exact target's logits."""
    pair = make_pair("qwen3")
    exact = load(str(pair.path))[0]
    approx = approximate(load(str(pair.path))[0], query_chunk=4)
    tokens = mx.array(np.random.default_rng(1).integers(0, 256, (1, 30)), dtype=mx.int32)
    out = []
    for model in (exact, approx):
        cache = make_prompt_cache(model)
        out.append(mx.concatenate([model(tokens[:, :11], cache=cache), model(tokens[:, 11:], cache=cache)], axis=1))
    np.testing.assert_allclose(np.array(out[1]), np.array(out[0]), atol=2e-3, rtol=1e-3)


def test_approximate_refuses_a_hybrid_target(qwen3_5_pair):
    model, _ = load(str(qwen3_5_pair.path))
    with pytest.raises(dflash_mlx.targets.TargetError, match="llama"):
        approximate(model)


def small_run(pair, data, out, *extra):
    return [
        "--model", str(pair.path), "--data", str(data), "--draft-model", str(out), "--block-size", "8",
        "--seq-len", "48", "--batch-size", "2", "--anchors-per-seq", "6", "--learning-rate", "3e-3",
        "--warmup", "2", *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def rows(qwen3_pair, tmp_path_factory):
    """Rows of structured text and an answer mask (the second half of each row)."""
    root = tmp_path_factory.mktemp("rows")
    text = tiny.seeded_source()[:6000]
    ids = np.asarray(qwen3_pair.tokenizer.encode(text))[: 12 * 48].reshape(12, 48)
    np.save(root / "rows.npy", ids)
    mask = np.zeros(ids.shape, bool)
    mask[:, 30:] = True
    np.save(root / "answers.npy", mask)
    return root


def test_draft_vocab_training_and_levers(qwen3_pair, rows, tmp_path):
    """--draft-vocab K saves the data's K most frequent ids; --loss-slots,
    --answer-mask and --init-from-target train; the checkpoint decodes
    losslessly; --resume must repeat the levers."""
    out = tmp_path / "draft"
    argv = small_run(qwen3_pair, rows / "rows.npy", out, "--steps", "4", "--draft-vocab", "40", "--loss-slots", "4",
                     "--answer-mask", str(rows / "answers.npy"), "--init-from-target", "--num-layers", "1")  # fmt: skip
    assert cli.run(T.main, argv) == 0
    cfg = json.loads((out / "config.json").read_text())
    ids = np.load(rows / "rows.npy")
    counts = np.bincount(ids[:, 30:].ravel(), minlength=cfg["vocab_size"])
    want = sorted(np.argsort(-counts, kind="stable")[:40].tolist())
    assert cfg["dflash_config"]["draft_vocab"] == want
    draft = dflash_mlx.load_draft(out, qwen3_pair.model)
    got, _ = qwen3_pair.dflash(draft, "import mlx", eos_ids=[], max_tokens=20)
    assert got == qwen3_pair.reference("import mlx", 20, eos_ids=[])
    assert cli.run(T.main, argv[:-1] + ["2", "--resume"]) == 1  # another --num-layers


def test_answer_anchors_and_slot_losses():
    args = type("A", (), dict(batch_size=64, seq_len=40, block_size=4, anchors_per_seq=5))
    flat = np.arange(400)
    answers = np.zeros(400, bool)
    answers[20:30] = True
    _, windows, anchors = T.sample_batch(np.random.default_rng(0), (flat, np.array([0]), None), args, answers)
    nxt = anchors + 1  # the slot-1 token of each anchor
    assert answers[nxt].all(axis=1).all() and (np.diff(anchors, axis=1) > 0).all()
    few = np.zeros(400, bool)
    few[10:12] = True  # two answer anchors, three fillers
    _, _, anchors = T.sample_batch(np.random.default_rng(0), (flat, np.array([0]), None), args, few)
    assert (few[anchors + 1].sum(axis=1) == 2).all() and len(np.unique(anchors[0])) == 5
    # labels outside the draft vocabulary carry no loss and are never correct
    labels = T.draft_labels(mx.array([[3, 7, 9]]), [3, 9], 12)
    assert labels.tolist() == [[0, -1, 1]]


def test_lever_flags_are_checked_first(qwen3_pair, rows, tmp_path, capsys):
    bad = {
        "--loss-slots": (["--loss-slots", "8"], "--loss-slots"),
        "--answer-mask shape": (["--answer-mask", str(tmp_path / "m.npy")], "shaped like"),
        "--draft-vocab": (["--draft-vocab", "999999"], "exceeds"),
        "two inits": (["--init-from-target", "--init-from", str(tmp_path)], "pass one"),
    }
    np.save(tmp_path / "m.npy", np.zeros((3, 3), bool))
    for name, (extra, words) in bad.items():
        assert cli.run(T.main, small_run(qwen3_pair, rows / "rows.npy", tmp_path / name, "--steps", "1", *extra)) == 1
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and words in err, (name, err)
        assert not (tmp_path / name).exists()


def test_init_from_target_copies_the_last_layers(qwen3_pair):
    from dflash_mlx.models.dflash import DFlashConfig, DFlashDraftModel, draft_config_for_target

    adapter = dflash_mlx.targets.adapter_for(qwen3_pair.model)
    cfg = draft_config_for_target(adapter.args, num_layers=2, mask_token_id=1)
    draft = DFlashDraftModel(DFlashConfig.from_hf(cfg))
    T.init_from_target_layers(draft, adapter)
    n = adapter.num_layers
    for j, layer in enumerate(draft.layers):
        source = dict(tree_flatten(adapter.backbone.layers[n - 2 + j].parameters()))
        for name, value in tree_flatten(layer.parameters()):
            if "q_norm" in name or "k_norm" in name:
                assert name not in source or mx.array_equal(value, source[name]).item()
            else:
                assert mx.array_equal(value, source[name]).item(), name


def test_trainable_approximations_follow_the_exact_gradients():
    from dflash_mlx.ops import fast_math

    x = mx.random.normal((4, 6, 50), key=mx.random.key(1)) * 4
    w = mx.random.normal((4, 6, 50), key=mx.random.key(2))
    labels = mx.random.randint(0, 50, (4, 6), key=mx.random.key(3))
    for approx, exact in (
        (lambda x: (fast_math.softmax_trainable(x) * w).sum(), lambda x: (mx.softmax(x, axis=-1) * w).sum()),
        (lambda x: fast_math.cross_entropy_approx(x, labels).sum(), lambda x: nn.losses.cross_entropy(x, labels).sum()),
    ):
        (va, ga), (ve, ge) = mx.value_and_grad(approx)(x), mx.value_and_grad(exact)(x)
        assert abs(va.item() - ve.item()) < 1e-3 * max(1.0, abs(ve.item()))
        np.testing.assert_allclose(np.array(ga), np.array(ge), atol=1e-4)


def test_approximate_softmax_trains_like_the_exact_one(qwen3_pair, rows, tmp_path):
    runs = {}
    for name, extra in (("exact", []), ("fast", ["--approximate-softmax"])):
        out = tmp_path / name
        assert cli.run(T.main, small_run(qwen3_pair, rows / "rows.npy", out, "--steps", "4", *extra)) == 0
        runs[name] = np.array(json.loads((out / T.STATE_DIR / "training_state.json").read_text())["history"])
    assert np.abs(runs["fast"][:, 0] - runs["exact"][:, 0]).max() < 1e-2
    assert not np.array_equal(runs["fast"], runs["exact"])  # the approximate path ran


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("quantized", [False, True])
def test_head_rows_are_the_heads_columns(make_pair, family, quantized):
    model, _ = load(str(make_pair(family).path))
    if quantized:
        nn.quantize(model, group_size=32, bits=4)
    adapter = dflash_mlx.targets.adapter_for(model)
    ids = [1, 7, 30, 200]
    h = mx.random.normal((2, 3, adapter.hidden_size), key=mx.random.key(4))
    np.testing.assert_allclose(np.array(adapter.lm_head_rows(ids)(h)), np.array(adapter.lm_head(h)[..., ids]), atol=1e-4)
