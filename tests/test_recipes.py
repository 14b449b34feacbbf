"""Recipes: the default pair's target trains through the package's adapter
(mlx-lm untouched, same gradients); the SmolLM2 data pipeline (requests,
self-distillation shards with resume, packed rows) on tiny stand-ins."""

import json
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm import load as mlx_lm_load
from mlx_lm import stream_generate as mlx_lm_stream_generate
from mlx_lm.models import qwen3_5

from tiny_gguf import make_fixture

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
sys.path.insert(0, str(RECIPES))

import smollm2_distill  # noqa: E402
import smollm2_requests  # noqa: E402
import smollm2_rows  # noqa: E402
from default_pair.target import training_forward  # noqa: E402


def test_target_training_forward_has_mlx_lms_gradients(qwen3_5_pair):
    """The chunked recurrence through the adapter: mlx-lm's loss and gradients
    (to float32 rounding), with mlx-lm's own recurrence left in place."""
    original = qwen3_5.gated_delta_update
    model = qwen3_5_pair.model
    x = mx.array([[(7 * i) % 250 + 1 for i in range(128)]] * 2)
    y = mx.roll(x, -1, axis=1)

    def grads(forward):
        loss = lambda m: nn.losses.cross_entropy(forward(x), y, reduction="mean")  # noqa: E731
        value, g = nn.value_and_grad(model, loss)(model)
        return value.item(), dict(tree_flatten(g))

    model.train()
    try:
        ours, ref = grads(training_forward(model, chunked=True)), grads(model)
    finally:
        model.eval()
    assert qwen3_5.gated_delta_update is original
    assert abs(ours[0] - ref[0]) < 1e-5
    for k, g in ref[1].items():
        assert mx.abs(ours[1][k] - g).max().item() <= 2e-3 * (mx.abs(g).max().item() + 1e-6), k


def test_requests_are_seeded_and_held_out_by_topic(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    smollm2_requests.main(["--out", str(a)])
    smollm2_requests.main(["--out", str(b)])
    assert a.read_text() == b.read_text()
    d = json.loads(a.read_text())
    assert len(d["train"]) > 2000 and len(d["heldout"]) == 64
    assert not {r["topic"] for r in d["heldout"]} & {r["topic"] for r in d["train"]}
    assert not {r["request"] for r in d["heldout"]} & {r["request"] for r in d["train"]}
    assert {r["kind"] for r in d["train"]} == set(smollm2_requests.KINDS)
    assert all(1 <= len(r["followups"]) <= 2 for r in d["train"] if r["kind"] == "multi-turn")
    # The held-out requests are the SmolLM2 pair's benchmark prompts, none of them trained on.
    bench = json.loads((RECIPES.parent / "dflash_mlx" / "smollm2_pair" / "prompts.json").read_text())
    assert [r["request"] for r in d["heldout"]] == bench
    # Nor is the long-prompt bench's document (stdlib docstrings) asked about.
    from dflash_mlx.benchmark import DOCUMENT_MODULES

    stdlib = {r["topic"].split(":", 1)[1] for r in d["train"] if r["kind"] == "stdlib"}
    assert "os" in stdlib and not stdlib & set(DOCUMENT_MODULES)
    assert not any(m.startswith(("json.", "logging.", "unittest.", "email.message")) for m in stdlib)


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """A tiny llama with a real chat template (the GGUF fixture's HF side)."""
    return make_fixture(tmp_path_factory.mktemp("chat"))["src"]


def test_distill_shards_are_the_targets_greedy_answers_and_resume(chat_model, tmp_path, capsys):
    reqs = tmp_path / "requests.json"
    train = [{"request": f"Question {i}: def f(x): return {i}"} for i in range(5)]
    reqs.write_text(json.dumps({"train": train, "heldout": []}))
    out = tmp_path / "shards"
    argv = ["--model", str(chat_model), "--requests", str(reqs), "--out", str(out),
            "--shard-size", "2", "--batch-size", "1", "--max-tokens", "12", "--no-fast-target"]  # fmt: skip
    smollm2_distill.main(argv + ["--limit", "3"])
    assert sorted(p.name for p in out.glob("shard-*.npz")) == ["shard-00000.npz", "shard-00001.npz"]
    with pytest.raises(SystemExit):  # shards exist: only --resume continues
        smollm2_distill.main(argv)
    first = (out / "shard-00000.npz").stat().st_mtime_ns
    smollm2_distill.main(argv + ["--resume"])  # all 5: shard 0 kept, shard 1 (cut short by --limit) redone
    assert (out / "shard-00000.npz").stat().st_mtime_ns == first
    model, tok = mlx_lm_load(str(chat_model))
    rows = []
    for path in sorted(out.glob("shard-*.npz")):
        rows += smollm2_distill.read_shard(path)[0]
    assert len(rows) == 5
    assert all(smollm2_distill.shard_seconds(p) > 0 for p in out.glob("shard-*.npz"))
    for r, row in zip(train, rows):
        prompt = tok.apply_chat_template([{"role": "user", "content": r["request"]}], add_generation_prompt=True)
        answer = [g.token for g in mlx_lm_stream_generate(model, tok, prompt, max_tokens=12)]
        assert row.tolist() == prompt + answer
    assert "done" in (out / "progress.log").read_text()


def test_rows_pack_conversations_back_to_back(tmp_path):
    rng = np.random.default_rng(0)
    convs = [rng.integers(0, 400, size=n).astype(np.int32) for n in (30, 70, 45, 90, 12)]
    shards = tmp_path / "shards"
    shards.mkdir()
    smollm2_distill.write_shard(shards / "shard-00000.npz", convs[:3], [5, 5, 5], 12.5)
    smollm2_distill.write_shard(shards / "shard-00001.npz", convs[3:], [5, 5], 7.0)
    assert smollm2_distill.shard_seconds(shards / "shard-00001.npz") == 7.0
    out = tmp_path / "rows.npy"
    smollm2_rows.main(["--shards", str(shards), "--seq-len", "64", "--out", str(out)])
    rows = np.load(out)
    assert rows.shape == (3, 64) and rows.dtype == np.int32
    assert np.array_equal(rows.reshape(-1), np.concatenate(convs)[: 3 * 64])
    # Answers shorter than the cap (prompt 5 + answer < 80) get their end-of-turn tokens back.
    smollm2_rows.main(["--shards", str(shards), "--seq-len", "64", "--out", str(out), "--max-tokens", "80",
                       "--end-ids", "401,402"])  # fmt: skip
    end = np.array([401, 402], np.int32)
    closed = [np.concatenate([c, end]) if len(c) - 5 < 80 else c for c in convs]
    assert [len(c) - 5 < 80 for c in convs] == [True, True, True, False, True]
    assert np.array_equal(np.load(out).reshape(-1), np.concatenate(closed)[: np.load(out).size])


def test_install_ships_a_bfloat16_drafter_with_its_card(tmp_path):
    import smollm2_drafter

    from dflash_mlx import random_pair

    work, pkg = tmp_path / "work", tmp_path / "pkg"
    (work / "distill").mkdir(parents=True)
    rng = np.random.default_rng(0)
    for i, seconds in enumerate((100.0, 50.0, 25.0)):
        rows = [rng.integers(0, 400, size=40).astype(np.int32) for _ in range(2)]
        smollm2_distill.write_shard(work / "distill" / f"shard-{i:05d}.npz", rows, [5, 5], seconds)
    np.save(work / "rows-64-s2.npy", np.zeros((3, 64), np.int32))
    # Shared stages add up in the work directory, a data set's own beside its run directory.
    (work / "times.json").write_text(json.dumps({"requests": 36.0, "rows": 99999.0}))
    argv = ["--stage", "install", "--work-dir", str(work), "--pkg-dir", str(pkg), "--max-shards", "2",
            "--seq-len", "64", "--steps", "4"]  # fmt: skip
    run = work / "drafter_run-64-s2"
    target_cfg = random_pair.family_config("llama", "LlamaForCausalLM")
    cfg = random_pair.draft_config(target_cfg, 400, block_size=4)
    random_pair.make_draft(run, cfg)
    (run / "training_state").mkdir()
    state = {"step": 4, "train_seconds": 7200.0, "history": [[2.0, 0.5, 0.25, 1.5]] * 4,
             "eval": [[0, 1.5, 10], [4, 1.75, 8]]}  # fmt: skip
    (run / "training_state" / "training_state.json").write_text(json.dumps(state))
    (work / "drafter_run-64-s2-times.json").write_text(json.dumps({"rows": 1800.0, "measure": 360.0, "train": 9.0}))
    (run / "acceptance.json").write_text(json.dumps({"0-64": 2.5, "all": 2.5, "prompts": 3, "max_tokens": 64}))
    earlier = "| field | value |\n| --- | --- |\n| data | 19 shards |\n| layers | 2 |\n| wall time (hours) | {'train': 0.05} |\n"
    (work / "drafter_run-64-s2-started-from.md").write_text(earlier)  # the train stage's copy (--init-from)
    smollm2_drafter.main(argv)
    shipped = mx.load(str(pkg / "draft" / "model.safetensors"))
    trained = mx.load(str(run / "model.safetensors"))
    assert shipped.keys() == trained.keys() and {v.dtype for v in shipped.values()} == {mx.bfloat16}
    assert all(mx.array_equal(shipped[k], trained[k].astype(mx.bfloat16)) for k in trained)
    card = (pkg / "draft" / "README.md").read_text()
    # The first 2 shards' own seconds, the training state's, the short stages' from the times files.
    assert "'distill': 0.04" in card and "'train': 2.0" in card and "'rows': 0.5" in card
    assert "'requests': 0.01" in card and "'measure': 0.1" in card
    assert "(3 held-out requests, 64 new tokens, greedy, fixed block 4) | {'0-64': 2.5, 'all': 2.5} |" in card
    # the learning curve, with the conversations seen: 4 steps of 8 rows, 2 x 128 conversations in 3 rows
    assert "fixed block 4, predicted by the training forward) | 0 (0 conversations): 1.5, 4 (2,731 conversations): 1.75 |" in card
    assert "| started from: data | 19 shards |" in card and "| started from: wall time (hours) | {'train': 0.05} |" in card
    assert "started from: layers" not in card
    assert "2 distillation shards (0-1), 128 requests each, packed into 3 rows" in card and "3 rows of 64 tokens" in card and "bfloat16" in card
    assert json.loads((pkg / "draft" / "config.json").read_text()) == json.loads((run / "config.json").read_text())
    assert "install" not in json.loads((work / "drafter_run-64-s2-times.json").read_text())  # only the card's stages are timed
