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
import time
from pathlib import Path

import mlx.core as mx
import openai
import pytest
import tiny
from mlx_lm import load
from mlx_lm import stream_generate as mlx_lm_stream_generate

from dflash_mlx import cli
from dflash_mlx.chat import main as chat_main
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


def start(*args, **popen) -> subprocess.Popen:
    """Two ranks on 127.0.0.1, in a process group of their own (with Ctrl-C's
    default action even where the test runner's shell ignores it)."""
    cmd = [str(LAUNCH), "--backend", "ring", "--hosts", "127.0.0.1", "-n", "2",
           "--starting-port", str(free_port_pair()), "--python", sys.executable, *args]
    return subprocess.Popen(cmd, text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL), **popen)


def launch(*args, input=None) -> subprocess.CompletedProcess:
    """Two ranks run to the end; the whole process group dies at the timeout."""
    proc = start(*args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out, err = proc.communicate(input, timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise AssertionError(f"a rank hung: {' '.join(proc.args)} ran past {TIMEOUT} s")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def text_of(stdout: str, adaptive: bool = False) -> str:
    """What generate prints, without the lines that follow timings, which
    differ run to run: the rates, and (adaptive) the block lengths, draft
    trees and sources of the drafted tokens chosen."""
    timed = ["tokens-per-sec", "Peak memory"] + (["Block sizes", "Draft trees", "Mean tokens per cycle", "Accepted drafted tokens"] if adaptive else [])
    return "\n".join(line for line in stdout.splitlines() if not any(t in line for t in timed))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipeline")
    dirs = {}
    # Kimi-K2.5 (MLA): the family that needs several Macs at full size.
    for name, base in [("qwen3_5", tiny.QWEN3_5), ("qwen2", QWEN2), ("qwen3", tiny.QWEN3), ("kimi_k25", tiny.KIMI_K25)]:
        target = tiny.make_hf_target(root / name, base)
        vocab = load(str(target))[0].model.embed_tokens.weight.shape[0]
        # Taps 0 and 1 sit on rank 1's layers, 2 and 3 on rank 0's.
        cfg = tiny.draft_config(base.get("text_config", base), vocab, block_size=16, taps=[0, 1, 3])
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


# Two launches of the CLI (None: adaptive); the other family/block pairs run in ``ranks``.
@pytest.mark.parametrize("family,block", [("qwen3_5", 4), ("qwen2", None)])
def test_pipelined_generate_prints_the_single_process_text_once(models, capsys, family, block):
    args = generate_args(*models[family], *(["--block-size", str(block)] if block else []))
    expected = single_process(capsys, args)
    run = launch("-m", "dflash_mlx.generate", "--pipeline", *args)
    assert "Traceback" not in run.stderr, run.stderr
    assert run.stdout.count(PROMPT) == 1 and run.stdout.count("Generation:") == 1, run.stdout
    assert text_of(run.stdout, block is None) == text_of(expected, block is None)


@pytest.mark.parametrize("command", ["generate", "chat", "server"])
def test_unsupported_family_ends_every_rank_with_one_message(models, command):
    target, draft = models["qwen3"]
    args = generate_args(target, draft) if command == "generate" else ["--model", target, "--draft-model", draft]
    run = launch("-m", f"dflash_mlx.{command}", "--pipeline", *args, input="q\n")
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
    dirs = {name: models[name][0] for name in ("qwen3_5", "qwen2", "qwen3", "kimi_k25")}
    for name in ("llama", "gpt_oss", "qwen3_next", "deepseek_v3"):
        dirs[name] = str(tiny.make_hf_target(tmp_path / name, tiny.FAMILIES[name]))
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
        "adapters": {"qwen3_5": models["qwen3_5"][0], "qwen2": models["qwen2"][0], "sharded": str(sharded),
                     "kimi_k25": models["kimi_k25"][0]},
        "partial": str(partial),
        "diverged_drafts": [models["qwen3_5"][1], models["qwen3_5_other"][1]],
        "runs": {
            "sampled": {"target": models["qwen3_5"][0], "draft": models["qwen3_5"][1], "seed": 5,
                        "kwargs": {"temperature": 1.0, "max_tokens": 40, "block_size": 4}},
            "default": {"target": str(DEFAULT_TARGET), "draft": str(DEFAULT_DRAFT),
                        "kwargs": {"max_tokens": 48, "block_size": 16}},
            "adaptive": {"target": str(DEFAULT_TARGET), "draft": str(DEFAULT_DRAFT), "kwargs": {"max_tokens": 160}},
            "qwen3_5": {"target": models["qwen3_5"][0], "draft": models["qwen3_5"][1],
                        "kwargs": {"max_tokens": 40, "block_size": 16}},
            "qwen2": {"target": models["qwen2"][0], "draft": models["qwen2"][1],
                      "kwargs": {"max_tokens": 40, "block_size": 4}},
            "kimi_k25": {"target": models["kimi_k25"][0], "draft": models["kimi_k25"][1],
                         "kwargs": {"max_tokens": 40, "block_size": 8}},
        },
    }
    (out / "spec.json").write_text(json.dumps(spec))
    run = launch(str(RANKS), str(out / "spec.json"), str(out))
    reports = [out / f"rank{r}.json" for r in range(2)]
    assert all(p.exists() for p in reports), run.stderr
    return [json.loads(p.read_text()) for p in reports]


def test_each_rank_runs_its_slice_and_matches_the_whole_model(ranks):
    """Every forward after every rollback length gives the unsplit adapter's
    logits and taps bit for bit, on both ranks, for every family (MLA's
    compressed caches among them), from a single-file checkpoint and from an
    indexed one."""
    for report, layers in zip(ranks, ([2, 4], [0, 2])):
        for family in ("qwen3_5", "qwen2", "sharded", "kimi_k25"):
            assert report["adapter"][family]["local_layers"] == layers
            assert report["adapter"][family]["identical"] == [True] * 6, family


def single_run(target, draft, **kwargs):
    model, tokenizer = load(str(target))
    tokens, accepted, blocks = [], [], []
    for r in stream_generate(model, load_draft(draft, model), tokenizer, PROMPT, **kwargs):
        tokens += r.tokens
        accepted.append(r.accepted)
        blocks.append(r.block_size)
    return {"tokens": tokens, "accepted": accepted, "blocks": blocks}


def test_trained_pair_pipelined_commits_the_single_process_tokens(ranks):
    expected = single_run(DEFAULT_TARGET, DEFAULT_DRAFT, max_tokens=48, block_size=16)
    assert sum(expected["accepted"]) > 0  # partly accepted blocks are rolled back
    assert [report["default"] for report in ranks] == [expected, expected]


def test_every_rank_takes_rank_0s_timings(ranks):
    assert [report["agreed"] for report in ranks] == [[0.5, 0.0], [0.5, 0.0]]


def test_pipelined_adaptive_ranks_choose_alike_and_commit_the_single_process_tokens(ranks):
    """The default (adaptive) loop pipelined: every rank takes rank 0's
    timings (above), so they choose the same block lengths cycle by cycle
    (else the run would stop at a refused verify); the text is the single
    process's."""
    first, second = (report["adaptive"] for report in ranks)
    assert first == second
    assert first["tokens"] == single_run(DEFAULT_TARGET, DEFAULT_DRAFT, max_tokens=160)["tokens"]
    assert len(set(first["blocks"][1:])) > 1  # lengths were chosen, not fixed


@pytest.mark.parametrize("family,block", [("qwen3_5", 16), ("qwen2", 4), ("kimi_k25", 8)])
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


CHAT_INPUT = "def f(x):\n    return x\nr\nimport os\nq\n"


def without_rates(text: str) -> str:
    """The transcript without what follows timings: rates, and the tokens
    per cycle of the (adaptive) blocks chosen."""
    return re.sub(r"\[[\d.]+ tok/s, ", "[", re.sub(r", [\d.]+ tokens/cycle\]", "]", text))


def test_pipelined_chat_prints_the_single_process_chat_once(models, capsys):
    """Rank 0 reads the lines (a turn, another on the same cache, a reset, a
    turn, quit) and shares each with rank 1: one transcript, the single
    process's (adaptive blocks, as by default)."""
    target, draft = models["qwen3_5"]
    args = ["--model", target, "--draft-model", draft, "-m", "12"]
    lines = iter(CHAT_INPUT.splitlines())

    def read(prompt):
        print(prompt, end="")
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None

    assert chat_main(args, input_fn=read) == 0
    expected = capsys.readouterr().out
    assert expected.count("[conversation reset]") == 1 and "12 prompt tokens reused" not in expected
    run = launch("-m", "dflash_mlx.chat", "--pipeline", *args, input=CHAT_INPUT)
    assert "Traceback" not in run.stderr and "exited with code" not in run.stderr, run.stderr
    assert without_rates(run.stdout) == without_rates(expected)


def rank_pids(launcher: int):
    """The ranks mlx.launch started on this machine (its children)."""
    tasks = Path(f"/proc/{launcher}/task")
    return [int(p) for t in tasks.iterdir() for p in (t / "children").read_text().split()]


def disconnect(port: int, log: Path):
    """A long streamed request dropped after its first token."""
    body = json.dumps({"prompt": "class A:\n", "max_tokens": 3000, "stream": True}).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        seen = b""
        while b"data: " not in seen:
            seen += sock.recv(4096)
    deadline = time.time() + TIMEOUT
    while not (m := re.search(r"stopped by the client after (\d+) tokens", log.read_text())):
        assert time.time() < deadline, log.read_text()
        time.sleep(0.2)
    assert int(m.group(1)) < 3000


def test_pipelined_server_answers_the_single_process_text(models, tmp_path):
    """Rank 0 serves HTTP and shares each request with rank 1. A streamed
    request whose client goes away stops on both ranks; then the answer is
    the single process's text, a repeated prompt is reused from the prompt
    cache on both ranks (they are still in step), and Ctrl-C ends both."""
    target, draft = models["qwen3_5"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path / "server.log"
    with open(log, "w") as err:
        proc = start("-m", "dflash_mlx.server", "--pipeline", "--model", target, "--draft-model", draft,
                     "--port", str(port), stdout=subprocess.PIPE, stderr=err)
    try:
        deadline = time.time() + TIMEOUT
        while "listening on" not in log.read_text():
            assert proc.poll() is None and time.time() < deadline, log.read_text()
            time.sleep(0.2)
        disconnect(port, tmp_path / "server.log")
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=TIMEOUT)
        model, tokenizer = load(target)
        expected = "".join(r.text for r in mlx_lm_stream_generate(model, tokenizer, PROMPT, max_tokens=24))
        answers = [client.completions.create(model="default", prompt=PROMPT, max_tokens=24) for _ in range(2)]
        assert [a.choices[0].text for a in answers] == [expected, expected]
        assert [a.usage.prompt_tokens_details.cached_tokens for a in answers] == [0, len(tokenizer.encode(PROMPT))]
        for pid in rank_pids(proc.pid):
            os.kill(pid, signal.SIGINT)
        proc.communicate(timeout=30)
        text = log.read_text()
        # mlx.launch warns of each rank that did not exit with 0.
        assert proc.returncode == 0 and "exited with code" not in text and "was killed" not in text, text
        assert text.count("listening on") == 1
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
