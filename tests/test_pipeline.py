"""--pipeline: the target split over two local ranks (mlx.launch, ring
backend, loopback only, every launch bounded in time)."""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest
import tiny
from mlx_lm import load

from dflash_mlx import cli
from dflash_mlx.generate import main as generate_main
from dflash_mlx import load_draft, stream_generate
from dflash_mlx.pair import DEFAULT_DRAFT, DEFAULT_TARGET
from dflash_mlx.targets.pipeline import PIPELINE_MODEL_TYPES
from dflash_mlx.targets import ADAPTERS, TargetError
from dflash_mlx.targets.pipeline import PipelineTarget

LAUNCH = Path(sys.executable).parent / "mlx.launch"
RANKS = Path(__file__).parent / "pipeline_ranks.py"
QWEN2 = {**tiny.QWEN3, "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}
PROMPT = "def fib(n):"
TIMEOUT = 120


def free_port_pair() -> int:
    """A port p with p and p + 1 free on loopback (one per rank)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no two adjacent free ports on 127.0.0.1")


def launch(*args) -> subprocess.CompletedProcess:
    """Two ranks on 127.0.0.1; the whole process group dies at the timeout."""
    cmd = [str(LAUNCH), "--backend", "ring", "--hosts", "127.0.0.1", "-n", "2",
           "--starting-port", str(free_port_pair()), "--python", sys.executable, *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise AssertionError(f"a rank hung: {' '.join(cmd)} ran past {TIMEOUT} s")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def text_of(stdout: str) -> str:
    """What generate prints, without the timing lines that differ run to run."""
    return "\n".join(
        line for line in stdout.splitlines() if "tokens-per-sec" not in line and "Peak memory" not in line
    )


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipeline")
    dirs = {}
    for name, base in [("qwen3_5", tiny.QWEN3_5), ("qwen2", QWEN2), ("qwen3", tiny.QWEN3)]:
        target = tiny.make_target(root / name, base)
        vocab = load(str(target))[0].model.embed_tokens.weight.shape[0]
        # Taps 0 and 1 sit on rank 1's layers, 2 and 3 on rank 0's.
        cfg = tiny.draft_config(base, vocab, block_size=16, taps=[0, 1, 3])
        dirs[name] = (str(target), str(tiny.make_draft(root / f"{name}_draft", cfg)))
        if name == "qwen3_5":  # another drafter for the same target
            dirs["qwen3_5_other"] = (str(target), str(tiny.make_draft(root / "other_draft", cfg, seed=2)))
    return dirs


def shard_by_layers(src: Path, dst: Path) -> Path:
    """``src`` re-saved as two indexed shards: layers 0-1 (rank 1's slice of a
    4-layer target) in the first file, everything else in the second."""
    shutil.copytree(src, dst)
    weights = mx.load(str(dst / "model.safetensors"))
    (dst / "model.safetensors").unlink()
    names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    weight_map = {
        k: names[0] if (m := re.search(r"layers\.(\d+)\.", k)) and int(m.group(1)) < 2 else names[1]
        for k in weights
    }
    for name in names:
        mx.save_safetensors(str(dst / name), {k: v for k, v in weights.items() if weight_map[k] == name})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return dst


def generate_args(target, draft, *extra):
    return ["--model", target, "--draft-model", draft, "--prompt", PROMPT,
            "--ignore-chat-template", "--max-tokens", "40", *extra]


def single_process(capsys, args) -> str:
    assert generate_main(args) == 0
    return capsys.readouterr().out


# Two launches of the CLI; the other family/block pairs run in ``ranks``.
@pytest.mark.parametrize("family,block", [("qwen3_5", 4), ("qwen2", 16)])
def test_pipelined_generate_prints_the_single_process_text_once(models, capsys, family, block):
    args = generate_args(*models[family], "--block-size", str(block))
    expected = single_process(capsys, args)
    run = launch("-m", "dflash_mlx.generate", "--pipeline", *args)
    assert "Traceback" not in run.stderr, run.stderr
    assert run.stdout.count(PROMPT) == 1 and run.stdout.count("Generation:") == 1, run.stdout
    assert text_of(run.stdout) == text_of(expected)


def test_unsupported_family_ends_every_rank_with_one_message(models):
    run = launch("-m", "dflash_mlx.generate", "--pipeline", *generate_args(*models["qwen3"]))
    errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, run.stderr
    assert "'qwen3' cannot be pipelined" in errors[0]
    assert all(t in errors[0] for t in PIPELINE_MODEL_TYPES)
    assert "Traceback" not in run.stderr and run.stdout == ""


def test_pipeline_without_ranks_is_one_clear_error(models, capsys):
    assert cli.run(generate_main, ["--pipeline", *generate_args(*models["qwen3_5"])]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: --pipeline needs at least 2 processes") and err.count("\n") == 1


def test_pipeline_families_are_mlx_lms(models, tmp_path):
    """The families named as pipelined are exactly those whose mlx-lm
    backbone has ``pipeline`` (checked for every family tests can build)."""
    dirs = {name: models[name][0] for name in ("qwen3_5", "qwen2", "qwen3")}
    dirs["llama"] = str(tiny.make_target(tmp_path / "llama", tiny.LLAMA))
    for name, path in dirs.items():
        model = load(path)[0]
        assert name in ADAPTERS
        assert hasattr(model.model, "pipeline") == (name in PIPELINE_MODEL_TYPES), name


class FakeGroup:
    """Rank and size only: what ``pipeline()`` and the adapter's checks read."""

    def __init__(self, rank, size):
        self._rank, self._size = rank, size

    def rank(self):
        return self._rank

    def size(self):
        return self._size


def test_pipeline_target_refuses_slices_it_cannot_run(models):
    model = load(models["qwen3_5"][0])[0]
    with pytest.raises(TargetError, match="not split over this group of 2 ranks"):
        PipelineTarget(model, FakeGroup(0, 2))
    model.model.pipeline(FakeGroup(0, 4))  # rank 0 of 4: layer 3 alone, attention
    with pytest.raises(TargetError, match="layers 3..3 are all of one kind"):
        PipelineTarget(model, FakeGroup(0, 4))


@pytest.fixture(scope="module")
def ranks(models, tmp_path_factory):
    """One launch of pipeline_ranks.py; each rank's report."""
    out = tmp_path_factory.mktemp("ranks")
    sharded = shard_by_layers(Path(models["qwen3_5"][0]), out / "sharded")
    partial = shard_by_layers(Path(models["qwen3_5"][0]), out / "partial")
    (partial / "model-00001-of-00002.safetensors").unlink()  # rank 1's layers
    spec = {
        "adapters": {"qwen3_5": models["qwen3_5"][0], "qwen2": models["qwen2"][0], "sharded": str(sharded)},
        "partial": str(partial),
        "diverged_drafts": [models["qwen3_5"][1], models["qwen3_5_other"][1]],
        "runs": {
            "sampled": {"target": models["qwen3_5"][0], "draft": models["qwen3_5"][1], "seed": 5,
                        "kwargs": {"temperature": 1.0, "max_tokens": 40, "block_size": 4}},
            "default": {"target": str(DEFAULT_TARGET), "draft": str(DEFAULT_DRAFT),
                        "kwargs": {"max_tokens": 48, "block_size": 16}},  # pipelined: a fixed block
            "qwen3_5": {"target": models["qwen3_5"][0], "draft": models["qwen3_5"][1],
                        "kwargs": {"max_tokens": 40, "block_size": 16}},
            "qwen2": {"target": models["qwen2"][0], "draft": models["qwen2"][1],
                      "kwargs": {"max_tokens": 40, "block_size": 4}},
        },
    }
    (out / "spec.json").write_text(json.dumps(spec))
    run = launch(str(RANKS), str(out / "spec.json"), str(out))
    reports = [out / f"rank{r}.json" for r in range(2)]
    assert all(p.exists() for p in reports), run.stderr
    return [json.loads(p.read_text()) for p in reports]


def test_each_rank_runs_its_slice_and_matches_the_whole_model(ranks):
    """Every forward after every rollback length gives the unsplit adapter's
    logits and taps bit for bit, on both ranks, for both families, from a
    single-file checkpoint and from an indexed one."""
    for report, layers in zip(ranks, ([2, 4], [0, 2])):
        for family in ("qwen3_5", "qwen2", "sharded"):
            assert report["adapter"][family]["local_layers"] == layers
            assert report["adapter"][family]["identical"] == [True] * 6, family


def single_run(target, draft, **kwargs):
    model, tokenizer = load(str(target))
    tokens, accepted = [], []
    for r in stream_generate(model, load_draft(draft, model), tokenizer, PROMPT, **kwargs):
        tokens += r.tokens
        accepted.append(r.accepted)
    return {"tokens": tokens, "accepted": accepted}


def test_trained_pair_pipelined_commits_the_single_process_tokens(ranks):
    expected = single_run(DEFAULT_TARGET, DEFAULT_DRAFT, max_tokens=48, block_size=16)
    assert sum(expected["accepted"]) > 0  # partly accepted blocks are rolled back
    assert [report["default"] for report in ranks] == [expected, expected]


@pytest.mark.parametrize("family,block", [("qwen3_5", 16), ("qwen2", 4)])
def test_tiny_targets_pipelined_commit_the_single_process_tokens(ranks, models, family, block):
    expected = single_run(*models[family], max_tokens=40, block_size=block)
    assert [report[family] for report in ranks] == [expected, expected]


def test_sampled_runs_agree_across_runs_and_ranks(ranks, models, capsys):
    """A seeded sampled run: the 2-rank CLI prints what one process prints
    with that seed, and both ranks of a second 2-rank run commit the tokens
    that one process commits with it."""
    assert ranks[0]["sampled"] == ranks[1]["sampled"]
    target, draft = models["qwen3_5"]
    args = generate_args(target, draft, "--temp", "1.0", "--seed", "5", "--block-size", "4")
    expected = single_process(capsys, args)
    run = launch("-m", "dflash_mlx.generate", "--pipeline", *args)
    assert text_of(run.stdout) == text_of(expected)
    model, tokenizer = load(target)
    drafter = load_draft(draft, model)
    mx.random.seed(5)
    single = [t for r in stream_generate(model, drafter, tokenizer, PROMPT, temperature=1.0,
                                         max_tokens=40, block_size=4) for t in r.tokens]
    assert single == ranks[0]["sampled"]["tokens"]


def test_a_rank_that_fails_to_load_stops_every_rank(ranks):
    """The shard of rank 1's layers missing, then rank 0's drafter: both
    ranks raise the failing rank's message and stay in step (no rank waits
    forever)."""
    first, second = ranks[0]["failures"]
    assert all(report["failures"] == [first, second] for report in ranks)
    assert first.startswith("rank 1: ") and "model-00001-of-00002.safetensors is missing" in first
    assert second.startswith("rank 0: ") and "missing" in second
    assert [report["after"] for report in ranks] == [3, 3]


def test_ranks_that_diverge_stop_before_committing(ranks):
    """Ranks whose drafts differ (here: different drafters) feed the verify
    different tokens; every rank refuses at that cycle's rollback, before the
    cycle's tokens are committed."""
    assert ranks[0]["diverged"] == ranks[1]["diverged"]
    assert "drafts or acceptances diverged" in ranks[0]["diverged"]
