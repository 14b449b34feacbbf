"""The SmolLM2 recipe's cheaper, resumable build on tiny stand-ins:
multi-turn distillation with its answer marks, compact shards, the answer
mask beside the rows, the target's own questions kept off the held-out
topics, the levers reaching ``mlx-dflash train``, and committed shards."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from mlx_lm import load as mlx_lm_load
from mlx_lm import stream_generate as mlx_lm_stream_generate

from tiny_gguf import make_fixture

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
sys.path.insert(0, str(RECIPES))

import smollm2_distill  # noqa: E402
import smollm2_drafter  # noqa: E402
import smollm2_questions  # noqa: E402
import smollm2_rows  # noqa: E402


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """A tiny llama with a real chat template (the GGUF fixture's HF side)."""
    return make_fixture(tmp_path_factory.mktemp("chat"))["src"]


def test_multi_turn_distillation_marks_every_answer(chat_model, tmp_path):
    reqs = tmp_path / "requests.json"
    train = [{"request": "Question: def f(x):"}, {"request": "Tell me about lists", "followups": ["And tuples?"]}]
    reqs.write_text(json.dumps({"train": train, "heldout": []}))
    out = tmp_path / "shards"
    smollm2_distill.main(["--model", str(chat_model), "--requests", str(reqs), "--out", str(out), "--batch-size", "2",
                          "--max-tokens", "8", "--no-fast-target"])  # fmt: skip
    path = out / "shard-00000.npz"
    with np.load(path) as z:
        assert z["tokens"].dtype == np.uint16
    rows, prompt_lens = smollm2_distill.read_shard(path)
    answers = smollm2_distill.read_answers(path)
    model, tok = mlx_lm_load(str(chat_model))
    greedy = lambda chat: [g.token for g in mlx_lm_stream_generate(  # noqa: E731
        model, tok, tok.apply_chat_template(chat, add_generation_prompt=True), max_tokens=8)]
    # single turn: prompt + the target's greedy answer, the answer marked
    chat = [{"role": "user", "content": train[0]["request"]}]
    first = greedy(chat)
    assert rows[0].dtype == np.int32 and rows[0].tolist()[prompt_lens[0]:] == first
    assert answers[0].tolist() == [False] * prompt_lens[0] + [True] * len(first)
    # two turns: the follow-up sees the first answer; both answers are marked
    chat = [{"role": "user", "content": train[1]["request"]}]
    one = greedy(chat)
    chat += [{"role": "assistant", "content": tok.decode(one)}, {"role": "user", "content": "And tuples?"}]
    prompt = tok.apply_chat_template(chat, add_generation_prompt=True)
    two = greedy(chat)
    assert rows[1].tolist() == prompt + two and prompt_lens[1] == len(prompt)
    start = len(tok.apply_chat_template(chat[:1], add_generation_prompt=True))
    end = len(tok.apply_chat_template(chat[:2]))
    marked = np.flatnonzero(answers[1])
    assert marked.tolist() == list(range(start, end)) + list(range(len(prompt), len(prompt) + len(two)))
    # the rows file has its answer mask beside it, the same shape
    rows_out = tmp_path / "rows.npy"
    smollm2_rows.main(["--shards", str(out), "--seq-len", "16", "--out", str(rows_out)])
    packed, mask = np.load(rows_out), np.load(smollm2_rows.answers_path(rows_out))
    flat = np.concatenate(answers)[: packed.size]
    assert mask.shape == packed.shape and mask.dtype == bool and np.array_equal(mask.reshape(-1), flat)


def test_written_questions_skip_held_out_subjects(monkeypatch, tmp_path):
    text = "1. What?\n- How do I sort with shlex quickly?\nNot a question\n3) Why use tuples in Python?"
    assert list(smollm2_questions.questions(text)) == [
        "How do I sort with shlex quickly?", "Why use tuples in Python?"]  # fmt: skip
    data = {"train": [{"topic": "general:lists", "request": "x"}, {"topic": "stdlib:shlex", "request": "y"}],
            "heldout": [{"topic": "stdlib:shlex", "request": "Why use tuples in Python?"}]}  # fmt: skip
    asked = []

    def fake_answers(model, tokenizer, prompts, args):
        asked.extend(prompts)
        return [[0]] * len(prompts)

    class Tok:
        def apply_chat_template(self, chat, add_generation_prompt):
            return chat[0]["content"]

        def decode(self, ids):
            return text + "\nWhat are Python lists good for?"

    monkeypatch.setattr(smollm2_questions, "greedy_answers", fake_answers)
    args = type("A", (), {"limit": None, "chunk": 128})
    new = smollm2_questions.written_requests(None, Tok(), data, args, tmp_path / "progress.json")
    assert len(asked) == len(smollm2_questions.WRITE_ASKS) and all("lists" in a for a in asked)  # training topic only
    assert [r["request"] for r in new] == ["What are Python lists good for?"]
    assert {r["topic"] for r in new} == {"general:lists"} and {r["kind"] for r in new} == {"written"}


def test_written_questions_resume_after_the_last_saved_chunk(monkeypatch, tmp_path):
    """An interrupted questions stage keeps what its finished chunks wrote
    and asks only the prompts after them; the result is the uninterrupted one's."""
    data = {"train": [{"topic": f"general:t{i}", "request": "x"} for i in range(3)], "heldout": []}
    asked, fail_at = [], [2]

    def fake_answers(model, tokenizer, prompts, args):
        if len(asked) // 2 == fail_at[0]:
            raise KeyboardInterrupt
        asked.extend(prompts)
        return [[len(asked) - len(prompts) + i] for i in range(len(prompts))]  # one question per prompt

    class Tok:
        def apply_chat_template(self, chat, add_generation_prompt):
            return chat[0]["content"]

        def decode(self, ids):
            return f"Question {ids[0]} about something?"

    monkeypatch.setattr(smollm2_questions, "greedy_answers", fake_answers)
    args = type("A", (), {"limit": None, "chunk": 2})
    progress = tmp_path / "progress.json"
    with pytest.raises(KeyboardInterrupt):
        smollm2_questions.written_requests(None, Tok(), data, args, progress)
    assert json.loads(progress.read_text())["asked"] == 4
    fail_at[0] = None
    resumed = smollm2_questions.written_requests(None, Tok(), data, args, progress)
    total = 3 * len(smollm2_questions.WRITE_ASKS)
    assert len(asked) == total and len(set(asked)) == total  # every prompt asked once
    asked.clear()
    whole = smollm2_questions.written_requests(None, Tok(), data, args, tmp_path / "fresh.json")
    assert resumed == whole and len(whole) == total


def test_levers_reach_the_training_command(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    np.save(work / "rows-64-s2.npy", np.zeros((3, 64), np.int32))
    base = ["--work-dir", str(work), "--seq-len", "64", "--max-shards", "2", "--stage", "train"]
    def argv(*extra):
        args = smollm2_drafter.parser().parse_args(base + list(extra))
        return smollm2_drafter.train_argv(args, "T", 16), args

    cmd, args = argv()
    assert "--approximate-target" in cmd and "--approximate-softmax" in cmd and "--answer-mask" in cmd and cmd[cmd.index("--num-layers") + 1] == "2"
    assert cmd[cmd.index("--answer-mask") + 1] == str(work / "rows-64-s2-answers.npy")
    assert cmd[cmd.index("--cache-dir") + 1].endswith("target-outputs-64-s2-approx")
    assert cmd[cmd.index("--eval-data") + 1] == str(work / "rows-heldout-64.npy")  # the learning curve's rows
    assert cmd[cmd.index("--eval-answer-mask") + 1] == str(work / "rows-heldout-64-answers.npy")
    assert cmd[cmd.index("--eval-train-rows") + 1] == str(smollm2_drafter.EVAL_TRAIN_ROWS)  # and some training rows
    assert cmd[cmd.index("--draft-vocab") + 1] == str(smollm2_drafter.DRAFT_VOCAB)  # on by default
    # the rows stage's seconds stay out of the run directory, which a new training run needs empty
    assert smollm2_drafter.times_file(args, "rows").parent == work and "--targets" in cmd and cmd[cmd.index("--targets") + 1] == "data"
    cmd, args = argv("--no-fast-target", "--no-fast-softmax", "--no-answer-anchors", "--draft-vocab", "8192", "--loss-slots", "8",
                     "--layers", "4", "--init-from-target", "--variant", "deep", "--no-data-labels")  # fmt: skip
    assert not {"--approximate-target", "--approximate-softmax", "--answer-mask"} & set(cmd)
    assert cmd[cmd.index("--targets") + 1] == "self-distill" and cmd[cmd.index("--cache-dir") + 1].endswith("target-outputs-64-s2-greedy")
    assert cmd[cmd.index("--draft-vocab") + 1] == "8192" and cmd[cmd.index("--loss-slots") + 1] == "8"
    assert cmd[cmd.index("--num-layers") + 1] == "4" and "--init-from-target" in cmd
    assert cmd[cmd.index("--draft-model") + 1] == str(work / "drafter_run-64-s2-deep")
    assert "--init-from" not in cmd
    cmd, args = argv("--init-from", str(tmp_path / "shipped"), "--draft-vocab", "0")  # 0: the whole vocabulary
    assert cmd[cmd.index("--init-from") + 1] == str(tmp_path / "shipped") and "--draft-vocab" not in cmd


def test_the_learning_curve_reads_its_trend_in_doublings_of_steps(tmp_path):
    """Points on a line in log2 of all the drafter's steps (2,000 before the
    run, from the card it continued from) give that line's slope and the
    steps where it reaches the goal; the first point (the warm-up's) is left
    out of the fit, a falling curve reaches nothing, and three points are
    needed."""
    work = tmp_path / "work"
    work.mkdir()
    np.save(work / "rows-64-s2.npy", np.zeros((4, 64), np.int32))
    args = smollm2_drafter.parser().parse_args(["--work-dir", str(work), "--seq-len", "64", "--max-shards", "2"])
    smollm2_drafter.started_from(args).write_text("| training | 2,000 steps, batch 8, 16 anchors per row |\n")
    assert smollm2_drafter.earlier_steps(args) == 2000
    line = [[s, round(1.5 + 0.1 * np.log2(2000 + s), 6), 100] for s in (500, 1000, 1500, 2000)]
    slope, goal = smollm2_drafter.steps_trend([[0, 0.9, 100]] + line, 2000)
    assert slope == pytest.approx(0.1, abs=1e-4) and goal == pytest.approx(2**15, rel=1e-3)
    assert smollm2_drafter.steps_trend([[s, 2.0 - 0.01 * i, 9] for i, s in enumerate((500, 1000, 1500))], 0)[1] is None
    assert smollm2_drafter.steps_trend(line[:2], 2000) is None
    card = smollm2_drafter.learning_curve({"eval": line}, args, rows=4)
    # 2 shards of 128 conversations in 4 rows: 64 a row, 8 rows a step
    assert card.startswith(f"500 ({500 * 8 * 64:,} conversations): {line[0][1]}") and "+0.100 tokens per cycle a doubling" in card
    seen = [[s, 2.5, 90] for s in (500, 1000)]
    assert smollm2_drafter.learning_curve({"eval": line, "eval_train": seen}, args, rows=4).endswith(
        f"; on {smollm2_drafter.EVAL_TRAIN_ROWS} training rows: 500: 2.5, 1000: 2.5"
    )


def test_exported_shards_seed_a_new_machine(tmp_path, monkeypatch):
    rng = np.random.default_rng(0)
    old, new = tmp_path / "old", tmp_path / "new"
    (old / "distill").mkdir(parents=True)
    for i in range(2):
        rows = [rng.integers(0, 400, size=40).astype(np.int32) for _ in range(2)]
        smollm2_distill.write_shard(old / "distill" / f"shard-{i:05d}.npz", rows, [5, 5], 10.0)
    requests = {"seed": 0, "train": [{"topic": "general:x", "kind": "written", "request": "Why?"}], "heldout": [],
                "written_questions": 1}  # fmt: skip
    (old / "requests.json").write_text(json.dumps(requests))
    (old / "times.json").write_text(json.dumps({"requests": 4.0, "questions": 3600.0}))
    committed = tmp_path / "committed"
    monkeypatch.setattr(smollm2_drafter, "COMMITTED", committed)
    smollm2_drafter.main(["--stage", "export", "--work-dir", str(old)])
    assert sorted(p.name for p in committed.glob("*.npz")) == ["shard-00000.npz", "shard-00001.npz"]
    # The requests go with the shards: on a new machine the target's own
    # questions are not asked again, and the shards' answers stay theirs.
    smollm2_drafter.main(["--stage", "requests", "--work-dir", str(new)])
    assert json.loads((new / "requests.json").read_text()) == requests
    assert json.loads((new / "times.json").read_text())["questions"] == 3600.0  # the card keeps their hour
    monkeypatch.setattr(smollm2_drafter, "COMMITTED_LIMIT", 10)
    with pytest.raises(SystemExit, match="over the repository"):
        smollm2_drafter.main(["--stage", "export", "--work-dir", str(old)])
    # A new machine: the distill stage starts from the committed shards (all
    # requests answered already, so nothing is generated) and keeps their seconds.
    calls = []
    monkeypatch.setattr(smollm2_distill, "main", lambda argv: calls.append(argv))
    smollm2_drafter.main(["--stage", "distill", "--work-dir", str(new)])
    assert sorted(p.name for p in (new / "distill").glob("*.npz")) == ["shard-00000.npz", "shard-00001.npz"]
    assert smollm2_distill.shard_seconds(new / "distill" / "shard-00001.npz") == 10.0
    assert len(calls) == 2 and all("--resume" in c for c in calls)
    assert calls[0][calls[0].index("--split") + 1] == "heldout"  # the learning curve's answers, then the shards


def test_questions_stage_extends_the_requests_once(chat_model, tmp_path):
    reqs = tmp_path / "requests.json"
    train = [{"topic": "general:lists", "kind": "general", "request": "Explain lists."}]
    reqs.write_text(json.dumps({"train": train, "heldout": []}))
    argv = ["--model", str(chat_model), "--requests", str(reqs), "--max-tokens", "8", "--batch-size", "3"]
    smollm2_questions.main(argv)
    data = json.loads(reqs.read_text())
    assert data["train"][:1] == train and data["written_questions"] == len(data["train"]) - 1
    before = reqs.read_text()
    smollm2_questions.main(argv)  # done once: the file stays as it is
    assert reqs.read_text() == before


def test_gpu_script_plans_every_stage_within_its_budget(tmp_path):
    """Only its plan can run here (it needs MLX's CUDA backend): each stage
    in order under a timeout that adds up to the budget, then the packing."""
    import os
    import re
    import subprocess

    env = dict(os.environ, WORK=str(tmp_path / "work"), BUDGET_S="720", EXTRA="--draft-vocab 8192")
    r = subprocess.run(["bash", str(RECIPES / "smollm2_gpu.sh"), "--dry-run", str(tmp_path / "out")],
                       capture_output=True, text=True, env=env)  # fmt: skip
    assert r.returncode == 0, r.stderr
    plan = [line for line in r.stdout.splitlines() if line.startswith("+ timeout")]
    assert [re.search(r"--stage (\w+)", line).group(1) for line in plan] == [
        "requests", "questions", "distill", "rows", "train", "measure"]  # fmt: skip
    assert sum(int(line.split()[4]) for line in plan) <= 720
    assert all("--draft-vocab 8192" in line for line in plan)
    assert "smollm2-run-state.tar.gz" in r.stdout and not (tmp_path / "out").exists()
    assert subprocess.run(["bash", str(RECIPES / "smollm2_gpu.sh")], capture_output=True).returncode == 2


def test_deferred_shards_are_made_and_packed_last(monkeypatch, tmp_path, capsys):
    """``--defer A:B``: shards A..B-1 come after the others, in the
    distillation and in the rows, and ``--max-shards`` cuts that order."""
    reqs = tmp_path / "requests.json"
    reqs.write_text(json.dumps({"train": [{"request": str(i)} for i in range(5)], "heldout": []}))
    monkeypatch.setattr(smollm2_distill, "load_target", lambda args: ("target", None, None))
    made = []

    def answer(model, tokenizer, requests, args):  # a row of 8 tokens naming its request
        made.append(int(requests[0]["request"]))
        rows = [np.full(8, int(r["request"]), np.int32) for r in requests]
        return rows, [2] * len(rows), [np.arange(8) >= 2 for _ in rows]

    monkeypatch.setattr(smollm2_distill, "answer", answer)
    out = tmp_path / "shards"
    argv = ["--requests", str(reqs), "--out", str(out), "--shard-size", "1", "--resume", "--defer", "1:3"]
    smollm2_distill.main(argv + ["--max-shards", "3"])
    assert made == [0, 3, 4]
    rows = tmp_path / "rows.npy"
    smollm2_rows.main(["--shards", str(out), "--seq-len", "8", "--out", str(rows), "--defer", "1:3", "--max-shards", "2"])
    assert np.load(rows)[:, 0].tolist() == [0, 3]  # a fixed data set: the first two in the order
    smollm2_distill.main(argv)
    assert made == [0, 3, 4, 1, 2]
    smollm2_rows.main(["--shards", str(out), "--seq-len", "8", "--out", str(rows), "--defer", "1:3"])
    assert np.load(rows)[:, 0].tolist() == [0, 3, 4, 1, 2]
    assert smollm2_drafter.shard_list(smollm2_distill.ordered_shards(out, range(1, 3), 3)) == "3 distillation shards (0, 3-4)"
    with pytest.raises(SystemExit):
        smollm2_distill.main(["--requests", str(reqs), "--out", str(out), "--defer", "3"])
    assert "--defer takes A:B" in capsys.readouterr().err
