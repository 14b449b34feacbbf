"""Adapting while serving (dflash_mlx.adapt): drafter swaps between requests
change no output, only better drafters that load are swapped in, a killed or
paused round leaves the drafter in use, and a restart keeps the last one."""

import json
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import openai
import pytest
from mlx_lm import load
from tiny import damage, recorded_traffic, reference_text

import dflash_mlx
from dflash_mlx.adapt import CURRENT, DRAFTERS, Adaptation
from dflash_mlx.server import make_server, setup_arg_parser
from dflash_mlx.traffic import ADAPT_RESULT, Recorder, read_traffic

TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
TINY_ROUND = "--steps 60 --learning-rate 2e-2 --seq-len 48 --batch-size 4 --anchors-per-seq 8 --warmup 2 --eval-every 100"


def candidate(pair, path, init_from, seed, before=1.0, after=2.0, **scores):
    """A drafter checkpoint as a round writes it: weights and its scores."""
    pair.make_draft(path, seed=seed, block_size=4)
    (path / ADAPT_RESULT).write_text(json.dumps({"init_from": str(init_from.resolve()), "before": before, "after": after, **scores}))
    return path


@pytest.fixture
def served(qwen3_pair, tmp_path):
    """An in-process server over the tiny pair with --learn and an adaptation
    whose rounds the test runs by hand."""
    pair = qwen3_pair
    model, tokenizer = load(str(pair.path))
    first = pair.make_draft(tmp_path / "draft", block_size=4)
    args = setup_arg_parser().parse_args(["--model", str(pair.path), "--port", "0", "--chat-template", TEMPLATE,
                                          "--learn", str(tmp_path / "t"), "--adapt"])  # fmt: skip
    recorder = Recorder(tmp_path / "t")
    adaptation = Adaptation(recorder, pair.path, first, every=10**6)
    server = make_server(args, model, tokenizer, dflash_mlx.load_draft(first, model), str(first), (recorder, adaptation))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    host, port = server.server_address[:2]
    try:
        yield f"http://{host}:{port}", model, tokenizer, adaptation, first
    finally:
        server.shutdown()
        server.server_close()
        server.generator.stop_and_join()


def metrics(url):
    text = urllib.request.urlopen(url + "/metrics").read().decode()
    return {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines() if line.startswith("dflash_drafter")}


def test_swaps_change_no_output_and_only_better_drafters_that_load_get_in(qwen3_pair, served, tmp_path):
    url, model, tokenizer, adaptation, first = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=300)

    def streamed(prompt):
        parts = client.completions.create(model="default", prompt=prompt, max_tokens=10, temperature=0, stream=True)
        text = "".join(c.choices[0].text for c in parts if c.choices)
        assert text == reference_text(model, tokenizer, prompt, 10)

    def chat(messages):
        r = client.chat.completions.create(model="default", messages=messages, max_tokens=8, temperature=0)
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        assert r.choices[0].message.content == reference_text(model, tokenizer, ids, 8)
        return r.choices[0].message.content

    streamed("def f(x):")
    second = candidate(qwen3_pair, tmp_path / "c2", first, seed=2)
    adaptation.offer(second)  # a swap between two streamed requests
    streamed("import os\n")
    assert metrics(url) == {"dflash_drafter_version": 1, 'dflash_drafter_heldout_tokens_per_cycle{drafter="before"}': 1.0,
                            'dflash_drafter_heldout_tokens_per_cycle{drafter="after"}': 2.0}  # fmt: skip
    assert client.models.list().data[0].model_extra["draft_model"] == str(second.resolve())
    talk = [{"role": "user", "content": "def f(x):"}]
    talk.append({"role": "assistant", "content": chat(talk)})
    adaptation.offer(candidate(qwen3_pair, tmp_path / "c3", second, seed=3))  # a swap mid-conversation
    talk.append({"role": "user", "content": "and g?"})
    chat(talk)
    assert metrics(url)["dflash_drafter_version"] == 2
    third = adaptation.path
    for bad in (
        damage(candidate(qwen3_pair, tmp_path / "broken", third, seed=4), "truncated"),  # fails to load
        candidate(qwen3_pair, tmp_path / "worse", third, seed=5, before=2.0, after=1.5),  # scores worse
        candidate(qwen3_pair, tmp_path / "forgets", third, seed=7, replay={"before": 2.0, "after": 1.5}),  # forgets the replay rows
        candidate(qwen3_pair, tmp_path / "stale", second, seed=6),  # beat another drafter, not this one
    ):
        adaptation.offer(bad)
        streamed("x = 1\n")
        assert adaptation.path == third and metrics(url)["dflash_drafter_version"] == 2
    # Every request recorded: 8, or 7 where the chat's second turn begins with the
    # first one's tokens (it need not: the random target writes invalid UTF-8,
    # which the re-templated history does not round-trip).
    records = read_traffic(tmp_path / "t")
    assert len(records) in (7, 8) and all(r.answer.any() for r in records)
    again = Adaptation(Recorder(tmp_path / "t"), qwen3_pair.path, first)  # a restart
    assert (again.version, again.path) == (2, third.resolve())


@pytest.fixture(scope="module")
def traffic(qwen3_pair, tmp_path_factory):
    return recorded_traffic(qwen3_pair, tmp_path_factory.mktemp("adapt"))


def process_state(pid) -> str:
    return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]


def test_a_round_pauses_for_requests_and_a_killed_one_changes_nothing(qwen3_pair, traffic, tmp_path):
    first = qwen3_pair.make_draft(tmp_path / "init", block_size=8, intermediate_size=96)
    adaptation = Adaptation(traffic, qwen3_pair.path, first, train_args=TINY_ROUND)
    child = adaptation.start_round()
    adaptation.request_started()  # a request runs: the round stops
    deadline = time.time() + 10
    while process_state(child.pid) != "T" and time.time() < deadline:
        time.sleep(0.05)
    assert process_state(child.pid) == "T"
    adaptation.request_finished()
    while process_state(child.pid) == "T" and time.time() < deadline:
        time.sleep(0.05)
    assert process_state(child.pid) != "T"
    child.send_signal(signal.SIGKILL)
    child.wait()
    adaptation.step()
    draft = object()
    assert adaptation.swap(qwen3_pair.model, draft) is draft and adaptation.version == 0
    assert not (traffic.root / DRAFTERS / CURRENT).exists()


def test_a_round_trains_and_its_better_drafter_is_swapped_in(qwen3_pair, traffic, tmp_path):
    first = qwen3_pair.make_draft(tmp_path / "init", block_size=8, intermediate_size=96)
    adaptation = Adaptation(traffic, qwen3_pair.path, first, train_args=TINY_ROUND)
    adaptation.start_round().wait(timeout=600)
    adaptation.step()
    new = adaptation.swap(qwen3_pair.model, None)
    assert new is not None and adaptation.version == 1 and adaptation.scores["after"] > adaptation.scores["before"]
    got = dflash_mlx.generate(qwen3_pair.model, new, qwen3_pair.tokenizer, "def f(x):", max_tokens=16)
    assert got == reference_text(qwen3_pair.model, qwen3_pair.tokenizer, "def f(x):", 16)


def test_chat_records_only_with_learn(qwen3_pair, tmp_path):
    draft = qwen3_pair.make_draft(tmp_path / "draft", block_size=4)
    base = [sys.executable, "-m", "dflash_mlx.chat", "--model", str(qwen3_pair.path), "--draft-model", str(draft), "-m", "6"]
    for extra in ([], ["--learn", str(tmp_path / "t")]):
        done = subprocess.run(base + extra, input="def f(x):\nimport os\nq\n", capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        assert (tmp_path / "t").exists() == bool(extra)
    (conv,) = read_traffic(tmp_path / "t")  # two turns, one conversation
    assert conv.answer.sum() > 6
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "x").write_text("x")
    done = subprocess.run(base + ["--learn", str(tmp_path / "other")], input="q\n", capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and done.stderr.strip().splitlines() == [done.stderr.strip()] and "not a traffic directory" in done.stderr


@pytest.mark.parametrize("flags, message", [(["--adapt"], "pass --learn too"), (["--learn", "NOTDIR"], "not a traffic directory")])
def test_server_learn_flags_fail_before_loading(qwen3_pair, tmp_path, flags, message):
    (tmp_path / "NOTDIR").mkdir()
    (tmp_path / "NOTDIR" / "x").write_text("x")
    flags = [str(tmp_path / f) if f == "NOTDIR" else f for f in flags]
    done = subprocess.run([sys.executable, "-m", "dflash_mlx", "server", "--model", str(qwen3_pair.path), "--port", "0", *flags],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 1 and done.stderr.startswith("error: ") and message in done.stderr
    assert done.stderr.count("\n") == 1


def test_a_round_takes_the_fine_tunes_defaults_and_adapt_args_override_them(qwen3_pair, traffic, tmp_path):
    """A round runs ``train --from-traffic`` with nothing but its flags and
    ``--adapt-args``: the trainer's defaults for a fine-tune (one home,
    ``train.fill_defaults``) unless the server's operator turns one off."""
    from dflash_mlx import train as T

    first = qwen3_pair.make_draft(tmp_path / "init", block_size=8, intermediate_size=96)
    for extra, cached in (("", True), ("--no-cache-target --no-approximate-softmax", False)):
        argv = Adaptation(traffic, qwen3_pair.path, first, train_args=extra).round_argv(tmp_path / "v1")
        args = T.TrainConfig(**{**vars(T.setup_arg_parser().parse_args(argv)), "taps": None})
        T.fill_defaults(args)
        assert args.cache_target is cached and args.anchors_per_seq == T.FINE_TUNE_ANCHORS
        assert args.approximate_softmax is (None if cached else False) and args.approximate_target is None
