"""The bundled default pair: present, small, trained, lossless, runnable offline."""

import os
import subprocess
import sys

import pytest
from mlx_lm import stream_generate as mlx_lm_stream_generate

import dflash_mlx
from dflash_mlx.pair import DEFAULT_DRAFT, DEFAULT_TARGET, PAIR_DIR, default_prompts


@pytest.fixture(scope="module")
def bundled():
    model, tokenizer = dflash_mlx.load(str(DEFAULT_TARGET))
    return model, tokenizer, dflash_mlx.load_draft(DEFAULT_DRAFT, model)


def test_pair_ships_with_cards_and_fits_budget():
    size = sum(p.stat().st_size for p in PAIR_DIR.rglob("*") if p.is_file())
    assert size < 25e6
    for d in (DEFAULT_TARGET, DEFAULT_DRAFT):
        assert (d / "README.md").read_text().strip()
    assert len(default_prompts()) >= 8


def test_bundled_pair_is_lossless_and_trained(bundled):
    model, tokenizer, draft = bundled
    cycles = committed = 0
    for prompt in default_prompts()[:3]:
        ref = [r.token for r in mlx_lm_stream_generate(model, tokenizer, prompt, max_tokens=64)
               if r.finish_reason != "stop"]
        got = []
        for i, r in enumerate(dflash_mlx.stream_generate(model, draft, tokenizer, prompt, max_tokens=64)):
            got += r.tokens
            if i:
                cycles += 1
                committed += r.committed
        assert got == ref
    # the shipped drafter commits 3.4 tokens per cycle here, an untrained one ~1
    assert committed / cycles > 3.0


def test_readme_first_command_runs_offline(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path))
    done = subprocess.run(
        [sys.executable, "-m", "dflash_mlx", "generate", "--max-tokens", "40"],
        capture_output=True, text=True, env=env, timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(default_prompts()[0])
    assert "Mean tokens per cycle" in done.stdout
