"""The server's prompt cache across turns (audit): a hybrid target's
conversation that is regenerated and branched, across a restart with the
disk tier, answers as mlx-lm's greedy decode of the templated conversation,
with cached-token counts no larger than what it can have reused."""

import threading

import openai
from mlx_lm import load
from test_server import HEAD, TEMPLATE, exact_chat

import dflash_mlx
from dflash_mlx.server import make_server, setup_arg_parser


def test_hybrid_branches_and_regenerations_across_a_restart(qwen3_5_pair, tmp_path):
    model, tokenizer = load(str(qwen3_5_pair.path))
    draft_dir = qwen3_5_pair.make_draft(tmp_path / "draft", block_size=4)
    draft = dflash_mlx.load_draft(draft_dir, model)
    flags = ["--chat-template", TEMPLATE, "--prompt-cache-dir", str(tmp_path / "c"), "--prompt-cache-size", "1"]
    args = setup_arg_parser().parse_args(["--model", str(qwen3_5_pair.path), "--port", "0", *flags])

    def chat(messages):
        """A fresh server (a restart) answers ``messages``; (answer, cached tokens)."""
        server = make_server(args, model, tokenizer, draft, str(draft_dir))
        threading.Thread(target=server.serve_forever, daemon=True).start()
        host, port = server.server_address[:2]
        try:
            client = openai.OpenAI(base_url=f"http://{host}:{port}/v1", api_key="x", max_retries=0, timeout=300)
            return exact_chat(client, model, tokenizer, messages)
        finally:
            server.shutdown()
            server.server_close()
            server.generator.stop_and_join()

    head = HEAD
    first, cached = chat(head)
    assert cached == 0
    turn = head + [{"role": "assistant", "content": first}, {"role": "user", "content": "and g?"}]
    _, cached = chat(turn)
    assert cached == len(tokenizer.apply_chat_template(head, add_generation_prompt=True))
    assert chat(turn)[1] == len(tokenizer.apply_chat_template(turn, add_generation_prompt=True))  # regenerated
    edited = [head[0], {"role": "user", "content": "def k(y):"}] + turn[2:]
    _, cached = chat(edited)  # an edited earlier message reuses only the system message's snapshot
    assert cached == len(tokenizer.apply_chat_template(head[:1], add_generation_prompt=False))
