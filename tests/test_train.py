"""The trainer: train/inference consistency, learning, lossless checkpoints,
exact resume, and one-line errors for bad input."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

import dflash_mlx
from dflash_mlx import cli
from dflash_mlx import train as T
from dflash_mlx.models.dflash import DFlashConfig, DFlashDraftModel

import tiny

REPO = Path(__file__).resolve().parents[1]
VARIANTS = {
    "bidirectional": {},
    "causal": {"is_causal": True},
    "sliding": {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 5},
}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    path.write_text(tiny.seeded_source())
    return path


def train_cli(argv):
    """``mlx-dflash train`` as the dispatcher runs it: user errors end as exit code 1."""
    return cli.run(T.main, argv)


def small_run(pair, corpus, out, *extra):
    """argv of a CI-sized run (block 8, 2 drafter layers, byte tokens)."""
    return [
        "--model", str(pair.path), "--data", str(corpus), "--draft-model", str(out),
        "--block-size", "8", "--seq-len", "48", "--batch-size", "2", "--anchors-per-seq", "6",
        "--learning-rate", "3e-3", "--warmup", "2", "--intermediate-size", "96", *extra,
    ]  # fmt: skip


def assert_lossless(pair, draft, prompt, max_tokens):
    """DFlash greedy == mlx-lm greedy (eos disabled so both run the full length)."""
    got, responses = pair.dflash(draft, prompt, eos_ids=[], max_tokens=max_tokens)
    assert got == pair.reference(prompt, max_tokens, eos_ids=[])
    return responses


def history(out: Path):
    return json.loads((out / T.STATE_DIR / "training_state.json").read_text())["history"]


def training_batch(pair, variant, anchors, seed, B=6, S=24):
    """A seeded drafter of ``variant`` bound to the pair's target, and one
    batch of two rows: tokens, taps, blocks at ``anchors``, positions, mask."""
    cfg = pair.draft_config(block_size=B, **VARIANTS[variant])
    draft = DFlashDraftModel(DFlashConfig.from_hf(cfg))
    tiny.seeded_init(draft, 3)
    draft.bind(pair.model)
    tokens = mx.array(np.random.default_rng(seed).integers(0, 256, (2, S)), dtype=mx.int32)
    taps, _ = T.target_pass(draft.target, tokens, cfg["dflash_config"]["target_layer_ids"])
    anchors = mx.array(anchors, dtype=mx.int32)
    blocks, positions = T.make_blocks(tokens, anchors, B, draft.mask_token_id)
    return draft, tokens, taps, anchors, blocks, positions, T.context_mask(anchors, S)


@pytest.mark.parametrize("variant", VARIANTS)
def test_train_forward_equals_inference(pair, variant):
    """Every block of the one-pass training forward gives the logits the
    inference drafter gives from a fresh cache fed the taps before its anchor."""
    B, S = 6, 24
    draft, tokens, taps, anchors, blocks, positions, mask = training_batch(pair, variant, [[1, 7, 15], [3, 9, S - B]], 0)
    logits = draft.compute_logits(
        T.train_forward(draft, draft.target.embed, taps, blocks, positions, mask)
    )
    for b in range(2):
        for i, a in enumerate(anchors[b].tolist()):
            block = blocks[b, i][None]
            assert block[0, 0].item() == tokens[b, a].item()
            ref = draft(block, taps[b : b + 1, :a], draft.make_cache())[0]
            np.testing.assert_allclose(logits[b, i], ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("fast", [False, True])
def test_head_loss_in_slices_equals_one_pass(pair, monkeypatch, fast):
    """The training loss's head, a slice of rows at a time, gives the
    whole batch's cross-entropy, best ids and gradients."""
    draft = DFlashDraftModel(DFlashConfig.from_hf(pair.draft_config(block_size=6)))
    tiny.seeded_init(draft, 3)
    draft.bind(pair.model)
    hidden = mx.random.normal((2, 3, 5, draft.target.hidden_size), key=mx.random.key(6))
    labels = mx.random.randint(-1, draft.config.vocab_size, (2, 3, 5), key=mx.random.key(7))
    runs = []
    for chunk in (1 << 30, 7 * draft.config.vocab_size):  # one slice; slices of 7 rows, the last shorter
        monkeypatch.setattr(T, "HEAD_CHUNK", chunk)
        value_grad = mx.value_and_grad(lambda h: T.head_loss(draft, h, labels, fast)[0].sum())
        runs.append((*value_grad(hidden), T.head_loss(draft, hidden, labels, fast)[1]))
    (v1, g1, b1), (v2, g2, b2) = runs
    assert b1.shape == labels.shape and mx.array_equal(b1, b2).item()
    assert abs(v1.item() - v2.item()) < 1e-4 * abs(v1.item())
    np.testing.assert_allclose(np.array(g1), np.array(g2), atol=1e-5)


@pytest.mark.parametrize("variant", VARIANTS)
def test_fast_training_attention_follows_the_exact_one(pair, variant):
    """The approximate path (each block's own context span, its softmax
    split between context and block) gives the exact path's states and
    gradients, for drafters whose blocks see the context differently."""
    B, S = 6, 24
    draft, _, taps, _, blocks, positions, mask = training_batch(pair, variant, [[1, 4, 9], [2, 12, S - B]], 1)
    assert T.context_spans(mask) == [2, 12, S - B]  # the last anchor of each block, + 1
    w = mx.random.normal((2, 3, B, draft.target.hidden_size), key=mx.random.key(5))

    def loss(fast):
        return lambda model: (T.train_forward(model, model.target.embed, taps, blocks, positions, mask, fast) * w).sum()

    (fast, g_fast), (exact, g_exact) = (nn.value_and_grad(draft, loss(f))(draft) for f in (True, False))
    assert abs(fast.item() - exact.item()) < 1e-3 * max(1.0, abs(exact.item()))
    for (name, a), (_, e) in zip(tree_flatten(g_fast), tree_flatten(g_exact)):
        np.testing.assert_allclose(np.array(a), np.array(e), atol=2e-3 * max(1.0, float(mx.abs(e).max())), err_msg=name)


def test_labels_and_weights():
    tokens = mx.arange(20)[None]
    greedy = tokens + 100
    anchors = mx.array([[1, 5]])
    blocks, positions = T.make_blocks(tokens, anchors, 4, 99)
    assert blocks.tolist() == [[[1, 99, 99, 99], [5, 99, 99, 99]]]
    assert positions.tolist() == [[[1, 2, 3, 4], [5, 6, 7, 8]]]
    # slot j: data token at a+j, or the target's prediction made at a+j-1
    assert T.slot_labels(tokens, None, anchors, 4).tolist() == [[[2, 3, 4], [6, 7, 8]]]
    assert T.slot_labels(tokens, greedy, anchors, 4).tolist() == [[[101, 102, 103], [105, 106, 107]]]
    np.testing.assert_allclose(T.slot_weights(4, 2.0), np.exp(-np.arange(3) / 2.0), rtol=1e-6)
    # strictly before the anchor: its own taps are not context yet
    assert T.context_mask(anchors, 7).tolist() == [[[True] + [False] * 6, [True] * 5 + [False] * 2]]


def test_windows_never_cross_a_row():
    docs = [np.arange(6), np.array([100, 101]), np.array([200, 201, 202, 203])]
    flat, starts = T.window_starts(docs, 4)
    windows = sorted(tuple(flat[s : s + 4].tolist()) for s in starts)
    assert windows == [(0, 1, 2, 3), (1, 2, 3, 4), (2, 3, 4, 5), (200, 201, 202, 203)]


def test_training_learns_and_checkpoint_decodes_losslessly(qwen3_5_pair, corpus, tmp_path):
    pair, out = qwen3_5_pair, tmp_path / "draft"
    assert train_cli(small_run(pair, corpus, out, "--steps", "40", "--save-every", "100")) == 0
    losses = [h[0] for h in history(out)]
    assert len(losses) == 40
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.3, losses

    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["block_size"] == 8
    assert cfg["dflash_config"]["mask_token_id"] == pair.tokenizer.convert_tokens_to_ids(tiny.MASK)
    assert set(mx.load(str(out / "model.safetensors"))) >= {"fc.weight", "layers.1.mlp.up_proj.weight"}

    assert_lossless(pair, dflash_mlx.load_draft(out, pair.model), "def load_draft(path", 40)


def test_data_targets_npy_and_bf16_checkpoint(qwen3_pair, corpus, tmp_path):
    pair = qwen3_pair
    ids = np.asarray(pair.tokenizer.encode(corpus.read_text()[:4000]), dtype=np.uint16)
    np.save(tmp_path / "tokens.npy", ids[:3000].reshape(30, 100))  # rows: separate documents
    out = tmp_path / "draft"
    np.save(tmp_path / "held_out.npy", ids[3000:3200].reshape(2, 100))
    written = np.arange(100) >= np.array([[30], [0]])  # a prompt of 30 tokens, then a whole row of answer
    np.save(tmp_path / "written.npy", written)
    argv = small_run(pair, tmp_path / "tokens.npy", out, "--steps", "3", "--targets", "data",
                     "--dtype", "bfloat16", "--taps", "1,2", "--num-layers", "1", "--eval-every", "2",
                     "--eval-data", str(tmp_path / "held_out.npy"), "--eval-answer-mask", str(tmp_path / "written.npy"),
                     "--eval-train-rows", "3")  # fmt: skip
    assert train_cli(argv) == 0
    state = json.loads((out / T.STATE_DIR / "training_state.json").read_text())
    curve, seen = state["eval"], state["eval_train"]
    assert [step for step, _, _ in curve] == [step for step, _, _ in seen] == [0, 2, 3]  # the start, every --eval-every steps, the end
    # cycles from anchor 30 (row 0) and 1 (row 1) to where a block of 8 no longer fits (anchor 92)
    assert all(1 <= per_cycle <= 8 and per_cycle * cycles >= (92 - 30) + (92 - 1) for _, per_cycle, cycles in curve)
    # 3 training rows cut to --seq-len 48, all written (no --answer-mask): from anchor 1 to 40 each
    assert all(1 <= per_cycle <= 8 and per_cycle * cycles >= 3 * (40 - 1) for _, per_cycle, cycles in seen)
    assert all(v.dtype == mx.bfloat16 for v in mx.load(str(out / "model.safetensors")).values())
    draft = dflash_mlx.load_draft(out, pair.model)
    assert draft.config.target_layer_ids == [1, 2] and draft.config.num_hidden_layers == 1
    assert_lossless(pair, draft, "import mlx", 20)


def test_training_sample_takes_rows_with_their_answer_marks():
    """The learning curve's training rows: whole documents cut to --seq-len,
    each with its own slice of the flat answer mask, the same for a seed."""
    docs = [np.arange(n) + 100 * i for i, n in enumerate((40, 5, 70, 30, 60))]
    answers = np.concatenate([np.arange(len(d)) % 3 == 0 for d in docs])
    args = T.TrainConfig(model="m", data=["d"], draft_model="o", block_size=8, seq_len=50, eval_train_rows=3, seed=4)
    rows, written = T.training_sample(args, docs, answers)
    again, _ = T.training_sample(args, docs, answers)
    assert [r.tolist() for r in rows] == [r.tolist() for r in again]
    assert len(rows) == 3 and all(len(r) >= 10 and r[0] % 100 == 0 for r in rows)  # never doc 1 (5 < block + 2)
    for row, marks in zip(rows, written):
        assert len(row) == min(50, len(docs[row[0] // 100])) and (marks == (np.arange(len(row)) % 3 == 0)).all()
    _, plain = T.training_sample(args, docs, None)
    assert all(m.tolist() == [False] + [True] * (len(m) - 1) for m in plain)


def test_cached_target_trains_identically(qwen3_5_pair, corpus, tmp_path):
    """--cache-target only skips repeated target passes: same run, same numbers."""
    ids = np.asarray(qwen3_5_pair.tokenizer.encode(corpus.read_text()[:2000]))
    np.save(tmp_path / "rows.npy", ids[: 6 * 48].reshape(6, 48))
    runs = {}
    for name, extra in (("plain", []), ("cached", ["--cache-target"])):
        out = tmp_path / name
        argv = small_run(qwen3_5_pair, tmp_path / "rows.npy", out, "--steps", "8", *extra)
        assert train_cli(argv) == 0
        runs[name] = history(out)
    # The same arithmetic, the taps computed for all rows at once instead of
    # per batch: a BLAS may block a matmul by its row count and sum in
    # another order (OpenBLAS does), so equal to float32 rounding over a few
    # layers and steps, not bit for bit.
    np.testing.assert_allclose(runs["cached"], runs["plain"], rtol=1e-5, atol=1e-7)
    assert train_cli(small_run(qwen3_5_pair, corpus, tmp_path / "x", "--cache-target")) == 1


def test_memory_cache_keeps_only_rows_drawn_again(qwen3_5_pair, corpus, tmp_path):
    """In memory, --cache-target keeps the rows the run is expected to draw
    more than once (a fine-tune's replayed rows are drawn about once each);
    the others run the target whenever drawn. Either way the taps and labels
    are the target's own."""
    ids = np.asarray(qwen3_5_pair.tokenizer.encode(corpus.read_text()[:2000]))
    np.save(tmp_path / "rows.npy", ids[: 6 * 48].reshape(6, 48))
    argv = small_run(qwen3_5_pair, tmp_path / "rows.npy", tmp_path / "o", "--cache-target")
    args = T.TrainConfig(**vars(T.setup_arg_parser().parse_args(argv)))
    T.check_args(args)
    _, adapter, docs, data, *_ = T.prepare(args)
    width = len(args.taps) * adapter.hidden_size
    chance = np.array([3.0, 0.5, 3.0, 0.5, 3.0, 0.5]) / (args.steps * args.batch_size)  # expected draws 3 or 0.5
    cached = T.TargetOutputs(adapter, args, len(docs), width, chance=chance)
    plain = T.TargetOutputs(adapter, T.TrainConfig(**{**vars(args), "cache_target": False}), len(docs), width)
    assert cached.arrays["taps"].shape[0] == 3  # rows 0, 2 and 4
    flat = np.concatenate(docs)
    for rows in ([0, 1, 1, 2], [1, 2, 3, 0]):
        starts = np.array(rows) * args.seq_len
        windows = np.stack([flat[s : s + args.seq_len] for s in starts])
        (taps, greedy), (want, labels) = cached(starts, windows), plain(starts, windows)
        np.testing.assert_allclose(np.array(taps), np.array(want), rtol=1e-5, atol=1e-5)
        assert np.array_equal(np.array(greedy), np.array(labels))
    assert cached.arrays["done"].tolist() == [True, True, False]


def test_disk_cache_of_target_outputs(qwen3_5_pair, corpus, tmp_path):
    """--cache-dir: float16 taps on disk, written once, reused by a later run;
    training follows the uncached run closely (taps rounded to float16)."""
    ids = np.asarray(qwen3_5_pair.tokenizer.encode(corpus.read_text()[:2000]))
    np.save(tmp_path / "rows.npy", ids[: 6 * 48].reshape(6, 48))
    cache = tmp_path / "cache"
    runs = {}
    for name, extra in (("plain", []), ("disk", ["--cache-target", "--cache-dir", str(cache)]),
                        ("again", ["--cache-target", "--cache-dir", str(cache)])):  # fmt: skip
        argv = small_run(qwen3_5_pair, tmp_path / "rows.npy", tmp_path / name, "--steps", "8", *extra)
        assert train_cli(argv) == 0
        runs[name] = np.array(history(tmp_path / name))
    taps = np.load(cache / "taps.npy", mmap_mode="r")
    assert taps.dtype == np.float16 and taps.shape[:2] == (6, 48) and np.load(cache / "done.npy").sum() > 0
    assert np.array_equal(runs["again"], runs["disk"])
    assert np.abs(runs["disk"][:, 0] - runs["plain"][:, 0]).max() < 1e-2
    # The cache belongs to its rows: other data is refused, and --cache-dir needs --cache-target.
    np.save(tmp_path / "other.npy", ids[48 : 7 * 48].reshape(6, 48))
    argv = small_run(qwen3_5_pair, tmp_path / "other.npy", tmp_path / "o", "--cache-target", "--cache-dir", str(cache))
    assert train_cli(argv) == 1
    assert train_cli(small_run(qwen3_5_pair, tmp_path / "rows.npy", tmp_path / "p", "--cache-dir", str(cache))) == 1


def test_data_labels_cache_only_the_taps(qwen3_5_pair, corpus, tmp_path, monkeypatch):
    """With ``--targets data`` the cache holds taps and no greedy labels,
    trains as the uncached run does (filled a row a pass here), and is
    refused to self-distillation, whose labels it lacks."""
    monkeypatch.setattr(T, "CACHE_PASS_ROWS", 1)
    ids = np.asarray(qwen3_5_pair.tokenizer.encode(corpus.read_text()[:2000]))
    np.save(tmp_path / "rows.npy", ids[: 6 * 48].reshape(6, 48))
    cache = tmp_path / "cache"
    runs = {}
    for name, extra in (("plain", []), ("disk", ["--cache-target", "--cache-dir", str(cache)])):
        argv = small_run(qwen3_5_pair, tmp_path / "rows.npy", tmp_path / name, "--steps", "6", "--targets", "data", *extra)
        assert train_cli(argv) == 0
        runs[name] = np.array(history(tmp_path / name))
    assert sorted(p.name for p in cache.glob("*.npy")) == ["done.npy", "taps.npy"]
    assert np.abs(runs["disk"][:, 0] - runs["plain"][:, 0]).max() < 1e-2
    argv = small_run(qwen3_5_pair, tmp_path / "rows.npy", tmp_path / "sd", "--cache-target", "--cache-dir", str(cache))
    assert train_cli(argv) == 1


def test_resume_equals_uninterrupted_run(qwen3_pair, corpus, tmp_path, monkeypatch, capsys):
    pair = qwen3_pair
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert train_cli(small_run(pair, corpus, straight, "--steps", "8", "--save-every", "3")) == 0

    # Interrupt (Ctrl-C) while sampling step 5's batch: the checkpoint of step 3 survives.
    real = tiny.interrupt_sampling_at(monkeypatch, 5)
    argv = small_run(pair, corpus, resumed, "--steps", "8", "--save-every", "3")
    assert train_cli(argv) == 130
    assert "--resume" in capsys.readouterr().err
    assert len(history(resumed)) == 3
    monkeypatch.setattr(T, "sample_batch", real)
    assert train_cli(argv + ["--resume"]) == 0

    assert history(resumed) == history(straight)
    a, b = mx.load(str(straight / "model.safetensors")), mx.load(str(resumed / "model.safetensors"))
    assert all(mx.array_equal(a[k], b[k]).item() for k in a)
    # Changing what the run trains on is refused rather than silently mixed in.
    assert train_cli(argv + ["--resume", "--learning-rate", "1e-3"]) == 1
    assert "--learning-rate" in capsys.readouterr().err


def test_init_from_starts_at_the_checkpoint(qwen3_pair, corpus, tmp_path, capsys):
    """--init-from loads an earlier drafter's weights: with a zero learning
    rate the new run saves them unchanged and its losses are the old run's
    level, not a random drafter's: on the same first batches (one seed), the
    old run's first ones were a drafter's first steps (one batch alone says
    little at this size). A run with a draft vocabulary may start from one
    without. A drafter of another shape is refused."""
    pair = qwen3_pair
    first, second = tmp_path / "first", tmp_path / "second"
    assert train_cli(small_run(pair, corpus, first, "--steps", "30")) == 0
    argv = small_run(pair, corpus, second, "--steps", "8", "--init-from", str(first))
    argv[argv.index("--learning-rate") + 1] = "0"
    assert train_cli(argv) == 0
    a, b = mx.load(str(first / "model.safetensors")), mx.load(str(second / "model.safetensors"))
    assert all(mx.array_equal(a[k], b[k]).item() for k in a)
    assert np.mean([h[0] for h in history(second)]) < np.mean([h[0] for h in history(first)[:8]]) - 0.3
    vocab = small_run(pair, corpus, tmp_path / "vocab", "--steps", "1", "--draft-vocab", "64", "--init-from", str(first))
    assert train_cli(vocab) == 0  # a head over fewer ids: the same weights
    c = mx.load(str(tmp_path / "vocab" / "model.safetensors"))
    assert sorted(c) == sorted(a)
    other = small_run(pair, corpus, tmp_path / "third", "--steps", "2", "--num-layers", "1", "--init-from", str(first))
    assert train_cli(other) == 1
    err = capsys.readouterr().err
    assert "different drafter" in err and "num_hidden_layers" in err


def test_init_from_a_shallower_drafter_grows_it_and_drafts_as_it_did(qwen3_pair, corpus, tmp_path):
    """A run with more layers than the --init-from drafter: that drafter's
    weights as they were, the added layer fresh but for its outputs into
    the residual stream (zero), so at a zero learning rate the first loss is
    the saved drafter's own on the same batch."""
    pair = qwen3_pair
    first = tmp_path / "first"
    assert train_cli(small_run(pair, corpus, first, "--steps", "30")) == 0
    losses = {}
    for layers in (2, 3):
        argv = small_run(pair, corpus, tmp_path / f"l{layers}", "--steps", "1", "--num-layers", str(layers),
                         "--taps", "1,1", "--init-from", str(first))  # the first run's taps (by default they follow the depth)
        argv[argv.index("--learning-rate") + 1] = "0"
        assert train_cli(argv) == 0
        losses[layers] = history(tmp_path / f"l{layers}")[0][0]
    a, g = mx.load(str(first / "model.safetensors")), mx.load(str(tmp_path / "l3" / "model.safetensors"))
    assert all(mx.array_equal(a[k], g[k]).item() for k in a) and "layers.2.mlp.down_proj.weight" in g
    assert not mx.any(g["layers.2.self_attn.o_proj.weight"]).item() and not mx.any(g["layers.2.mlp.down_proj.weight"]).item()
    assert mx.any(g["layers.2.self_attn.q_proj.weight"]).item()  # the rest of the layer is a fresh initialisation
    assert losses[3] == pytest.approx(losses[2], rel=1e-5)


def _no_mask_target(pair, root: Path) -> Path:
    path = root / "no_mask_target"
    shutil.copytree(pair.path, path)
    tok = json.loads((path / "tokenizer.json").read_text())
    tok["added_tokens"] = [t for t in tok["added_tokens"] if t["content"] != tiny.MASK]
    (path / "tokenizer.json").write_text(json.dumps(tok))
    return path


BAD = {  # case: (arguments after the common ones, words the message must hold)
    "no data": (lambda p, d, t: [], "no --data"),
    "missing data": (lambda p, d, t: ["--data", str(t / "nope.txt")], "not found"),
    "seq shorter than a block": (lambda p, d, t: ["--data", str(d), "--seq-len", "8"], "shorter than a block"),
    "data shorter than a window": (lambda p, d, t: ["--data", str(t / "short.txt")], "no --seq-len 48 window"),
    "taps out of range": (lambda p, d, t: ["--data", str(d), "--taps", "1,9"], "out of range"),
    "bad taps": (lambda p, d, t: ["--data", str(d), "--taps", "1,x"], "comma list"),
    "init from nothing": (lambda p, d, t: ["--data", str(d), "--init-from", str(t)], "no drafter checkpoint"),
    "mask id out of vocab": (lambda p, d, t: ["--data", str(d), "--mask-token-id", "9999"], "outside"),
    "npy outside vocab": (lambda p, d, t: ["--data", str(t / "big.npy")], "outside the target"),
    "no mask token": (lambda p, d, t: ["--data", str(d), "--model", str(_no_mask_target(p, t))], "--mask-token-id"),
    "unsupported target": (lambda p, d, t: ["--data", str(d), "--model", str(t / "mistral")], "unsupported target"),
    "missing target": (lambda p, d, t: ["--data", str(d), "--model", str(t / "absent")], "absent"),
    "nothing to resume": (lambda p, d, t: ["--data", str(d), "--resume"], "no training state"),
    "eval rows not 2-D": (lambda p, d, t: ["--data", str(d), "--eval-data", str(t / "big.npy")], "2-D .npy"),
    "eval mask alone": (lambda p, d, t: ["--data", str(d), "--eval-answer-mask", str(t / "big.npy")], "pass --eval-data too"),
    "train rows alone": (lambda p, d, t: ["--data", str(d), "--eval-train-rows", "2"], "pass --eval-data too"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_input_fails_with_one_line(case, qwen3_pair, corpus, tmp_path, capsys):
    (tmp_path / "short.txt").write_text("tiny")
    np.save(tmp_path / "big.npy", np.array([1, 2, 5000]))
    if case == "unsupported target":
        tiny.make_target(tmp_path / "mistral", tiny.LLAMA, model_type="mistral")
    extra, words = BAD[case]
    # A later --model replaces this one (argparse keeps the last).
    argv = ["--model", str(qwen3_pair.path), "--draft-model", str(tmp_path / "out"), "--block-size", "8",
            "--seq-len", "48", "--steps", "1", *extra(qwen3_pair, corpus, tmp_path)]  # fmt: skip
    assert train_cli(argv) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and words in err, err
    assert not (tmp_path / "out").exists()


def test_cli_entry_points_report_errors_without_traceback(tmp_path):
    for cmd in (["-m", "dflash_mlx.train"], ["-m", "dflash_mlx", "train"]):
        r = subprocess.run(
            [sys.executable, *cmd, "--target", "x", "--data", str(tmp_path / "none.txt"), "--out", str(tmp_path / "o")],
            capture_output=True, text=True, cwd=REPO,
        )  # fmt: skip
        assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
        assert "not found" in r.stderr


def test_old_flag_names_are_hidden_aliases(qwen3_pair, corpus, tmp_path, capsys):
    """``--target`` / ``--out`` still name the target and the output, as
    ``--model`` / ``--draft-model`` do, but --help lists only mlx-lm's names."""
    help_text = T.setup_arg_parser().format_help()
    assert "--model" in help_text and "--draft-model" in help_text
    assert "--target " not in help_text and "--out" not in help_text
    new = vars(T.setup_arg_parser().parse_args(["--model", "a", "--draft-model", "b"]))
    old = vars(T.setup_arg_parser().parse_args(["--target", "a", "--out", "b"]))
    assert new == old and new["model"] == "a" and new["draft_model"] == "b"
    assert train_cli(["--data", str(corpus)]) == 1
    assert "--model" in capsys.readouterr().err


def test_train_config_api_equals_the_cli(qwen3_pair, corpus, tmp_path):
    """``train(TrainConfig(...))`` writes the checkpoint the CLI writes from the same settings."""
    argv = small_run(qwen3_pair, corpus, tmp_path / "cli", "--steps", "2")
    assert train_cli(argv) == 0
    config = T.TrainConfig(
        model=str(qwen3_pair.path), draft_model=str(tmp_path / "api"), data=[str(corpus)], steps=2,
        block_size=8, seq_len=48, batch_size=2, anchors_per_seq=6, learning_rate=3e-3, warmup=2,
        intermediate_size=96,
    )  # fmt: skip
    state = T.train(config)
    assert state["step"] == 2 and state["history"] == history(tmp_path / "cli")
    a, b = mx.load(str(tmp_path / "cli" / "model.safetensors")), mx.load(str(tmp_path / "api" / "model.safetensors"))
    assert a.keys() == b.keys() and all(mx.array_equal(a[k], b[k]).item() for k in a)


def test_cycles_along_hops_from_anchor_to_anchor():
    """A cycle from anchor ``a`` commits ``accepted[a] + 1`` tokens, clipped
    at its run's end, and the next starts at the last token it committed."""
    written = np.array([0, 1, 1, 1, 1, 1, 1, 1, 0, 0, 1, 1, 1, 0], bool)
    accepted = np.array([9, 2, 0, 0, 5, 1, 0, 0, 0, 9, 0, 9, 9, -1])
    # run 1..7: anchor 1 commits 3 (to 4), anchor 4 commits 5 clipped to 3 (7 is the run's last)
    # run 10..12: anchor 10 commits 1, anchor 11 commits 1 (the run's end)
    assert T.cycles_along(accepted, written) == [3, 3, 1, 1]
    accepted[4] = -1  # no block drafted there: the run stops being counted
    assert T.cycles_along(accepted, written) == [3, 1, 1]


def test_held_out_cycles_are_the_loops_own():
    """The learning curve's measure: on the bundled pair's greedy text, the
    cycles the training forward predicts are the cycles the loop runs at a
    fixed block, up to where a whole block no longer fits the row."""
    from dflash_mlx.benchmark import run_dflash
    from dflash_mlx.generate import encode_prompt
    from dflash_mlx.pair import DEFAULT_TARGET, default_prompts, load_pair

    model, tokenizer, draft, _ = load_pair(DEFAULT_TARGET)
    prompt = default_prompts()[0]
    run = run_dflash(model, draft, tokenizer, prompt, 96, draft.block_size, copy_drafts=False)  # (the drafter's blocks only)
    ids = encode_prompt(tokenizer, prompt).tolist()
    row = np.array(ids + run["tokens"], np.int32)
    written = np.arange(len(row)) >= len(ids)
    taps, _ = T.target_pass(draft.target, mx.array(row[None]), draft.config.target_layer_ids)
    got = T.held_out_cycles(draft, draft.target, [row], [written], [taps], chunk=16)
    assert max(run["committed"]) > 3  # the pair's drafter agrees: the check has cycles of many lengths
    assert got == run["committed"][: len(got)], (got, run["committed"])
    assert len(ids) + sum(got) > len(row) - draft.block_size  # it stops only where no whole block fits
