"""mlx-dflash chat, driven through its REPL on stdin: one prompt cache per
conversation, each turn exactly what mlx-lm answers on its own cache."""

import re
import subprocess
import sys

from mlx_lm.models.cache import make_prompt_cache
from tiny import reference_text


def mlx_lm_replies(pair, turns, max_tokens):
    cache = make_prompt_cache(pair.model)
    return [reference_text(pair.model, pair.tokenizer, t + "\n", max_tokens, prompt_cache=cache) for t in turns]


def test_repl_keeps_the_conversation_and_resets(qwen3_5_pair, tmp_path):
    pair = qwen3_5_pair
    draft = pair.make_draft(tmp_path / "draft", block_size=4)
    stdin = "def f(x):\n    return x\nr\nimport os\nq\n"
    done = subprocess.run(
        [sys.executable, "-m", "dflash_mlx.chat", "--model", str(pair.path), "--draft-model", str(draft), "-m", "12"],
        input=stdin, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr
    out = done.stdout
    stats = re.findall(r"\[[\d.]+ tok/s, (\d+) prompt tokens reused, ([\d.]+) tokens/cycle\]", out)
    assert len(stats) == 3 and "[conversation reset]" in out
    first, second = mlx_lm_replies(pair, ["def f(x):", "    return x"], 12)
    fresh = mlx_lm_replies(pair, ["import os"], 12)[0]
    replies = re.split(r"\n\[[^\]]*tokens/cycle\]\n", out)
    assert [r.split(">> ")[-1] for r in replies[:3]] == [first, second, fresh]
    # turn 2 reuses turn 1 (its prompt and 12 answer tokens); the reset starts over
    n1 = len(pair.tokenizer.encode("def f(x):\n"))
    assert [int(s[0]) for s in stats] == [0, n1 + 12, 0]


def test_bad_model_path_is_one_line_error(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "dflash_mlx.chat", "--model", str(tmp_path / "missing"), "--draft-model", str(tmp_path)],
        input="q\n", capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 1
    assert done.stderr.startswith("error:") and "Traceback" not in done.stderr
